// The differentiable collectives ("mappings") of the DESIGN table, over one process group.
// Each is a change of placement on the group (rule.hpp); forward runs the step's primitive and
// backward asks the one rule with the placement of the gradient that actually arrives, so a
// mapping needs no flag for "is the downstream gradient partial" (Megatron's
// tensor_parallel_output_grad): a gradient marked partial on the group's axes (placement.hpp:
// mark_partial_grad, DTensor from_local with P, the column-parallel layer's dX) is reduced, an
// unmarked (replicated) one only sliced. The gradient that leaves a mapping is marked complete on
// the group's axes; marks on other axes pass through.
//
// dims: the feature dim is the last (-1) and the sequence dim is given by the caller (default 0).
// Uneven shards follow the shard rule. Where a forward gathers, full_size is the extent of the
// gathered dim; -1 = learn the shards' extents with exchange_sizes (one small extra collective).
// order: how the step's sums add the ranks' terms, forward and backward (ReduceOrder, rule.hpp):
// the backend's rank order, or the fixed tree of the tp-invariant mode. Nothing else changes.
// A group of size 1 makes every mapping an identity, bit-identical to serial code.
#pragma once

#include <string>
#include <vector>

#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/distributed/placement.hpp"
#include "meshgrad/distributed/rule.hpp"
#include "meshgrad/tensor/shard.hpp"
#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::dist {

// The one differentiable step: x, this coordinate's piece of a tensor placed `from` on the
// group, becomes its piece placed `to`. full_size: the global extent along the dim that the step
// gathers (S(d) -> R: d; S(i) -> S(j): i); -1 = exchange the extents. Every mapping below is this.
Tensor change_placement(const Tensor& x, const ProcessGroup& group, Placement from, Placement to,
                        std::int64_t full_size = -1, ReduceOrder order = ReduceOrder::RankOrder);

// R -> R: forward identity / backward all-reduce if the gradient arrives partial, else identity
Tensor copy_to_region(const Tensor& x, const ProcessGroup& group, ReduceOrder order = ReduceOrder::RankOrder);
// P -> R: forward all-reduce / backward identity (all-reduce if the gradient arrives partial)
Tensor reduce_from_region(const Tensor& x, const ProcessGroup& group, ReduceOrder order = ReduceOrder::RankOrder);
// R -> S(dim): forward keep own slice / backward all-gather
Tensor scatter_to_region(const Tensor& x, const ProcessGroup& group, std::int64_t dim = -1);
// S(dim) -> R: forward all-gather / backward keep own slice (reduce-scatter if the gradient arrives partial)
Tensor gather_from_region(const Tensor& x, const ProcessGroup& group, std::int64_t dim = -1,
                          std::int64_t full_size = -1);
// R -> S(dim) along the sequence: forward keep own slice / backward all-gather
Tensor scatter_to_sequence(const Tensor& x, const ProcessGroup& group, std::int64_t dim = 0);
// S(dim) -> R along the sequence: forward all-gather / backward reduce-scatter if the gradient
// arrives partial (the next op is tensor-parallel), keep own slice if it arrives replicated
Tensor gather_from_sequence(const Tensor& x, const ProcessGroup& group, std::int64_t dim = 0,
                            std::int64_t full_size = -1);
// P -> S(dim) along the sequence: forward reduce-scatter / backward all-gather
Tensor reduce_scatter_to_sequence(const Tensor& x, const ProcessGroup& group, std::int64_t dim = 0,
                                  ReduceOrder order = ReduceOrder::RankOrder);
// S(cat_dim) -> S(split_dim): forward all-to-all / backward the reverse all-to-all
Tensor all_to_all(const Tensor& x, const ProcessGroup& group, std::int64_t split_dim, std::int64_t cat_dim,
                  std::int64_t cat_full_size = -1);
// The token exchange of expert parallelism (nn/moe.hpp), an all-to-all with uneven counts: x [M, ...]
// holds send_rows[d] rows for every rank d of group, in rank order; the result [sum(recv_rows), ...]
// holds recv_rows[s] rows from every rank s. As placements it is the rule's S(i) -> S(j) over a
// ragged [source, destination, rows] view of the tokens: each rank holds its source slice before and
// its destination slice after, so the rule answers the reverse all-to-all, with the two count lists
// exchanged. forward: all-to-all / backward: all-to-all back.
Tensor all_to_all_rows(const Tensor& x, const ProcessGroup& group, std::vector<std::int64_t> send_rows,
                       std::vector<std::int64_t> recv_rows);
// An all-gather whose result feeds a loss that differs per rank (each rank's loss may use every
// rank's rows): gather_from_sequence with the result's gradient marked partial on the group, so
// backward reduce-scatters. forward: all-gather / backward: reduce-scatter.
Tensor all_gather_with_grad(const Tensor& x, const ProcessGroup& group, std::int64_t dim = 0,
                            std::int64_t full_size = -1);

struct MappingRow {
  std::string name;       // "copy to TP region"
  std::string forward;    // "identity", "all-reduce", "keep own slice", "all-gather", "reduce-scatter", ...
  std::string backward;   // the rule's answer for the gradient the mapping usually receives
  std::string backward_if_partial;      // ... when the gradient arrives partial on the group
  std::string backward_if_replicated;   // ... when it arrives replicated (both "" for sharded outputs)
};
// The mappings above, described from the rule (rule.hpp).
std::vector<MappingRow> mapping_table();

}  // namespace meshgrad::dist
