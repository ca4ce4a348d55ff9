// Neural-network kernels: pointwise nonlinearities and their derivatives, row-wise softmax and
// log-softmax (over the last dim) with their backwards, max over the last dim, and the embedding
// gather / scatter-add. (Arithmetic, reductions, matmul and cat are in kernels.cpp.)
//
// Conventions shared by every kernel here:
//  - inputs may be strided views; outputs are new contiguous tensors (except embedding_backward_,
//    which adds into its first argument in place, whatever its layout);
//  - float32 and float64 only; the operands of one kernel share a dtype;
//  - row-wise kernels treat a tensor of shape [..., C] as rows of C elements and take per-row
//    sums in a fixed order (deterministic): float64 in one double accumulator in index order,
//    float32 in 16 float lanes added in double (vec_math.hpp row_sum), which vectorises; float32
//    exponentials use the vectorised exp_float, float64 ones libm.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "meshgrad/tensor/iter.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/parallel.hpp"
#include "vec_math.hpp"

namespace meshgrad::kernels {

namespace {

using parallel::Slab;

using detail::exp_float;
using detail::exp_fast;

// Pointer to element 0 of a tensor of element type T (storage + offset).
template <class T>
T* base(const Tensor& t) {
  return reinterpret_cast<T*>(t.storage()->data()) + t.offset();
}

// out[i] = f(a[i]) over every element of a (any layout); out is new and contiguous.
template <class T, class F>
Tensor map_unary(const Tensor& a, F&& f) {
  Tensor out = Tensor::empty(a.shape(), a.dtype());
  parallel::for_slabs(a.shape(), [&](int dim, std::int64_t begin, std::int64_t end) {
    const Slab slab(a.shape(), dim, begin, end);
    T* po = out.data<T>() + slab.offset(out.strides());
    const T* pa = base<T>(a) + slab.offset(a.strides());
    for_each_row<2>(slab.shape, {&out.strides(), &a.strides()},
                    [&](const std::array<std::int64_t, 2>& off, std::int64_t n, const std::array<std::int64_t, 2>& st) {
                      T* o = po + off[0];
                      const T* x = pa + off[1];
                      if (st[1] == 1) {
                        for (std::int64_t i = 0; i < n; ++i) o[i] = f(x[i]);
                      } else {
                        for (std::int64_t i = 0; i < n; ++i) o[i] = f(x[i * st[1]]);
                      }
                    });
  });
  return out;
}

// out[i] = f(a[i], b[i]) for two tensors of the same shape (any layouts); out new and contiguous.
template <class T, class F>
Tensor map_binary(const Tensor& a, const Tensor& b, F&& f) {
  Tensor out = Tensor::empty(a.shape(), a.dtype());
  parallel::for_slabs(a.shape(), [&](int dim, std::int64_t begin, std::int64_t end) {
    const Slab slab(a.shape(), dim, begin, end);
    T* po = out.data<T>() + slab.offset(out.strides());
    const T* pa = base<T>(a) + slab.offset(a.strides());
    const T* pb = base<T>(b) + slab.offset(b.strides());
    for_each_row<3>(slab.shape, {&out.strides(), &a.strides(), &b.strides()},
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
    case Unary::Silu: return "silu";
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
      case Unary::Silu: return map_unary<T>(a, [](T x) { return x / (T(1) + std::exp(-x)); });
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

// silu(x) = x sigmoid(x): d / dx = s (1 + x (1 - s)), s = sigmoid(x).
Tensor silu_backward(const Tensor& grad, const Tensor& x) {
  check_backward_pair(grad, x, "silu_backward", "input");
  return dispatch_floating(x.dtype(), "silu_backward", [&]<class T>() {
    return map_binary<T>(grad, x, [](T g, T v) {
      const T s = T(1) / (T(1) + std::exp(-v));
      return g * (s * (T(1) + v * (T(1) - s)));
    });
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

// y = exp(x - m) / sum(exp(x - m)) with m the row max: no overflow for large logits; a row of
// all -inf gives NaN (0/0), as the usual libraries do. float32 rows take the vectorised exp and
// lane sums (vec_math.hpp); float64 rows are libm exp summed in index order.
Tensor softmax_last(const Tensor& x) {
  return row_forward(x, "softmax", []<class T>(const T* row, T* y, std::int64_t cols) {
    const T m = detail::row_max(row, cols);
    for (std::int64_t j = 0; j < cols; ++j) y[j] = exp_fast(row[j] - m);
    const T inv = static_cast<T>(1.0 / detail::row_sum<T>(cols, [&](std::int64_t j) { return y[j]; }));
    for (std::int64_t j = 0; j < cols; ++j) y[j] *= inv;
  });
}

// y = (x - m) - log(sum(exp(x - m))): computed from the shifted logits, never as log(softmax),
// so very negative entries stay finite.
Tensor log_softmax_last(const Tensor& x) {
  return row_forward(x, "log_softmax", []<class T>(const T* row, T* y, std::int64_t cols) {
    const T m = detail::row_max(row, cols);
    const double total = detail::row_sum<T>(cols, [&](std::int64_t j) { return exp_fast(row[j] - m); });
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
    const T d = static_cast<T>(detail::row_sum<T>(cols, [&](std::int64_t j) { return dy[j] * yy[j]; }));
    for (std::int64_t j = 0; j < cols; ++j) dx[j] = yy[j] * (dy[j] - d);
  });
}

// dx = dy - exp(y) * sum(dy) per row (exp(y) is the softmax).
Tensor log_softmax_backward_last(const Tensor& grad, const Tensor& y) {
  return row_backward(grad, y, "log_softmax_backward", []<class T>(const T* dy, const T* yy, T* dx, std::int64_t cols) {
    const T t = static_cast<T>(detail::row_sum<T>(cols, [&](std::int64_t j) { return dy[j]; }));
    for (std::int64_t j = 0; j < cols; ++j) dx[j] = dy[j] - exp_fast(yy[j]) * t;
  });
}

// ---- cross-entropy rows ---------------------------------------------------------------------------

namespace {

template <class T>
double sum_exp_shifted_t(const T* x, std::int64_t n, T shift) {
  return detail::row_sum<T>(n, [&](std::int64_t j) { return exp_fast(x[j] - shift); });
}

template <class T>
double log_sum_exp_t(const T* x, std::int64_t n) {
  const T m = detail::row_max(x, n);
  return static_cast<double>(m) + std::log(sum_exp_shifted_t(x, n, m));
}

template <class T>
void exp_shifted_scaled_t(const T* x, std::int64_t n, T shift, T scale, T* out) {
  for (std::int64_t j = 0; j < n; ++j) out[j] = exp_fast(x[j] - shift) * scale;
}

}  // namespace

double sum_exp_shifted(const float* x, std::int64_t n, float shift) { return sum_exp_shifted_t(x, n, shift); }
double sum_exp_shifted(const double* x, std::int64_t n, double shift) { return sum_exp_shifted_t(x, n, shift); }
double log_sum_exp(const float* x, std::int64_t n) { return log_sum_exp_t(x, n); }
double log_sum_exp(const double* x, std::int64_t n) { return log_sum_exp_t(x, n); }
void exp_shifted_scaled(const float* x, std::int64_t n, float shift, float scale, float* out) {
  exp_shifted_scaled_t(x, n, shift, scale, out);
}
void exp_shifted_scaled(const double* x, std::int64_t n, double shift, double scale, double* out) {
  exp_shifted_scaled_t(x, n, shift, scale, out);
}

// ---- layer norm -----------------------------------------------------------------------------------

// float32 rows: lane sums and float arithmetic per element (vectorised); float64 rows: double sums
// in index order. The weight / bias cases are separate loops so no per-element branch remains.
LayerNormForward layer_norm_forward(const Tensor& x_in, const Tensor& weight, const Tensor& bias, double eps,
                                    bool center) {
  Rows r = as_rows(x_in, "layer_norm");
  LayerNormForward f{Tensor::empty(x_in.shape(), x_in.dtype()), Tensor::empty({r.rows}, DType::Float64),
                     Tensor::empty({r.rows}, DType::Float64)};
  const std::int64_t cols = r.cols;
  dispatch_floating(x_in.dtype(), "layer_norm", [&]<class T>() {
    const T* pw = weight.defined() ? weight.data<T>() : nullptr;
    const T* pb = bias.defined() ? bias.data<T>() : nullptr;
    double* pm = f.mean.data<double>();
    double* pr = f.rstd.data<double>();
    for (std::int64_t i = 0; i < r.rows; ++i) {
      const T* row = r.packed.data<T>() + i * cols;
      T* out = f.y.data<T>() + i * cols;
      const double mu =
          center ? detail::row_sum<T>(cols, [&](std::int64_t j) { return row[j]; }) / static_cast<double>(cols) : 0.0;
      const T mu_t = static_cast<T>(mu);
      const double squares = detail::row_sum<T>(cols, [&](std::int64_t j) {
        const T d = row[j] - mu_t;
        return d * d;
      });
      const double rs = 1.0 / std::sqrt(squares / static_cast<double>(cols) + eps);
      pm[i] = mu;
      pr[i] = rs;
      const T rs_t = static_cast<T>(rs);
      if (pw != nullptr && pb != nullptr) {
        for (std::int64_t j = 0; j < cols; ++j) out[j] = (row[j] - mu_t) * rs_t * pw[j] + pb[j];
      } else if (pw != nullptr) {
        for (std::int64_t j = 0; j < cols; ++j) out[j] = (row[j] - mu_t) * rs_t * pw[j];
      } else if (pb != nullptr) {
        for (std::int64_t j = 0; j < cols; ++j) out[j] = (row[j] - mu_t) * rs_t + pb[j];
      } else {
        for (std::int64_t j = 0; j < cols; ++j) out[j] = (row[j] - mu_t) * rs_t;
      }
    }
  });
  return f;
}

LayerNormGrads layer_norm_backward(const Tensor& dy_in, const Tensor& x, const Tensor& weight, const Tensor& mean,
                                   const Tensor& rstd, bool want_dx, bool want_dw, bool want_db,
                                   const std::vector<std::int64_t>& row_blocks, bool center) {
  check_backward_pair(dy_in, x, "layer_norm backward", "input");
  Rows r = as_rows(x, "layer_norm backward");
  const Tensor dy = dy_in.contiguous();
  const std::int64_t cols = r.cols;
  // Block b's rows end at block_end[b]; without row_blocks, one block of every row.
  std::vector<std::int64_t> block_end;
  for (const std::int64_t size : row_blocks) {
    MG_CHECK(size >= 0, "layer_norm backward: row block of {} rows", size);
    block_end.push_back((block_end.empty() ? 0 : block_end.back()) + size);
  }
  MG_CHECK(row_blocks.empty() || block_end.back() == r.rows, "layer_norm backward: row blocks cover {} rows, the "
           "input {} has {}", row_blocks.empty() ? 0 : block_end.back(), shape_str(x.shape()), r.rows);
  if (row_blocks.empty()) block_end.push_back(r.rows);
  const auto blocks = static_cast<std::int64_t>(block_end.size());
  LayerNormGrads g;
  if (want_dx) g.dx = Tensor::empty(x.shape(), x.dtype());
  // Column sums over each block's rows, in row order (deterministic), in double.
  std::vector<double> dw_acc(want_dw ? static_cast<std::size_t>(blocks * cols) : 0, 0.0);
  std::vector<double> db_acc(want_db ? static_cast<std::size_t>(blocks * cols) : 0, 0.0);
  dispatch_floating(x.dtype(), "layer_norm backward", [&]<class T>() {
    std::vector<T> xhat(static_cast<std::size_t>(cols)), gw(static_cast<std::size_t>(cols));
    const T* pw = weight.defined() ? weight.data<T>() : nullptr;
    const double* pm = mean.data<double>();
    const double* pr = rstd.data<double>();
    std::int64_t block = 0;
    for (std::int64_t i = 0; i < r.rows; ++i) {
      while (i >= block_end[static_cast<std::size_t>(block)]) ++block;
      double* dw_row = want_dw ? dw_acc.data() + block * cols : nullptr;
      double* db_row = want_db ? db_acc.data() + block * cols : nullptr;
      const T* row = r.packed.data<T>() + i * cols;
      const T* drow = dy.data<T>() + i * cols;
      const T mu = static_cast<T>(pm[i]), rs = static_cast<T>(pr[i]);
      for (std::int64_t j = 0; j < cols; ++j) xhat[static_cast<std::size_t>(j)] = (row[j] - mu) * rs;
      if (pw != nullptr) {
        for (std::int64_t j = 0; j < cols; ++j) gw[static_cast<std::size_t>(j)] = drow[j] * pw[j];
      } else {
        std::copy(drow, drow + cols, gw.begin());
      }
      if (want_dw) {
        for (std::int64_t j = 0; j < cols; ++j) dw_row[j] += static_cast<double>(drow[j] * xhat[static_cast<std::size_t>(j)]);
      }
      if (want_db) {
        for (std::int64_t j = 0; j < cols; ++j) db_row[j] += static_cast<double>(drow[j]);
      }
      if (!want_dx) continue;
      const T* xh = xhat.data();
      const T* gg = gw.data();
      const double inv_cols = 1.0 / static_cast<double>(cols);
      const T mean_g =
          center ? static_cast<T>(detail::row_sum<T>(cols, [&](std::int64_t j) { return gg[j]; }) * inv_cols) : T(0);
      const T mean_gx =
          static_cast<T>(detail::row_sum<T>(cols, [&](std::int64_t j) { return gg[j] * xh[j]; }) * inv_cols);
      T* out = g.dx.data<T>() + i * cols;
      for (std::int64_t j = 0; j < cols; ++j) out[j] = rs * (gg[j] - mean_g - xh[j] * mean_gx);
    }
  });
  const Shape col_shape = row_blocks.empty() ? Shape{cols} : Shape{blocks, cols};
  if (want_dw) g.dweight = Tensor::from_values(dw_acc, col_shape, x.dtype());
  if (want_db) g.dbias = Tensor::from_values(db_acc, col_shape, x.dtype());
  return g;
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
