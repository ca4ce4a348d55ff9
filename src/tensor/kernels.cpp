// Core kernels: broadcasting arithmetic, reductions, matrix products, concatenation.
// (Pointwise nonlinearities, softmax and embedding kernels are in kernels_nn.cpp.)
#include "meshgrad/tensor/kernels.hpp"

#include <algorithm>
#include <cstring>

#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/iter.hpp"

namespace meshgrad::kernels {

namespace {

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

template <class T>
void binary_dispatch(Binary op, T* out, const T* a, const T* b, const Shape& shape, const Strides& so,
                     const Strides& sa, const Strides& sb) {
  switch (op) {
    case Binary::Add: return binary_rows<T, Binary::Add>(out, a, b, shape, so, sa, sb);
    case Binary::Sub: return binary_rows<T, Binary::Sub>(out, a, b, shape, so, sa, sb);
    case Binary::Mul: return binary_rows<T, Binary::Mul>(out, a, b, shape, so, sa, sb);
    case Binary::Div: return binary_rows<T, Binary::Div>(out, a, b, shape, so, sa, sb);
  }
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

void matmul_into(Tensor& c, const Tensor& a_in, const Tensor& b_in, bool accumulate) {
  check_floating(a_in, "matmul");
  check_same_dtype(a_in, b_in, "matmul");
  check_same_dtype(a_in, c, "matmul");
  MG_CHECK(a_in.dim() == 2 && b_in.dim() == 2 && c.dim() == 2, "matmul_into: expects 2-D operands, got {} @ {} -> {}",
           a_in.str(), b_in.str(), c.str());
  const std::int64_t m = a_in.size(0), k = a_in.size(1), n = b_in.size(1);
  MG_CHECK(b_in.size(0) == k && c.size(0) == m && c.size(1) == n, "matmul: shapes {} @ {} -> {} do not match",
           shape_str(a_in.shape()), shape_str(b_in.shape()), shape_str(c.shape()));
  MG_CHECK(c.is_contiguous(), "matmul_into: output {} must be contiguous", c.str());
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
  dispatch_floating(a.dtype(), "matmul", [&]<class T>() {
    blas::gemm(la.trans, lb.trans, m, n, k, T(1), base_ptr<T>(a), la.ld, base_ptr<T>(b), lb.ld,
               accumulate ? T(1) : T(0), c.data<T>(), std::max<std::int64_t>(n, 1));
  });
}

Tensor matmul(const Tensor& a, const Tensor& b) {
  check_floating(a, "matmul");
  check_same_dtype(a, b, "matmul");
  MG_CHECK(a.dim() >= 2 && b.dim() >= 2, "matmul: operands must have at least 2 dims, got {} @ {}",
           shape_str(a.shape()), shape_str(b.shape()));
  const std::int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
  MG_CHECK(b.size(-2) == k, "matmul: inner dims differ: {} @ {} ({} vs {})", shape_str(a.shape()),
           shape_str(b.shape()), k, b.size(-2));
  if (a.dim() == 2 && b.dim() == 2) {
    Tensor out = Tensor::empty({m, n}, a.dtype());
    matmul_into(out, a, b, false);
    return out;
  }
  const Shape a_batch(a.shape().begin(), a.shape().end() - 2);
  const Shape b_batch(b.shape().begin(), b.shape().end() - 2);
  // [..., m, k] @ [k, n] with rows of a packed: one GEMM over all batch rows.
  if (b.dim() == 2) {
    Tensor a_rows = a.reshape({-1, k});
    Tensor out = Tensor::empty({a_rows.size(0), n}, a.dtype());
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
  const Tensor ae = a.expand(a_full);
  const Tensor be = b.expand(b_full);
  Tensor out = Tensor::empty(out_shape, a.dtype());
  const std::int64_t batches = shape_numel(batch);
  // Walk the batch index; each step is one GEMM on [m, k] x [k, n] views (no copies unless a
  // matrix has a layout BLAS cannot take).
  std::vector<std::int64_t> index(batch.size(), 0);
  for (std::int64_t bi = 0; bi < batches; ++bi) {
    Tensor am = ae, bm = be, om = out;
    for (std::size_t d = 0; d < batch.size(); ++d) {
      am = am.select(0, index[d]);
      bm = bm.select(0, index[d]);
      om = om.select(0, index[d]);
    }
    matmul_into(om, am, bm, false);
    for (std::size_t d = batch.size(); d-- > 0;) {
      if (++index[d] < batch[d]) break;
      index[d] = 0;
    }
  }
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
