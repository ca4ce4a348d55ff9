// THE ONE RULE: where the backward of every collective is decided.
//
// A collective meshgrad records in a graph is a change of placement of one tensor on one mesh
// axis (or one group of axes): R -> R when a replicated tensor enters a region of sharded
// compute, P -> R (all-reduce), S(d) -> R (all-gather), R -> S(d) (keep own slice),
// P -> S(d) (reduce-scatter), S(i) -> S(j) (all-to-all), R -> P. Its backward is decided by one
// table, from that forward step and the placement of the gradient that arrives at the output:
//
//   forward        gradient arrives P            gradient arrives R / S
//   R -> R         all-reduce        -> R        identity          -> R
//   P -> R         all-reduce        -> R        identity          -> R
//   S(d) -> R      reduce-scatter(d) -> S(d)     keep own slice(d) -> S(d)
//   R -> S(d)      -                             all-gather(d)     -> R
//   P -> S(d)      -                             all-gather(d)     -> R
//   S(i) -> S(j)   -                             all-to-all(j->i)  -> S(i)
//   R -> P         all-reduce        -> R        identity          -> R
//
// A sharded output's gradient is always complete for its shard (no other coordinate's loss can
// depend on this shard without a collective, which has its own backward), so S outputs only see
// S gradients. The gradient that comes out of a step is never partial on that axis again: the
// result placement is the rule's too.
//
// Who asks it (each in one step from here): the differentiable mappings (mappings.hpp), DTensor
// redistribute and its gradient reduction (dtensor.hpp), the column-parallel linear's fused and
// overlapped backward (nn/layers.cpp), the backward of fsdp's gathers (nn/fsdp.cpp), parameter
// gradient synchronisation (optim/grad_sync.cpp) and `meshgrad explain`, whose `--rules` prints this
// table from rule_table(). Not from this table: point-to-point transfers between pipeline stages
// (p2p.hpp: a send's backward is a receive and the reverse), the tied weight's transfers between
// the first and last stage (nn/tied_weight.cpp) and the vocabulary-parallel cross-entropy's fused
// reductions (nn/layers.cpp).
//
// The placement of an arriving gradient is read from its PartialGradient annotation
// (placement.hpp): bit set on the axis = P, clear = R.
//
// The order of a sum is a policy of the step, not a second rule: ReduceOrder travels in StepArgs,
// and run_primitive, the one executor, picks the collective that adds in that order. The normal
// mode adds in rank order (the backends' all-reduce and reduce-scatter); the tp-invariant mode in
// the fixed binary tree (docs/mesh-invariance.md). Placements and backwards are the same in both.
#pragma once

#include <string>
#include <vector>

#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/distributed/placement.hpp"

namespace meshgrad::dist {

// What runs on one group in one direction. Slice keeps this coordinate's shard (no communication);
// KeepOnRoot keeps the value on coordinate 0 and zeros elsewhere (no communication).
enum class Primitive : std::uint8_t { Identity, AllReduce, AllGather, ReduceScatter, Slice, AllToAll, KeepOnRoot };
const char* primitive_name(Primitive p);   // "all-reduce", "keep own slice", ...
bool communicates(Primitive p);           // false for Identity, Slice, KeepOnRoot

// The forward primitive that turns placement `from` into `to` on one axis. Throws InvalidArgument
// naming both for a change with no single step (S -> P, P -> P', ...).
Primitive forward_primitive(Placement from, Placement to);

struct BackwardStep {
  Primitive op;       // what backward runs on the arriving gradient
  Placement result;   // the placement of the input's gradient afterwards (never P)
};

// The rule. `incoming` is the placement of the gradient arriving at the output: R or P when `to`
// is R or P, S(to.dim) when `to` is a shard. Throws naming the step when the combination cannot
// happen (a partial gradient for a sharded output, a shard gradient for a replicated one).
BackwardStep backward_step(Placement from, Placement to, Placement incoming);

// The placement of gradient `grad` of a tensor placed `forward_placement` on the axes `axes`:
// S stays S (shard gradients are complete); R or P becomes P when the gradient is marked partial
// on every one of `axes`, R when on none. A gradient partial on only some of a group's axes is
// refused (it cannot be reduced over the group as a whole), naming the op.
Placement arriving_placement(const Tensor& grad, Placement forward_placement, AxisMask axes, std::string_view op);

// One row of the table, for `meshgrad explain --rules`, docs and tests.
struct RuleRow {
  Placement from, to, incoming;
  Primitive forward;
  BackwardStep backward;
};
// Every (from, to, incoming) combination the rule accepts, with symbolic dims (shards use dims 0
// and 1), in the order of the table above.
std::vector<RuleRow> rule_table();
// The table as aligned text (explain --rules).
std::string format_rule_table();

// ---- running a step ------------------------------------------------------------------------------

// The order in which a reduction (AllReduce, ReduceScatter) adds the group's terms:
//   RankOrder  the backend's collective: ((r0 + r1) + r2) + r3, in rank order (comm contract)
//   FixedTree  the fixed binary tree over the ranks: (r0 + r1) + (r2 + r3) (tree_collectives.hpp).
//              When every rank holds the root of its subtree of fixed blocks, this is one tree over
//              the blocks, the same at every group size: the tp-invariant mode. The group size
//              must be a power of two.
// Two ranks add r0 + r1 either way. Primitives that add nothing ignore the order.
enum class ReduceOrder : std::uint8_t { RankOrder, FixedTree };
const char* reduce_order_name(ReduceOrder order);   // "rank order", "fixed tree"

// What a step needs besides the tensor: the group, the tensor dim it acts on (and the second dim of
// an all-to-all), every coordinate's extent along the dim that is sharded after the step
// (AllGather/ReduceScatter/Slice: along dim; AllToAll: along dim2, the dim being gathered), and the
// order of its sums.
struct StepArgs {
  int dim = 0;
  int dim2 = 0;
  std::vector<std::int64_t> sizes;
  ReduceOrder order = ReduceOrder::RankOrder;
};

// Runs primitive p on x over group (blocking). A group of size 1 returns x itself (Identity) or
// x (Slice of the whole), bit-identical to serial code.
Tensor run_primitive(Primitive p, const Tensor& x, const ProcessGroup& group, const StepArgs& args);
// The same, asynchronous where p communicates: the column-parallel backward overlaps it with
// compute. in_place: a rank-order AllReduce may reduce x's own buffer (the caller owns x
// exclusively); the result is then x itself, else a new tensor.
PendingTensor run_primitive_async(Primitive p, const Tensor& x, const ProcessGroup& group, const StepArgs& args,
                                  bool in_place = false);

// The sum of x over group in `order` (run_primitive's AllReduce): for values reduced outside a graph
// (a reported loss, a bucket of gradients, a cross-entropy's sum of exponentials).
Tensor sum_over(const Tensor& x, const ProcessGroup& group, ReduceOrder order);
// The same for a one-element tensor, as a double (a loss summed over the dp replicas).
double sum_scalar_over(const Tensor& x, const ProcessGroup& group, ReduceOrder order);

}  // namespace meshgrad::dist
