// TP-invariant mode (nn::Invariance::Tp, `--tp-invariant`; docs/mesh-invariance.md): the
// loss, every gradient and every update are bitwise those of tp=1. The layers run the same code as
// in the normal mode; the context's policy (parallel_context.hpp) gives them plans of
// ParallelConfig::invariant_blocks fixed blocks per split dimension, so every GEMM and column sum
// has the same shape at every tp (OpenBLAS results depend on the shape and thread count, not only
// on the data), and the fixed tree as the order of every sum over tp.
//
// Which sums (the split dimension -> its blocks):
//   column-parallel   forward Y = X W: per output block (no sum split)    backward dX: tree over output blocks
//   row-parallel      forward Y: tree over input blocks                    backward: per input block (no sum split)
//   LayerNorm / row bias weight gradients: tree over token blocks (sequence parallelism splits them)
//   vocab-parallel cross-entropy: the sum of exps, tree over vocabulary blocks
//
// What is left here is checking, before any layer is built, that a model's splits keep the tree.
#pragma once

#include <string>

#include "meshgrad/nn/model.hpp"
#include "meshgrad/nn/parallel_context.hpp"

namespace meshgrad::nn::invariant {

// Checks that every split of the model keeps the tree at this mesh's tp (hidden by heads, the fused
// QKV, ffn, vocabulary, and the sequence under sequence parallelism) and throws InvalidArgument
// naming the first that does not and the degrees that work for the whole model. No-op when the
// mode is off.
void check_model(const ModelConfig& cfg, const ParallelContext& ctx);
// The degrees among 1, 2, 4, ... that keep the tree for the whole model, e.g. "1, 2, 4".
std::string working_degrees(const ModelConfig& cfg, const ParallelConfig& parallel);

}  // namespace meshgrad::nn::invariant
