// Non-differentiable compute kernels on Tensors (CPU). Results are new contiguous tensors unless the
// name ends in '_' (in place; these and matmul_into bump the written tensor's version, see
// Tensor::version). The differentiable ops in ops/ call these in forward and backward.
// Floating kernels take float32 or float64 (operands of one op share a dtype) and throw
// InvalidArgument naming the op, dtypes and shapes otherwise.
#pragma once

#include <cstdint>
#include <vector>

#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::kernels {

enum class Binary { Add, Sub, Mul, Div };
// out = a (op) b with NumPy broadcasting.
Tensor binary(Binary op, const Tensor& a, const Tensor& b);
// a (op)= b in place; b broadcasts to a's shape.
void binary_(Binary op, Tensor& a, const Tensor& b);
// a += alpha * b in place (b broadcast to a).
void axpy_(Tensor& a, double alpha, const Tensor& b);
// a * s
Tensor scale(const Tensor& a, double s);

enum class Unary { Neg, Exp, Log, Tanh, Sqrt, Relu, Gelu, Silu };
Tensor unary(Unary op, const Tensor& a);
// Gradients of pointwise nonlinearities: grad * f'(x).
Tensor relu_backward(const Tensor& grad, const Tensor& x);
Tensor gelu_backward(const Tensor& grad, const Tensor& x);   // tanh approximation (GPT-2)
Tensor tanh_backward(const Tensor& grad, const Tensor& y);   // y = tanh(x)
Tensor silu_backward(const Tensor& grad, const Tensor& x);   // silu(x) = x sigmoid(x) (SwiGLU)

// Sum over dims (empty = all dims). keepdim keeps reduced dims as size 1. Accumulates in the
// tensor's dtype, in row-major order (deterministic).
Tensor sum(const Tensor& a, const std::vector<std::int64_t>& dims, bool keepdim);
// Sums `g` down to `shape` (the reverse of broadcasting `shape` to g's shape).
Tensor sum_to(const Tensor& g, const Shape& shape);
// Max over the last dim, keepdim.
Tensor max_last(const Tensor& a);

// Matrix product with BLAS. a: [..., m, k], b: [..., k, n] -> [..., m, n]; batch dims broadcast;
// a 2-D operand whose layout is a transpose of a contiguous matrix is passed to BLAS with the
// transpose flag, not copied. Operands float32 or float64 (the result has their dtype), or both
// bfloat16: a float32 result, accumulated in float32 (blas::gemm's bf16 overload).
Tensor matmul(const Tensor& a, const Tensor& b);
// c (+)= a @ b for 2-D operands: accumulate=true adds into c (beta = 1). c [m, n] needs unit column
// stride with rows at least n apart: it may be a column slice of a wider matrix (the per-block
// GEMMs of a layer write their segment of its output features in place). c is float32 when a and b
// are bfloat16, else their dtype.
void matmul_into(Tensor& c, const Tensor& a, const Tensor& b, bool accumulate);

// The precision of float32 matrix products on the calling thread. BFloat16 (--precision bf16): matmul
// and matmul_into round float32 operands to bfloat16 and multiply those, accumulating in float32 into
// a float32 result, as torch.autocast("cpu", torch.bfloat16) runs its products; float64 products are
// never rounded. Per thread, as a rank runs on its own thread: the trainer sets it on each rank for
// its steps (autograd runs a step's backward on the thread of its forward).
enum class ProductPrecision { Float32, BFloat16 };
ProductPrecision product_precision();
class ProductPrecisionScope {
 public:
  explicit ProductPrecisionScope(ProductPrecision precision);
  ~ProductPrecisionScope();
  ProductPrecisionScope(const ProductPrecisionScope&) = delete;
  ProductPrecisionScope& operator=(const ProductPrecisionScope&) = delete;

 private:
  ProductPrecision previous_;
};
// a as a product operand under product_precision(): a bf16 copy of a float32 a under BFloat16 (in
// a's layout: a transposed matrix stays transposed, so its products choose the transpose the float32
// ones do), else a. Layers that use one operand in several products (or keep it for backward)
// convert it once.
Tensor product_operand(const Tensor& a);

// A float32 tensor rounded to bfloat16 (round to nearest even), contiguous, same shape.
Tensor to_bfloat16(const Tensor& a);
// A float32 tensor whose values are a's rounded to bfloat16 (still float32): the operand of a
// float32 kernel meant to see bf16 inputs (attention under --precision bf16).
Tensor round_to_bfloat16(const Tensor& a);

// Concatenation along dim; every other dim must match.
Tensor cat(const std::vector<Tensor>& parts, std::int64_t dim);

// Rows of `weight` ([V, C]) picked by int64 `indices` (any shape) -> [..., C]. Out-of-range index
// throws naming it.
Tensor embedding(const Tensor& weight, const Tensor& indices);
// grad_weight[indices[i]] += grad[i] (rows), in index order (deterministic).
void embedding_backward_(Tensor& grad_weight, const Tensor& grad, const Tensor& indices);

// Softmax / log-softmax over the last dim (max-subtracted).
Tensor softmax_last(const Tensor& x);
Tensor log_softmax_last(const Tensor& x);
// Given y = softmax(x) and dy: dx = y * (dy - sum(dy * y)).
Tensor softmax_backward_last(const Tensor& grad, const Tensor& y);
// Given y = log_softmax(x) and dy: dx = dy - exp(y) * sum(dy).
Tensor log_softmax_backward_last(const Tensor& grad, const Tensor& y);

// Row kernels of the cross-entropy losses (ops' cross_entropy and nn's vocab-parallel one), on
// one packed row x[0, n). float32 uses a vectorised exp and lane sums; float64 is libm exp summed
// in index order.
//   sum_exp_shifted:    sum_j exp(x[j] - shift), in double
//   log_sum_exp:        m + log(sum_j exp(x[j] - m)), m = max_j x[j]  (n > 0)
//   exp_shifted_scaled: out[j] = exp(x[j] - shift) * scale  (the softmax times a loss scale)
double sum_exp_shifted(const float* x, std::int64_t n, float shift);
double sum_exp_shifted(const double* x, std::int64_t n, double shift);
double log_sum_exp(const float* x, std::int64_t n);
double log_sum_exp(const double* x, std::int64_t n);
void exp_shifted_scaled(const float* x, std::int64_t n, float shift, float scale, float* out);
void exp_shifted_scaled(const double* x, std::int64_t n, double shift, double scale, double* out);

// Layer norm over the last dim of packed x [..., C] (C > 0), per row:
//   y = (x - mean) * rstd * weight + bias,  rstd = 1 / sqrt(var + eps)
// with the biased variance (divide by C), weight / bias packed [C] or undefined (1 / 0).
// mean and rstd are float64 [rows]. Two passes over the row (mean, then squared deviations).
struct LayerNormForward {
  Tensor y, mean, rstd;
};
// center = false: RMSNorm (Llama's): no mean is taken out (mean = 0), rstd = 1 / sqrt(mean(x^2) + eps).
LayerNormForward layer_norm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                                    bool center = true);
// With g = dy * weight (or dy) and xhat = (x - mean) * rstd per row:
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),  dweight = sum_rows dy * xhat,
//   dbias = sum_rows dy (column sums in row order, in double). Unwanted results are undefined.
// center = false (RMSNorm): mean = 0 and the mean(g) term is dropped: dx = rstd * (g - xhat * mean(g * xhat)).
// row_blocks (optional): the rows cut into consecutive blocks of these sizes (summing to the row
// count); dweight and dbias are then [blocks, C], one column sum per block (each in row order, in
// double), for a caller that adds the blocks in its own fixed tree (TP-invariant mode).
struct LayerNormGrads {
  Tensor dx, dweight, dbias;
};
LayerNormGrads layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean,
                                   const Tensor& rstd, bool want_dx, bool want_dweight, bool want_dbias,
                                   const std::vector<std::int64_t>& row_blocks = {}, bool center = true);

// Rotary position embedding, rotate-half layout (Hugging Face's Llama family): x [B, H, T, D] (any
// strides, D even), cos and sin [T, D] -> [B, H, T, D] contiguous,
//   y = x * cos + rotate_half(x) * sin,   rotate_half(x) = [-x[D/2:], x[:D/2]].
// inverse = true computes the transposed map, which is the gradient of that one: for dy,
//   dx = dy * cos + rotate_half^T(dy * sin),   rotate_half^T(z) = [z[D/2:], -z[:D/2]].
Tensor rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse = false);

// Causal self-attention, blocked and causal like FlashAttention (kernels_attention.cpp): no
// [T, T] matrix is kept, tiles above the diagonal are skipped.
// q, k, v: [B, H, T, D], one dtype, any strides.
//   out[b, h, t] = sum_{s <= t} softmax_s(scale * q_t . k_s) * v_s    -> [B, H, T, D] (contiguous)
//   lse[b, h, t] = log sum_{s <= t} exp(scale * q_t . k_s)             -> [B, H, T]    (contiguous)
// The forward also takes longer keys and values (incremental decoding with a key/value cache):
// q [B, H, T_q, D], k, v [B, H, T_k, D] with T_q <= T_k; query row r is then position
// T_k - T_q + r of the sequence and attends to keys 0 .. T_k - T_q + r. With T_q == T_k this is the
// case above, bit for bit. The backward takes the same shapes (dq like q, dk and dv like k): a
// context-parallel rank's chunk of queries against every key up to its end (nn/context_parallel.hpp).
// window > 0 is a sliding window (Mistral's; Hugging Face's mask kv_idx > q_idx - sliding_window):
// position t attends to keys max(0, t - window + 1) .. t only, and key tiles wholly before the window
// are skipped. window = 0 is plain causal attention, bit for bit as without the argument.
struct AttentionForward {
  Tensor out;
  Tensor lse;
  // q . k products computed, over every (batch, head): the entries of the tiles visited (masked
  // entries inside a tile included). A cost counter: T_q = 1 against T_k keys computes B H T_k.
  std::int64_t scores = 0;
};
// first >= 0: query row 0 sits at position `first` counted from key 0 (default, -1: keys - queries,
// the queries are the last positions of the keys' sequence). Context parallelism's ring passes an
// earlier piece of the sequence's keys with first >= keys, every key then visible (window aside); a
// query row that sees no key of the piece gets out 0 and lse -inf, a part that weighs nothing when
// parts are merged.
AttentionForward causal_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                                          std::int64_t window = 0, std::int64_t first = -1);
// Gradients of sum(dout * out) with respect to q, k, v, recomputing the probabilities from
// (q, k, fwd.lse). Only the wanted ones are computed; the others are undefined. first as in forward;
// for one piece of keys, fwd is the whole attention's (out and lse of every piece merged): the
// FlashAttention backward of that piece.
struct AttentionGrads {
  Tensor dq, dk, dv;
};
AttentionGrads causal_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                         const AttentionForward& fwd, double scale, bool want_dq, bool want_dk,
                                         bool want_dv, std::int64_t window = 0, std::int64_t first = -1);

}  // namespace meshgrad::kernels
