// Differentiable ops. Each records a node (when recording is on and an input requires grad) whose
// backward is written beside its forward in src/ops/. Shapes in comments: [rows, cols].
// Conventions: a linear weight is [in, out] and y = x W + b (as GPT-2's Conv1D); integer inputs
// (indices, targets) are int64; errors name the op and the shapes.
#pragma once

#include <cstdint>
#include <vector>

#include "meshgrad/tensor/random.hpp"
#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad {

// ---- elementwise, NumPy broadcasting (gradients are summed back to each input's shape) ----------
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor neg(const Tensor& a);
Tensor scale(const Tensor& a, double s);   // a * s
Tensor add_scalar(const Tensor& a, double s);

inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator-(const Tensor& a) { return neg(a); }
inline Tensor operator*(const Tensor& a, double s) { return scale(a, s); }
inline Tensor operator*(double s, const Tensor& a) { return scale(a, s); }

// ---- matrix products --------------------------------------------------------------------------
// a: [m, k] or [..., m, k]; b: [k, n] or [..., k, n] (batch dims broadcast) -> [..., m, n].
// Transposed operands reach BLAS as flags, not copies.
Tensor matmul(const Tensor& a, const Tensor& b);
// x: [..., in], weight: [in, out], bias: [out] or undefined -> [..., out].
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());

// ---- reductions -------------------------------------------------------------------------------
// Over dims (empty = all); keepdim keeps them as size 1.
Tensor sum(const Tensor& a, const std::vector<std::int64_t>& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& a, const std::vector<std::int64_t>& dims = {}, bool keepdim = false);

// ---- shape ops (views where possible; gradients map back to the input layout) ------------------
Tensor reshape(const Tensor& a, const Shape& shape);
Tensor transpose(const Tensor& a, std::int64_t d0, std::int64_t d1);
Tensor permute(const Tensor& a, const std::vector<std::int64_t>& dims);
Tensor narrow(const Tensor& a, std::int64_t dim, std::int64_t start, std::int64_t length);
Tensor expand(const Tensor& a, const Shape& shape);
Tensor contiguous(const Tensor& a);
Tensor cat(const TensorList& parts, std::int64_t dim);
TensorList split(const Tensor& a, std::int64_t dim, const std::vector<std::int64_t>& sizes);
// `parts` pieces by the shard rule (10 over 4 -> 3, 3, 2, 2).
TensorList chunk(const Tensor& a, std::int64_t dim, int parts);

// ---- pointwise nonlinearities -------------------------------------------------------------------
Tensor relu(const Tensor& a);
// GELU, tanh approximation as GPT-2: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
Tensor gelu(const Tensor& a);
Tensor silu(const Tensor& a);   // x * sigmoid(x) (SwiGLU: silu(gate) * up)
Tensor tanh(const Tensor& a);
Tensor exp(const Tensor& a);
Tensor log(const Tensor& a);

// ---- normalisation and probabilities (over the last dim) -----------------------------------------
Tensor softmax(const Tensor& x);
Tensor log_softmax(const Tensor& x);
// x: [..., C], weight, bias: [C] (either may be undefined) -> [..., C]. row_blocks: the rows of x
// (viewed as [rows, C]) in consecutive blocks of these sizes, a power of two of them; the weight and
// bias gradients are then the fixed tree (tree_reduce.hpp) over the blocks' column sums, the same
// at every tp that holds whole subtrees of the blocks. Empty or one block: one column sum.
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5,
                  const std::vector<std::int64_t>& row_blocks = {});

// RMSNorm (Llama, Hugging Face's LlamaRMSNorm): x * rsqrt(mean(x^2) + eps) * weight over the last
// dim; weight [C] or undefined; row_blocks as layer_norm's.
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps = 1e-6,
                const std::vector<std::int64_t>& row_blocks = {});

// ---- embedding and loss -------------------------------------------------------------------------
// weight: [V, C], indices: int64 [...] -> [..., C]. row_blocks (sizes of consecutive blocks of the
// indices in order, a power of two of them; empty: one): each row's gradient is the fixed tree over
// the blocks of each block's sum (tree_reduce.hpp; --mesh-invariant's sequence blocks).
Tensor embedding(const Tensor& weight, const Tensor& indices, const std::vector<std::int64_t>& row_blocks = {});
// logits: [N, V], targets: int64 [N]; mean over the targets that are not ignore_index
// (0 when all are ignored). Out-of-range targets throw naming the position and value.
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, std::int64_t ignore_index = -100);

// ---- regularisation -----------------------------------------------------------------------------
// Zeroes each element with probability p and scales the rest by 1/(1-p). The mask element i is
// uniform(gen.next_seed(), i) < p: reproducible, and replayed by checkpointing. Identity when
// !training or p == 0.
Tensor dropout(const Tensor& x, double p, random::Generator& gen, bool training = true);

// ---- attention ----------------------------------------------------------------------------------
// Rotary position embedding (the Llama family's RoPE, rotate-half layout): x [B, H, T, D] (any
// strides), cos and sin [T, D] constants -> x * cos + rotate_half(x) * sin, [B, H, T, D]
// contiguous, rotate_half(x) = [-x[..., D/2:], x[..., :D/2]]. One pass forward and one backward.
Tensor rotary(const Tensor& x, const Tensor& cos, const Tensor& sin);

// Causal scaled-dot-product attention over heads: q, k, v: [B, H, T, D] -> [B, H, T, D];
// softmax(q k^T / sqrt(D) + causal mask) v, where position t attends to positions <= t. Fewer
// queries than keys (q [B, H, T_q, D], k, v [B, H, T_k, D], T_q < T_k) are the last T_q positions
// (a context-parallel chunk against every key up to its end); gradients follow the inputs' shapes. With a
// sliding window > 0 only to positions t - window + 1 .. t (Mistral's: Hugging Face's mask
// kv_idx > q_idx - sliding_window). window = 0 is plain causal attention.
Tensor causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t window = 0);

}  // namespace meshgrad
