// The collective half of TP-invariant mode's fixed reduction tree (ops/tree_reduce.hpp): every rank
// holds the root of its subtree, in rank order = tree order, and the collective combines the roots
// in the same pairwise tree on every rank. Implemented as a gather of the roots followed by a local
// tree sum (tp=2: r0 + r1; tp=4: (r0 + r1) + (r2 + r3)), not as the backend's all-reduce, whose
// order (rank order: ((r0 + r1) + r2) + r3) is not the tree. Two ranks are the exception: there the
// tree is the one addition r0 + r1, which the backend's all-reduce and reduce-scatter compute (comm
// contract), so they are used. The group size must be a power of two.
// A group of size 1 returns the root itself.
#pragma once

#include <cstdint>
#include <vector>

#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/distributed/mesh.hpp"

namespace meshgrad::dist {

// ---- not differentiable ---------------------------------------------------------------------------
// root: any shape -> the tree sum of every rank's root (same shape, same bits on every rank).
Tensor tree_all_reduce(const Tensor& root, const ProcessGroup& group);
PendingTensor tree_all_reduce_async(const Tensor& root, const ProcessGroup& group);
// root: [S, ...] (S = the full extent of dim 0) -> this rank's rows (shard rule) of the tree sum:
// an all-to-all of the rows, then the tree sum of the ranks' pieces.
Tensor tree_reduce_scatter(const Tensor& root, const ProcessGroup& group);

// ---- differentiable -------------------------------------------------------------------------------
// P -> R with the tree. forward: tree all-reduce / backward: identity (the gradient arrives
// replicated on the group; a partial one is an error: the tree mode has no partial dual here).
Tensor tree_reduce_from_region(const Tensor& x, const ProcessGroup& group);
// P -> S(0) with the tree. forward: tree reduce-scatter along dim 0 / backward: all-gather (exact).
Tensor tree_reduce_scatter_to_sequence(const Tensor& x, const ProcessGroup& group);
// A replicated tensor used on data split over the group (a LayerNorm weight under sequence
// parallelism). forward: identity / backward: the gradient (this rank's subtree root) tree-all-reduced
// over the group, so it leaves complete on the group's axes.
Tensor tree_reduce_grad(const Tensor& x, const ProcessGroup& group);

}  // namespace meshgrad::dist
