// Sums in a fixed order, and the blocks a layer computes in: the local half of the summation-order
// policy (dist::ReduceOrder, distributed/rule.hpp; the collective half is
// distributed/tree_collectives.hpp).
//
// The fixed binary tree (docs/mesh-invariance.md): a split dimension is cut into a fixed number of
// blocks (a power of two, the same at every tensor-parallel degree), every block is reduced on its
// own (a GEMM of the same shape at every tp), and the block results are summed in one binary tree:
//
//   blocks 0 1 2 3        tp=1: one rank sums the whole tree
//          \ / \ /        tp=2: rank 0 sums (0+1), rank 1 (2+3); the collective adds the roots
//          01   23        tp=4: every rank holds one leaf; the collective sums the whole tree
//            \ /
//           0123
//
// A rank holds the blocks [r * n / tp, (r + 1) * n / tp), a whole subtree when tp divides n (both
// powers of two), so "each rank reduces its subtree, the collective combines the roots in tree order"
// is the same sum in the same order at every tp.
//
// The normal mode is the same code with one block per rank (SplitPlan::whole): one GEMM over the
// rank's whole shard, a tree of one leaf (the leaf itself), and rank-order collectives. Layers
// therefore always carry a plan, and differ between the modes only in it and in the order.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "meshgrad/tensor/error.hpp"
#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::tree {

// True when n is a power of two (1, 2, 4, ...).
bool is_power_of_two(std::int64_t n);

// ---- the one tree sum --------------------------------------------------------------------------

namespace testing {
// A mutation for the tests that must be able to fail (tests/launch/test_mesh_invariant.cpp): while
// on, every tree sum adds its leaves left to right, ((l0 + l1) + l2) + l3, instead of in the tree,
// so meshes that split the leaves differently must stop agreeing. Process-wide; change it only
// while no ranks run. Never on outside tests.
void set_left_fold(bool on);
bool left_fold();
}  // namespace testing

// The fixed binary tree over leaves that arrive one at a time: after n = 2^k pushes, root() is
// ((l0 + l1) + (l2 + l3)) + ..., the left operand always the earlier subtree. Holds at most
// log2(n) + 1 partial sums (two partial sums of the same size are siblings and are added at once).
// add(a, b) returns a + b. Every tree sum of meshgrad runs on this class: tree::sum, StreamingSum,
// the vocab-parallel cross-entropy's sums of exponentials, the row blocks of bias and LayerNorm
// gradients.
template <class T, class Add>
class PairwiseSum {
 public:
  explicit PairwiseSum(Add add = Add()) : add_(std::move(add)) {}

  void push(T leaf) {
    MG_CHECK(depth_ < kMaxDepth, "tree sum: more than 2^{} leaves", kMaxDepth - 1);
    stack_[depth_++] = {0, std::move(leaf)};
    ++leaves_;
    while (depth_ >= 2 && (stack_[depth_ - 2].level == stack_[depth_ - 1].level || testing::left_fold())) {
      Partial& left = stack_[depth_ - 2];
      left.value = add_(left.value, stack_[depth_ - 1].value);
      ++left.level;
      stack_[--depth_] = Partial{};
    }
  }
  // The root; throws InvalidArgument unless the pushes so far are a power of two (>= 1).
  const T& root() const {
    MG_CHECK(depth_ == 1, "tree sum: {} leaves; the fixed tree needs a power of two (>= 1)", leaves_);
    return stack_[0].value;
  }
  std::int64_t leaves() const { return leaves_; }

 private:
  static constexpr int kMaxDepth = 64;
  struct Partial {
    int level = 0;   // the partial sum of 2^level leaves
    T value{};
  };
  Add add_;
  std::array<Partial, kMaxDepth> stack_{};
  int depth_ = 0;
  std::int64_t leaves_ = 0;
};

// Sums leaves in the tree. The count must be a power of two; every leaf has the same shape and
// dtype. Not differentiable (kernels::binary).
Tensor sum(const std::vector<Tensor>& leaves);
// The same sum with the differentiable add (ops.hpp), for graphs.
Tensor sum_op(const std::vector<Tensor>& leaves);

// The tree over leaves that are lists of tensors (the micro-batches of a step, each a list with
// one gradient per parameter), entry by entry. An undefined entry is a zero leaf: the sum is the
// other operand (x + 0 is x, signed zeros aside). Leaves are kept, not copied: the caller hands
// over tensors it no longer writes.
class StreamingSum {
 public:
  void push(std::vector<Tensor> leaf) { sum_.push(std::move(leaf)); }
  // The root; throws InvalidArgument unless the pushes so far are a power of two (>= 1).
  const std::vector<Tensor>& root() const { return sum_.root(); }
  std::int64_t leaves() const { return sum_.leaves(); }

 private:
  struct AddLists {
    std::vector<Tensor> operator()(const std::vector<Tensor>& a, const std::vector<Tensor>& b) const;
  };
  PairwiseSum<std::vector<Tensor>, AddLists> sum_;
};

// The one accumulator of a step's micro-batches: the values pushed one after the other, added in
// one of the two orders meshgrad sums in, left to right (((v0 + v1) + v2) + ...: rank order, as
// .grad accumulates) or the fixed binary tree (StreamingSum: the tp- and mesh-invariant modes). A
// push is a list of tensors added entry by entry; an undefined entry adds nothing. The losses and
// gradients of a step (optim/micro_batches.hpp), an fsdp unit's unsharded gradients (nn/fsdp.cpp)
// and the tied weight's output gradient (nn/tied_weight.cpp) all add through it, so the three agree
// on the order by construction. Pushed tensors are kept, not copied (the caller no longer writes
// them); the sums are new tensors.
class OrderedSum {
 public:
  explicit OrderedSum(bool fixed_tree) : tree_(fixed_tree) {}
  void push(std::vector<Tensor> values);
  // The sum of the pushes so far; in the tree their count must be a power of two. Throws
  // InvalidArgument when nothing was pushed.
  std::vector<Tensor> total() const;
  std::int64_t count() const { return count_; }
  bool fixed_tree() const { return tree_; }
  void clear();   // back to no pushes, same order

 private:
  bool tree_;
  std::int64_t count_ = 0;
  std::vector<Tensor> running_;   // left to right
  StreamingSum sum_;              // the tree
};

// ---- the blocks a layer computes in ------------------------------------------------------------

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
// plan_split() throws.
struct SplitPlan {
  std::int64_t full = 0;
  int parts = 1;
  std::int64_t unit = 1;
  int blocks = 1;
  int tp = 1, rank = 0;
  std::vector<Segment> segments;   // in local order: part-major, then block
  int local_blocks = 1;            // blocks this rank holds (per part)
  int first_block = 0;             // the global index of the first of them

  // The normal mode's plan: the rank's whole local piece of `local_extent` elements as one segment
  // and one block, whatever its parts (one GEMM over the shard, no tree).
  static SplitPlan whole(std::int64_t local_extent);
  // The segments of local block i (0 <= i < local_blocks), one per part, in part order.
  std::vector<Segment> block_segments(int i) const;
  // The extents of the segments, in local order.
  std::vector<std::int64_t> sizes() const;
  // The local extent the plan covers.
  std::int64_t local_extent() const;
};

// Whether the split nests at this tp (see SplitPlan); never throws.
bool nests(std::int64_t full, int parts, std::int64_t unit, int blocks, int tp);
// The plan for rank of tp; throws InvalidArgument naming `what` and the degrees that do nest
// (candidates: 1, 2, 4, ... up to blocks) when this one does not.
SplitPlan plan_split(const std::string& what, std::int64_t full, int parts, std::int64_t unit, int blocks, int tp,
                     int rank);
// The degrees among 1, 2, 4, ..., blocks at which the split nests, e.g. "1, 2, 4".
std::string nesting_degrees(std::int64_t full, int parts, std::int64_t unit, int blocks);

// ---- differentiable ops computed per block, summed in the tree ---------------------------------
// With SplitPlan::whole (one block) each is the plain op, bit for bit.

// x [..., in] @ w [in, out] with the in features cut by `in_plan` (segments over in): one GEMM per
// segment (the same shape at every tp), the products summed in the tree. Backward per segment:
// dx[..., s] = dy w[s, :]^T, dw[s, :] = x[..., s]^T dy. The row-parallel linear's local product.
// row_blocks (sizes of consecutive blocks of x's rows viewed as [rows, in]; empty = one block): every
// product runs per row block (the same GEMM shapes wherever the block lies) and dw is the tree over
// the row blocks of theirs (--mesh-invariant's sequence blocks).
Tensor linear_over_input_blocks(const Tensor& x, const Tensor& w, const SplitPlan& in_plan,
                                const std::vector<std::int64_t>& row_blocks = {});

// y [N..., C] + bias [C], the bias gradient the tree over row blocks of column sums: row_blocks
// are the sizes of consecutive blocks of the rows of y viewed as [rows, C] (sum = rows; empty = one
// block).
Tensor add_bias(const Tensor& y, const Tensor& bias, const std::vector<std::int64_t>& row_blocks);

// The sum of every element of x, per block of its leading dim (row_blocks: sizes of consecutive
// blocks along dim 0, sum = x.size(0); empty = one block), the block sums added in the tree.
Tensor sum_over_blocks(const Tensor& x, const std::vector<std::int64_t>& row_blocks);

}  // namespace meshgrad::tree
