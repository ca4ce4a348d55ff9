// Core kernels: broadcasting arithmetic, reductions, matrix products, concatenation.
// (Pointwise nonlinearities, softmax and embedding kernels are in kernels_nn.cpp.)
#include "meshgrad/tensor/kernels.hpp"

#include <algorithm>
#include <cstring>

#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/iter.hpp"
#include "meshgrad/tensor/parallel.hpp"

namespace meshgrad::kernels {

namespace {

using parallel::Slab;

const char* binary_name(Binary op) {
  switch (op) {
    case Binary::Add: return "add";
    case Binary::Sub: return "sub";
    case Binary::Mul: return "mul";
    case Binary::Div: return "div";
  }
  return "binary";
}

template <class T>
inline T apply_binary(Binary op, T x, T y) {
  switch (op) {
    case Binary::Add: return x + y;
    case Binary::Sub: return x - y;
    case Binary::Mul: return x * y;
    case Binary::Div: return x / y;
  }
  return T(0);
}

// out[i] = a[i] op b[i] over rows; the op is a template parameter so the inner loops vectorise.
template <class T, Binary Op>
void binary_rows(T* out, const T* a, const T* b, const Shape& shape, const Strides& so, const Strides& sa,
                 const Strides& sb) {
  for_each_row<3>(shape, {&so, &sa, &sb},
                  [&](const std::array<std::int64_t, 3>& off, std::int64_t n, const std::array<std::int64_t, 3>& st) {
                    T* o = out + off[0];
                    const T* x = a + off[1];
                    const T* y = b + off[2];
                    if (st[0] == 1 && st[1] == 1 && st[2] == 1) {
                      for (std::int64_t i = 0; i < n; ++i) o[i] = apply_binary(Op, x[i], y[i]);
                    } else if (st[0] == 1 && st[1] == 1 && st[2] == 0) {
                      const T yv = *y;
                      for (std::int64_t i = 0; i < n; ++i) o[i] = apply_binary(Op, x[i], yv);
                    } else if (st[0] == 1 && st[1] == 0 && st[2] == 1) {
                      const T xv = *x;
                      for (std::int64_t i = 0; i < n; ++i) o[i] = apply_binary(Op, xv, y[i]);
                    } else {
                      for (std::int64_t i = 0; i < n; ++i) o[i * st[0]] = apply_binary(Op, x[i * st[1]], y[i * st[2]]);
                    }
                  });
}

// 2-D operands of out's shape where some operand's inner stride is not 1 (a transposed view,
// e.g. the tied embedding's [V, C] gradient from the LM head, added to the embedding's own):
// visited in kTile x kTile tiles, so the reads across rows stay within kTile cache lines
// instead of touching a new line per element.
constexpr std::int64_t kTile = 32;

template <class T, Binary Op>
void binary_tiled_2d(T* out, const T* a, const T* b, std::int64_t rows, std::int64_t cols, const Strides& so,
                     const Strides& sa, const Strides& sb) {
  for (std::int64_t i0 = 0; i0 < rows; i0 += kTile) {
    const std::int64_t i1 = std::min(rows, i0 + kTile);
    for (std::int64_t j0 = 0; j0 < cols; j0 += kTile) {
      const std::int64_t j1 = std::min(cols, j0 + kTile);
      for (std::int64_t i = i0; i < i1; ++i) {
        for (std::int64_t j = j0; j < j1; ++j) {
          out[i * so[0] + j * so[1]] = apply_binary(Op, a[i * sa[0] + j * sa[1]], b[i * sb[0] + j * sb[1]]);
        }
      }
    }
  }
}

// True when a 2-D op over `shape` should take binary_tiled_2d: every operand is a full matrix
// (no broadcast dims), at least one is read across rows, and the matrix spans several tiles.
bool wants_tiles(const Shape& shape, std::initializer_list<const Strides*> strides) {
  if (shape.size() != 2 || shape[0] < kTile || shape[1] < kTile) return false;
  bool across = false;
  for (const Strides* s : strides) {
    if ((*s)[0] == 0 || (*s)[1] == 0) return false;
    across = across || (*s)[1] != 1;
  }
  return across;
}

template <class T>
void binary_dispatch(Binary op, T* out, const T* a, const T* b, const Shape& shape, const Strides& so,
                     const Strides& sa, const Strides& sb) {
  if (wants_tiles(shape, {&so, &sa, &sb})) {
    switch (op) {
      case Binary::Add: return binary_tiled_2d<T, Binary::Add>(out, a, b, shape[0], shape[1], so, sa, sb);
      case Binary::Sub: return binary_tiled_2d<T, Binary::Sub>(out, a, b, shape[0], shape[1], so, sa, sb);
      case Binary::Mul: return binary_tiled_2d<T, Binary::Mul>(out, a, b, shape[0], shape[1], so, sa, sb);
      case Binary::Div: return binary_tiled_2d<T, Binary::Div>(out, a, b, shape[0], shape[1], so, sa, sb);
    }
  }
  // Rows in slabs over the rank's cores (elementwise: the bits do not depend on the split; out is
  // never broadcast, so slabs write disjoint elements, also in place when out == a).
  parallel::for_slabs(shape, [&](int dim, std::int64_t begin, std::int64_t end) {
    const Slab slab(shape, dim, begin, end);
    T* o = out + slab.offset(so);
    const T* x = a + slab.offset(sa);
    const T* y = b + slab.offset(sb);
    switch (op) {
      case Binary::Add: return binary_rows<T, Binary::Add>(o, x, y, slab.shape, so, sa, sb);
      case Binary::Sub: return binary_rows<T, Binary::Sub>(o, x, y, slab.shape, so, sa, sb);
      case Binary::Mul: return binary_rows<T, Binary::Mul>(o, x, y, slab.shape, so, sa, sb);
      case Binary::Div: return binary_rows<T, Binary::Div>(o, x, y, slab.shape, so, sa, sb);
    }
  });
}

template <class T>
T* base_ptr(const Tensor& t) {
  return reinterpret_cast<T*>(t.storage()->data()) + t.offset();
}

}  // namespace

Tensor binary(Binary op, const Tensor& a, const Tensor& b) {
  const char* name = binary_name(op);
  check_floating(a, name);
  check_same_dtype(a, b, name);
  const Shape shape = broadcast_shapes(a.shape(), b.shape(), name);
  Tensor out = Tensor::empty(shape, a.dtype());
  const Strides sa = broadcast_strides(a.shape(), a.strides(), shape);
  const Strides sb = broadcast_strides(b.shape(), b.strides(), shape);
  dispatch_floating(a.dtype(), name, [&]<class T>() {
    binary_dispatch<T>(op, out.data<T>(), base_ptr<T>(a), base_ptr<T>(b), shape, out.strides(), sa, sb);
  });
  return out;
}

void binary_(Binary op, Tensor& a, const Tensor& b) {
  const char* name = binary_name(op);
  check_floating(a, name);
  check_same_dtype(a, b, name);
  MG_CHECK(broadcast_shapes(a.shape(), b.shape(), name) == a.shape(),
           "{} (in place): shape {} does not broadcast to {}", name, shape_str(b.shape()), shape_str(a.shape()));
  a.bump_version();
  const Strides sb = broadcast_strides(b.shape(), b.strides(), a.shape());
  dispatch_floating(a.dtype(), name, [&]<class T>() {
    binary_dispatch<T>(op, base_ptr<T>(a), base_ptr<T>(a), base_ptr<T>(b), a.shape(), a.strides(), a.strides(), sb);
  });
}

void axpy_(Tensor& a, double alpha, const Tensor& b) {
  check_floating(a, "axpy");
  check_same_dtype(a, b, "axpy");
  MG_CHECK(broadcast_shapes(a.shape(), b.shape(), "axpy") == a.shape(), "axpy: shape {} does not broadcast to {}",
           shape_str(b.shape()), shape_str(a.shape()));
  a.bump_version();
  const Strides sb = broadcast_strides(b.shape(), b.strides(), a.shape());
  dispatch_floating(a.dtype(), "axpy", [&]<class T>() {
    T* pa = base_ptr<T>(a);
    const T* pb = base_ptr<T>(b);
    const T s = static_cast<T>(alpha);
    for_each_row<2>(a.shape(), {&a.strides(), &sb},
                    [&](const std::array<std::int64_t, 2>& off, std::int64_t n, const std::array<std::int64_t, 2>& st) {
                      T* x = pa + off[0];
                      const T* y = pb + off[1];
                      for (std::int64_t i = 0; i < n; ++i) x[i * st[0]] += s * y[i * st[1]];
                    });
  });
}

Tensor scale(const Tensor& a, double s) {
  check_floating(a, "scale");
  Tensor out = Tensor::empty(a.shape(), a.dtype());
  dispatch_floating(a.dtype(), "scale", [&]<class T>() {
    T* po = out.data<T>();
    const T* pa = base_ptr<T>(a);
    const T factor = static_cast<T>(s);
    for_each_row<2>(a.shape(), {&out.strides(), &a.strides()},
                    [&](const std::array<std::int64_t, 2>& off, std::int64_t n, const std::array<std::int64_t, 2>& st) {
                      T* o = po + off[0];
                      const T* x = pa + off[1];
                      if (st[1] == 1) {
                        for (std::int64_t i = 0; i < n; ++i) o[i] = x[i] * factor;
                      } else {
                        for (std::int64_t i = 0; i < n; ++i) o[i] = x[i * st[1]] * factor;
                      }
                    });
  });
  return out;
}

// ---- reductions -----------------------------------------------------------------------------------

Tensor sum(const Tensor& a, const std::vector<std::int64_t>& dims, bool keepdim) {
  check_floating(a, "sum");
  const int nd = a.dim();
  std::vector<bool> reduce(static_cast<std::size_t>(nd), dims.empty());
  for (std::int64_t d : dims) reduce[static_cast<std::size_t>(normalize_dim(d, a.shape(), "sum"))] = true;
  Shape kept_shape = a.shape();
  for (int d = 0; d < nd; ++d) {
    if (reduce[d]) kept_shape[d] = 1;
  }
  Tensor out = Tensor::zeros(kept_shape, a.dtype());
  // Output strides seen from the input's shape: 0 along reduced dims, so every input element adds
  // into its output element. Input order is row-major: deterministic.
  Strides out_strides = out.strides();
  for (int d = 0; d < nd; ++d) {
    if (reduce[d]) out_strides[d] = 0;
  }
  dispatch_floating(a.dtype(), "sum", [&]<class T>() {
    T* po = out.data<T>();
    const T* pa = base_ptr<T>(a);
    for_each_row<2>(a.shape(), {&out_strides, &a.strides()},
                    [&](const std::array<std::int64_t, 2>& off, std::int64_t n, const std::array<std::int64_t, 2>& st) {
                      T* o = po + off[0];
                      const T* x = pa + off[1];
                      if (st[0] == 0) {
                        T acc = *o;
                        if (st[1] == 1) {
                          for (std::int64_t i = 0; i < n; ++i) acc += x[i];
                        } else {
                          for (std::int64_t i = 0; i < n; ++i) acc += x[i * st[1]];
                        }
                        *o = acc;
                      } else if (st[0] == 1 && st[1] == 1) {   // column sums (bias gradients): vectorises
                        for (std::int64_t i = 0; i < n; ++i) o[i] += x[i];
                      } else {
                        for (std::int64_t i = 0; i < n; ++i) o[i * st[0]] += x[i * st[1]];
                      }
                    });
  });
  if (keepdim) return out;
  Shape squeezed;
  for (int d = 0; d < nd; ++d) {
    if (!reduce[d]) squeezed.push_back(a.shape()[d]);
  }
  return out.view(squeezed);
}

Tensor sum_to(const Tensor& g, const Shape& shape) {
  if (g.shape() == shape) return g;
  MG_CHECK(broadcast_shapes(shape, g.shape(), "sum_to") == g.shape(), "sum_to: shape {} does not broadcast to {}",
           shape_str(shape), shape_str(g.shape()));
  const std::size_t lead = g.shape().size() - shape.size();
  std::vector<std::int64_t> dims;
  for (std::size_t d = 0; d < g.shape().size(); ++d) {
    if (d < lead || (shape[d - lead] == 1 && g.shape()[d] != 1)) dims.push_back(static_cast<std::int64_t>(d));
  }
  if (dims.empty()) return g.reshape(shape);
  return sum(g, dims, /*keepdim=*/true).reshape(shape);
}

// ---- matrix products ------------------------------------------------------------------------------

namespace {

// How a [rows, cols] matrix with strides (s0, s1) reaches BLAS without a copy: row-major with
// leading dimension ld (trans = false), or as the transpose of a row-major [cols, rows] matrix.
struct BlasOperand {
  bool usable = false;
  bool trans = false;
  std::int64_t ld = 0;
};

BlasOperand blas_layout(std::int64_t rows, std::int64_t cols, std::int64_t s0, std::int64_t s1) {
  if ((s1 == 1 || cols == 1) && (s0 >= std::max<std::int64_t>(1, cols) || rows == 1)) {
    return {true, false, std::max<std::int64_t>({s0, cols, 1})};
  }
  if ((s0 == 1 || rows == 1) && (s1 >= std::max<std::int64_t>(1, rows) || cols == 1)) {
    return {true, true, std::max<std::int64_t>({s1, rows, 1})};
  }
  return {};
}

}  // namespace

namespace {

// matmul's operand dtypes: both float32 or both float64 (the result's dtype), or both bfloat16 (a
// float32 result). Returns the result's dtype.
DType product_dtype(const Tensor& a, const Tensor& b) {
  MG_CHECK(a.defined() && b.defined(), "matmul: undefined operand");
  if (a.dtype() == DType::BFloat16 || b.dtype() == DType::BFloat16) {
    MG_CHECK(a.dtype() == b.dtype(), "matmul: a bfloat16 operand needs a bfloat16 partner, got {} @ {}", a.str(),
             b.str());
    return DType::Float32;
  }
  check_floating(a, "matmul");
  check_same_dtype(a, b, "matmul");
  return a.dtype();
}

// Calls f.template operator()<In, Out>() with the operand and result types of a product.
template <class F>
void dispatch_product(DType operands, F&& f) {
  if (operands == DType::BFloat16) {
    f.template operator()<bfloat16, float>();
    return;
  }
  dispatch_floating(operands, "matmul", [&]<class T>() { f.template operator()<T, T>(); });
}

thread_local ProductPrecision thread_product_precision = ProductPrecision::Float32;

// Whether a product of these operands is a bf16 one: under bf16 products with float32 operands, or
// when an operand is bfloat16 already (a layer's saved bf16 copy meets a float32 gradient).
bool bf16_product(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined()) return false;
  const bool bf16_a = a.dtype() == DType::BFloat16, bf16_b = b.dtype() == DType::BFloat16;
  const bool f32_a = a.dtype() == DType::Float32, f32_b = b.dtype() == DType::Float32;
  if (bf16_a || bf16_b) return (bf16_a || f32_a) && (bf16_b || f32_b);
  return f32_a && f32_b && thread_product_precision == ProductPrecision::BFloat16;
}

// A bf16 copy with the float32 operand's BLAS layout: a matrix stored transposed (its last two dims
// column-major) stays transposed. The float32 product and the bf16 one then make the same transpose
// choice, and OpenBLAS sums in another order for another choice: the invariant modes, whose plain
// and block products must agree bit for bit, depend on it.
Tensor as_bf16(const Tensor& a) {
  if (a.dtype() == DType::BFloat16) return a;
  if (a.dim() >= 2 && a.strides()[a.dim() - 2] == 1 && a.size(-1) > 1 && a.size(-2) > 1)
    return to_bfloat16(a.transpose(-2, -1)).transpose(-2, -1);
  return to_bfloat16(a);
}

}  // namespace

ProductPrecision product_precision() { return thread_product_precision; }
ProductPrecisionScope::ProductPrecisionScope(ProductPrecision precision) : previous_(thread_product_precision) {
  thread_product_precision = precision;
}
ProductPrecisionScope::~ProductPrecisionScope() { thread_product_precision = previous_; }

Tensor product_operand(const Tensor& a) {
  if (a.defined() && a.dtype() == DType::Float32 && thread_product_precision == ProductPrecision::BFloat16)
    return as_bf16(a);
  return a;
}

void matmul_into(Tensor& c, const Tensor& a_given, const Tensor& b_given, bool accumulate) {
  const bool bf16 = bf16_product(a_given, b_given);
  const Tensor a_in = bf16 ? as_bf16(a_given) : a_given;
  const Tensor b_in = bf16 ? as_bf16(b_given) : b_given;
  const DType out_dtype = product_dtype(a_in, b_in);
  MG_CHECK(c.dtype() == out_dtype, "matmul: output {} should be {} for {} @ {}", c.str(), out_dtype, a_in.str(),
           b_in.str());
  MG_CHECK(a_in.dim() == 2 && b_in.dim() == 2 && c.dim() == 2, "matmul_into: expects 2-D operands, got {} @ {} -> {}",
           a_in.str(), b_in.str(), c.str());
  const std::int64_t m = a_in.size(0), k = a_in.size(1), n = b_in.size(1);
  MG_CHECK(b_in.size(0) == k && c.size(0) == m && c.size(1) == n, "matmul: shapes {} @ {} -> {} do not match",
           shape_str(a_in.shape()), shape_str(b_in.shape()), shape_str(c.shape()));
  // The output may be a column slice of a wider matrix (a segment of a layer's output features):
  // unit column stride, rows at least n apart.
  MG_CHECK((n <= 1 || c.strides()[1] == 1) && (m <= 1 || c.strides()[0] >= n),
           "matmul_into: output {} needs unit column stride and rows at least {} apart", c.str(), n);
  const std::int64_t ldc = std::max<std::int64_t>({m > 1 ? c.strides()[0] : n, n, 1});
  c.bump_version();
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (!accumulate) c.zero_();
    return;
  }
  Tensor a = a_in, b = b_in;
  BlasOperand la = blas_layout(m, k, a.strides()[0], a.strides()[1]);
  if (!la.usable) {
    a = a.contiguous();
    la = blas_layout(m, k, a.strides()[0], a.strides()[1]);
  }
  BlasOperand lb = blas_layout(k, n, b.strides()[0], b.strides()[1]);
  if (!lb.usable) {
    b = b.contiguous();
    lb = blas_layout(k, n, b.strides()[0], b.strides()[1]);
  }
  dispatch_product(a.dtype(), [&]<class In, class Out>() {
    blas::gemm(la.trans, lb.trans, m, n, k, Out(1), base_ptr<In>(a), la.ld, base_ptr<In>(b), lb.ld,
               accumulate ? Out(1) : Out(0), base_ptr<Out>(c), ldc);
  });
}

Tensor matmul(const Tensor& a_given, const Tensor& b_given) {
  const bool bf16 = bf16_product(a_given, b_given);
  const Tensor a = bf16 ? as_bf16(a_given) : a_given;
  const Tensor b = bf16 ? as_bf16(b_given) : b_given;
  const DType out_dtype = product_dtype(a, b);
  MG_CHECK(a.dim() >= 2 && b.dim() >= 2, "matmul: operands must have at least 2 dims, got {} @ {}",
           shape_str(a.shape()), shape_str(b.shape()));
  const std::int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
  MG_CHECK(b.size(-2) == k, "matmul: inner dims differ: {} @ {} ({} vs {})", shape_str(a.shape()),
           shape_str(b.shape()), k, b.size(-2));
  if (a.dim() == 2 && b.dim() == 2) {
    Tensor out = Tensor::empty({m, n}, out_dtype);
    matmul_into(out, a, b, false);
    return out;
  }
  const Shape a_batch(a.shape().begin(), a.shape().end() - 2);
  const Shape b_batch(b.shape().begin(), b.shape().end() - 2);
  // [..., m, k] @ [k, n] with rows of a packed: one GEMM over all batch rows.
  if (b.dim() == 2) {
    Tensor a_rows = a.reshape({-1, k});
    Tensor out = Tensor::empty({a_rows.size(0), n}, out_dtype);
    matmul_into(out, a_rows, b, false);
    Shape out_shape = a_batch;
    out_shape.push_back(m);
    out_shape.push_back(n);
    return out.view(out_shape);
  }
  const Shape batch = broadcast_shapes(a_batch, b_batch, "matmul (batch dims)");
  Shape a_full = batch, b_full = batch, out_shape = batch;
  a_full.insert(a_full.end(), {m, k});
  b_full.insert(b_full.end(), {k, n});
  out_shape.insert(out_shape.end(), {m, n});
  Tensor ae = a.expand(a_full), be = b.expand(b_full);
  Tensor out = Tensor::empty(out_shape, out_dtype);
  const std::int64_t batches = shape_numel(batch);
  if (batches == 0 || m == 0 || n == 0) return out;
  if (k == 0) {
    out.zero_();
    return out;
  }
  // One layout check for all batches (every batch matrix of a view has the same strides); a
  // matrix layout BLAS cannot take is packed once, up front.
  const std::size_t nb = batch.size();
  BlasOperand la = blas_layout(m, k, ae.strides()[nb], ae.strides()[nb + 1]);
  if (!la.usable) {
    ae = ae.contiguous();
    la = blas_layout(m, k, ae.strides()[nb], ae.strides()[nb + 1]);
  }
  BlasOperand lb = blas_layout(k, n, be.strides()[nb], be.strides()[nb + 1]);
  if (!lb.usable) {
    be = be.contiguous();
    lb = blas_layout(k, n, be.strides()[nb], be.strides()[nb + 1]);
  }
  // Walk the batch index, moving each operand's element offset by its batch strides (0 along
  // broadcast dims): one GEMM per batch on pointers, no per-batch tensor views.
  dispatch_product(a.dtype(), [&]<class In, class T>() {
    const In* pa = base_ptr<In>(ae);
    const In* pb = base_ptr<In>(be);
    T* pc = out.data<T>();
    std::vector<std::int64_t> index(nb, 0);
    std::int64_t off_a = 0, off_b = 0;
    for (std::int64_t bi = 0; bi < batches; ++bi) {
      blas::gemm(la.trans, lb.trans, m, n, k, T(1), pa + off_a, la.ld, pb + off_b, lb.ld, T(0), pc + bi * m * n, n);
      for (std::size_t d = nb; d-- > 0;) {
        off_a += ae.strides()[d];
        off_b += be.strides()[d];
        if (++index[d] < batch[d]) break;
        off_a -= ae.strides()[d] * batch[d];
        off_b -= be.strides()[d] * batch[d];
        index[d] = 0;
      }
    }
  });
  return out;
}

Tensor to_bfloat16(const Tensor& a) {
  MG_CHECK(a.defined() && a.dtype() == DType::Float32, "to_bfloat16: expected a float32 tensor, got {}",
           a.defined() ? a.str() : std::string("an undefined one"));
  Tensor out = Tensor::empty(a.shape(), DType::BFloat16);
  bfloat16* o = out.data<bfloat16>();
  // A matrix of rows with unit stride (a weight's column segment, a row block) is read in place,
  // row by row: no float32 copy first.
  if (a.dim() == 2 && (a.strides()[1] == 1 || a.size(1) <= 1)) {
    const float* in = a.data<float>();
    const std::int64_t rows = a.size(0), cols = a.size(1), ld = a.strides()[0];
    for (std::int64_t r = 0; r < rows; ++r) {
      const float* row = in + r * ld;
      bfloat16* dst = o + r * cols;
      for (std::int64_t c = 0; c < cols; ++c) dst[c].bits = bf16_bits_from_float(row[c]);
    }
    return out;
  }
  const Tensor packed = a.contiguous();
  const float* in = packed.data<float>();
  const std::int64_t n = a.numel();
  for (std::int64_t i = 0; i < n; ++i) o[i].bits = bf16_bits_from_float(in[i]);
  return out;
}

Tensor round_to_bfloat16(const Tensor& a) {
  MG_CHECK(a.defined() && a.dtype() == DType::Float32, "round_to_bfloat16: expected a float32 tensor, got {}",
           a.defined() ? a.str() : std::string("an undefined one"));
  const Tensor packed = a.contiguous();
  Tensor out = Tensor::empty(a.shape(), DType::Float32);
  const float* in = packed.data<float>();
  float* o = out.data<float>();
  const std::int64_t n = a.numel();
  for (std::int64_t i = 0; i < n; ++i) o[i] = float_from_bf16_bits(bf16_bits_from_float(in[i]));
  return out;
}

// ---- concatenation --------------------------------------------------------------------------------

Tensor cat(const std::vector<Tensor>& parts, std::int64_t dim) {
  MG_CHECK(!parts.empty(), "cat: no tensors given");
  const Tensor& first = parts.front();
  const int d = normalize_dim(dim, first.shape(), "cat");
  Shape out_shape = first.shape();
  out_shape[d] = 0;
  for (const Tensor& p : parts) {
    check_same_dtype(first, p, "cat");
    MG_CHECK(p.dim() == first.dim(), "cat: tensors {} and {} have different numbers of dims",
             shape_str(first.shape()), shape_str(p.shape()));
    for (int i = 0; i < p.dim(); ++i) {
      MG_CHECK(i == d || p.shape()[i] == first.shape()[i], "cat: shapes {} and {} differ in dim {} (cat dim {})",
               shape_str(first.shape()), shape_str(p.shape()), i, d);
    }
    out_shape[d] += p.shape()[d];
  }
  Tensor out = Tensor::empty(out_shape, first.dtype());
  std::int64_t start = 0;
  for (const Tensor& p : parts) {
    Tensor slot = out.narrow(d, start, p.shape()[d]);
    slot.copy_from(p);
    start += p.shape()[d];
  }
  return out;
}

}  // namespace meshgrad::kernels
