// The fixed reduction tree of TP-invariant mode (docs/tp-invariance.md): a split dimension is cut
// into a fixed number of blocks (a power of two, the same at every tensor-parallel degree), every
// block is reduced on its own (a GEMM of the same shape at every tp), and the block results are
// summed in one fixed binary tree:
//
//   blocks 0 1 2 3        tp=1: one rank sums the whole tree
//          \ / \ /        tp=2: rank 0 sums (0+1), rank 1 (2+3); the collective adds the roots
//          01   23        tp=4: every rank holds one leaf; the collective sums the whole tree
//            \ /
//           0123
//
// A rank holds the blocks [r * n / tp, (r + 1) * n / tp), a whole subtree when tp divides n (both
// powers of two), so "each rank reduces its subtree, the collective combines the roots in tree order"
// is the same sum in the same order at every tp. Pure computation, no communication (the collective
// half is distributed/tree_collectives.hpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::tree {

// True when n is a power of two (1, 2, 4, ...).
bool is_power_of_two(std::int64_t n);

// Sums leaves pairwise, level by level: ((l0 + l1) + (l2 + l3)) + ... The count must be a power of
// two; every leaf has the same shape and dtype. Not differentiable (kernels::binary).
Tensor sum(const std::vector<Tensor>& leaves);
// The same sum with the differentiable add (ops.hpp), for graphs.
Tensor sum_op(const std::vector<Tensor>& leaves);

// The same tree over leaves that arrive one at a time (the micro-batches of a step, each a list of
// tensors: one per parameter), holding at most log2(n) + 1 partial sums instead of n leaves. After
// n pushes (n a power of two) root() is bitwise sum() of the n leaves, entry by entry. An undefined
// entry is a zero leaf: the sum is the other operand (x + 0 is x, signed zeros aside). Leaves are
// kept, not copied: the caller hands over tensors it no longer writes.
class StreamingSum {
 public:
  void push(std::vector<Tensor> leaf);
  // The root; throws InvalidArgument unless the pushes so far are a power of two (>= 1).
  const std::vector<Tensor>& root() const;
  int leaves() const { return leaves_; }

 private:
  struct Partial {
    int level = 0;   // the partial sum of 2^level leaves
    std::vector<Tensor> values;
  };
  std::vector<Partial> stack_;
  int leaves_ = 0;
};

// One contiguous piece of a split dimension held by this rank: `size` elements at `local_offset` in
// the local piece, which are global block `block` of fused part `part`.
struct Segment {
  std::int64_t local_offset = 0;
  std::int64_t size = 0;
  int part = 0;
  int block = 0;
};

// How a dimension of `full` elements, made of `parts` equal fused parts (QKV: 3) split in whole
// units of `unit` elements (a head's width), is cut into `blocks` fixed blocks per part, and which of
// them rank `rank` of `tp` holds. The shard rule (tensor/shard.hpp) gives the rank its units of each
// part: shard_range(units per part, tp, rank); block b of a part is shard_range(units per part,
// blocks, b). The rank's pieces must be exactly the blocks [rank * blocks / tp, (rank + 1) * blocks /
// tp) of every part: otherwise (tp does not divide blocks, or uneven shards that cut a block)
// check_split() throws.
struct SplitPlan {
  std::int64_t full = 0;
  int parts = 1;
  std::int64_t unit = 1;
  int blocks = 1;
  int tp = 1, rank = 0;
  std::vector<Segment> segments;   // in local order: part-major, then block
  int local_blocks() const { return blocks / tp; }
  int first_block() const { return rank * blocks / tp; }
  // The segments of local block i (0 <= i < local_blocks()), one per part, in part order.
  std::vector<Segment> block_segments(int i) const;
};

// Whether the split nests at this tp (see SplitPlan); never throws.
bool nests(std::int64_t full, int parts, std::int64_t unit, int blocks, int tp);
// The plan for rank of tp; throws InvalidArgument naming `what` and the degrees that do nest
// (candidates: 1, 2, 4, ... up to blocks) when this one does not.
SplitPlan plan_split(const std::string& what, std::int64_t full, int parts, std::int64_t unit, int blocks, int tp,
                     int rank);
// The degrees among 1, 2, 4, ..., blocks at which the split nests, e.g. "1, 2, 4".
std::string nesting_degrees(std::int64_t full, int parts, std::int64_t unit, int blocks);

// c (+)= a @ b on 2-D views of one floating dtype: a [m, k] and b [k, n] each with a unit stride in
// one dim (a transpose is passed as a flag, not copied), c [m, n] with unit column stride (a column
// slice of a larger matrix is fine). No version bump: the caller owns c (a fresh result).
void gemm_into(Tensor& c, const Tensor& a, const Tensor& b, bool accumulate);

}  // namespace meshgrad::tree
