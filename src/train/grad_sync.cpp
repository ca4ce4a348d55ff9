#include "meshgrad/train/grad_sync.hpp"

#include <algorithm>

#include <fmt/format.h>

#include <cstddef>
#include <unordered_map>
#include <utility>

#include "meshgrad/distributed/collectives.hpp"

namespace meshgrad::train {

// Per-parameter progress of one step.
struct Entry {
  nn::Parameter* param = nullptr;
  bool ready = false;                 // its hook fired in this step
  std::vector<int> pending_axes;      // non-dp partial axes still to reduce (first one in flight)
  dist::PendingTensor axis_reduce;    // the in-flight reduction over pending_axes.front()
  dist::PendingTensor dp_reduce;      // the data-parallel all-reduce (or the ready local gradient)
};

struct GradientSynchronizer::State {
  dist::DeviceMeshPtr mesh;
  int dp_axis = -1;   // -1: no dp axis (dp size 1)
  std::vector<Entry> entries;
  std::unordered_map<const TensorImpl*, std::size_t> index_of;
  std::vector<std::size_t> deferred;   // entries whose non-dp reduction is in flight, in launch order
  int launched = 0;

  bool dp_active() const { return dp_axis >= 0 && mesh->axis_size(dp_axis) > 1; }

  // Starts the dp all-reduce of a gradient that is complete over every other axis.
  void launch_dp(Entry& e, const Tensor& grad) {
    if (!dp_active()) {
      e.dp_reduce = dist::PendingTensor::ready(grad);
      return;
    }
    e.dp_reduce = dist::all_reduce_async(grad, mesh->group(dp_axis), comm::ReduceOp::Sum);
    ++launched;
  }

  // Finishes the non-dp reductions launched by earlier hooks and starts their dp all-reduces.
  // Called at every hook and in finish(): a deterministic point, so the order is the same on every rank.
  void drain_deferred() {
    for (std::size_t i : deferred) {
      Entry& e = entries[i];
      Tensor g = e.axis_reduce.wait();   // bounded by the communicator's deadline
      e.axis_reduce = {};
      // Rare: partial over more than one non-dp axis (2-D meshes); the rest is reduced at once.
      for (std::size_t k = 1; k < e.pending_axes.size(); ++k) {
        g = dist::all_reduce(g, mesh->group(e.pending_axes[k]), comm::ReduceOp::Sum);
        ++launched;
      }
      e.pending_axes.clear();
      launch_dp(e, g);
    }
    deferred.clear();
  }

  // Before the engine adds a second gradient into a leaf whose reductions already started in this
  // backward (a parameter used inside two checkpointed regions): let those reductions finish, so
  // they never read .grad while it is being written. Their results are superseded by on_ready.
  void before_accumulate(std::size_t i) {
    Entry& e = entries[i];
    if (!e.ready) return;
    if (e.axis_reduce.valid()) {
      e.axis_reduce.wait();
      e.axis_reduce = {};
      std::erase(deferred, i);
    }
    if (e.dp_reduce.valid()) {
      e.dp_reduce.wait();
      e.dp_reduce = {};
    }
  }

  // The hook body: the accumulated local gradient of entries[i] is ready.
  void on_ready(std::size_t i, const Tensor& leaf) {
    drain_deferred();
    Entry& e = entries[i];
    // A leaf whose gradient is accumulated twice in one backward (used inside two checkpointed
    // regions, whose nested backward passes each accumulate) fires again with the sum: the reduction
    // launched for the first part was waited for by before_accumulate and is superseded here; every
    // rank does the same, so the collective order still matches.
    e.ready = true;
    e.dp_reduce = {};
    const Tensor grad = leaf.grad();
    const dist::AxisMask partial = dist::partial_axes(grad) & e.param->replicated_axes();
    e.pending_axes.clear();
    for (int a = 0; a < mesh->ndim(); ++a) {
      if (a != dp_axis && (partial & (dist::AxisMask{1} << a)) && mesh->axis_size(a) > 1) e.pending_axes.push_back(a);
    }
    if (e.pending_axes.empty()) {
      launch_dp(e, grad);
      return;
    }
    // Partial over tp (e.g. LayerNorm weights under sequence parallelism): sum over that axis
    // first. Launched now, waited at the next hook, so it too overlaps backward compute.
    e.axis_reduce = dist::all_reduce_async(grad, mesh->group(e.pending_axes.front()), comm::ReduceOp::Sum);
    ++launched;
    deferred.push_back(i);
  }
};

GradientSynchronizer::GradientSynchronizer(std::vector<nn::Parameter*> params, dist::DeviceMeshPtr mesh)
    : state_(std::make_shared<State>()) {
  MG_CHECK(mesh != nullptr, "GradientSynchronizer: no mesh given");
  state_->mesh = std::move(mesh);
  state_->dp_axis = state_->mesh->has_axis("dp") ? state_->mesh->axis_index("dp") : -1;
  state_->entries.reserve(params.size());
  for (nn::Parameter* p : params) {
    MG_CHECK(p != nullptr, "GradientSynchronizer: null parameter");
    MG_CHECK(p->value.defined() && p->value.is_leaf() && p->value.requires_grad(),
             "GradientSynchronizer: parameter '{}' is not a leaf that requires grad", p->name);
    const std::size_t index = state_->entries.size();
    MG_CHECK(state_->index_of.emplace(p->value.impl_ptr().get(), index).second,
             "GradientSynchronizer: parameter '{}' is listed twice", p->name);
    Entry entry;
    entry.param = p;
    state_->entries.push_back(std::move(entry));
    std::weak_ptr<State> weak = state_;
    p->value.register_hook([weak, index](const Tensor&) {
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

void GradientSynchronizer::finish() {
  State& s = *state_;
  s.drain_deferred();
  std::vector<std::string> missing;
  for (Entry& e : s.entries) {
    if (!e.ready) {
      missing.push_back(e.param->name);
      continue;
    }
    Tensor reduced = e.dp_reduce.wait();   // bounded by the communicator's deadline
    e.dp_reduce = {};
    e.ready = false;
    dist::set_partial_axes(reduced, 0);   // explicitly complete: the optimizer checks this
    e.param->value.set_grad(reduced);
  }
  s.launched = 0;
  for (Entry& e : s.entries) e.ready = false;
  MG_CHECK(missing.empty(),
           "GradientSynchronizer::finish: no gradient reached parameter(s) {} during backward (not used by the "
           "loss, backward not run, or a hook lost because the parameter's tensor was replaced after the "
           "synchroniser was built)",
           fmt::join(missing, ", "));
}

}  // namespace meshgrad::train
