// Differentiable arithmetic, matrix products, reductions and shape ops. Each op: forward and
// backward side by side; forward saves only what backward needs.
#include <numeric>

#include "meshgrad/autograd/function.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/kernels.hpp"

namespace meshgrad {

using autograd::Function;
using kernels::Binary;

namespace {

// ---- elementwise --------------------------------------------------------------------------------

// add / sub: gradients are the output gradient (negated for b of sub), summed back to each shape.
class AddSubFn final : public Function {
 public:
  explicit AddSubFn(bool subtract) : subtract_(subtract) {}
  std::string_view name() const override { return subtract_ ? "sub" : "add"; }
  TensorList forward(const TensorList& x) override {
    a_shape_ = x[0].shape();
    b_shape_ = x[1].shape();
    return {kernels::binary(subtract_ ? Binary::Sub : Binary::Add, x[0], x[1])};
  }
  TensorList backward(const TensorList& g) override {
    Tensor ga, gb;
    if (needs_input_grad(0)) ga = kernels::sum_to(g[0], a_shape_);
    if (needs_input_grad(1)) gb = subtract_ ? kernels::scale(kernels::sum_to(g[0], b_shape_), -1.0)
                                            : kernels::sum_to(g[0], b_shape_);
    return {ga, gb};
  }

 private:
  bool subtract_;
  Shape a_shape_, b_shape_;
};

// mul: d(ab) = b da + a db.
class MulFn final : public Function {
 public:
  std::string_view name() const override { return "mul"; }
  TensorList forward(const TensorList& x) override {
    save_for_backward({needs_input_grad(1) ? x[0] : Tensor(), needs_input_grad(0) ? x[1] : Tensor()});
    a_shape_ = x[0].shape();
    b_shape_ = x[1].shape();
    return {kernels::binary(Binary::Mul, x[0], x[1])};
  }
  TensorList backward(const TensorList& g) override {
    const TensorList& s = saved();
    Tensor ga, gb;
    if (needs_input_grad(0)) ga = kernels::sum_to(kernels::binary(Binary::Mul, g[0], s[1]), a_shape_);
    if (needs_input_grad(1)) gb = kernels::sum_to(kernels::binary(Binary::Mul, g[0], s[0]), b_shape_);
    return {ga, gb};
  }

 private:
  Shape a_shape_, b_shape_;
};

// div: y = a / b; da = g / b; db = -g a / b^2 = -(g / b) * y.
class DivFn final : public Function {
 public:
  std::string_view name() const override { return "div"; }
  TensorList forward(const TensorList& x) override {
    Tensor y = kernels::binary(Binary::Div, x[0], x[1]);
    save_for_backward({x[1], needs_input_grad(1) ? y : Tensor()});
    a_shape_ = x[0].shape();
    b_shape_ = x[1].shape();
    return {y};
  }
  TensorList backward(const TensorList& g) override {
    const TensorList& s = saved();
    const Tensor g_over_b = kernels::binary(Binary::Div, g[0], s[0]);
    Tensor ga, gb;
    if (needs_input_grad(0)) ga = kernels::sum_to(g_over_b, a_shape_);
    if (needs_input_grad(1)) gb = kernels::scale(kernels::sum_to(kernels::binary(Binary::Mul, g_over_b, s[1]), b_shape_), -1.0);
    return {ga, gb};
  }

 private:
  Shape a_shape_, b_shape_;
};

// y = s * a (neg is s = -1); dy/da = s.
class ScaleFn final : public Function {
 public:
  ScaleFn(double s, std::string_view op) : s_(s), op_(op) {}
  std::string_view name() const override { return op_; }
  TensorList forward(const TensorList& x) override { return {kernels::scale(x[0], s_)}; }
  TensorList backward(const TensorList& g) override { return {kernels::scale(g[0], s_)}; }

 private:
  double s_;
  std::string_view op_;
};

// y = a + s; dy/da = 1.
class AddScalarFn final : public Function {
 public:
  explicit AddScalarFn(double s) : s_(s) {}
  std::string_view name() const override { return "add_scalar"; }
  TensorList forward(const TensorList& x) override {
    return {kernels::binary(Binary::Add, x[0], Tensor::scalar(s_, x[0].dtype()))};
  }
  TensorList backward(const TensorList& g) override { return {g[0]}; }

 private:
  double s_;
};

// ---- matrix products ------------------------------------------------------------------------------

// y = a @ b; da = g @ b^T; db = a^T @ g (summed over broadcast batch dims). Transposes are views,
// which reach BLAS as flags.
class MatmulFn final : public Function {
 public:
  std::string_view name() const override { return "matmul"; }
  TensorList forward(const TensorList& x) override {
    // Under bf16 products the operands are rounded once and kept so for backward (half the bytes).
    const Tensor a = kernels::product_operand(x[0]), b = kernels::product_operand(x[1]);
    save_for_backward({needs_input_grad(1) ? a : Tensor(), needs_input_grad(0) ? b : Tensor()});
    a_shape_ = x[0].shape();
    b_shape_ = x[1].shape();
    return {kernels::matmul(a, b)};
  }
  TensorList backward(const TensorList& g_in) override {
    const TensorList& s = saved();
    const TensorList g = {kernels::product_operand(g_in[0])};   // rounded once for both products
    Tensor ga, gb;
    if (needs_input_grad(0)) ga = kernels::sum_to(kernels::matmul(g[0], s[1].transpose(-2, -1)), a_shape_);
    if (needs_input_grad(1)) {
      if (b_shape_.size() == 2) {
        // b shared by every batch row: one GEMM over all rows, [k, rows] @ [rows, n].
        const std::int64_t k = a_shape_.back(), n = b_shape_.back();
        gb = kernels::matmul(s[0].reshape({-1, k}).transpose(0, 1), g[0].reshape({-1, n}));
      } else {
        gb = kernels::sum_to(kernels::matmul(s[0].transpose(-2, -1), g[0]), b_shape_);
      }
    }
    return {ga, gb};
  }

 private:
  Shape a_shape_, b_shape_;
};

// y = x W + b over the rows of x: x [..., in], W [in, out], b [out].
// dx = g W^T; dW = x_rows^T g_rows; db = sum over rows of g.
class LinearFn final : public Function {
 public:
  std::string_view name() const override { return "linear"; }
  TensorList forward(const TensorList& x) override {
    const Tensor& input = x[0];
    const Tensor& weight = x[1];
    const Tensor& bias = x[2];
    MG_CHECK(input.dim() >= 1 && weight.dim() == 2 && input.size(-1) == weight.size(0),
             "linear: input {} and weight {} do not match (weight is [in, out])", shape_str(input.shape()),
             shape_str(weight.shape()));
    MG_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(1)),
             "linear: bias {} does not match weight {} (bias is [out])", shape_str(bias.shape()),
             shape_str(weight.shape()));
    input_shape_ = input.shape();
    const std::int64_t in = weight.size(0), out = weight.size(1);
    // Under bf16 products the input is rounded once and kept so for backward (half its bytes); the
    // weight is rounded here and again in backward, not kept as a second copy of every weight.
    const Tensor rows = kernels::product_operand(input.reshape({-1, in}));
    const Tensor w = kernels::product_operand(weight);
    save_for_backward({needs_input_grad(1) ? rows : Tensor(), needs_input_grad(0) ? weight : Tensor()});
    Tensor y = Tensor::empty({rows.size(0), out}, input.dtype());
    if (bias.defined()) {
      y.copy_from(bias);  // broadcast over rows, then y += x W
      kernels::matmul_into(y, rows, w, /*accumulate=*/true);
    } else {
      kernels::matmul_into(y, rows, w, /*accumulate=*/false);
    }
    Shape out_shape = input_shape_;
    out_shape.back() = out;
    return {y.view(out_shape)};
  }
  TensorList backward(const TensorList& g) override {
    const TensorList& s = saved();
    const std::int64_t out = g[0].size(-1);
    const Tensor g_rows = g[0].reshape({-1, out});
    const Tensor g_operand = kernels::product_operand(g_rows);   // rounded once for both products
    Tensor gx, gw, gb;
    if (needs_input_grad(0)) {
      gx = kernels::matmul(g_operand, kernels::product_operand(s[1]).transpose(0, 1)).view(input_shape_);
    }
    if (needs_input_grad(1)) {
      const std::int64_t in = input_shape_.back();
      gw = kernels::matmul(s[0].reshape({-1, in}).transpose(0, 1), g_operand);
    }
    if (needs_input_grad(2)) gb = kernels::sum(g_rows, {0}, false);
    return {gx, gw, gb};
  }

 private:
  Shape input_shape_;
};

// ---- reductions -----------------------------------------------------------------------------------

// y = sum(a over dims) * factor (mean: factor = 1 / count); da = broadcast of g * factor.
class SumFn final : public Function {
 public:
  SumFn(std::vector<std::int64_t> dims, bool keepdim, bool mean)
      : dims_(std::move(dims)), keepdim_(keepdim), mean_(mean) {}
  std::string_view name() const override { return mean_ ? "mean" : "sum"; }
  TensorList forward(const TensorList& x) override {
    input_shape_ = x[0].shape();
    Tensor y = kernels::sum(x[0], dims_, true);
    factor_ = mean_ ? static_cast<double>(y.numel()) / static_cast<double>(std::max<std::int64_t>(x[0].numel(), 1))
                    : 1.0;
    if (mean_) y = kernels::scale(y, factor_);
    kept_shape_ = y.shape();
    if (!keepdim_) {
      Shape squeezed;
      std::vector<bool> reduced(input_shape_.size(), dims_.empty());
      for (auto d : dims_) reduced[static_cast<std::size_t>(normalize_dim(d, input_shape_, name().data()))] = true;
      for (std::size_t d = 0; d < input_shape_.size(); ++d) {
        if (!reduced[d]) squeezed.push_back(input_shape_[d]);
      }
      y = y.view(squeezed);
    }
    return {y};
  }
  TensorList backward(const TensorList& g) override {
    Tensor gk = g[0].reshape(kept_shape_);
    if (mean_) gk = kernels::scale(gk, factor_);
    return {gk.expand(input_shape_).contiguous()};
  }

 private:
  std::vector<std::int64_t> dims_;
  bool keepdim_, mean_;
  double factor_ = 1.0;
  Shape input_shape_, kept_shape_;
};

// ---- shape ops --------------------------------------------------------------------------------------

class ReshapeFn final : public Function {
 public:
  explicit ReshapeFn(Shape shape) : shape_(std::move(shape)) {}
  std::string_view name() const override { return "reshape"; }
  TensorList forward(const TensorList& x) override {
    input_shape_ = x[0].shape();
    return {x[0].reshape(shape_)};
  }
  TensorList backward(const TensorList& g) override { return {g[0].reshape(input_shape_)}; }

 private:
  Shape shape_, input_shape_;
};

class PermuteFn final : public Function {
 public:
  explicit PermuteFn(std::vector<std::int64_t> dims) : dims_(std::move(dims)) {}
  std::string_view name() const override { return "permute"; }
  TensorList forward(const TensorList& x) override {
    Tensor y = x[0].permute(dims_);
    inverse_.assign(dims_.size(), 0);
    for (std::size_t i = 0; i < dims_.size(); ++i) {
      inverse_[static_cast<std::size_t>(normalize_dim(dims_[i], x[0].shape(), "permute"))] = static_cast<std::int64_t>(i);
    }
    return {y};
  }
  TensorList backward(const TensorList& g) override { return {g[0].permute(inverse_)}; }

 private:
  std::vector<std::int64_t> dims_, inverse_;
};

// narrow: the gradient is zero outside the window.
class NarrowFn final : public Function {
 public:
  NarrowFn(std::int64_t dim, std::int64_t start, std::int64_t length) : dim_(dim), start_(start), length_(length) {}
  std::string_view name() const override { return "narrow"; }
  TensorList forward(const TensorList& x) override {
    input_shape_ = x[0].shape();
    return {x[0].narrow(dim_, start_, length_)};
  }
  TensorList backward(const TensorList& g) override {
    Tensor ga = Tensor::zeros(input_shape_, g[0].dtype());
    ga.narrow(dim_, start_, length_).copy_from(g[0]);
    return {ga};
  }

 private:
  std::int64_t dim_, start_, length_;
  Shape input_shape_;
};

class ExpandFn final : public Function {
 public:
  explicit ExpandFn(Shape shape) : shape_(std::move(shape)) {}
  std::string_view name() const override { return "expand"; }
  TensorList forward(const TensorList& x) override {
    input_shape_ = x[0].shape();
    return {x[0].expand(shape_)};
  }
  TensorList backward(const TensorList& g) override { return {kernels::sum_to(g[0], input_shape_)}; }

 private:
  Shape shape_, input_shape_;
};

class ContiguousFn final : public Function {
 public:
  std::string_view name() const override { return "contiguous"; }
  TensorList forward(const TensorList& x) override { return {x[0].contiguous()}; }
  TensorList backward(const TensorList& g) override { return {g[0]}; }
};

// cat: the gradient of each part is its slice of the output gradient.
class CatFn final : public Function {
 public:
  explicit CatFn(std::int64_t dim) : dim_(dim) {}
  std::string_view name() const override { return "cat"; }
  TensorList forward(const TensorList& x) override {
    for (const Tensor& t : x) sizes_.push_back(t.size(dim_));
    return {kernels::cat(x, dim_)};
  }
  TensorList backward(const TensorList& g) override {
    TensorList parts = g[0].split(dim_, sizes_);
    for (std::size_t i = 0; i < parts.size(); ++i) parts[i] = needs_input_grad(i) ? parts[i].contiguous() : Tensor();
    return parts;
  }

 private:
  std::int64_t dim_;
  std::vector<std::int64_t> sizes_;
};

// split: one output per piece (views); the gradient is their concatenation (missing pieces are
// zero-filled by the engine).
class SplitFn final : public Function {
 public:
  SplitFn(std::int64_t dim, std::vector<std::int64_t> sizes) : dim_(dim), sizes_(std::move(sizes)) {}
  std::string_view name() const override { return "split"; }
  TensorList forward(const TensorList& x) override { return x[0].split(dim_, sizes_); }
  TensorList backward(const TensorList& g) override { return {kernels::cat(g, dim_)}; }

 private:
  std::int64_t dim_;
  std::vector<std::int64_t> sizes_;
};

Tensor one(const TensorList& outputs) { return outputs.front(); }

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) { return one(autograd::apply<AddSubFn>({a, b}, false)); }
Tensor sub(const Tensor& a, const Tensor& b) { return one(autograd::apply<AddSubFn>({a, b}, true)); }
Tensor mul(const Tensor& a, const Tensor& b) { return one(autograd::apply<MulFn>({a, b})); }
Tensor div(const Tensor& a, const Tensor& b) { return one(autograd::apply<DivFn>({a, b})); }
Tensor neg(const Tensor& a) { return one(autograd::apply<ScaleFn>({a}, -1.0, "neg")); }
Tensor scale(const Tensor& a, double s) { return one(autograd::apply<ScaleFn>({a}, s, "scale")); }
Tensor add_scalar(const Tensor& a, double s) { return one(autograd::apply<AddScalarFn>({a}, s)); }

Tensor matmul(const Tensor& a, const Tensor& b) { return one(autograd::apply<MatmulFn>({a, b})); }
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  check_floating(x, "linear");
  check_same_dtype(x, weight, "linear");
  if (bias.defined()) check_same_dtype(x, bias, "linear");
  return one(autograd::apply<LinearFn>({x, weight, bias}));
}

Tensor sum(const Tensor& a, const std::vector<std::int64_t>& dims, bool keepdim) {
  return one(autograd::apply<SumFn>({a}, dims, keepdim, false));
}
Tensor mean(const Tensor& a, const std::vector<std::int64_t>& dims, bool keepdim) {
  return one(autograd::apply<SumFn>({a}, dims, keepdim, true));
}

Tensor reshape(const Tensor& a, const Shape& shape) { return one(autograd::apply<ReshapeFn>({a}, shape)); }
Tensor transpose(const Tensor& a, std::int64_t d0, std::int64_t d1) {
  std::vector<std::int64_t> dims(static_cast<std::size_t>(a.dim()));
  std::iota(dims.begin(), dims.end(), 0);
  std::swap(dims[static_cast<std::size_t>(normalize_dim(d0, a.shape(), "transpose"))],
            dims[static_cast<std::size_t>(normalize_dim(d1, a.shape(), "transpose"))]);
  return one(autograd::apply<PermuteFn>({a}, dims));
}
Tensor permute(const Tensor& a, const std::vector<std::int64_t>& dims) {
  return one(autograd::apply<PermuteFn>({a}, dims));
}
Tensor narrow(const Tensor& a, std::int64_t dim, std::int64_t start, std::int64_t length) {
  return one(autograd::apply<NarrowFn>({a}, dim, start, length));
}
Tensor expand(const Tensor& a, const Shape& shape) { return one(autograd::apply<ExpandFn>({a}, shape)); }
Tensor contiguous(const Tensor& a) { return one(autograd::apply<ContiguousFn>({a})); }
Tensor cat(const TensorList& parts, std::int64_t dim) {
  MG_CHECK(!parts.empty(), "cat: no tensors given");
  return one(autograd::apply<CatFn>(parts, normalize_dim(dim, parts.front().shape(), "cat")));
}
TensorList split(const Tensor& a, std::int64_t dim, const std::vector<std::int64_t>& sizes) {
  return autograd::apply<SplitFn>({a}, normalize_dim(dim, a.shape(), "split"), sizes);
}
TensorList chunk(const Tensor& a, std::int64_t dim, int parts) {
  const int d = normalize_dim(dim, a.shape(), "chunk");
  return split(a, d, shard_sizes(a.size(d), parts));
}

}  // namespace meshgrad
