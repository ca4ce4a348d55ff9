// Tensor-parallel layers. Activations are [T, B, C] (sequence first, as Megatron), so sequence
// parallelism shards dim 0. A linear weight is [in, out] and y = x W + b.
//
// Where communication happens (the DESIGN table; the tests count it):
//   column-parallel, all-reduce mode   forward: none                 backward: all-reduce of dX
//   row-parallel, all-reduce mode      forward: all-reduce of Y      backward: none
//   column-parallel, sequence-parallel forward: all-gather X (seq)   backward: reduce-scatter of dX (seq)
//   row-parallel, sequence-parallel    forward: reduce-scatter Y     backward: all-gather of dY (seq)
// Weight gradients stay local. Replicated parameters used on sequence-sharded data (LayerNorm,
// the row-parallel bias, position embeddings under SP) get gradients that are partial over tp;
// ParallelContext::replicated_on_sequence_shard says where they are summed.
//
// Both modes run this code: what the tp-invariant mode changes is only the context's plans (the
// fixed blocks each GEMM and column sum runs in, one block normally) and order (the fixed tree,
// rank order normally), see parallel_context.hpp.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/nn/model.hpp"
#include "meshgrad/nn/parallel_context.hpp"
#include "meshgrad/nn/parameter.hpp"
#include "meshgrad/ops/tree_reduce.hpp"
#include "meshgrad/tensor/random.hpp"

namespace meshgrad::nn {

// A parameter of a layer, created from its full shape with deterministic init (std > 0: normal;
// else the constant).
Parameter make_parameter(const std::string& name, const Shape& full_shape, dist::Placements placements,
                         const ParallelContext& ctx, std::uint64_t seed, double std, double constant, DType dtype);

// True when w is a 2-D view whose elements are a row-major matrix of the transposed shape (w = M^T
// with M contiguous, like the tied LM head's wte^T). Column layers then compute the weight's
// gradient directly in M's layout (dM = dY^T X, one GEMM), so it reaches M with no transposed copy.
bool is_transposed_matrix(const Tensor& w);

class ColumnParallelLinear {
 public:
  struct Options {
    bool bias = true;
    bool gather_output = false;   // all-gather the output features (forward) / keep own slice (backward)
    int blocks = 1;               // fused outputs split per block (QKV: 3)
    std::int64_t unit = 1;        // split in whole units (a head's width)
    double init_std = 0.02;
    bool owns_weight = true;      // false: the caller passes the weight to forward_with (tied LM head)
  };
  ColumnParallelLinear(const std::string& name, std::int64_t in, std::int64_t out, const Options& options,
                       ParallelContextPtr ctx, std::uint64_t seed, DType dtype);
  // x: [T, B, in] (replicated) or, under sequence parallelism, [T_local, B, in] with seq_len = T.
  // Returns [T, B, out_local] ([T, B, out] with gather_output).
  Tensor forward(const Tensor& x, std::int64_t seq_len) const;
  // The same with an explicit weight [in, out_local] (the tied LM head passes wte^T).
  Tensor forward_with(const Tensor& x, std::int64_t seq_len, const Tensor& weight, const Tensor& bias) const;
  // The blocks of the local output features it computes in (ParallelContext::feature_plan).
  const tree::SplitPlan& plan() const { return plan_; }

  Parameter weight, bias;

 private:
  std::string name_;
  Options options_;
  std::int64_t out_;
  ParallelContextPtr ctx_;
  tree::SplitPlan plan_;
};

class RowParallelLinear {
 public:
  struct Options {
    bool bias = true;
    bool input_is_parallel = true;   // else scatter the input features first
    std::int64_t unit = 1;
    double init_std = 0.02;
  };
  RowParallelLinear(const std::string& name, std::int64_t in, std::int64_t out, const Options& options,
                    ParallelContextPtr ctx, std::uint64_t seed, DType dtype);
  // x: [T, B, in_local] -> [T, B, out] (all-reduce mode) or [T_local, B, out] (sequence parallel).
  Tensor forward(const Tensor& x) const;

  Parameter weight, bias;

 private:
  std::string name_;
  Options options_;
  ParallelContextPtr ctx_;
  tree::SplitPlan plan_;   // the blocks of the local input features (ParallelContext::feature_plan)
};

class LayerNorm {
 public:
  LayerNorm(const std::string& name, std::int64_t features, double eps, ParallelContextPtr ctx, DType dtype);
  // x: [T(_local), B, C]; seq: the global sequence length (needed under sequence parallelism, where
  // x holds one shard of it; -1: x.size(0) is the whole sequence).
  Tensor forward(const Tensor& x, std::int64_t seq = -1) const;
  Parameter weight, bias;

 private:
  std::string name_;   // its trace scope
  double eps_;
  ParallelContextPtr ctx_;
};

// RMSNorm (Llama): x * rsqrt(mean(x^2) + eps) * weight over the last dim, the weight replicated
// and its gradient summed as LayerNorm's.
class RmsNorm {
 public:
  RmsNorm(const std::string& name, std::int64_t features, double eps, ParallelContextPtr ctx, DType dtype);
  // As LayerNorm::forward.
  Tensor forward(const Tensor& x, std::int64_t seq = -1) const;
  Parameter weight;

 private:
  std::string name_;
  double eps_;
  ParallelContextPtr ctx_;
};

// Embedding whose table [V, C] is split over tp by vocabulary rows. forward returns this rank's
// partial sum (rows it does not hold contribute zero); the caller reduces it over tp.
class VocabParallelEmbedding {
 public:
  VocabParallelEmbedding(const std::string& name, std::int64_t vocab, std::int64_t features,
                         ParallelContextPtr ctx, std::uint64_t seed, DType dtype);
  // ids: int64 [...] -> [..., C], partial over tp.
  Tensor forward_partial(const Tensor& ids) const { return forward_partial(ids, weight.operand()); }
  // The same with `table` (this rank's [V_local, C] rows: the weight's operand, or a node of it) as
  // the table: how a model adds its own step between the weight and the lookup.
  Tensor forward_partial(const Tensor& ids, const Tensor& table) const;
  // The embedding of ids [T, B] from `table` as above, reduced over tp: [T, B, C] replicated, or under
  // sequence parallelism this rank's sequence shard [T_local, B, C] (a reduce-scatter along T).
  Tensor forward(const Tensor& ids, const Tensor& table) const;
  std::int64_t vocab_offset() const { return offset_; }
  std::int64_t vocab() const { return vocab_; }
  Parameter weight;

 private:
  std::int64_t vocab_, offset_;
  ParallelContextPtr ctx_;
};

// A linear layer of 2-D tensor parallelism: W [in, out] split over both axes of the tp grid,
// in_axis splitting the input features and out_axis the output features (blocks / unit as the
// column layer). x: [T, B, in] replicated on both axes, or already split by features on in_axis
// (input_is_split: the output of a GridLinear whose out_axis is this in_axis). Returns
// [T, B, out_local]: split by features on out_axis, replicated on in_axis.
//   forward:  keep own feature slice on in_axis (if replicated) | local X W: partial over in_axis |
//             all-reduce over in_axis | + bias (split on out_axis)
//   backward: by the rule: dX = dY W^T is partial over out_axis -> all-reduce over out_axis; then
//             the feature slice's dual, all-gather over in_axis (if the input was replicated)
// In the TP- and mesh-invariant modes (docs/mesh-invariance.md, "2-D grids") the grid's rows store
// and do not split the sums: the weight (and bias) are all-gathered over the row axis before use,
// and the layer computes as the 1-D layer of tp = C does over tp_col (the column layer for
// in_on_rows, the row layer otherwise), with the same fixed blocks, so a grid gives the bits of
// tp = 1. The row ranks repeat one another's compute; their parameters, gradients and optimizer
// state stay split as in the normal mode.
class GridLinear {
 public:
  struct Options {
    bool bias = true;
    bool input_is_split = false;
    int blocks = 1;
    std::int64_t in_unit = 1, out_unit = 1;
    double init_std = 0.02;
  };
  GridLinear(const std::string& name, std::int64_t in, std::int64_t out, bool in_on_rows, const Options& options,
             ParallelContextPtr ctx, std::uint64_t seed, DType dtype);
  // [T, B, out_local] as above. In the invariant modes only for in_on_rows (the column layers).
  Tensor forward(const Tensor& x) const;
  // [T, B, out]: every output feature on every rank (forward, all-gathered over out_axis; in the
  // invariant modes computed whole). For the layers whose out_axis is tp_row (c_proj).
  Tensor forward_gathered(const Tensor& x) const;
  Parameter weight, bias;

 private:
  Tensor forward_invariant_column(const Tensor& x) const;

  std::string name_;
  Options options_;
  std::int64_t in_, out_;
  bool in_on_rows_;
  int in_axis_, out_axis_;
  ParallelContextPtr ctx_;
  tree::SplitPlan plan_;   // invariant modes: the 1-D layer's blocks over tp_col
};

// Cross-entropy over logits split by vocabulary ([N, V_local], never gathered): the sum over the
// N positions of -log softmax(logits)[target], divided by `divisor`; positions whose target is
// ignore_index count zero. Three small all-reduces over tp in forward (row max, sum of exps,
// target logit), none in backward. Works for a vocabulary not divisible by the ranks.
// vocab_blocks: the blocks of the local vocabulary (the LM head's plan); the sum of exps is taken per
// block and added in the tree (ops/tree_reduce.hpp); nullptr: one block. order: how the sum of exps
// is added over tp (dist::sum_over). row_blocks: sizes of consecutive blocks of the rows (a power of
// two of them; empty: one): each block's loss is summed in double, divided by divisor and rounded,
// and the blocks' losses added in the tree (--mesh-invariant's sequence blocks).
Tensor vocab_parallel_cross_entropy(const Tensor& logits_local, const Tensor& targets, std::int64_t vocab_offset,
                                    std::int64_t vocab, const dist::ProcessGroup& tp, double divisor,
                                    std::int64_t ignore_index = -100, const tree::SplitPlan* vocab_blocks = nullptr,
                                    dist::ReduceOrder order = dist::ReduceOrder::RankOrder,
                                    const std::vector<std::int64_t>& row_blocks = {});

// Dropout whose mask element for global index g of a tensor of `global_shape` is
// uniform(seed, g) < p, so a sharded activation gets exactly its slice of the unsharded mask and a
// replicated one the same mask on every rank. offsets: this piece's offsets in the global tensor.
Tensor dropout_global(const Tensor& x, double p, std::uint64_t seed, const Shape& global_shape,
                      const std::vector<std::int64_t>& offsets);

}  // namespace meshgrad::nn
