// Neural-network kernels: pointwise nonlinearities and their derivatives, row-wise softmax and
// log-softmax (over the last dim) with their backwards, max over the last dim, and the embedding
// gather / scatter-add. (Arithmetic, reductions, matmul and cat are in kernels.cpp.)
//
// Conventions shared by every kernel here:
//  - inputs may be strided views; outputs are new contiguous tensors (except embedding_backward_,
//    which adds into its first argument in place, whatever its layout);
//  - float32 and float64 only; the operands of one kernel share a dtype;
//  - row-wise kernels treat a tensor of shape [..., C] as rows of C elements and accumulate the
//    per-row sums in double, in index order, so results are deterministic and float32 rows of
//    any length lose no more than one float rounding in the sum.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "meshgrad/tensor/iter.hpp"
#include "meshgrad/tensor/kernels.hpp"

namespace meshgrad::kernels {

namespace {

// Pointer to element 0 of a tensor of element type T (storage + offset).
template <class T>
T* base(const Tensor& t) {
  return reinterpret_cast<T*>(t.storage()->data()) + t.offset();
}

// out[i] = f(a[i]) over every element of a (any layout); out is new and contiguous.
template <class T, class F>
Tensor map_unary(const Tensor& a, F&& f) {
  Tensor out = Tensor::empty(a.shape(), a.dtype());
  T* po = out.data<T>();
  const T* pa = base<T>(a);
  for_each_row<2>(a.shape(), {&out.strides(), &a.strides()},
                  [&](const std::array<std::int64_t, 2>& off, std::int64_t n, const std::array<std::int64_t, 2>& st) {
                    T* o = po + off[0];
                    const T* x = pa + off[1];
                    if (st[1] == 1) {
                      for (std::int64_t i = 0; i < n; ++i) o[i] = f(x[i]);
                    } else {
                      for (std::int64_t i = 0; i < n; ++i) o[i] = f(x[i * st[1]]);
                    }
                  });
  return out;
}

// out[i] = f(a[i], b[i]) for two tensors of the same shape (any layouts); out new and contiguous.
template <class T, class F>
Tensor map_binary(const Tensor& a, const Tensor& b, F&& f) {
  Tensor out = Tensor::empty(a.shape(), a.dtype());
  T* po = out.data<T>();
  const T* pa = base<T>(a);
  const T* pb = base<T>(b);
  for_each_row<3>(a.shape(), {&out.strides(), &a.strides(), &b.strides()},
                  [&](const std::array<std::int64_t, 3>& off, std::int64_t n, const std::array<std::int64_t, 3>& st) {
                    T* o = po + off[0];
                    const T* x = pa + off[1];
                    const T* y = pb + off[2];
                    if (st[1] == 1 && st[2] == 1) {
                      for (std::int64_t i = 0; i < n; ++i) o[i] = f(x[i], y[i]);
                    } else {
                      for (std::int64_t i = 0; i < n; ++i) o[i] = f(x[i * st[1]], y[i * st[2]]);
                    }
                  });
  return out;
}

// Checks the (grad, saved) pair of a pointwise or row-wise backward: both floating, one dtype,
// one shape.
void check_backward_pair(const Tensor& grad, const Tensor& saved, const char* op, const char* saved_name) {
  check_floating(grad, op);
  check_same_dtype(grad, saved, op);
  MG_CHECK(grad.shape() == saved.shape(), "{}: grad shape {} differs from {} shape {}", op, shape_str(grad.shape()),
           saved_name, shape_str(saved.shape()));
}

// A tensor of shape [..., C] seen as `rows` packed rows of `cols` elements.
struct Rows {
  Tensor packed;   // contiguous
  std::int64_t rows = 0;
  std::int64_t cols = 0;
};

Rows as_rows(const Tensor& x, const char* op) {
  check_floating(x, op);
  MG_CHECK(x.dim() >= 1, "{}: expected a tensor with at least 1 dim (rows over the last dim), got {}", op, x.str());
  Rows r;
  r.packed = x.contiguous();
  r.cols = x.size(-1);
  r.rows = 1;
  for (int d = 0; d + 1 < x.dim(); ++d) r.rows *= x.shape()[static_cast<std::size_t>(d)];
  return r;
}

// GELU, tanh approximation (GPT-2):  gelu(x) = 0.5 x (1 + tanh(u)),  u = k (x + c x^3),
// k = sqrt(2/pi), c = 0.044715.
constexpr double kGeluK = 0.7978845608028654;   // sqrt(2 / pi)
constexpr double kGeluC = 0.044715;

// exp for float32 that the compiler can vectorise (libm's expf/tanhf are scalar calls, which made
// GELU ~20% of an MLP training step). x = k ln2 + r with |r| <= ln2/2; e^r by its Taylor series to
// r^7 (truncation (ln2/2)^8 / 8! ~ 5e-9, below float32's 6e-8); 2^k by adding k to the exponent.
[[gnu::always_inline]] inline float exp_float(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;         // ln 2 split so k * kLn2Hi is exact
  constexpr float kLn2Lo = 1.42860682030941723212e-6f;
  constexpr float kRound = 12582912.0f;                 // 1.5 * 2^23: (v + kRound) - kRound rounds v
  x = std::min(std::max(x, -87.0f), 88.0f);            // 2^k stays a normal float
  // k = nearest integer to x / ln2, so |r| <= ln2/2. Rounded by adding and subtracting 1.5 * 2^23
  // (exact for |v| < 2^22) rather than std::floor, which GCC does not vectorise here.
  const float k = (x * kLog2e + kRound) - kRound;
  const float r = (x - k * kLn2Hi) - k * kLn2Lo;
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const std::int32_t bits = std::bit_cast<std::int32_t>(p) + (static_cast<std::int32_t>(k) << 23);
  return std::bit_cast<float>(bits);
}

// GELU through the logistic function: 0.5 (1 + tanh u) = s = e / (e + 1) with e = e^{2u}, and
// 1 - s = 1 / (e + 1), so
//   gelu(x)  = x s
//   gelu'(x) = s + 2 x s (1 - s) du/dx,   du/dx = k (1 + 3 c x^2)
// (the same formula as 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) du/dx). Written this way nothing
// cancels in the tails (1 + tanh u near -1 would), and for float32 e comes from exp_float, which
// vectorises. float64 (gradient checks) keeps libm's tanh in the textbook form.
template <class T>
[[gnu::always_inline]] inline T gelu_value(T x) {
  const T u = T(kGeluK) * (x + T(kGeluC) * x * x * x);
  if constexpr (std::is_same_v<T, float>) {
    const float e = exp_float(2.0f * u);
    return x * (e / (e + 1.0f));
  } else {
    return T(0.5) * x * (T(1) + std::tanh(u));
  }
}

template <class T>
[[gnu::always_inline]] inline T gelu_derivative(T x) {
  const T u = T(kGeluK) * (x + T(kGeluC) * x * x * x);
  const T du = T(kGeluK) * (T(1) + T(3 * kGeluC) * x * x);
  if constexpr (std::is_same_v<T, float>) {
    const float e = exp_float(2.0f * u);
    const float one_minus_s = 1.0f / (e + 1.0f);
    const float s = e * one_minus_s;
    return s + 2.0f * x * s * one_minus_s * du;
  } else {
    const T t = std::tanh(u);
    return T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * du;
  }
}

const char* unary_name(Unary op) {
  switch (op) {
    case Unary::Neg: return "neg";
    case Unary::Exp: return "exp";
    case Unary::Log: return "log";
    case Unary::Tanh: return "tanh";
    case Unary::Sqrt: return "sqrt";
    case Unary::Relu: return "relu";
    case Unary::Gelu: return "gelu";
  }
  return "unary";
}

}  // namespace

// ---- pointwise ------------------------------------------------------------------------------------

// log and sqrt of negative numbers give NaN (IEEE), as in the usual libraries; relu propagates
// NaN (NaN < 0 is false).
Tensor unary(Unary op, const Tensor& a) {
  const char* name = unary_name(op);
  check_floating(a, name);
  return dispatch_floating(a.dtype(), name, [&]<class T>() -> Tensor {
    switch (op) {
      case Unary::Neg: return map_unary<T>(a, [](T x) { return -x; });
      case Unary::Exp: return map_unary<T>(a, [](T x) { return std::exp(x); });
      case Unary::Log: return map_unary<T>(a, [](T x) { return std::log(x); });
      case Unary::Tanh: return map_unary<T>(a, [](T x) { return std::tanh(x); });
      case Unary::Sqrt: return map_unary<T>(a, [](T x) { return std::sqrt(x); });
      case Unary::Relu: return map_unary<T>(a, [](T x) { return x < T(0) ? T(0) : x; });
      case Unary::Gelu: return map_unary<T>(a, [](T x) { return gelu_value(x); });
    }
    throw InvalidArgument(fmt::format("unary: unknown op {}", static_cast<int>(op)));
  });
}

// d relu / dx = 1 for x > 0 and 0 for x <= 0 (the subgradient 0 at the kink, as PyTorch).
Tensor relu_backward(const Tensor& grad, const Tensor& x) {
  check_backward_pair(grad, x, "relu_backward", "input");
  return dispatch_floating(x.dtype(), "relu_backward", [&]<class T>() {
    return map_binary<T>(grad, x, [](T g, T v) { return v > T(0) ? g : T(0); });
  });
}

Tensor gelu_backward(const Tensor& grad, const Tensor& x) {
  check_backward_pair(grad, x, "gelu_backward", "input");
  return dispatch_floating(x.dtype(), "gelu_backward", [&]<class T>() {
    return map_binary<T>(grad, x, [](T g, T v) { return g * gelu_derivative(v); });
  });
}

// y = tanh(x): d y / dx = 1 - y^2, from the saved output (no second tanh).
Tensor tanh_backward(const Tensor& grad, const Tensor& y) {
  check_backward_pair(grad, y, "tanh_backward", "output");
  return dispatch_floating(y.dtype(), "tanh_backward", [&]<class T>() {
    return map_binary<T>(grad, y, [](T g, T v) { return g * (T(1) - v * v); });
  });
}

// ---- row-wise -------------------------------------------------------------------------------------

// [..., C] -> [..., 1]. C must be positive (the max of nothing is undefined). NaN in a row makes
// that row's max NaN.
Tensor max_last(const Tensor& a) {
  Rows r = as_rows(a, "max_last");
  MG_CHECK(r.cols > 0, "max_last: last dim of {} is empty", a.str());
  Shape out_shape = a.shape();
  out_shape.back() = 1;
  Tensor out = Tensor::empty(out_shape, a.dtype());
  dispatch_floating(a.dtype(), "max_last", [&]<class T>() {
    const T* x = r.packed.data<T>();
    T* o = out.data<T>();
    for (std::int64_t i = 0; i < r.rows; ++i) {
      const T* row = x + i * r.cols;
      T m = row[0];
      for (std::int64_t j = 1; j < r.cols; ++j) {
        if (row[j] > m || std::isnan(row[j])) m = row[j];
      }
      o[i] = m;
    }
  });
  return out;
}

// The scaffolding of a row-wise op over the last dim: packs x into rows and calls
// row(x_row, y_row, cols) for each, writing a new tensor of x's shape.
template <class RowFn>
Tensor row_forward(const Tensor& x, const char* op, RowFn&& row) {
  Rows r = as_rows(x, op);
  Tensor out = Tensor::empty(x.shape(), x.dtype());
  dispatch_floating(x.dtype(), op, [&]<class T>() {
    const T* in = r.packed.data<T>();
    T* o = out.data<T>();
    for (std::int64_t i = 0; i < r.rows; ++i) row(in + i * r.cols, o + i * r.cols, r.cols);
  });
  return out;
}

template <class T>
T row_max(const T* row, std::int64_t cols) {
  T m = -std::numeric_limits<T>::infinity();
  for (std::int64_t j = 0; j < cols; ++j) m = std::max(m, row[j]);
  return m;
}

// y = exp(x - m) / sum(exp(x - m)) with m the row max: no overflow for large logits; a row of
// all -inf gives NaN (0/0), as the usual libraries do.
Tensor softmax_last(const Tensor& x) {
  return row_forward(x, "softmax", []<class T>(const T* row, T* y, std::int64_t cols) {
    const T m = row_max(row, cols);
    double total = 0;
    for (std::int64_t j = 0; j < cols; ++j) {
      y[j] = std::exp(row[j] - m);
      total += static_cast<double>(y[j]);
    }
    const T inv = static_cast<T>(1.0 / total);
    for (std::int64_t j = 0; j < cols; ++j) y[j] *= inv;
  });
}

// y = (x - m) - log(sum(exp(x - m))): computed from the shifted logits, never as log(softmax),
// so very negative entries stay finite.
Tensor log_softmax_last(const Tensor& x) {
  return row_forward(x, "log_softmax", []<class T>(const T* row, T* y, std::int64_t cols) {
    const T m = row_max(row, cols);
    double total = 0;
    for (std::int64_t j = 0; j < cols; ++j) total += std::exp(static_cast<double>(row[j] - m));
    const T log_total = static_cast<T>(std::log(total));
    for (std::int64_t j = 0; j < cols; ++j) y[j] = (row[j] - m) - log_total;
  });
}

// The scaffolding of a row-wise backward over the last dim: checks the (grad, saved output) pair,
// packs both into rows and calls row(dy, y, dx, cols) for each row, dy, y, dx pointing at its start.
template <class RowFn>
Tensor row_backward(const Tensor& grad, const Tensor& y, const char* op, RowFn&& row) {
  check_backward_pair(grad, y, op, "output");
  Rows g = as_rows(grad, op);
  Rows s = as_rows(y, op);
  Tensor out = Tensor::empty(y.shape(), y.dtype());
  dispatch_floating(y.dtype(), op, [&]<class T>() {
    const T* pg = g.packed.data<T>();
    const T* py = s.packed.data<T>();
    T* o = out.data<T>();
    for (std::int64_t i = 0; i < g.rows; ++i) row(pg + i * g.cols, py + i * g.cols, o + i * g.cols, g.cols);
  });
  return out;
}

// dx = y * (dy - <dy, y>) per row (the Jacobian of softmax is diag(y) - y y^T).
Tensor softmax_backward_last(const Tensor& grad, const Tensor& y) {
  return row_backward(grad, y, "softmax_backward", []<class T>(const T* dy, const T* yy, T* dx, std::int64_t cols) {
    double dot = 0;
    for (std::int64_t j = 0; j < cols; ++j) dot += static_cast<double>(dy[j]) * static_cast<double>(yy[j]);
    const T d = static_cast<T>(dot);
    for (std::int64_t j = 0; j < cols; ++j) dx[j] = yy[j] * (dy[j] - d);
  });
}

// dx = dy - exp(y) * sum(dy) per row (exp(y) is the softmax).
Tensor log_softmax_backward_last(const Tensor& grad, const Tensor& y) {
  return row_backward(grad, y, "log_softmax_backward", []<class T>(const T* dy, const T* yy, T* dx, std::int64_t cols) {
    double total = 0;
    for (std::int64_t j = 0; j < cols; ++j) total += static_cast<double>(dy[j]);
    const T t = static_cast<T>(total);
    for (std::int64_t j = 0; j < cols; ++j) dx[j] = dy[j] - std::exp(yy[j]) * t;
  });
}

// ---- embedding ------------------------------------------------------------------------------------

namespace {

// Checks indices (int64, every value in [0, V)) and returns them packed. The error names the
// position (row-major) and the value of the first bad index.
Tensor checked_indices(const Tensor& indices, std::int64_t vocab, const char* op) {
  check_dtype(indices, DType::Int64, op, "indices");
  Tensor packed = indices.contiguous();
  const std::int64_t* idx = packed.data<std::int64_t>();
  for (std::int64_t i = 0; i < packed.numel(); ++i) {
    MG_CHECK(idx[i] >= 0 && idx[i] < vocab, "{}: index {} at position {} of indices {} is out of range [0, {})", op,
             idx[i], i, shape_str(indices.shape()), vocab);
  }
  return packed;
}

}  // namespace

// out[p, :] = weight[indices[p], :] for every position p of indices.
Tensor embedding(const Tensor& weight, const Tensor& indices) {
  check_floating(weight, "embedding");
  MG_CHECK(weight.dim() == 2, "embedding: weight must be [V, C], got {}", weight.str());
  const std::int64_t vocab = weight.size(0), cols = weight.size(1);
  const Tensor idx = checked_indices(indices, vocab, "embedding");
  Shape out_shape = indices.shape();
  out_shape.push_back(cols);
  Tensor out = Tensor::empty(out_shape, weight.dtype());
  const std::int64_t s0 = weight.strides()[0], s1 = weight.strides()[1];
  dispatch_floating(weight.dtype(), "embedding", [&]<class T>() {
    const T* w = base<T>(weight);
    const std::int64_t* pi = idx.data<std::int64_t>();
    T* o = out.data<T>();
    for (std::int64_t p = 0; p < idx.numel(); ++p) {
      const T* src = w + pi[p] * s0;
      T* dst = o + p * cols;
      if (s1 == 1) {
        if (cols > 0) std::memcpy(dst, src, static_cast<std::size_t>(cols) * sizeof(T));
      } else {
        for (std::int64_t j = 0; j < cols; ++j) dst[j] = src[j * s1];
      }
    }
  });
  return out;
}

// grad_weight[indices[p], :] += grad[p, :], p in row-major order of indices: a repeated index
// sums its rows in that order, so the result does not depend on anything but the inputs.
void embedding_backward_(Tensor& grad_weight, const Tensor& grad, const Tensor& indices) {
  check_floating(grad_weight, "embedding_backward");
  check_same_dtype(grad_weight, grad, "embedding_backward");
  MG_CHECK(grad_weight.dim() == 2, "embedding_backward: grad_weight must be [V, C], got {}", grad_weight.str());
  const std::int64_t vocab = grad_weight.size(0), cols = grad_weight.size(1);
  Shape expected = indices.shape();
  expected.push_back(cols);
  MG_CHECK(grad.shape() == expected, "embedding_backward: grad shape {} does not match indices {} + [{}]",
           shape_str(grad.shape()), shape_str(indices.shape()), cols);
  const Tensor idx = checked_indices(indices, vocab, "embedding_backward");
  const Tensor g = grad.contiguous();
  grad_weight.bump_version();
  const std::int64_t s0 = grad_weight.strides()[0], s1 = grad_weight.strides()[1];
  dispatch_floating(grad_weight.dtype(), "embedding_backward", [&]<class T>() {
    T* w = base<T>(grad_weight);
    const T* pg = g.data<T>();
    const std::int64_t* pi = idx.data<std::int64_t>();
    for (std::int64_t p = 0; p < idx.numel(); ++p) {
      T* dst = w + pi[p] * s0;
      const T* src = pg + p * cols;
      for (std::int64_t j = 0; j < cols; ++j) dst[j * s1] += src[j];
    }
  });
}

}  // namespace meshgrad::kernels
