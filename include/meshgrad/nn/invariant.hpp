// TP-invariant mode (ParallelConfig::tp_invariant, `--tp-invariant`; docs/tp-invariance.md): the
// layers' arithmetic is the same at every tensor-parallel degree, so the loss, every gradient and
// every update are bitwise those of tp=1. Every sum whose terms are split over tp is cut into
// ParallelConfig::invariant_blocks fixed blocks and added in one fixed binary tree (ops/
// tree_reduce.hpp, distributed/tree_collectives.hpp); every GEMM runs per block, so it has the same
// shape at every tp (OpenBLAS results depend on the shape and thread count, not only on the data).
//
// Which sums (the split dimension -> its blocks):
//   column-parallel   forward Y = X W: per output block (no sum split)    backward dX: tree over output blocks
//   row-parallel      forward Y: tree over input blocks                    backward: per input block (no sum split)
//   LayerNorm / row bias weight gradients: tree over token blocks (sequence parallelism splits them)
//   vocab-parallel cross-entropy: the sum of exps, tree over vocabulary blocks
#pragma once

#include <cstdint>
#include <string>

#include "meshgrad/nn/layers.hpp"
#include "meshgrad/ops/tree_reduce.hpp"

namespace meshgrad::nn::invariant {

// Checks that every split of the model keeps the tree at this mesh's tp (hidden by heads, the fused
// QKV, ffn, vocabulary, and the sequence under sequence parallelism) and throws InvalidArgument
// naming the first that does not and the degrees that work for the whole model. No-op when the
// mode is off.
void check_model(const ModelConfig& cfg, const ParallelContext& ctx);
// The degrees among 1, 2, 4, ... that keep the tree for the whole model, e.g. "1, 2, 4".
std::string working_degrees(const ModelConfig& cfg, const ParallelConfig& parallel);

// The token blocks of an activation [T(_local), B, ...] with global sequence length seq: over the
// rank's sequence shard under sequence parallelism, else over the whole sequence (tp = 1 plan).
tree::SplitPlan token_plan(const ParallelContext& ctx, std::int64_t seq);

// Column-parallel linear: x [T(_local), B, in], w [in, out_local] (out_plan: its output blocks),
// b [out_local] or undefined -> [T, B, out_local]. Communication as ColumnParallelLinear's, with the
// tree for dX.
Tensor column_linear(const Tensor& x, const Tensor& w, const Tensor& b, const ParallelContextPtr& ctx,
                     const tree::SplitPlan& out_plan, std::int64_t seq_len, const std::string& label);
// Row-parallel linear without bias: x [T, B, in_local], w [in_local, out] (in_plan: its input
// blocks) -> [T, B, out] (tree all-reduce) or [T_local, B, out] (tree reduce-scatter under SP).
Tensor row_linear(const Tensor& x, const Tensor& w, const ParallelContext& ctx, const tree::SplitPlan& in_plan,
                  const std::string& label);
// y [T(_local), B, C] + bias [C], the bias gradient summed per token block in the tree (and over tp
// under sequence parallelism).
Tensor add_bias(const Tensor& y, const Tensor& bias, const ParallelContext& ctx, std::int64_t seq);
// LayerNorm of x [T(_local), B, C] with replicated weight and bias, their gradients in the tree.
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, const ParallelContext& ctx,
                  std::int64_t seq);
// The sum of every element of x [T(_local), ...]: per token block, in the tree, over tp under
// sequence parallelism (a replicated scalar).
Tensor token_sum(const Tensor& x, const ParallelContext& ctx, std::int64_t seq);

}  // namespace meshgrad::nn::invariant
