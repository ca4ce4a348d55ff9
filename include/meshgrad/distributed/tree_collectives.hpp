// The collectives of the fixed reduction tree (ReduceOrder::FixedTree, rule.hpp; ops/tree_reduce.hpp
// for the local half): every rank holds the root of its subtree, in rank order = tree order, and
// the collective combines the roots in the same pairwise tree on every rank. Implemented as a
// gather of the roots followed by a local tree sum (4 ranks: (r0 + r1) + (r2 + r3)), not as the
// backend's all-reduce, whose order (rank order: ((r0 + r1) + r2) + r3) is not the tree. Two ranks
// are the exception: there the tree is the one addition r0 + r1, which the backend's all-reduce and
// reduce-scatter compute (comm contract), so they are used. The group size must be a power of two.
// A group of size 1 returns the root itself.
//
// Not differentiable and not called by layers: run_primitive (rule.hpp) runs these for a step whose
// StepArgs::order is FixedTree, so every differentiable step keeps the one rule's backward.
#pragma once

#include <cstdint>
#include <vector>

#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/distributed/mesh.hpp"

namespace meshgrad::dist {

// root: any shape -> the tree sum of every rank's root (same shape, same bits on every rank).
Tensor tree_all_reduce(const Tensor& root, const ProcessGroup& group);
PendingTensor tree_all_reduce_async(const Tensor& root, const ProcessGroup& group);
// root: full along dim (extent sum(sizes), sizes by the shard rule) -> this rank's shard of the tree
// sum along dim: an all-to-all of the shards, then the tree sum of the ranks' pieces.
PendingTensor tree_reduce_scatter_async(const Tensor& root, const ProcessGroup& group, std::int64_t dim,
                                        const std::vector<std::int64_t>& sizes);

}  // namespace meshgrad::dist
