// FSDP units (contract in include/meshgrad/nn/fsdp.hpp).
#include "meshgrad/nn/fsdp.hpp"

#include <fmt/format.h>

#include <deque>
#include <utility>

#include "meshgrad/autograd/function.hpp"
#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/autograd/node.hpp"
#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/rule.hpp"
#include "meshgrad/ops/tree_reduce.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/trace.hpp"

namespace meshgrad::nn {

// The reduce-scatters a model's units left in flight during one backward (see FsdpReductions in
// fsdp.hpp): each unit's gradients leave as async reduce-scatters that overlap the next unit's
// backward, and are delivered to the shards' leaves (the engine's accumulation and hooks, so the
// gradient synchroniser sees them as any other) by the next unit's backward, or by the model's own
// unit, whose backward is the last.
struct FsdpReductions {
  struct InFlight {
    Tensor leaf;                  // the shard the gradient belongs to
    dist::PendingTensor shard;    // its reduce-scatter
    dist::AxisMask partial = 0;   // the axes the result is still partial on (dp)
  };
  std::deque<InFlight> queue;

  // Waits for every reduction in flight (each bounded by the communicator's deadline) and delivers it.
  void deliver() {
    while (!queue.empty()) {
      InFlight f = std::move(queue.front());
      queue.pop_front();
      Tensor g = f.shard.wait();
      dist::set_partial_axes(g, f.partial);
      autograd::grad_accumulator(f.leaf)->apply(TensorList{std::move(g)});
    }
  }
};

// What a unit and the graph nodes it records share (nodes hold it, so a graph never points into a
// unit that died; the parameters themselves are reached only from the unit's calls).
struct FsdpUnitState {
  std::string name;
  std::vector<Parameter*> params;
  ParallelContextPtr ctx;
  std::shared_ptr<FsdpReductions> reductions;    // shared by the model's units
  bool last_in_backward = false;                 // the model's own unit: delivers everything
  const dist::ProcessGroup* fsdp = nullptr;
  std::vector<std::vector<std::int64_t>> rows;   // per parameter: every fsdp coordinate's rows of dim 0
  std::vector<Tensor> full;                      // per parameter: the gathered piece (its bytes may be released)
  std::vector<dist::PendingTensor> pending;      // per parameter: a gather in flight into full[i]
  bool resident = false;                         // full[] holds the gathered values now
  std::vector<std::uint64_t> versions;           // the shards' versions those values were gathered from
  bool accumulating = false;
  // Gradient accumulation, unsharded, in the model's order: rank order sums each micro-batch into
  // `accumulated` (per parameter, as dp sums them in .grad); the fixed tree (tp- and mesh-invariant
  // modes) pushes each micro-batch's gradients into `tree` as one leaf and reduces the root, so fsdp
  // adds the micro-batches in the tree dp adds them in (optim/micro_batches.hpp).
  std::vector<Tensor> accumulated;
  tree::StreamingSum tree;
  std::vector<dist::AxisMask> tree_partial;      // per parameter: the axes the tree's terms are partial on

  dist::StepArgs gather_args(std::size_t i) const {
    dist::StepArgs a;
    a.dim = 0;
    a.sizes = rows[i];
    a.order = ctx->reduce_order();
    return a;
  }

  // Issues the gathers into full[] (its bytes taken again where they were given back).
  void issue() {
    if (!pending.empty() || (resident && versions == current_versions())) return;
    versions = current_versions();   // a shard written since (an optimizer step) is gathered again
    resident = false;
    dist::CommLabelScope label(fmt::format("fsdp:{}", name));
    for (std::size_t i = 0; i < params.size(); ++i) {
      full[i].storage()->restore_memory();
      pending.push_back(dist::all_gather_async(params[i]->value.detach(), *fsdp, 0, rows[i], full[i]));
    }
  }

  std::vector<std::uint64_t> current_versions() const {
    std::vector<std::uint64_t> v;
    for (const Parameter* p : params) v.push_back(p->value.version());
    return v;
  }

  // Waits for the gathers (each bounded by the communicator's deadline).
  void settle() {
    issue();
    for (std::size_t i = 0; i < pending.size(); ++i) {
      const Tensor got = pending[i].wait();
      // all_gather_async writes into full[i] when its shape and dtype fit, which they always do here.
      MG_CHECK(got.storage() == full[i].storage(), "fsdp unit '{}': the gather of '{}' did not land in its buffer",
               name, params[i]->name);
    }
    pending.clear();
    resident = true;
  }

  void release() {
    if (ctx->keeps_gathered_parameters()) return;   // --shard-optimizer: kept until a shard changes
    if (!pending.empty()) settle();   // a gather in flight writes into the bytes: let it finish first
    for (Tensor& t : full) t.storage()->release_memory();
    resident = false;
  }
};

namespace {

// Sp(0) -> R over fsdp for every parameter of a unit at once. Inputs: the shards (leaves); outputs:
// the gathered pieces. Backward: the rule's backward of the all-gather per parameter, after the
// tp reduction a partial gradient still needs (see fsdp.hpp).
class GatherUnitFn final : public autograd::Function {
 public:
  explicit GatherUnitFn(std::shared_ptr<FsdpUnitState> state) : state_(std::move(state)) {}
  std::string_view name() const override { return "fsdp_all_gather"; }
  bool decides_gradient_placement() const override { return true; }

  TensorList forward(const TensorList&) override {
    TensorList out;
    for (const Tensor& t : state_->full) out.push_back(t.detach());   // new handles on the gathered bytes
    return out;
  }

  TensorList backward(const TensorList& grads) override {
    FsdpUnitState& s = *state_;
    trace::Span span(fmt::format("fsdp:{}", s.name), "fsdp_reduce");
    dist::CommLabelScope label(fmt::format("fsdp:{}", s.name));
    // Overlapped: this unit's reduce-scatters stay in flight through the next unit's backward. Not
    // inside a checkpointed block's recomputation (its inner backward hands gradients back to the
    // checkpoint) and not for the last unit, whose gradients are returned as they are.
    const bool defer = s.reductions && !s.last_in_backward && !autograd::PassState::recomputing();
    std::vector<FsdpReductions::InFlight> launched;
    TensorList out(grads.size());
    const TensorList summed = sum_in_tree(grads);
    for (std::size_t i = 0; i < grads.size(); ++i) {
      Tensor g = summed[i];
      if (!g.defined()) continue;
      if (s.accumulated[i].defined()) {   // earlier micro-batches' sum + this one: dp's order in .grad
        const dist::AxisMask mask = dist::partial_axes(g);
        g = kernels::binary(kernels::Binary::Add, s.accumulated[i], g);
        dist::set_partial_axes(g, mask);
        s.accumulated[i] = Tensor();
      }
      if (s.accumulating) {
        s.accumulated[i] = g.detach();
        continue;
      }
      launched.push_back(reduce(i, g));
    }
    if (!s.accumulating) s.release();   // the next use gathers again
    // What earlier units left in flight has had this unit's whole backward to finish: deliver it.
    if (s.reductions) s.reductions->deliver();
    std::size_t k = 0;
    for (std::size_t i = 0; i < grads.size() && k < launched.size(); ++i) {
      if (!grads[i].defined() || s.accumulating) continue;
      FsdpReductions::InFlight& f = launched[k++];
      if (defer) {
        s.reductions->queue.push_back(std::move(f));
        continue;
      }
      out[i] = f.shard.wait();
      dist::set_partial_axes(out[i], f.partial);
    }
    return out;   // deferred: none yet (FsdpReductions::deliver gives them to the leaves)
  }

 private:
  // In the fixed tree with micro-batches: this micro-batch's gradients become a leaf of the unit's
  // tree; while accumulating nothing is returned (nothing to reduce yet), after the last micro-batch
  // the root, each entry partial on the axes its terms were. Otherwise (rank order) grads as given.
  TensorList sum_in_tree(const TensorList& grads) const {
    FsdpUnitState& s = *state_;
    if (s.ctx->reduce_order() != dist::ReduceOrder::FixedTree || (!s.accumulating && s.tree.leaves() == 0)) return grads;
    std::vector<Tensor> leaf(grads.size());
    s.tree_partial.resize(grads.size(), 0);
    for (std::size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i].defined()) continue;
      leaf[i] = grads[i].detach();
      s.tree_partial[i] = dist::partial_axes(grads[i]);
    }
    s.tree.push(std::move(leaf));
    if (s.accumulating) return TensorList(grads.size());
    TensorList root = s.tree.root();
    for (std::size_t i = 0; i < root.size(); ++i) {
      if (root[i].defined()) dist::set_partial_axes(root[i], s.tree_partial[i]);
    }
    s.tree = tree::StreamingSum();
    return root;
  }

  // The gathered piece's gradient -> the shard's: over tp where it is partial there, then the rule's
  // backward of Sp(0) -> R over fsdp, launched (not waited). Partial over dp stays (the synchroniser's).
  FsdpReductions::InFlight reduce(std::size_t i, Tensor g) const {
    const FsdpUnitState& s = *state_;
    const dist::DeviceMesh& mesh = *s.ctx->mesh;
    dist::StepArgs args = s.gather_args(i);
    dist::AxisMask mask = dist::partial_axes(g);
    for (int a = 0; a < mesh.ndim(); ++a) {
      if (a == s.ctx->dp_axis || a == s.ctx->fsdp_axis || !(mask & dist::axis_bit(a))) continue;
      // A replicated (on this axis) parameter used on sharded data: R -> R, arriving P: all-reduce.
      const dist::BackwardStep step = dist::backward_step(dist::Placement::replicate(), dist::Placement::replicate(),
                                                          dist::Placement::partial());
      g = dist::run_primitive(step.op, g, mesh.group(a), args);
      mask &= ~dist::axis_bit(a);
    }
    const dist::Placement arriving = (mask & dist::axis_bit(s.ctx->fsdp_axis)) ? dist::Placement::partial()
                                                                                 : dist::Placement::replicate();
    const dist::BackwardStep step = dist::backward_step(dist::Placement::shard(0), dist::Placement::replicate(), arriving);
    FsdpReductions::InFlight f;
    f.leaf = s.params[i]->value;
    f.shard = dist::run_primitive_async(step.op, g.contiguous(), *s.fsdp, args);
    f.partial = mask & ~dist::axis_bit(s.ctx->fsdp_axis);
    return f;
  }

  std::shared_ptr<FsdpUnitState> state_;
};

// Identity whose backward refills the unit before its backward and issues the previous unit's gathers.
class RegatherFn final : public autograd::Function {
 public:
  RegatherFn(std::shared_ptr<FsdpUnitState> unit, std::shared_ptr<FsdpUnitState> previous)
      : unit_(std::move(unit)), previous_(std::move(previous)) {}
  std::string_view name() const override { return "fsdp_regather"; }
  TensorList forward(const TensorList& x) override { return {x[0]}; }
  TensorList backward(const TensorList& g) override {
    trace::Span span(fmt::format("fsdp:{}", unit_->name), "fsdp_gather");
    unit_->settle();
    if (previous_) previous_->issue();
    return {g[0]};
  }

 private:
  std::shared_ptr<FsdpUnitState> unit_, previous_;
};

}  // namespace

FsdpUnit::FsdpUnit(std::string name, std::vector<Parameter*> params, ParallelContextPtr ctx,
                   std::shared_ptr<FsdpReductions> reductions, bool last_in_backward)
    : state_(std::make_shared<FsdpUnitState>()) {
  MG_CHECK(ctx != nullptr && ctx->fsdp_active(), "fsdp unit '{}': the mesh has no fsdp axis of size > 1 (nor dp with "
           "--shard-optimizer)", name);
  FsdpUnitState& s = *state_;
  s.name = std::move(name);
  s.params = std::move(params);
  s.ctx = std::move(ctx);
  s.reductions = std::move(reductions);
  s.last_in_backward = last_in_backward;
  s.fsdp = &s.ctx->mesh->group(s.ctx->fsdp_axis);
  for (const Parameter* p : s.params) {
    MG_CHECK(p != nullptr && p->value.defined(), "fsdp unit '{}': a parameter without a value", s.name);
    MG_CHECK(p->placements.at(static_cast<std::size_t>(s.ctx->fsdp_axis)) == dist::Placement::shard_of_piece(0),
             "fsdp unit '{}': parameter '{}' is placed {} (Sp(0) on fsdp expected)", s.name, p->name,
             dist::placements_str(p->placements));
    const Shape shape = p->operand_shape();
    s.rows.push_back(shard_sizes(shape.at(0), s.fsdp->size()));
    MG_CHECK(s.rows.back()[static_cast<std::size_t>(s.fsdp->rank())] == p->value.size(0),
             "fsdp unit '{}': parameter '{}' holds {} rows of {}, its share is {}", s.name, p->name, p->value.size(0),
             shape_str(shape), s.rows.back()[static_cast<std::size_t>(s.fsdp->rank())]);
    s.full.push_back(Tensor::empty(shape, p->value.dtype()));
    s.full.back().storage()->release_memory();   // taken when first gathered
  }
  s.accumulated.resize(s.params.size());
}

FsdpUnit::~FsdpUnit() {
  // A gather in flight writes into full[]: let it finish (errors are the next collective's to report).
  for (dist::PendingTensor& p : state_->pending) {
    try {
      p.wait();
    } catch (...) {
    }
  }
  state_->pending.clear();
}

const std::string& FsdpUnit::name() const { return state_->name; }

void FsdpUnit::prefetch() { state_->issue(); }

std::shared_ptr<FsdpReductions> FsdpUnit::new_reductions() { return std::make_shared<FsdpReductions>(); }

void FsdpUnit::begin_forward() {
  FsdpUnitState& s = *state_;
  // A backward that failed half-way may have left reductions in flight: a new forward of the model
  // (its last unit in backward is its first in forward) drops them, each waited for by its destructor.
  if (s.last_in_backward && s.reductions) s.reductions->queue.clear();
  {
    trace::Span span(fmt::format("fsdp:{}", s.name), "fsdp_gather");
    s.settle();
  }
  TensorList leaves;
  for (const Parameter* p : s.params) leaves.push_back(p->value);
  const TensorList gathered = autograd::apply<GatherUnitFn>(leaves, state_);
  for (std::size_t i = 0; i < s.params.size(); ++i) s.params[i]->gathered = gathered[i];
}

void FsdpUnit::end_forward(bool release) {
  for (Parameter* p : state_->params) p->gathered = Tensor();
  if (release) state_->release();
}

Tensor FsdpUnit::regather_before_backward(const Tensor& out, FsdpUnit* previous) {
  return autograd::apply<RegatherFn>({out}, state_, previous ? previous->state_ : nullptr)[0];
}

void FsdpUnit::set_accumulating(bool on) { state_->accumulating = on; }

std::int64_t FsdpUnit::gathered_bytes() const {
  std::int64_t bytes = 0;
  for (const Tensor& t : state_->full) {
    if (t.storage()->resident()) bytes += static_cast<std::int64_t>(t.storage()->nbytes());
  }
  return bytes;
}

FsdpForwardScope::FsdpForwardScope(FsdpUnit* unit, bool release) : unit_(unit), release_(release) {
  if (unit_) unit_->begin_forward();
}

FsdpForwardScope::~FsdpForwardScope() {
  if (unit_) unit_->end_forward(release_);
}

}  // namespace meshgrad::nn
