// FSDP units (contract in include/meshgrad/nn/fsdp.hpp).
#include "meshgrad/nn/fsdp.hpp"

#include <fmt/format.h>

#include <cstring>
#include <deque>
#include <utility>

#include "meshgrad/autograd/function.hpp"
#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/autograd/node.hpp"
#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/distributed/rule.hpp"
#include "meshgrad/ops/tree_reduce.hpp"
#include "meshgrad/tensor/trace.hpp"

namespace meshgrad::nn {

// The reduce-scatters a model's units left in flight during one backward (see FsdpReductions in
// fsdp.hpp): each unit's gradients leave as async reduce-scatters that overlap the next unit's
// backward, and are delivered to the shards' leaves (the engine's accumulation and hooks, so the
// gradient synchroniser sees them as any other) by the next unit's backward, or by the model's own
// unit, whose backward is the last.
struct FsdpReductions {
  // One reduce-scatter of a unit: the gradients of several shards packed into one buffer.
  struct InFlight {
    struct Piece {
      std::size_t param = 0;        // index in the unit
      Tensor leaf;                  // the shard the gradient belongs to
      std::int64_t offset = 0;      // its elements in the reduced buffer: [offset, offset + numel)
      dist::AxisMask partial = 0;   // the axes the result is still partial on (dp)
    };
    std::vector<Piece> pieces;
    dist::PendingTensor shards;     // the reduce-scatter of every piece at once

    // Waits (bounded by the communicator's deadline) and cuts the result into the shards'
    // gradients: views of the one reduced buffer, in the pieces' order.
    std::vector<Tensor> wait() {
      Tensor flat = shards.wait();
      if (flat.dtype() == DType::BFloat16) flat = flat.to(pieces.empty() ? DType::Float32 : pieces.front().leaf.dtype());
      std::vector<Tensor> out;
      for (const Piece& p : pieces) {
        Tensor g = flat.narrow(0, p.offset, p.leaf.numel()).view(p.leaf.shape());
        dist::set_partial_axes(g, p.partial);
        out.push_back(std::move(g));
      }
      return out;
    }
  };
  std::deque<InFlight> queue;

  // Waits for every reduction in flight and delivers it to its leaves.
  void deliver() {
    while (!queue.empty()) {
      InFlight f = std::move(queue.front());
      queue.pop_front();
      std::vector<Tensor> grads = f.wait();
      for (std::size_t k = 0; k < grads.size(); ++k) {
        autograd::grad_accumulator(f.pieces[k].leaf)->apply(TensorList{std::move(grads[k])});
      }
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
  std::vector<std::int64_t> row_numel;           // per parameter: elements per row of dim 0
  std::vector<Tensor> full;                      // per parameter: the gathered piece (its bytes may be released)
  // One all-gather per unit (FSDP2's foreach all-gather): coordinate r's chunk is its shards of every
  // parameter, packed in parameter order; the gathered chunks are copied out into full[].
  dist::PendingTensor pending;                   // the gather in flight (valid() while it is)
  bool resident = false;                         // full[] holds the gathered values now
  std::vector<std::uint64_t> versions;           // the shards' versions those values were gathered from
  bool accumulating = false;
  // Gradient accumulation, unsharded, in the model's order (tree::OrderedSum, the accumulator dp's
  // micro-batches go through too: left to right as .grad sums them, or the fixed tree of the tp- and
  // mesh-invariant modes): each micro-batch's gradients are one push, the sum is reduced after the last.
  tree::OrderedSum micro_sum{false};
  std::vector<dist::AxisMask> partial;           // per parameter: the axes its terms are partial on

  dist::StepArgs gather_args(std::size_t i) const {
    dist::StepArgs a;
    a.dim = 0;
    a.sizes = rows[i];
    a.order = ctx->reduce_order();
    return a;
  }

  // Elements of coordinate r's rows of the parameters in `which` (indices), packed in that order.
  std::int64_t chunk_numel(const std::vector<std::size_t>& which, std::size_t r) const {
    std::int64_t n = 0;
    for (std::size_t i : which) n += rows[i][r] * row_numel[i];
    return n;
  }
  // The first row of coordinate r's shard of parameter i.
  std::int64_t first_row(std::size_t i, std::size_t r) const {
    std::int64_t row = 0;
    for (std::size_t q = 0; q < r; ++q) row += rows[i][q];
    return row;
  }
  std::vector<std::size_t> all_params() const {
    std::vector<std::size_t> which(params.size());
    for (std::size_t i = 0; i < which.size(); ++i) which[i] = i;
    return which;
  }

  // Issues the unit's one all-gather (full[]'s bytes taken again where they were given back).
  void issue() {
    if (pending.valid() || (resident && versions == current_versions())) return;
    versions = current_versions();   // a shard written since (an optimizer step) is gathered again
    resident = false;
    dist::CommLabelScope label(fmt::format("fsdp:{}", name));
    const std::vector<std::size_t> which = all_params();
    const auto me = static_cast<std::size_t>(fsdp->rank());
    std::vector<std::int64_t> chunks(static_cast<std::size_t>(fsdp->size()));
    for (std::size_t r = 0; r < chunks.size(); ++r) chunks[r] = chunk_numel(which, r);
    Tensor mine = Tensor::empty({chunks[me]}, full.front().dtype());
    const std::size_t elem = dtype_size(mine.dtype());
    auto* dst = static_cast<std::byte*>(mine.raw_data());
    for (std::size_t i = 0; i < params.size(); ++i) {
      const Tensor shard = params[i]->value.detach().contiguous();
      const std::size_t bytes = static_cast<std::size_t>(shard.numel()) * elem;
      if (bytes > 0) std::memcpy(dst, shard.raw_data(), bytes);
      dst += bytes;
      full[i].storage()->restore_memory();
    }
    pending = dist::all_gather_async(mine, *fsdp, 0, chunks);
  }

  // The gathered chunks -> full[]: coordinate r's rows of parameter i sit in r's chunk. Raw copies:
  // the bytes are the values the graph saved (a regather refills them), so no version changes.
  void copy_out(const Tensor& chunks) {
    const std::size_t elem = dtype_size(chunks.dtype());
    const auto* src = static_cast<const std::byte*>(chunks.raw_data());
    for (std::size_t r = 0; r < static_cast<std::size_t>(fsdp->size()); ++r) {
      for (std::size_t i = 0; i < params.size(); ++i) {
        const std::size_t bytes = static_cast<std::size_t>(rows[i][r] * row_numel[i]) * elem;
        auto* dst = static_cast<std::byte*>(full[i].raw_data()) +
                    static_cast<std::size_t>(first_row(i, r) * row_numel[i]) * elem;
        if (bytes > 0) std::memcpy(dst, src, bytes);
        src += bytes;
      }
    }
  }

  std::vector<std::uint64_t> current_versions() const {
    std::vector<std::uint64_t> v;
    for (const Parameter* p : params) v.push_back(p->value.version());
    return v;
  }

  // Waits for the gather (bounded by the communicator's deadline) and fills full[].
  void settle() {
    issue();
    if (pending.valid()) {
      const Tensor chunks = pending.wait();
      pending = dist::PendingTensor();
      std::int64_t expected = 0;
      for (const Tensor& t : full) expected += t.numel();
      MG_CHECK(chunks.numel() == expected, "fsdp unit '{}': the gather returned {} elements, the unit's parameters "
               "hold {}", name, chunks.numel(), expected);
      copy_out(chunks);
    }
    resident = true;
  }

  void release() {
    if (ctx->keeps_gathered_parameters()) return;   // --shard-optimizer: kept until a shard changes
    if (pending.valid()) settle();   // a gather in flight: let it finish first
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
    TensorList out(grads.size());
    std::vector<Tensor> micro(grads.size());
    for (std::size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i].defined()) continue;
      micro[i] = grads[i].detach();
      s.partial[i] = dist::partial_axes(grads[i]);
    }
    s.micro_sum.push(std::move(micro));
    std::vector<std::pair<std::size_t, Tensor>> ready;   // (parameter, gradient) to reduce now
    if (!s.accumulating) {   // the last micro-batch: the sum of all of them
      std::vector<Tensor> total = s.micro_sum.total();
      s.micro_sum.clear();
      for (std::size_t i = 0; i < total.size(); ++i) {
        if (!total[i].defined()) continue;
        dist::set_partial_axes(total[i], s.partial[i]);   // partial where its terms were
        ready.emplace_back(i, std::move(total[i]));
      }
    }
    std::vector<FsdpReductions::InFlight> launched = reduce(ready);
    if (!s.accumulating) s.release();   // the next use gathers again
    // What earlier units left in flight has had this unit's whole backward to finish: deliver it.
    if (s.reductions) s.reductions->deliver();
    for (FsdpReductions::InFlight& f : launched) {
      if (defer) {
        s.reductions->queue.push_back(std::move(f));
        continue;
      }
      std::vector<Tensor> got = f.wait();
      for (std::size_t k = 0; k < got.size(); ++k) out[f.pieces[k].param] = std::move(got[k]);
    }
    return out;   // deferred: none yet (FsdpReductions::deliver gives them to the leaves)
  }

 private:
  // The gathered pieces' gradients -> the shards': each over tp where it is partial there (a
  // replicated parameter under SP), then the rule's backward of Sp(0) -> R over fsdp for all of them
  // at once (FSDP2's foreach reduce-scatter): coordinate r's chunk of the packed buffer holds its rows
  // of every gradient, in parameter order, and comes back reduced as r's shards. One launch (not
  // waited) per arriving placement: partial over fsdp (reduce-scatter) or not (keep own rows). The
  // sums are element by element, so packing changes no bit. Partial over dp and cp stays (the
  // synchroniser's buckets).
  std::vector<FsdpReductions::InFlight> reduce(std::vector<std::pair<std::size_t, Tensor>>& ready) const {
    const FsdpUnitState& s = *state_;
    const dist::DeviceMesh& mesh = *s.ctx->mesh;
    const dist::AxisMask fsdp_bit = dist::axis_bit(s.ctx->fsdp_axis);
    std::vector<dist::AxisMask> masks;
    for (auto& [i, g] : ready) {
      dist::AxisMask mask = dist::partial_axes(g);
      for (int a = 0; a < mesh.ndim(); ++a) {
        if (a == s.ctx->dp_axis || a == s.ctx->cp_axis || a == s.ctx->fsdp_axis || !(mask & dist::axis_bit(a))) {
          continue;
        }
        // A replicated (on this axis) parameter used on sharded data: R -> R, arriving P: all-reduce.
        const dist::BackwardStep step = dist::backward_step(dist::Placement::replicate(),
                                                            dist::Placement::replicate(), dist::Placement::partial());
        g = dist::run_primitive(step.op, g, mesh.group(a), s.gather_args(i));
        mask &= ~dist::axis_bit(a);
      }
      MG_CHECK(g.dtype() == s.params[i]->value.dtype(), "fsdp unit '{}': the gradient of '{}' is {}, the parameter {}",
               s.name, s.params[i]->name, dtype_name(g.dtype()), dtype_name(s.params[i]->value.dtype()));
      g = g.contiguous();
      masks.push_back(mask);
    }
    std::vector<FsdpReductions::InFlight> launched;
    const auto me = static_cast<std::size_t>(s.fsdp->rank());
    const auto coordinates = static_cast<std::size_t>(s.fsdp->size());
    for (const bool arriving_partial : {true, false}) {
      std::vector<std::size_t> which, params;   // indices into ready; the parameters
      for (std::size_t k = 0; k < ready.size(); ++k) {
        if (((masks[k] & fsdp_bit) != 0) != arriving_partial) continue;
        which.push_back(k);
        params.push_back(ready[k].first);
      }
      if (which.empty()) continue;
      dist::StepArgs args;
      args.order = s.ctx->reduce_order();
      for (std::size_t r = 0; r < coordinates; ++r) args.sizes.push_back(s.chunk_numel(params, r));
      std::int64_t total = 0;
      for (std::int64_t n : args.sizes) total += n;
      const Tensor packed = Tensor::empty({total}, ready[which.front()].second.dtype());
      const std::size_t elem = dtype_size(packed.dtype());
      auto* dst = static_cast<std::byte*>(packed.raw_data());
      for (std::size_t r = 0; r < coordinates; ++r) {
        for (std::size_t k : which) {
          const std::size_t i = ready[k].first;
          const std::size_t bytes = static_cast<std::size_t>(s.rows[i][r] * s.row_numel[i]) * elem;
          const auto* src = static_cast<const std::byte*>(ready[k].second.raw_data()) +
                            static_cast<std::size_t>(s.first_row(i, r) * s.row_numel[i]) * elem;
          if (bytes > 0) std::memcpy(dst, src, bytes);
          dst += bytes;
        }
      }
      FsdpReductions::InFlight f;
      std::int64_t offset = 0;
      for (std::size_t k : which) {
        const std::size_t i = ready[k].first;
        f.pieces.push_back({i, s.params[i]->value, offset, masks[k] & ~fsdp_bit});
        offset += s.rows[i][me] * s.row_numel[i];
      }
      const dist::BackwardStep step = dist::backward_step(
          dist::Placement::shard(0), dist::Placement::replicate(),
          arriving_partial ? dist::Placement::partial() : dist::Placement::replicate());
      // --reduce-dtype bf16: the reduce-scatter carries a bf16 copy (InFlight::wait widens it back).
      const bool bf16_wire = arriving_partial && s.ctx->config.reduce_dtype == DType::BFloat16;
      f.shards = dist::run_primitive_async(step.op, bf16_wire ? kernels::to_bfloat16(packed) : packed, *s.fsdp, args);
      launched.push_back(std::move(f));
    }
    return launched;
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
  MG_CHECK(!s.params.empty(), "fsdp unit '{}': no parameters", s.name);
  for (const Parameter* p : s.params) {
    MG_CHECK(p != nullptr && p->value.defined(), "fsdp unit '{}': a parameter without a value", s.name);
    // One packed buffer carries the unit's parameters (and their gradients): one dtype.
    MG_CHECK(p->value.dtype() == s.params.front()->value.dtype(), "fsdp unit '{}': parameter '{}' is {} and '{}' is {}: "
             "a unit's parameters share one dtype", s.name, p->name, dtype_name(p->value.dtype()),
             s.params.front()->name, dtype_name(s.params.front()->value.dtype()));
    MG_CHECK(p->placements.at(static_cast<std::size_t>(s.ctx->fsdp_axis)) == dist::Placement::shard_of_piece(0),
             "fsdp unit '{}': parameter '{}' is placed {} (Sp(0) on fsdp expected)", s.name, p->name,
             dist::placements_str(p->placements));
    const Shape shape = p->operand_shape();
    s.rows.push_back(shard_sizes(shape.at(0), s.fsdp->size()));
    MG_CHECK(s.rows.back()[static_cast<std::size_t>(s.fsdp->rank())] == p->value.size(0),
             "fsdp unit '{}': parameter '{}' holds {} rows of {}, its share is {}", s.name, p->name, p->value.size(0),
             shape_str(shape), s.rows.back()[static_cast<std::size_t>(s.fsdp->rank())]);
    s.row_numel.push_back(shape.at(0) > 0 ? shape_numel(shape) / shape.at(0) : 0);
    s.full.push_back(Tensor::empty(shape, p->value.dtype()));
    s.full.back().storage()->release_memory();   // taken when first gathered
  }
  s.micro_sum = tree::OrderedSum(s.ctx->reduce_order() == dist::ReduceOrder::FixedTree);
  s.partial.assign(s.params.size(), 0);
}

FsdpUnit::~FsdpUnit() {
  // A gather in flight reads this unit's buffers: let it finish (errors are the next collective's to report).
  if (state_->pending.valid()) {
    try {
      (void)state_->pending.wait();
    } catch (...) {
    }
  }
  state_->pending = dist::PendingTensor();
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
