// Differentiable neural-network ops: pointwise nonlinearities, softmax / log-softmax, layer norm,
// embedding, cross-entropy, dropout and causal attention. Each op is one Function with its
// forward and backward side by side; forward saves only what backward needs.
//
// Shapes in comments: x [..., C] means "any leading dims, C along the last one", and a row is one
// index of the leading dims. The row loops are tensor kernels (kernels.hpp): per-row statistics
// (layer-norm mean and variance, log-sum-exp) are deterministic, summed in double in index order
// for float64 and in 16 float lanes combined in double for float32 (so that they vectorise).
#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_map>
#include <vector>

#include "meshgrad/autograd/function.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/ops/tree_reduce.hpp"
#include "meshgrad/tensor/iter.hpp"
#include "meshgrad/tensor/kernels.hpp"

namespace meshgrad {

using autograd::Function;
using kernels::Binary;
using kernels::Unary;

namespace {

// ---- pointwise nonlinearities ---------------------------------------------------------------------

// relu: dx = dy * [x > 0]. Saves x.
class ReluFn final : public Function {
 public:
  std::string_view name() const override { return "relu"; }
  TensorList forward(const TensorList& x) override {
    save_for_backward({x[0]});
    return {kernels::unary(Unary::Relu, x[0])};
  }
  TensorList backward(const TensorList& g) override { return {kernels::relu_backward(g[0], saved()[0])}; }
};

// gelu (tanh approximation): dx = dy * gelu'(x), the exact derivative of that formula. Saves x.
class GeluFn final : public Function {
 public:
  std::string_view name() const override { return "gelu"; }
  TensorList forward(const TensorList& x) override {
    save_for_backward({x[0]});
    return {kernels::unary(Unary::Gelu, x[0])};
  }
  TensorList backward(const TensorList& g) override { return {kernels::gelu_backward(g[0], saved()[0])}; }
};

// silu (x sigmoid(x), SwiGLU's gate): dx = dy * silu'(x). Saves x.
class SiluFn final : public Function {
 public:
  std::string_view name() const override { return "silu"; }
  TensorList forward(const TensorList& x) override {
    save_for_backward({x[0]});
    return {kernels::unary(Unary::Silu, x[0])};
  }
  TensorList backward(const TensorList& g) override { return {kernels::silu_backward(g[0], saved()[0])}; }
};

// tanh: dx = dy * (1 - y^2). Saves the output y.
class TanhFn final : public Function {
 public:
  std::string_view name() const override { return "tanh"; }
  TensorList forward(const TensorList& x) override {
    Tensor y = kernels::unary(Unary::Tanh, x[0]);
    save_for_backward({y});
    return {y};
  }
  TensorList backward(const TensorList& g) override { return {kernels::tanh_backward(g[0], saved()[0])}; }
};

// exp: dx = dy * y. Saves the output y.
class ExpFn final : public Function {
 public:
  std::string_view name() const override { return "exp"; }
  TensorList forward(const TensorList& x) override {
    Tensor y = kernels::unary(Unary::Exp, x[0]);
    save_for_backward({y});
    return {y};
  }
  TensorList backward(const TensorList& g) override { return {kernels::binary(Binary::Mul, g[0], saved()[0])}; }
};

// log: dx = dy / x. Saves x.
class LogFn final : public Function {
 public:
  std::string_view name() const override { return "log"; }
  TensorList forward(const TensorList& x) override {
    save_for_backward({x[0]});
    return {kernels::unary(Unary::Log, x[0])};
  }
  TensorList backward(const TensorList& g) override { return {kernels::binary(Binary::Div, g[0], saved()[0])}; }
};

// ---- softmax / log-softmax over the last dim --------------------------------------------------------

// y = softmax(x); dx = y * (dy - <dy, y>). Saves y.
class SoftmaxFn final : public Function {
 public:
  std::string_view name() const override { return "softmax"; }
  TensorList forward(const TensorList& x) override {
    Tensor y = kernels::softmax_last(x[0]);
    save_for_backward({y});
    return {y};
  }
  TensorList backward(const TensorList& g) override { return {kernels::softmax_backward_last(g[0], saved()[0])}; }
};

// y = log_softmax(x); dx = dy - exp(y) * sum(dy). Saves y.
class LogSoftmaxFn final : public Function {
 public:
  std::string_view name() const override { return "log_softmax"; }
  TensorList forward(const TensorList& x) override {
    Tensor y = kernels::log_softmax_last(x[0]);
    save_for_backward({y});
    return {y};
  }
  TensorList backward(const TensorList& g) override {
    return {kernels::log_softmax_backward_last(g[0], saved()[0])};
  }
};

// ---- layer norm -----------------------------------------------------------------------------------

// inputs {x [..., C], weight [C] or undefined, bias [C] or undefined}
//   y = xhat * weight + bias,  xhat = (x - mean) * rstd,  rstd = 1 / sqrt(var + eps)
// with mean and the biased variance (divide by C, as PyTorch) over the last dim of each row.
// Saves x (packed), weight, and mean and rstd per row as float64 [rows].
// Backward, with g = dy * weight (or dy) per row:
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
//   dweight = sum over rows of dy * xhat,   dbias = sum over rows of dy.
// center = false is RMSNorm (rms_norm): mean = 0, and the mean(g) term of dx drops out.
class LayerNormFn final : public Function {
 public:
  LayerNormFn(double eps, std::vector<std::int64_t> row_blocks, bool center = true)
      : eps_(eps), row_blocks_(std::move(row_blocks)), center_(center) {}
  std::string_view name() const override { return center_ ? "layer_norm" : "rms_norm"; }

  TensorList forward(const TensorList& in) override {
    const Tensor& x = in[0];
    const std::string op(name());
    check_floating(x, op.c_str());
    MG_CHECK(x.dim() >= 1, "{}: input must have at least 1 dim, got {}", op, x.str());
    MG_CHECK(std::isfinite(eps_) && eps_ >= 0, "{}: eps must be finite and >= 0, got {}", op, eps_);
    const Tensor weight = checked_affine(in[1], x, "weight");
    const Tensor bias = checked_affine(in[2], x, "bias");
    const Tensor xp = x.contiguous();
    kernels::LayerNormForward f = kernels::layer_norm_forward(xp, weight, bias, eps_, center_);
    has_bias_ = bias.defined();
    save_for_backward({xp, weight, f.mean, f.rstd});
    return {f.y};
  }

  TensorList backward(const TensorList& g) override {
    const TensorList& s = saved();
    const Tensor& weight = s[1];
    // Several row blocks: one column sum per block ([blocks, C]), added in the fixed tree.
    const std::vector<std::int64_t> blocks = row_blocks_.size() > 1 ? row_blocks_ : std::vector<std::int64_t>{};
    kernels::LayerNormGrads grads =
        kernels::layer_norm_backward(g[0], s[0], weight, s[2], s[3], needs_input_grad(0),
                                     weight.defined() && needs_input_grad(1), has_bias_ && needs_input_grad(2), blocks,
                                     center_);
    return {grads.dx, tree_over_rows(grads.dweight), tree_over_rows(grads.dbias)};
  }

 private:
  // weight / bias: undefined, or [C] of x's dtype; returned packed.
  static Tensor checked_affine(const Tensor& t, const Tensor& x, const char* what) {
    if (!t.defined()) return Tensor();
    MG_CHECK(t.dtype() == x.dtype(), "layer_norm: {} has dtype {}, input has {}", what, t.dtype(), x.dtype());
    MG_CHECK(t.shape() == Shape{x.size(-1)}, "layer_norm: {} shape {} does not match the last dim of input {} "
             "(expected [{}])", what, shape_str(t.shape()), shape_str(x.shape()), x.size(-1));
    return t.contiguous();
  }

  // [blocks, C] -> the tree sum of its rows; a [C] gradient (one block) as it is.
  Tensor tree_over_rows(const Tensor& per_block) const {
    if (!per_block.defined() || per_block.dim() == 1) return per_block;
    std::vector<Tensor> leaves;
    for (std::int64_t i = 0; i < per_block.size(0); ++i) leaves.push_back(per_block.select(0, i));
    return tree::sum(leaves);
  }

  double eps_;
  std::vector<std::int64_t> row_blocks_;   // empty or one entry: a single block
  bool center_;
  bool has_bias_ = false;
};

// ---- embedding ------------------------------------------------------------------------------------

// inputs {weight [V, C], indices int64 [...]} -> [..., C]. Backward: a zero [V, C] gradient with
// each output row's gradient added to the row it was read from, in index order. No gradient for
// the indices. Saves the indices.
// With row blocks (sizes of consecutive blocks of the indices in order, a power of two of them):
// each row's gradient is the fixed tree over the blocks of each block's sum (in index order, from
// zero), a block without the row a zero leaf: what a dense table per block added in the tree gives,
// computed for the rows read only.
class EmbeddingFn final : public Function {
 public:
  explicit EmbeddingFn(std::vector<std::int64_t> row_blocks) : row_blocks_(std::move(row_blocks)) {}
  std::string_view name() const override { return "embedding"; }
  TensorList forward(const TensorList& in) override {
    Tensor out = kernels::embedding(in[0], in[1]);
    weight_shape_ = in[0].shape();
    if (row_blocks_.size() > 1) {
      std::int64_t total = 0;
      for (const std::int64_t n : row_blocks_) total += n;
      MG_CHECK(total == in[1].numel() && tree::is_power_of_two(static_cast<std::int64_t>(row_blocks_.size())),
               "embedding: {} row blocks covering {} indices, for {} indices (a power of two of blocks covering them)",
               row_blocks_.size(), total, in[1].numel());
    }
    save_for_backward({in[1]});
    return {out};
  }
  TensorList backward(const TensorList& g) override {
    if (!needs_input_grad(0)) return {Tensor(), Tensor()};
    Tensor grad_weight = Tensor::zeros(weight_shape_, g[0].dtype());
    if (row_blocks_.size() > 1) {
      blocked_backward(grad_weight, g[0].contiguous(), saved()[0]);
    } else {
      kernels::embedding_backward_(grad_weight, g[0], saved()[0]);
    }
    return {grad_weight, Tensor()};
  }

 private:
  void blocked_backward(Tensor& grad_weight, const Tensor& grad, const Tensor& indices) const {
    const std::int64_t cols = grad_weight.size(1);
    const std::vector<std::int64_t> ids = indices.to_int64_vector();   // checked in forward's lookup
    const std::size_t blocks = row_blocks_.size();
    dispatch_floating(grad.dtype(), "embedding backward", [&]<class T>() {
      const T* g = grad.data<T>();
      // Per block: each row read, its sum over the block's indices in order, starting from zero.
      std::vector<std::unordered_map<std::int64_t, std::vector<T>>> sums(blocks);
      std::vector<std::int64_t> rows_read;
      std::int64_t i = 0;
      for (std::size_t b = 0; b < blocks; ++b) {
        for (std::int64_t end = i + row_blocks_[b]; i < end; ++i) {
          const std::int64_t id = ids[static_cast<std::size_t>(i)];
          auto [it, fresh] = sums[b].try_emplace(id, static_cast<std::size_t>(cols), T(0));
          if (fresh) rows_read.push_back(id);
          T* acc = it->second.data();
          for (std::int64_t c = 0; c < cols; ++c) acc[c] += g[i * cols + c];
        }
      }
      std::sort(rows_read.begin(), rows_read.end());
      rows_read.erase(std::unique(rows_read.begin(), rows_read.end()), rows_read.end());
      const std::vector<T> zero(static_cast<std::size_t>(cols), T(0));
      const auto add = [](const std::vector<T>& a, const std::vector<T>& b) {
        std::vector<T> out(a.size());
        for (std::size_t c = 0; c < a.size(); ++c) out[c] = a[c] + b[c];
        return out;
      };
      T* w = grad_weight.data<T>();
      for (const std::int64_t id : rows_read) {
        tree::PairwiseSum<std::vector<T>, decltype(add)> row(add);
        for (std::size_t b = 0; b < blocks; ++b) {
          const auto it = sums[b].find(id);
          row.push(it != sums[b].end() ? it->second : zero);
        }
        std::copy(row.root().begin(), row.root().end(), w + id * cols);
      }
    });
  }

  std::vector<std::int64_t> row_blocks_;
  Shape weight_shape_;
};

// ---- cross-entropy --------------------------------------------------------------------------------

// inputs {logits [N, V], targets int64 [N]} -> scalar
//   loss = (1 / n) * sum over rows i with t_i != ignore_index of (lse_i - logits[i, t_i]),
//   lse_i = log sum_j exp(logits[i, j]),  n = number of such rows (loss 0 when n = 0).
// Fused: no [N, V] log-softmax is materialised in forward. Saves the logits (packed), the targets
// and lse per row (float64 [N]); backward recomputes the probabilities from them:
//   dlogits[i, j] = (exp(logits[i, j] - lse_i) - [j == t_i]) * dloss / n,  0 on ignored rows.
class CrossEntropyFn final : public Function {
 public:
  explicit CrossEntropyFn(std::int64_t ignore_index) : ignore_index_(ignore_index) {}
  std::string_view name() const override { return "cross_entropy"; }

  TensorList forward(const TensorList& in) override {
    const Tensor& logits = in[0];
    const Tensor& targets = in[1];
    check_floating(logits, "cross_entropy");
    MG_CHECK(logits.dim() == 2, "cross_entropy: logits must be [N, V], got {}", logits.str());
    check_dtype(targets, DType::Int64, "cross_entropy", "targets");
    const std::int64_t rows = logits.size(0), vocab = logits.size(1);
    MG_CHECK(targets.dim() == 1 && targets.size(0) == rows,
             "cross_entropy: targets must be [N] = [{}] for logits {}, got {}", rows, shape_str(logits.shape()),
             shape_str(targets.shape()));
    const Tensor tp = targets.contiguous();
    const std::int64_t* pt = tp.data<std::int64_t>();
    count_ = 0;
    for (std::int64_t i = 0; i < rows; ++i) {
      if (pt[i] == ignore_index_) continue;
      MG_CHECK(pt[i] >= 0 && pt[i] < vocab,
               "cross_entropy: target {} at position {} is out of range [0, {}) (ignore_index {}, logits {})", pt[i],
               i, vocab, ignore_index_, shape_str(logits.shape()));
      ++count_;
    }
    const Tensor lp = logits.contiguous();
    Tensor lse = Tensor::zeros({rows}, DType::Float64);
    double total = 0;
    dispatch_floating(logits.dtype(), "cross_entropy", [&]<class T>() {
      const T* px = lp.data<T>();
      double* pl = lse.data<double>();
      for (std::int64_t i = 0; i < rows; ++i) {
        if (pt[i] == ignore_index_) continue;
        const T* row = px + i * vocab;
        pl[i] = kernels::log_sum_exp(row, vocab);
        total += pl[i] - static_cast<double>(row[pt[i]]);
      }
    });
    const double loss = count_ > 0 ? total / static_cast<double>(count_) : 0.0;
    save_for_backward({lp, tp, lse});
    return {Tensor::scalar(loss, logits.dtype())};
  }

  TensorList backward(const TensorList& g) override {
    if (!needs_input_grad(0)) return {Tensor(), Tensor()};
    const Tensor& lp = saved()[0];
    const Tensor& tp = saved()[1];
    const Tensor& lse = saved()[2];
    const std::int64_t rows = lp.size(0), vocab = lp.size(1);
    Tensor dlogits = Tensor::zeros(lp.shape(), lp.dtype());
    if (count_ == 0) return {dlogits, Tensor()};   // every target ignored: the loss is the constant 0
    const double factor = g[0].item() / static_cast<double>(count_);
    const std::int64_t* pt = tp.data<std::int64_t>();
    dispatch_floating(lp.dtype(), "cross_entropy backward", [&]<class T>() {
      const T* px = lp.data<T>();
      const double* pl = lse.data<double>();
      T* pd = dlogits.data<T>();
      for (std::int64_t i = 0; i < rows; ++i) {
        if (pt[i] == ignore_index_) continue;
        T* out = pd + i * vocab;
        kernels::exp_shifted_scaled(px + i * vocab, vocab, static_cast<T>(pl[i]), static_cast<T>(factor), out);
        out[pt[i]] -= static_cast<T>(factor);
      }
    });
    return {dlogits, Tensor()};
  }

 private:
  std::int64_t ignore_index_;
  std::int64_t count_ = 0;
};

// ---- dropout --------------------------------------------------------------------------------------

// out[i] = t[i] / (1 - p) where uniform(seed, i) >= p, else 0; i is the row-major logical index, so
// the mask depends only on (seed, shape), not on t's layout. Used for both forward (t = x) and
// backward (t = dy): the same mask, regenerated from the seed instead of stored.
Tensor apply_dropout_mask(const Tensor& t, std::uint64_t seed, double p) {
  check_floating(t, "dropout");
  Tensor out = Tensor::empty(t.shape(), t.dtype());
  dispatch_floating(t.dtype(), "dropout", [&]<class T>() {
    const T keep_scale = static_cast<T>(1.0 / (1.0 - p));
    T* po = out.data<T>();
    const T* pt = reinterpret_cast<const T*>(t.storage()->data()) + t.offset();
    for_each_row<2>(t.shape(), {&out.strides(), &t.strides()},
                    [&](const std::array<std::int64_t, 2>& off, std::int64_t n, const std::array<std::int64_t, 2>& st) {
                      for (std::int64_t k = 0; k < n; ++k) {
                        // out is contiguous: its element offset is the logical index.
                        const std::int64_t i = off[0] + k * st[0];
                        const bool dropped = random::uniform(seed, static_cast<std::uint64_t>(i)) < p;
                        po[i] = dropped ? T(0) : pt[off[1] + k * st[1]] * keep_scale;
                      }
                    });
  });
  return out;
}

// inputs {x}; dx = dy * mask / (1 - p). Keeps only (seed, p): no mask tensor is stored.
class DropoutFn final : public Function {
 public:
  DropoutFn(double p, std::uint64_t seed) : p_(p), seed_(seed) {}
  std::string_view name() const override { return "dropout"; }
  TensorList forward(const TensorList& x) override { return {apply_dropout_mask(x[0], seed_, p_)}; }
  TensorList backward(const TensorList& g) override { return {apply_dropout_mask(g[0], seed_, p_)}; }

 private:
  double p_;
  std::uint64_t seed_;
};

// ---- rotary position embedding ----------------------------------------------------------------------

// inputs {x [B, H, T, D]}; cos, sin [T, D] are constants (no gradient). y = x cos + rotate_half(x) sin,
// one pass; backward is the transposed rotation of dy (kernels::rotary with inverse), one pass.
class RotaryFn final : public Function {
 public:
  RotaryFn(Tensor cos, Tensor sin) : cos_(std::move(cos)), sin_(std::move(sin)) {}
  std::string_view name() const override { return "rotary"; }
  TensorList forward(const TensorList& in) override { return {kernels::rotary(in[0], cos_, sin_)}; }
  TensorList backward(const TensorList& g) override { return {kernels::rotary(g[0], cos_, sin_, /*inverse=*/true)}; }

 private:
  Tensor cos_, sin_;
};

// ---- causal attention -----------------------------------------------------------------------------

// inputs {q [B, H, T_q, D], k, v [B, H, T_k, D]}, T_q <= T_k -> O [B, H, T_q, D]
//   O[t] = sum_{s <= p(t)} softmax_s(q_t . k_s * scale) v_s,  scale = 1 / sqrt(D),
// where query row t is position p(t) = T_k - T_q + t (the last T_q positions; T_q == T_k: p(t) = t).
// Blocked like FlashAttention (kernels::causal_attention_forward): saves q, k, v (the inputs,
// no copies), the output and the per-row log-sum-exp [B, H, T] -- O(T) per head, no [T, T]
// matrix. Backward recomputes the probabilities tile by tile from them.
// window > 0: a sliding window (kernels.hpp), the same in backward.
class CausalAttentionFn final : public Function {
 public:
  explicit CausalAttentionFn(std::int64_t window) : window_(window) {}
  std::string_view name() const override { return "causal_attention"; }

  TensorList forward(const TensorList& in) override {
    const Tensor &q = in[0], &k = in[1], &v = in[2];
    MG_CHECK(q.dim() == 4 && q.size(3) > 0, "causal_attention: q must be [B, H, T, D] with D > 0, got {}", q.str());
    MG_CHECK(k.dim() == 4 && v.shape() == k.shape() && k.size(0) == q.size(0) && k.size(1) == q.size(1) &&
                 k.size(3) == q.size(3) && k.size(2) >= q.size(2),
             "causal_attention: q must be [B, H, T_q, D] and k, v one shape [B, H, T_k, D] with T_q <= T_k, got q {} "
             "k {} v {}", q.str(), k.str(), v.str());
    scale_ = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    // Under bf16 products the kernel's products see bf16 inputs, as autocast's attention does: q, k
    // and v rounded to bf16 values (kept float32: its tiles run the float32 kernels; the softmax and
    // its sums stay float32). The rounding's gradient is the identity, as a cast's is.
    const bool bf16 = kernels::product_precision() == kernels::ProductPrecision::BFloat16 && q.dtype() == DType::Float32;
    const Tensor qr = bf16 ? kernels::round_to_bfloat16(q) : q;
    const Tensor kr = bf16 ? kernels::round_to_bfloat16(k) : k;
    const Tensor vr = bf16 ? kernels::round_to_bfloat16(v) : v;
    kernels::AttentionForward fwd = kernels::causal_attention_forward(qr, kr, vr, scale_, window_);
    const bool any_grad = needs_input_grad(0) || needs_input_grad(1) || needs_input_grad(2);
    if (any_grad) save_for_backward({qr, kr, vr, fwd.out, fwd.lse});
    return {fwd.out};
  }

  TensorList backward(const TensorList& g) override {
    const TensorList& s = saved();
    kernels::AttentionGrads grads =
        kernels::causal_attention_backward(g[0], s[0], s[1], s[2], {s[3], s[4]}, scale_, needs_input_grad(0),
                                           needs_input_grad(1), needs_input_grad(2), window_);
    return {grads.dq, grads.dk, grads.dv};
  }

 private:
  std::int64_t window_;
  double scale_ = 1.0;
};

}  // namespace

Tensor relu(const Tensor& a) { return autograd::apply<ReluFn>({a})[0]; }
Tensor gelu(const Tensor& a) { return autograd::apply<GeluFn>({a})[0]; }
Tensor silu(const Tensor& a) { return autograd::apply<SiluFn>({a})[0]; }
Tensor tanh(const Tensor& a) { return autograd::apply<TanhFn>({a})[0]; }
Tensor exp(const Tensor& a) { return autograd::apply<ExpFn>({a})[0]; }
Tensor log(const Tensor& a) { return autograd::apply<LogFn>({a})[0]; }

Tensor softmax(const Tensor& x) { return autograd::apply<SoftmaxFn>({x})[0]; }
Tensor log_softmax(const Tensor& x) { return autograd::apply<LogSoftmaxFn>({x})[0]; }

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                  const std::vector<std::int64_t>& row_blocks) {
  return autograd::apply<LayerNormFn>({x, weight, bias}, eps, row_blocks)[0];
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps, const std::vector<std::int64_t>& row_blocks) {
  return autograd::apply<LayerNormFn>({x, weight, Tensor()}, eps, row_blocks, /*center=*/false)[0];
}

Tensor embedding(const Tensor& weight, const Tensor& indices, const std::vector<std::int64_t>& row_blocks) {
  return autograd::apply<EmbeddingFn>({weight, indices}, row_blocks)[0];
}

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, std::int64_t ignore_index) {
  return autograd::apply<CrossEntropyFn>({logits, targets}, ignore_index)[0];
}

// p must be in [0, 1). p = 1 is rejected rather than defined as "all zeros": the kept-element scale
// 1 / (1 - p) is infinite there, and a model that wants zeros should say so. Identity (x itself, no
// node, no generator draw) when !training or p == 0, so evaluation does not advance the generator.
Tensor dropout(const Tensor& x, double p, random::Generator& gen, bool training) {
  check_floating(x, "dropout");
  MG_CHECK(p >= 0.0 && p < 1.0, "dropout: p must be in [0, 1), got {} (input {})", p, x.str());
  if (!training || p == 0.0) return x;
  return autograd::apply<DropoutFn>({x}, p, gen.next_seed())[0];
}

Tensor rotary(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  return autograd::apply<RotaryFn>({x}, cos.detach(), sin.detach())[0];
}

Tensor causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t window) {
  MG_CHECK(window >= 0, "causal_attention: the sliding window must be >= 0 (0: none), got {}", window);
  return autograd::apply<CausalAttentionFn>({q, k, v}, window)[0];
}

}  // namespace meshgrad
