#include "meshgrad/optim/grad_sync.hpp"

#include <algorithm>

#include <fmt/format.h>

#include <cstddef>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "meshgrad/autograd/node.hpp"
#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/rule.hpp"
#include "meshgrad/ops/tree_reduce.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/trace.hpp"

namespace meshgrad::optim {

namespace {
// The label every synchronisation collective carries (explain tells them from the model's by it).
constexpr const char* kLabel = "grad-sync";
}  // namespace

// One dp bucket: a flat buffer the members' gradients are copied into, reduced in place.
struct Bucket {
  Tensor flat;                          // [sum of members' numel], the members' dtype
  std::vector<std::size_t> members;     // entry indices, in slot order
  int ready = 0;                        // members whose gradient is in this step
  dist::PendingTensor reduce;           // the dp all-reduce in flight: in place (rank order) or into a new tensor
};

// Per-parameter progress of one step.
struct Entry {
  nn::Parameter* param = nullptr;
  int bucket = -1;                    // its dp bucket (-1: no dp reduction)
  std::int64_t offset = 0;            // its slot's offset in the bucket's flat buffer
  bool ready = false;                 // its hook fired in this step
  std::vector<int> pending_axes;      // non-dp axes still to reduce (first one in flight)
  dist::PendingTensor axis_reduce;    // the in-flight reduction over pending_axes.front()
  Tensor complete;                    // the gradient once complete over every non-dp axis
};

struct GradientSynchronizer::State {
  dist::DeviceMeshPtr mesh;
  // The axes whose gradients travel in buckets: dp and cp, those of more than one rank. Every rank of
  // them saw other tokens (other rows, or other positions of the same rows), so a parameter replicated
  // over all of them has a gradient partial over all of them, reduced once over their flattened group.
  dist::AxisMask bucket_axes = 0;
  const dist::ProcessGroup* bucket_group = nullptr;   // the flattened group of bucket_axes
  std::vector<Entry> entries;
  std::vector<Bucket> buckets;
  std::unordered_map<const TensorImpl*, std::size_t> index_of;
  std::vector<std::size_t> deferred;   // entries whose non-dp reduction is in flight, in launch order
  int launched = 0;
  bool accumulating = false;   // set_accumulating: hooks do nothing
  dist::ReduceOrder order = dist::ReduceOrder::RankOrder;   // GradSyncOptions::order
  DType reduce_dtype = DType::Float32;                       // GradSyncOptions::reduce_dtype

  bool dp_active() const { return bucket_axes != 0; }
  bool in_bucket_axes(int axis) const { return (bucket_axes & dist::axis_bit(axis)) != 0; }
  // Whether the gradient arrives partial over every bucket axis (the rule's R -> R step asks for a
  // reduction on each).
  bool partial_over_bucket_axes(const Tensor& grad) const {
    for (int a = 0; a < mesh->ndim(); ++a) {
      if (in_bucket_axes(a) && !needs_reduction(grad, a)) return false;
    }
    return true;
  }

  // The arguments of every reduction here: the order of the policy.
  dist::StepArgs args() const {
    dist::StepArgs a;
    a.order = order;
    return a;
  }

  // The rule for a replicated parameter on one axis: R -> R forward, the gradient arriving as marked.
  bool needs_reduction(const Tensor& grad, int axis) const {
    const dist::Placement arriving =
        dist::arriving_placement(grad, dist::Placement::replicate(), dist::axis_bit(axis), kLabel);
    return dist::backward_step(dist::Placement::replicate(), dist::Placement::replicate(), arriving).op ==
           dist::Primitive::AllReduce;
  }

  // Entry e's slot in its bucket, shaped like the parameter.
  Tensor slot_of(const Entry& e) const {
    const Tensor& v = e.param->value;
    return buckets[static_cast<std::size_t>(e.bucket)].flat.narrow(0, e.offset, v.numel()).view(v.shape());
  }

  // Puts a gradient that is complete over every non-dp axis into its bucket; launches the bucket's
  // in-place dp all-reduce when it is full.
  void deposit(std::size_t i, const Tensor& grad) {
    Entry& e = entries[i];
    e.complete = grad;
    if (e.bucket < 0) return;
    MG_CHECK(partial_over_bucket_axes(grad),
             "GradientSynchronizer: the gradient of '{}' is not marked partial over {}, but the ranks there see "
             "different tokens: mark the loss (ParallelContext::loss_partial_over_dp / dist::mark_partial_grad) before "
             "backward", e.param->name, bucket_group->axis);
    Bucket& b = buckets[static_cast<std::size_t>(e.bucket)];
    Tensor dst = slot_of(e);
    if (dst.storage() != grad.storage() || dst.raw_data() != grad.raw_data()) dst.copy_from(grad);
    if (++b.ready == static_cast<int>(b.members.size())) {
      dist::CommLabelScope label(fmt::format("{}:bucket{}", kLabel, e.bucket));
      // --reduce-dtype bf16: a bf16 copy travels (finish() widens the sum back into the bucket).
      const Tensor wire = reduce_dtype == DType::BFloat16 ? kernels::to_bfloat16(b.flat) : b.flat;
      b.reduce = dist::run_primitive_async(dist::Primitive::AllReduce, wire, *bucket_group, args(),
                                           /*in_place=*/true);
      ++launched;
    }
  }

  // Finishes the non-dp reductions launched by earlier hooks. Called at every hook and in finish():
  // a deterministic point, so the order is the same on every rank.
  void drain_deferred() {
    for (std::size_t i : deferred) {
      Entry& e = entries[i];
      Tensor g = e.axis_reduce.wait();   // bounded by the communicator's deadline
      e.axis_reduce = {};
      // Partial over more than one non-dp axis: the rest is reduced at once.
      for (std::size_t k = 1; k < e.pending_axes.size(); ++k) {
        dist::CommLabelScope label(fmt::format("{}:{}", kLabel, e.param->name));
        g = dist::run_primitive(dist::Primitive::AllReduce, g, mesh->group(e.pending_axes[k]), args());
        ++launched;
      }
      e.pending_axes.clear();
      dist::set_partial_axes(g, e.bucket >= 0 ? bucket_axes : 0);
      deposit(i, g);
    }
    deferred.clear();
  }

  // Before the engine adds a second gradient into a leaf whose reductions already started in this
  // backward (a parameter used inside two checkpointed regions): let those reductions finish, so
  // they never read .grad while it is being written. Their results are superseded by on_ready.
  void before_accumulate(std::size_t i) {
    if (accumulating) return;
    Entry& e = entries[i];
    if (!e.ready) return;
    if (e.axis_reduce.valid()) {
      e.axis_reduce.wait();
      e.axis_reduce = {};
      std::erase(deferred, i);
    }
    if (e.bucket >= 0) {
      Bucket& b = buckets[static_cast<std::size_t>(e.bucket)];
      if (b.reduce.valid()) {
        b.reduce.wait();
        b.reduce = {};
      }
      // Its first part will be deposited again with the sum: take it out of the count.
      if (e.complete.defined()) --b.ready;
    }
    e.complete = Tensor();
  }

  // The hook body: the accumulated local gradient of entries[i] is ready.
  void on_ready(std::size_t i, const Tensor& leaf) {
    if (accumulating) return;
    drain_deferred();
    Entry& e = entries[i];
    e.ready = true;
    const Tensor grad = leaf.grad();
    e.pending_axes.clear();
    for (int a = 0; a < mesh->ndim(); ++a) {
      // A bucketed parameter's bucket axes are its bucket's reduction; any other axis it is replicated
      // on and partial over is reduced here (a parameter sharded over dp, --shard-optimizer, still
      // needs its cp reduction).
      if ((e.bucket >= 0 && in_bucket_axes(a)) || !(e.param->replicated_axes() & dist::axis_bit(a)) ||
          mesh->axis_size(a) == 1) {
        continue;
      }
      if (needs_reduction(grad, a)) e.pending_axes.push_back(a);
    }
    if (e.pending_axes.empty()) {
      deposit(i, grad);
      return;
    }
    // Partial over a tp axis (LayerNorm weights under sequence parallelism): sum over it first.
    // Launched now, waited at the next hook, so it too overlaps backward compute.
    dist::CommLabelScope label(fmt::format("{}:{}", kLabel, e.param->name));
    e.axis_reduce = dist::run_primitive_async(dist::Primitive::AllReduce, grad, mesh->group(e.pending_axes.front()),
                                              args());
    ++launched;
    deferred.push_back(i);
  }

  // Buckets in reverse parameter order (backward makes the last parameters' gradients first), one
  // dtype per bucket, up to bucket_bytes each.
  void make_buckets(std::int64_t bucket_bytes) {
    if (!dp_active()) return;
    std::vector<std::int64_t> sizes;   // elements per bucket
    std::vector<DType> dtypes;
    for (std::size_t k = entries.size(); k-- > 0;) {
      Entry& e = entries[k];
      // A parameter sharded over dp (--shard-optimizer) got its dp reduction as a reduce-scatter in
      // backward (nn/fsdp.hpp): only the replicated ones are all-reduced here.
      if ((e.param->replicated_axes() & bucket_axes) != bucket_axes) continue;
      const Tensor& v = e.param->value;
      const auto elem = static_cast<std::int64_t>(dtype_size(v.dtype()));
      const bool fits = !sizes.empty() && dtypes.back() == v.dtype() &&
                        (sizes.back() + v.numel()) * elem <= bucket_bytes;
      if (!fits) {   // a new bucket (a parameter larger than a bucket gets its own)
        buckets.emplace_back();
        sizes.push_back(0);
        dtypes.push_back(v.dtype());
      }
      e.bucket = static_cast<int>(buckets.size()) - 1;
      e.offset = sizes.back();
      buckets.back().members.push_back(k);
      sizes.back() += v.numel();
    }
    for (std::size_t b = 0; b < buckets.size(); ++b) buckets[b].flat = Tensor::zeros({sizes[b]}, dtypes[b]);
  }
};

GradientSynchronizer::GradientSynchronizer(std::vector<nn::Parameter*> params, dist::DeviceMeshPtr mesh,
                                           GradSyncOptions options)
    : state_(std::make_shared<State>()) {
  MG_CHECK(mesh != nullptr, "GradientSynchronizer: no mesh given");
  MG_CHECK(options.bucket_bytes > 0, "GradientSynchronizer: bucket_bytes must be positive, got {}", options.bucket_bytes);
  state_->mesh = std::move(mesh);
  std::vector<int> bucket_axes;
  for (const char* name : {"dp", "cp"}) {
    // In the fixed tree (--mesh-invariant's sequence blocks: cp is refused in the tree otherwise) cp
    // is summed before dp, per micro-batch (nn::Model::micro_batch_sum_group), or for one micro-batch
    // here per parameter before its bucket: the sequence blocks' tree is inside each row block's.
    if (std::string_view(name) == "cp" && options.order == dist::ReduceOrder::FixedTree) continue;
    if (state_->mesh->has_axis(name) && state_->mesh->axis_size(name) > 1) {
      bucket_axes.push_back(state_->mesh->axis_index(name));
      state_->bucket_axes |= dist::axis_bit(bucket_axes.back());
    }
  }
  // Collective on first use: every rank builds its synchroniser.
  if (!bucket_axes.empty()) state_->bucket_group = &state_->mesh->flattened_group(bucket_axes);
  state_->order = options.order;
  state_->reduce_dtype = options.reduce_dtype;
  MG_CHECK(options.reduce_dtype == DType::Float32 || options.reduce_dtype == DType::BFloat16,
           "GradientSynchronizer: gradients travel as float32 or bfloat16, not {}", options.reduce_dtype);
  MG_CHECK(options.reduce_dtype == DType::Float32 || options.order == dist::ReduceOrder::RankOrder,
           "GradientSynchronizer: --reduce-dtype bf16 cannot keep an invariant mode's fixed tree (its nodes would round "
           "to bf16 at other places on other meshes)");
  MG_CHECK(options.order != dist::ReduceOrder::FixedTree || !state_->dp_active() ||
               tree::is_power_of_two(state_->bucket_group->size()),
           "GradientSynchronizer: TP-invariant mode sums the dp replicas' gradients in a fixed binary tree, so dp must "
           "be a power of two (1, 2, 4, ...); this mesh has {}", state_->mesh->str());
  state_->entries.reserve(params.size());
  for (nn::Parameter* p : params) {
    MG_CHECK(p != nullptr, "GradientSynchronizer: null parameter");
    MG_CHECK(p->value.defined() && p->value.is_leaf() && p->value.requires_grad(),
             "GradientSynchronizer: parameter '{}' is not a leaf that requires grad", p->name);
    MG_CHECK(static_cast<int>(p->placements.size()) == state_->mesh->ndim(),
             "GradientSynchronizer: parameter '{}' has {} placements for {}", p->name, p->placements.size(),
             state_->mesh->str());
    const std::size_t index = state_->entries.size();
    MG_CHECK(state_->index_of.emplace(p->value.impl_ptr().get(), index).second,
             "GradientSynchronizer: parameter '{}' is listed twice", p->name);
    Entry entry;
    entry.param = p;
    state_->entries.push_back(std::move(entry));
  }
  state_->make_buckets(options.bucket_bytes);
  for (std::size_t index = 0; index < state_->entries.size(); ++index) {
    nn::Parameter* p = state_->entries[index].param;
    std::weak_ptr<State> weak = state_;
    autograd::register_hook(p->value, [weak, index](const Tensor&) {
      if (auto state = weak.lock()) state->before_accumulate(index);
      return Tensor();   // the gradient itself is unchanged
    });
    p->value.register_post_accumulate_hook([weak, index](Tensor& leaf) {
      if (auto state = weak.lock()) state->on_ready(index, leaf);
    });
  }
}

GradientSynchronizer::~GradientSynchronizer() = default;

int GradientSynchronizer::launched() const { return state_->launched; }

void GradientSynchronizer::set_accumulating(bool on) { state_->accumulating = on; }

void GradientSynchronizer::reduce_gradients() {
  State& s = *state_;
  s.accumulating = false;
  for (std::size_t i = s.entries.size(); i-- > 0;) {
    Tensor& value = s.entries[i].param->value;
    if (value.grad().defined()) s.on_ready(i, value);
  }
}

std::vector<std::vector<std::string>> GradientSynchronizer::buckets() const {
  std::vector<std::vector<std::string>> out;
  for (const Bucket& b : state_->buckets) {
    std::vector<std::string> names;
    for (std::size_t i : b.members) names.push_back(state_->entries[i].param->name);
    out.push_back(std::move(names));
  }
  return out;
}

void GradientSynchronizer::finish() {
  trace::Span span("grad_sync", "grad_sync");
  State& s = *state_;
  s.drain_deferred();
  std::vector<std::string> missing;
  for (const Entry& e : s.entries) {
    if (!e.ready) missing.push_back(e.param->name);
  }
  // A bucket with a missing member never launched: no rank launched it (same graph everywhere).
  for (Bucket& b : s.buckets) {
    // Bounded by the communicator's deadline. In place (rank order) the result is the bucket itself;
    // the tree's is a new tensor, and the slots are views of it from now on.
    if (b.reduce.valid()) {
      const Tensor sum = b.reduce.wait();
      if (sum.dtype() == DType::BFloat16) {
        b.flat.copy_from(sum.to(b.flat.dtype()));   // widened exactly; the slots stay views of the bucket
      } else {
        b.flat = sum;
      }
    }
    b.reduce = {};
  }
  for (Entry& e : s.entries) {
    if (e.ready && missing.empty()) {
      Tensor grad = e.bucket >= 0 ? s.slot_of(e) : e.complete;
      dist::set_partial_axes(grad, 0);
      e.param->value.set_grad(grad);
    }
    e.ready = false;
    e.complete = Tensor();
  }
  for (Bucket& b : s.buckets) b.ready = 0;
  s.launched = 0;
  // With a parameter missing no gradient is replaced (its bucket never launched anywhere).
  MG_CHECK(missing.empty(),
           "GradientSynchronizer::finish: no gradient reached parameter(s) {} during backward (not used by the "
           "loss, backward not run, or a hook lost because the parameter's tensor was replaced after the "
           "synchroniser was built); no gradient was changed",
           fmt::join(missing, ", "));
}

}  // namespace meshgrad::optim
