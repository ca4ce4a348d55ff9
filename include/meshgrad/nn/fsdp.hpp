// Fully sharded data parallelism (ZeRO-3, PyTorch FSDP2's design) over the mesh's "fsdp" axis, from
// the one rule (distributed/rule.hpp).
//
// Every parameter is placed Sp(0) on fsdp (placement.hpp): this rank holds a run of rows of its
// tensor-parallel piece as Parameter::value, and its gradient and AdamW moments have that shape too,
// so the optimizer steps the shard. A unit (one transformer block; a model's own parameters) gathers
// its parameters just before it computes and lets them go after:
//
//   forward   Sp(0) -> R on fsdp: one all-gather per unit (FSDP2's foreach all-gather: each rank's
//             shards of every parameter packed into one buffer, the gathered chunks copied out into
//             the full tensors), issued one unit ahead (prefetch) so
//             it overlaps the previous unit's compute; Parameter::gathered is the result, recorded
//             as one node whose backward is the rule's. After the unit's forward, with
//             reshard_after_forward, the gathered bytes are given back (the graph keeps its handles,
//             Storage::release_memory).
//   backward  before the unit's backward (an identity node on its output) its bytes are taken again
//             and refilled, and the previous unit's gather is issued; the gathered piece's gradient
//             arrives partial over fsdp (each rank saw its own rows), and the backward of the
//             all-gather is a reduce-scatter (P -> S(0)), one per unit over the packed gradients: the
//             shard's gradient, complete over fsdp,
//             still partial over dp, which the gradient synchroniser reduces as for any replica.
//             A gradient also partial over the tp axis (LayerNorm weights under SP) is all-reduced
//             over tp first, as the synchroniser does before dp. The reduce-scatters stay in flight
//             through the next unit's backward (FsdpReductions below).
//
// Bitwise equal to plain dp: every reduction adds the ranks' terms in the order the dp all-reduce
// does (comm contract: reduce-scatter and all-reduce add element by element in rank order; the
// fixed tree in tp-invariant mode), micro-batches are summed unsharded before the reduction (as dp
// sums them in .grad), and nothing else changes a value: gathers copy.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "meshgrad/nn/parallel_context.hpp"
#include "meshgrad/nn/parameter.hpp"

namespace meshgrad::nn {

struct FsdpUnitState;
struct FsdpReductions;

class FsdpUnit {
 public:
  // params: the unit's parameters (owned by the model, outliving the unit), each placed Sp(0) on the
  // context's fsdp axis. ctx->fsdp_active() must hold.
  // reductions: shared by a model's units (new_reductions()): a unit's reduce-scatters then stay in
  // flight through the next unit's backward, and each unit's backward delivers what the one before
  // left (to the shards' leaves, through the engine's accumulation and hooks). The unit whose backward
  // comes last (the model's own, gathered first in forward) says so with last_in_backward: it
  // delivers everything before backward ends. nullptr: every reduction is waited for in place.
  FsdpUnit(std::string name, std::vector<Parameter*> params, ParallelContextPtr ctx,
           std::shared_ptr<FsdpReductions> reductions = nullptr, bool last_in_backward = false);
  static std::shared_ptr<FsdpReductions> new_reductions();
  ~FsdpUnit();
  FsdpUnit(const FsdpUnit&) = delete;
  FsdpUnit& operator=(const FsdpUnit&) = delete;

  // Issues the all-gathers of every parameter (async) unless they are gathered or in flight.
  // Collective over the fsdp group: every rank issues the same units in the same order.
  void prefetch();
  // Before the unit's forward: waits for (or runs) the gathers and sets every parameter's
  // `gathered`, recorded when grad mode is on (one node whose backward reduce-scatters).
  void begin_forward();
  // After the unit's forward: clears `gathered`; release: gives the gathered bytes back (a graph
  // that saved them gets them refilled by regather_before_backward's node).
  void end_forward(bool release);
  // Identity on the unit's output (recorded when grad mode is on): its backward refills this unit's
  // gathered bytes before any of the unit's backward runs, and issues `previous`'s gathers (the unit
  // whose backward comes next; nullptr: none).
  Tensor regather_before_backward(const Tensor& out, FsdpUnit* previous);
  // Gradient accumulation: while on, backward sums the gathered pieces' gradients unsharded and
  // reduces nothing; the first backward after it is turned off reduces the whole sum.
  void set_accumulating(bool on);

  const std::string& name() const;
  // Bytes the unit holds gathered now (0 between its uses with resharding): for tests and reports.
  std::int64_t gathered_bytes() const;

 private:
  std::shared_ptr<FsdpUnitState> state_;
};

// A unit's forward bracket: begin_forward now, end_forward when it ends (release when no graph will
// need the bytes again before a regather: grad mode off, or resharding after forward).
class FsdpForwardScope {
 public:
  FsdpForwardScope(FsdpUnit* unit, bool release);
  ~FsdpForwardScope();
  FsdpForwardScope(const FsdpForwardScope&) = delete;
  FsdpForwardScope& operator=(const FsdpForwardScope&) = delete;

 private:
  FsdpUnit* unit_;
  bool release_;
};

}  // namespace meshgrad::nn
