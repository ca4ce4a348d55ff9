// Tests of the neural-network ops (src/ops/nn_ops.cpp) and their kernels (src/tensor/kernels_nn.cpp):
// forward values against closed forms or small hand-computed cases, error messages, and every
// backward against central differences in float64.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numbers>
#include <string>
#include <vector>

#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/autograd/function.hpp"
#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/random.hpp"

namespace meshgrad::test_nn_ops {
namespace {

constexpr DType f64 = DType::Float64;
constexpr DType f32 = DType::Float32;

// ---- helpers --------------------------------------------------------------------------------------

// Random float64 tensor of `shape` (standard normal, element i from (seed, i)).
Tensor randn64(const Shape& shape, std::uint64_t seed) { return random::randn(shape, seed, f64); }

// A float64 leaf with requires_grad.
Tensor leaf(const Shape& shape, std::uint64_t seed) {
  Tensor t = randn64(shape, seed);
  t.set_requires_grad(true);
  return t;
}

// Runs fn, expecting InvalidArgument whose message contains every one of `parts`.
void expect_invalid(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    for (const std::string& p : parts) EXPECT_NE(what.find(p), std::string::npos) << "'" << p << "' not in: " << what;
    return;
  }
  ADD_FAILURE() << "expected meshgrad::InvalidArgument";
}

// Local central-difference gradient check (independent of the library checker in ops/gradcheck.hpp).
//
// For L(x) = <f(x), W> with a fixed random W of the output's shape, autograd's dL/dx (backward
// from f's output with root gradient W) is compared with (L(x + h e_j) - L(x - h e_j)) / 2h for
// every element j of every input that requires grad.
//
// Why h = 1e-6 and a tolerance of 1e-6 (absolute + relative): in float64 the central difference
// has truncation error h^2 |L'''| / 6 ~ 1e-13 for |L'''| ~ 1, and rounding error ~ eps |L| / h ~
// 2.2e-16 * 10 / 1e-6 ~ 2e-9 for |L| ~ 10. Both are far below 1e-6, while a wrong backward
// (a missing term, a wrong sign, a transposed operand) is off by O(|gradient|) ~ 0.1..1. Inputs
// are kept away from kinks (relu at 0) where the derivative does not exist.
struct GradResult {
  bool ok = true;
  double max_error = 0;
  std::string message;   // first failure: input, element, numeric and analytic values
};

GradResult check_gradients(const std::function<Tensor(const TensorList&)>& f, const TensorList& inputs,
                           std::uint64_t weight_seed = 99) {
  constexpr double h = 1e-6, tol = 1e-6;
  GradResult result;
  TensorList checked;
  std::vector<std::size_t> checked_index;
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    if (inputs[k].defined() && inputs[k].requires_grad()) {
      EXPECT_EQ(inputs[k].dtype(), f64);
      EXPECT_TRUE(inputs[k].is_contiguous());
      checked.push_back(inputs[k]);
      checked_index.push_back(k);
    }
  }
  const Tensor out = f(inputs);
  const Tensor weights = randn64(out.shape(), weight_seed);
  const TensorList analytic = autograd::grad({out}, checked, {weights});
  const std::vector<double> w = weights.to_vector();
  auto objective = [&]() {
    autograd::NoGradGuard no_grad;
    const std::vector<double> y = f(inputs).to_vector();
    double total = 0;
    for (std::size_t i = 0; i < y.size(); ++i) total += y[i] * w[i];
    return total;
  };
  for (std::size_t c = 0; c < checked.size(); ++c) {
    double* x = checked[c].data<double>();
    const std::vector<double> a = analytic[c].defined() ? analytic[c].to_vector()
                                                        : std::vector<double>(checked[c].numel(), 0.0);
    for (std::int64_t j = 0; j < checked[c].numel(); ++j) {
      const double saved = x[j];
      x[j] = saved + h;
      const double plus = objective();
      x[j] = saved - h;
      const double minus = objective();
      x[j] = saved;
      const double numeric = (plus - minus) / (2 * h);
      const double err = std::abs(a[j] - numeric);
      result.max_error = std::max(result.max_error, err);
      if (err > tol + tol * std::abs(numeric) && result.ok) {
        result.ok = false;
        result.message = "input " + std::to_string(checked_index[c]) + " element " + std::to_string(j) +
                         ": numeric " + std::to_string(numeric) + " analytic " + std::to_string(a[j]);
      }
    }
  }
  return result;
}

#define EXPECT_GRADIENTS_MATCH(f, inputs)             \
  do {                                                \
    const GradResult r_ = check_gradients(f, inputs); \
    EXPECT_TRUE(r_.ok) << r_.message;                 \
  } while (0)

// ---- the checker itself must be able to fail ------------------------------------------------------

// A deliberately wrong op: y = x^2 with backward 3x (should be 2x).
struct WrongSquareFn final : autograd::Function {
  std::string_view name() const override { return "wrong_square"; }
  TensorList forward(const TensorList& x) override {
    save_for_backward({x[0]});
    return {kernels::binary(kernels::Binary::Mul, x[0], x[0])};
  }
  TensorList backward(const TensorList& g) override {
    return {kernels::binary(kernels::Binary::Mul, g[0], kernels::scale(saved()[0], 3.0))};
  }
};

TEST(NnGradHelper, DetectsAWrongBackward) {
  const GradResult r = check_gradients([](const TensorList& x) { return autograd::apply<WrongSquareFn>({x[0]})[0]; },
                                       {leaf({3, 2}, 1)});
  EXPECT_FALSE(r.ok);
  EXPECT_GT(r.max_error, 1e-2);
}

// ---- pointwise ------------------------------------------------------------------------------------

double gelu_reference(double x) {
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / std::numbers::pi) * (x + 0.044715 * x * x * x)));
}

TEST(NnKernels, UnaryMatchesStdOnStridedInput) {
  // A transposed view: the kernel must follow strides and produce a contiguous result.
  const Tensor base = random::rand({3, 4}, 7, f64, 0.1, 3.0);
  const Tensor x = base.transpose(0, 1);   // [4, 3], not contiguous
  ASSERT_FALSE(x.is_contiguous());
  const std::vector<double> xs = x.to_vector();
  struct Case {
    kernels::Unary op;
    double (*ref)(double);
  };
  const Case cases[] = {
      {kernels::Unary::Neg, [](double v) { return -v; }},
      {kernels::Unary::Exp, [](double v) { return std::exp(v); }},
      {kernels::Unary::Log, [](double v) { return std::log(v); }},
      {kernels::Unary::Tanh, [](double v) { return std::tanh(v); }},
      {kernels::Unary::Sqrt, [](double v) { return std::sqrt(v); }},
      {kernels::Unary::Relu, [](double v) { return v > 0 ? v : 0.0; }},
      {kernels::Unary::Gelu, gelu_reference},
  };
  for (const Case& c : cases) {
    const Tensor y = kernels::unary(c.op, x);
    ASSERT_EQ(y.shape(), x.shape());
    EXPECT_TRUE(y.is_contiguous());
    const std::vector<double> ys = y.to_vector();
    for (std::size_t i = 0; i < xs.size(); ++i) {
      EXPECT_NEAR(ys[i], c.ref(xs[i]), 1e-14 * (1 + std::abs(ys[i]))) << "op " << static_cast<int>(c.op) << " i " << i;
    }
  }
}

TEST(NnOps, ReluZeroesNegatives) {
  const Tensor x = Tensor::from_values({-2, -0.5, 0, 0.5, 3}, {5}, f32);
  EXPECT_EQ(relu(x).to_vector(), (std::vector<double>{0, 0, 0, 0.5, 3}));
}

TEST(NnOps, GeluIsTheGpt2TanhApproximation) {
  // Values of 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) computed independently (Python).
  const Tensor x = Tensor::from_values({1.0, -1.0, 0.5, 0.0}, {4}, f64);
  const std::vector<double> y = gelu(x).to_vector();
  EXPECT_NEAR(y[0], 0.8411919906082768, 1e-15);
  EXPECT_NEAR(y[1], -0.15880800939172324, 1e-15);
  EXPECT_NEAR(y[2], 0.34571400982514394, 1e-15);
  EXPECT_EQ(y[3], 0.0);
  // float32 agrees to float precision.
  const std::vector<double> y32 = gelu(x.to(f32)).to_vector();
  for (std::size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(y32[i], y[i], 1e-6);
}

TEST(NnOps, ExpLogTanhValues) {
  const Tensor x = Tensor::from_values({0.25, 1.0, 2.5}, {3}, f64);
  const std::vector<double> e = meshgrad::exp(x).to_vector();
  const std::vector<double> l = meshgrad::log(x).to_vector();
  const std::vector<double> t = meshgrad::tanh(x).to_vector();
  const double xs[] = {0.25, 1.0, 2.5};
  for (int i = 0; i < 3; ++i) {
    EXPECT_DOUBLE_EQ(e[i], std::exp(xs[i]));
    EXPECT_DOUBLE_EQ(l[i], std::log(xs[i]));
    EXPECT_DOUBLE_EQ(t[i], std::tanh(xs[i]));
  }
}

TEST(NnKernels, MaxLastKeepsDim) {
  const Tensor x = Tensor::from_values({1, 5, 3, -2, -7, -1}, {2, 3}, f64);
  const Tensor m = kernels::max_last(x);
  EXPECT_EQ(m.shape(), (Shape{2, 1}));
  EXPECT_EQ(m.to_vector(), (std::vector<double>{5, -1}));
  expect_invalid([] { kernels::max_last(Tensor::zeros({2, 0}, f64)); }, {"max_last", "[2, 0]"});
}

TEST(NnKernels, BackwardKernelsRejectShapeMismatch) {
  expect_invalid([] { kernels::relu_backward(Tensor::zeros({2, 3}, f64), Tensor::zeros({3, 2}, f64)); },
                 {"relu_backward", "[2, 3]", "[3, 2]"});
  expect_invalid([] { kernels::gelu_backward(Tensor::zeros({2}, f32), Tensor::zeros({2}, f64)); },
                 {"gelu_backward"});
}

// ---- softmax / log-softmax -----------------------------------------------------------------------

TEST(NnOps, SoftmaxRowsSumToOneAndMatchDefinition) {
  // The second row is offset by 1000: exp would overflow without the max subtraction.
  const std::vector<double> v = {0.5, -1.0, 2.0, 0.0, 1000.5, 999.0, 1002.0, 1000.0};
  const Tensor x = Tensor::from_values(v, {2, 4}, f64);
  const std::vector<double> y = softmax(x).to_vector();
  for (int r = 0; r < 2; ++r) {
    double denom = 0, total = 0;
    for (int j = 0; j < 4; ++j) denom += std::exp(v[r * 4 + j] - 1000.0 * r);
    for (int j = 0; j < 4; ++j) {
      EXPECT_NEAR(y[r * 4 + j], std::exp(v[r * 4 + j] - 1000.0 * r) / denom, 1e-14);
      total += y[r * 4 + j];
    }
    EXPECT_NEAR(total, 1.0, 1e-14);
  }
  // Both rows are the same logits up to a shift: same probabilities.
  for (int j = 0; j < 4; ++j) EXPECT_NEAR(y[j], y[4 + j], 1e-14);
}

TEST(NnOps, SoftmaxOverLastDimOfStridedInput) {
  const Tensor base = randn64({4, 3}, 3);
  const Tensor x = base.transpose(0, 1);   // [3, 4], rows are strided
  EXPECT_TRUE(bitwise_equal(softmax(x), softmax(x.contiguous())));
}

TEST(NnOps, LogSoftmaxIsLogOfSoftmaxAndStable) {
  const Tensor x = randn64({3, 5}, 11);
  const std::vector<double> ls = log_softmax(x).to_vector();
  const std::vector<double> s = softmax(x).to_vector();
  for (std::size_t i = 0; i < ls.size(); ++i) EXPECT_NEAR(ls[i], std::log(s[i]), 1e-14);
  // An entry 800 below the max: softmax underflows to 0, log_softmax stays finite and exact.
  const Tensor far = Tensor::from_values({0.0, -800.0}, {1, 2}, f64);
  const std::vector<double> lf = log_softmax(far).to_vector();
  EXPECT_NEAR(lf[0], -std::log1p(std::exp(-800.0)), 1e-15);
  EXPECT_NEAR(lf[1], -800.0, 1e-12);
}

// ---- layer norm -----------------------------------------------------------------------------------

TEST(NnOps, LayerNormRowsHaveMeanZeroAndUnitVariance) {
  const std::int64_t C = 16;
  const Tensor x = random::randn({2, 3, C}, 5, f64, /*mean=*/4.0, /*std=*/3.0);
  const std::vector<double> y = layer_norm(x, Tensor(), Tensor(), 0.0).to_vector();
  for (std::int64_t r = 0; r < 6; ++r) {
    double m = 0, var = 0;
    for (std::int64_t j = 0; j < C; ++j) m += y[r * C + j];
    m /= C;
    for (std::int64_t j = 0; j < C; ++j) var += (y[r * C + j] - m) * (y[r * C + j] - m);
    var /= C;   // biased, as layer_norm normalises by
    EXPECT_NEAR(m, 0.0, 1e-14);
    EXPECT_NEAR(var, 1.0, 1e-13);
  }
}

TEST(NnOps, LayerNormAppliesWeightBiasAndEps) {
  // Row [1, 3]: mean 2, biased var 1; with eps 0.25, rstd = 1/sqrt(1.25); xhat = [-1, 1] * rstd.
  const Tensor x = Tensor::from_values({1, 3}, {1, 2}, f64);
  const Tensor w = Tensor::from_values({2, -1}, {2}, f64);
  const Tensor b = Tensor::from_values({0.5, 10}, {2}, f64);
  const std::vector<double> y = layer_norm(x, w, b, 0.25).to_vector();
  const double rstd = 1 / std::sqrt(1.25);
  EXPECT_NEAR(y[0], -rstd * 2 + 0.5, 1e-15);
  EXPECT_NEAR(y[1], rstd * -1 + 10, 1e-15);
}

TEST(NnOps, LayerNormFloat32MatchesFloat64) {
  const Tensor x = random::randn({4, 32}, 8, f64, 100.0, 0.01);   // large mean, small spread
  const Tensor w = randn64({32}, 9), b = randn64({32}, 10);
  const std::vector<double> y64 = layer_norm(x, w, b).to_vector();
  const std::vector<double> y32 = layer_norm(x.to(f32), w.to(f32), b.to(f32)).to_vector();
  // Float32 inputs are rounded (x to ~1e-5 relative of 100, i.e. ~6e-6 absolute, against a std of
  // 0.01): the normalised values differ by up to ~1e-3; the statistics themselves are double.
  for (std::size_t i = 0; i < y64.size(); ++i) EXPECT_NEAR(y32[i], y64[i], 5e-3);
}

// The float32 row kernels use lane sums and a vectorised exp: rows of odd lengths (lanes plus a
// tail) must agree with float64 to float precision, forward and backward, and a -inf logit must
// still get exactly probability 0.
TEST(NnKernels, Float32RowKernelsMatchFloat64) {
  Tensor x = scale(randn64({3, 1001}, 12), 4.0);
  x.set({1, 7}, -std::numeric_limits<double>::infinity());
  const Tensor dy = randn64({3, 1001}, 13);
  auto close = [](const Tensor& got32, const Tensor& want64, double tol, const char* what) {
    const std::vector<double> a = got32.to_vector(), b = want64.to_vector();
    ASSERT_EQ(a.size(), b.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (std::isinf(b[i])) {
        EXPECT_EQ(a[i], b[i]) << what << " " << i;
      } else {
        EXPECT_NEAR(a[i], b[i], tol * (1 + std::abs(b[i]))) << what << " " << i;
      }
    }
  };
  const Tensor y64 = kernels::softmax_last(x), y32 = kernels::softmax_last(x.to(f32));
  close(y32, y64, 1e-6, "softmax");
  EXPECT_EQ(y32.at({1, 7}), 0.0);
  close(kernels::softmax_backward_last(dy.to(f32), y32), kernels::softmax_backward_last(dy, y64), 1e-6, "softmax bwd");
  const Tensor l64 = kernels::log_softmax_last(x), l32 = kernels::log_softmax_last(x.to(f32));
  close(l32, l64, 1e-6, "log_softmax");
  close(kernels::log_softmax_backward_last(dy.to(f32), l32), kernels::log_softmax_backward_last(dy, l64), 1e-5,
        "log_softmax bwd");

  const Tensor h = random::randn({5, 389}, 14, f64, 3.0, 2.0);
  const Tensor w = randn64({389}, 15), b = randn64({389}, 16), gy = randn64({5, 389}, 17);
  const kernels::LayerNormForward n64 = kernels::layer_norm_forward(h, w, b, 1e-5);
  const kernels::LayerNormForward n32 = kernels::layer_norm_forward(h.to(f32), w.to(f32), b.to(f32), 1e-5);
  close(n32.y, n64.y, 2e-5, "layer_norm");
  const kernels::LayerNormGrads g64 = kernels::layer_norm_backward(gy, h, w, n64.mean, n64.rstd, true, true, true);
  const kernels::LayerNormGrads g32 =
      kernels::layer_norm_backward(gy.to(f32), h.to(f32), w.to(f32), n32.mean, n32.rstd, true, true, true);
  close(g32.dx, g64.dx, 2e-5, "layer_norm dx");
  close(g32.dweight, g64.dweight, 2e-5, "layer_norm dweight");
  close(g32.dbias, g64.dbias, 1e-5, "layer_norm dbias");

  // Cross-entropy over the 1001-wide rows (row 1 has the -inf logit), loss and gradient.
  const std::vector<std::int64_t> t = {5, 8, 1000};
  const Tensor targets = Tensor::from_int64(t, {3});
  Tensor logits64 = x.clone(), logits32 = x.to(f32);
  logits64.set_requires_grad(true);
  logits32.set_requires_grad(true);
  const Tensor loss64 = cross_entropy(logits64, targets), loss32 = cross_entropy(logits32, targets);
  EXPECT_NEAR(loss32.item(), loss64.item(), 1e-5 * std::abs(loss64.item()));
  backward(loss64);
  backward(loss32);
  close(logits32.grad(), logits64.grad(), 1e-6, "cross_entropy grad");
}

TEST(NnOps, LayerNormErrorsNameShapes) {
  const Tensor x = Tensor::zeros({2, 4}, f64);
  expect_invalid([&] { layer_norm(x, Tensor::ones({3}, f64), Tensor()); }, {"layer_norm", "weight", "[3]", "[2, 4]"});
  expect_invalid([&] { layer_norm(x, Tensor(), Tensor::ones({4, 1}, f64)); }, {"layer_norm", "bias", "[4, 1]"});
  expect_invalid([&] { layer_norm(x, Tensor::ones({4}, f32), Tensor()); }, {"layer_norm", "weight", "float32"});
  expect_invalid([&] { layer_norm(x, Tensor(), Tensor(), -1.0); }, {"layer_norm", "eps"});
}

// ---- embedding ------------------------------------------------------------------------------------

TEST(NnOps, EmbeddingGathersRows) {
  const Tensor w = Tensor::from_values({0, 1, 10, 11, 20, 21}, {3, 2}, f64);
  const std::vector<std::int64_t> ids = {2, 0, 2, 1};
  const Tensor out = embedding(w, Tensor::from_int64(ids, {2, 2}));
  EXPECT_EQ(out.shape(), (Shape{2, 2, 2}));
  EXPECT_EQ(out.to_vector(), (std::vector<double>{20, 21, 0, 1, 20, 21, 10, 11}));
  // A transposed weight view gathers the same logical rows.
  const Tensor wt = Tensor::from_values({0, 10, 20, 1, 11, 21}, {2, 3}, f64).transpose(0, 1);
  EXPECT_TRUE(bitwise_equal(embedding(wt, Tensor::from_int64(ids, {2, 2})), out));
}

TEST(NnOps, EmbeddingBackwardSumsRepeatedIndices) {
  Tensor w = Tensor::zeros({4, 2}, f64);
  w.set_requires_grad(true);
  const std::vector<std::int64_t> ids = {1, 3, 1};
  const Tensor out = embedding(w, Tensor::from_int64(ids, {3}));
  const Tensor g = Tensor::from_values({1, 2, 3, 4, 5, 6}, {3, 2}, f64);
  backward(out, g);
  EXPECT_EQ(w.grad().to_vector(), (std::vector<double>{0, 0, 1 + 5, 2 + 6, 0, 0, 3, 4}));
}

TEST(NnOps, EmbeddingErrorsNameIndex) {
  const Tensor w = Tensor::zeros({5, 2}, f64);
  const std::vector<std::int64_t> bad = {0, 7};
  expect_invalid([&] { embedding(w, Tensor::from_int64(bad, {2})); }, {"embedding", "index 7", "position 1", "[0, 5)"});
  const std::vector<std::int64_t> negative = {-1};
  expect_invalid([&] { embedding(w, Tensor::from_int64(negative, {1})); }, {"embedding", "-1"});
  expect_invalid([&] { embedding(w, Tensor::zeros({2}, f64)); }, {"embedding", "indices", "int64"});
  expect_invalid([&] { embedding(Tensor::zeros({5}, f64), Tensor::from_int64(bad, {2})); }, {"embedding", "[V, C]"});
}

// ---- cross-entropy --------------------------------------------------------------------------------

// -log softmax(logits)[t] for one row, computed directly.
double row_nll(const std::vector<double>& logits, std::size_t row, std::size_t vocab, std::int64_t target) {
  double denom = 0;
  for (std::size_t j = 0; j < vocab; ++j) denom += std::exp(logits[row * vocab + j]);
  return std::log(denom) - logits[row * vocab + static_cast<std::size_t>(target)];
}

TEST(NnOps, CrossEntropyMatchesDirectFormula) {
  const Tensor logits = randn64({4, 6}, 21);
  const std::vector<std::int64_t> t = {5, 0, 3, 3};
  const Tensor loss = cross_entropy(logits, Tensor::from_int64(t, {4}));
  EXPECT_EQ(loss.dim(), 0);
  const std::vector<double> l = logits.to_vector();
  double expected = 0;
  for (std::size_t i = 0; i < 4; ++i) expected += row_nll(l, i, 6, t[i]);
  EXPECT_NEAR(loss.item(), expected / 4, 1e-15);
  // float32 logits give the float32 loss to float precision.
  EXPECT_NEAR(cross_entropy(logits.to(f32), Tensor::from_int64(t, {4})).item(), expected / 4, 1e-5);
}

TEST(NnOps, CrossEntropyIgnoreIndexAveragesOverTheRest) {
  const Tensor logits = randn64({4, 3}, 22);
  const std::vector<std::int64_t> t = {2, -100, 1, -100};
  const std::vector<double> l = logits.to_vector();
  const double expected = (row_nll(l, 0, 3, 2) + row_nll(l, 2, 3, 1)) / 2;
  EXPECT_NEAR(cross_entropy(logits, Tensor::from_int64(t, {4})).item(), expected, 1e-15);
  // A custom ignore_index inside the vocabulary range.
  const std::vector<std::int64_t> t2 = {2, 0, 1, 0};
  EXPECT_NEAR(cross_entropy(logits, Tensor::from_int64(t2, {4}), 0).item(), expected, 1e-15);
  // Ignored rows get a zero gradient.
  Tensor x = logits.clone();
  x.set_requires_grad(true);
  backward(cross_entropy(x, Tensor::from_int64(t, {4})));
  const Tensor g = x.grad();
  for (std::int64_t j = 0; j < 3; ++j) {
    EXPECT_EQ(g.at({1, j}), 0.0);
    EXPECT_EQ(g.at({3, j}), 0.0);
    EXPECT_NE(g.at({0, j}), 0.0);
  }
}

TEST(NnOps, CrossEntropyAllIgnoredIsZeroWithZeroGradient) {
  Tensor x = randn64({3, 4}, 23);
  x.set_requires_grad(true);
  const std::vector<std::int64_t> t = {-100, -100, -100};
  const Tensor loss = cross_entropy(x, Tensor::from_int64(t, {3}));
  EXPECT_EQ(loss.item(), 0.0);
  backward(loss);
  for (double v : x.grad().to_vector()) EXPECT_EQ(v, 0.0);   // not NaN
}

TEST(NnOps, CrossEntropyErrorsNamePositionAndValue) {
  const Tensor logits = Tensor::zeros({3, 4}, f64);
  const std::vector<std::int64_t> bad = {0, 1, 4};
  expect_invalid([&] { cross_entropy(logits, Tensor::from_int64(bad, {3})); },
                 {"cross_entropy", "target 4", "position 2", "[0, 4)"});
  const std::vector<std::int64_t> negative = {0, -3, 1};
  expect_invalid([&] { cross_entropy(logits, Tensor::from_int64(negative, {3})); },
                 {"cross_entropy", "target -3", "position 1"});
  const std::vector<std::int64_t> short_t = {0, 1};
  expect_invalid([&] { cross_entropy(logits, Tensor::from_int64(short_t, {2})); }, {"cross_entropy", "[2]", "[3, 4]"});
  expect_invalid([&] { cross_entropy(Tensor::zeros({3}, f64), Tensor::from_int64(short_t, {2})); },
                 {"cross_entropy", "[N, V]"});
}

// ---- dropout --------------------------------------------------------------------------------------

TEST(NnOps, DropoutSameGeneratorStateGivesSameMask) {
  const Tensor x = randn64({50, 40}, 31);
  random::Generator a(1234), b(1234);
  const Tensor ya = dropout(x, 0.4, a);
  const Tensor yb = dropout(x, 0.4, b);
  EXPECT_TRUE(bitwise_equal(ya, yb));
  // The next draw (counter 1) gives a different mask.
  const Tensor ya2 = dropout(x, 0.4, a);
  EXPECT_FALSE(bitwise_equal(ya, ya2));
  EXPECT_EQ(a.counter(), 2u);
  // Restoring the counter replays the mask (what checkpointing does).
  b.set_counter(1);
  EXPECT_TRUE(bitwise_equal(dropout(x, 0.4, b), ya2));
}

TEST(NnOps, DropoutMaskFollowsLogicalIndexNotLayout) {
  const Tensor x = randn64({30, 20}, 32).transpose(0, 1);   // [20, 30] strided
  random::Generator a(7), b(7);
  EXPECT_TRUE(bitwise_equal(dropout(x, 0.5, a), dropout(x.contiguous(), 0.5, b)));
}

TEST(NnOps, DropoutDropsFractionPAndScalesTheRest) {
  const double p = 0.3;
  const std::int64_t n = 100000;
  random::Generator gen(99);
  const std::vector<double> y = dropout(Tensor::ones({n}, f64), p, gen).to_vector();
  std::int64_t dropped = 0;
  for (double v : y) {
    if (v == 0.0) {
      ++dropped;
    } else {
      EXPECT_DOUBLE_EQ(v, 1.0 / (1.0 - p));
    }
  }
  // Binomial: std of the fraction is sqrt(p (1 - p) / n) ~ 1.45e-3; 0.01 is ~7 std.
  EXPECT_NEAR(static_cast<double>(dropped) / static_cast<double>(n), p, 0.01);
}

TEST(NnOps, DropoutIsIdentityInEvalOrWithZeroP) {
  const Tensor x = randn64({4, 4}, 33);
  random::Generator gen(5);
  EXPECT_TRUE(dropout(x, 0.5, gen, /*training=*/false).same_as(x));
  EXPECT_TRUE(dropout(x, 0.0, gen).same_as(x));
  EXPECT_EQ(gen.counter(), 0u);   // no randomness drawn
}

TEST(NnOps, DropoutRejectsPOutsideZeroOne) {
  const Tensor x = Tensor::zeros({2}, f64);
  random::Generator gen(1);
  expect_invalid([&] { dropout(x, 1.0, gen); }, {"dropout", "p must be in [0, 1)", "1"});
  expect_invalid([&] { dropout(x, -0.1, gen); }, {"dropout", "-0.1"});
  expect_invalid([&] { dropout(x, std::numeric_limits<double>::quiet_NaN(), gen, false); }, {"dropout"});
}

TEST(NnOps, DropoutBackwardUsesTheForwardMask) {
  Tensor x = Tensor::ones({1000}, f64);
  x.set_requires_grad(true);
  random::Generator gen(3);
  const Tensor y = dropout(x, 0.25, gen);
  backward(y, Tensor::ones({1000}, f64));
  // With x = 1 and dy = 1, dx = mask / (1 - p) = y.
  EXPECT_TRUE(bitwise_equal(x.grad(), y.detach()));
}

// ---- causal attention -----------------------------------------------------------------------------

// Direct loops: out[b,h,t] = sum_{s<=t} softmax_s(q[t].k[s] / sqrt(D)) v[s]; with window > 0 only
// over s > t - window (Hugging Face's sliding-window mask).
std::vector<double> attention_reference(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t window = 0) {
  const std::int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  std::vector<double> out(static_cast<std::size_t>(B * H * T * D), 0.0);
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t t = 0; t < T; ++t) {
        std::vector<double> score(static_cast<std::size_t>(t + 1));
        double m = -std::numeric_limits<double>::infinity(), denom = 0;
        const std::int64_t first = window > 0 ? std::max<std::int64_t>(0, t - window + 1) : 0;
        for (std::int64_t s = first; s <= t; ++s) {
          double dot = 0;
          for (std::int64_t d = 0; d < D; ++d) dot += q.at({b, h, t, d}) * k.at({b, h, s, d});
          score[s] = dot / std::sqrt(static_cast<double>(D));
          m = std::max(m, score[s]);
        }
        for (std::int64_t s = first; s <= t; ++s) denom += std::exp(score[s] - m);
        for (std::int64_t s = first; s <= t; ++s) {
          const double p = std::exp(score[s] - m) / denom;
          for (std::int64_t d = 0; d < D; ++d) out[((b * H + h) * T + t) * D + d] += p * v.at({b, h, s, d});
        }
      }
    }
  }
  return out;
}

TEST(NnOps, CausalAttentionFirstPositionSeesOnlyItself) {
  const Tensor q = randn64({2, 3, 5, 4}, 41), k = randn64({2, 3, 5, 4}, 42), v = randn64({2, 3, 5, 4}, 43);
  const Tensor out = causal_attention(q, k, v);
  ASSERT_EQ(out.shape(), q.shape());
  for (std::int64_t b = 0; b < 2; ++b) {
    for (std::int64_t h = 0; h < 3; ++h) {
      for (std::int64_t d = 0; d < 4; ++d) EXPECT_NEAR(out.at({b, h, 0, d}), v.at({b, h, 0, d}), 1e-15);
    }
  }
  // Changing a later key / value does not change earlier outputs.
  Tensor v2 = v.clone();
  v2.set({0, 0, 4, 0}, 100.0);
  const Tensor out2 = causal_attention(q, k, v2);
  for (std::int64_t t = 0; t < 4; ++t) EXPECT_EQ(out2.at({0, 0, t, 0}), out.at({0, 0, t, 0}));
  EXPECT_NE(out2.at({0, 0, 4, 0}), out.at({0, 0, 4, 0}));
}

TEST(NnOps, CausalAttentionMatchesDirectLoops) {
  const Tensor q = randn64({2, 2, 6, 3}, 44), k = randn64({2, 2, 6, 3}, 45), v = randn64({2, 2, 6, 3}, 46);
  const std::vector<double> expected = attention_reference(q, k, v);
  const std::vector<double> got = causal_attention(q, k, v).to_vector();
  ASSERT_EQ(got.size(), expected.size());
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], expected[i], 1e-14) << i;
  // float32 to float precision.
  const std::vector<double> got32 = causal_attention(q.to(f32), k.to(f32), v.to(f32)).to_vector();
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got32[i], expected[i], 1e-5) << i;
}

// T = 150 spans three 64-row tiles, the last one partial, so the online softmax rescales across
// key tiles and the diagonal tile is cut short. float64 must equal the direct loops to rounding.
TEST(NnOps, CausalAttentionMatchesDirectLoopsAcrossTiles) {
  const Tensor q = randn64({1, 2, 150, 5}, 144), k = randn64({1, 2, 150, 5}, 145), v = randn64({1, 2, 150, 5}, 146);
  // Large scores so the running max changes between tiles and a wrong rescale would show.
  const Tensor q3 = scale(q, 3.0);
  const std::vector<double> expected = attention_reference(q3, k, v);
  const std::vector<double> got = causal_attention(q3, k, v).to_vector();
  ASSERT_EQ(got.size(), expected.size());
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], expected[i], 1e-12) << i;
  const std::vector<double> got32 = causal_attention(q3.to(f32), k.to(f32), v.to(f32)).to_vector();
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got32[i], expected[i], 2e-5) << i;
  // Strided heads ([B, T, H, D] permuted) across tiles give the same numbers.
  const Tensor qs = scale(randn64({1, 150, 2, 5}, 147), 3.0).permute({0, 2, 1, 3});
  const std::vector<double> strided = causal_attention(qs, k, v).to_vector();
  const std::vector<double> packed = attention_reference(qs.contiguous(), k, v);
  for (std::size_t i = 0; i < strided.size(); ++i) EXPECT_NEAR(strided[i], packed[i], 1e-12) << i;
}

// Sliding windows shorter than, equal to and longer than a 64-key tile, over three tiles: tiles wholly
// before a window are skipped, a window starting inside a tile masks its first columns.
TEST(NnOps, SlidingWindowAttentionMatchesDirectLoops) {
  const Tensor q = scale(randn64({1, 2, 150, 5}, 244), 3.0), k = randn64({1, 2, 150, 5}, 245);
  const Tensor v = randn64({1, 2, 150, 5}, 246);
  for (const std::int64_t window : {1, 7, 64, 65, 100, 149, 150, 400}) {
    const std::vector<double> expected = attention_reference(q, k, v, window);
    const std::vector<double> got = causal_attention(q, k, v, window).to_vector();
    ASSERT_EQ(got.size(), expected.size());
    for (std::size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], expected[i], 1e-12) << "window " << window << " " << i;
  }
  // A window covering the sequence is plain causal attention, bit for bit.
  const std::vector<double> plain = causal_attention(q, k, v).to_vector();
  const std::vector<double> wide = causal_attention(q, k, v, 150).to_vector();
  for (std::size_t i = 0; i < plain.size(); ++i) ASSERT_EQ(plain[i], wide[i]) << i;
  // Window 1: every position sees only itself.
  const Tensor one = causal_attention(q, k, v, 1);
  EXPECT_NEAR(one.at({0, 1, 120, 3}), v.at({0, 1, 120, 3}), 1e-15);
  expect_invalid([&] { causal_attention(q, k, v, -1); }, {"causal_attention", "window", "-1"});
}

// Decoding with a cache (T_q < T_k) under a window sees the same keys as the full forward's rows.
TEST(NnOps, SlidingWindowAttentionWithACacheEqualsTheFullRows) {
  const Tensor q = randn64({1, 2, 140, 4}, 251), k = randn64({1, 2, 140, 4}, 252), v = randn64({1, 2, 140, 4}, 253);
  const double scale_d = 0.5;
  for (const std::int64_t window : {3, 70}) {
    const kernels::AttentionForward full = kernels::causal_attention_forward(q, k, v, scale_d, window);
    const kernels::AttentionForward last = kernels::causal_attention_forward(q.narrow(2, 130, 10), k, v, scale_d, window);
    for (std::int64_t t = 0; t < 10; ++t) {
      for (std::int64_t d = 0; d < 4; ++d) {
        EXPECT_NEAR(last.out.at({0, 1, t, d}), full.out.at({0, 1, 130 + t, d}), 1e-13) << window;
      }
    }
    // Window 3 needs only the last key tile; window 70 reaches back into the first.
    const std::int64_t plain = kernels::causal_attention_forward(q.narrow(2, 130, 10), k, v, scale_d).scores;
    if (window == 3) {
      EXPECT_LT(last.scores, plain);
    }
    if (window == 70) {
      EXPECT_EQ(last.scores, plain);
    }
  }
}

// RoPE's fused op equals its definition, x * cos + rotate_half(x) * sin, on strided heads, and its
// errors name the shapes.
TEST(NnOps, RotaryIsXCosPlusRotateHalfXSin) {
  const Tensor x = randn64({2, 5, 3, 8}, 301).permute({0, 2, 1, 3});   // [B, H, T, D], strided
  const Tensor cos = randn64({5, 8}, 302), sin = randn64({5, 8}, 303);
  const Tensor y = rotary(x, cos, sin);
  ASSERT_EQ(y.shape(), (Shape{2, 3, 5, 8}));
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t h = 0; h < 3; ++h)
      for (std::int64_t t = 0; t < 5; ++t)
        for (std::int64_t i = 0; i < 8; ++i) {
          const double rotated = i < 4 ? -x.at({b, h, t, i + 4}) : x.at({b, h, t, i - 4});
          const double expected = x.at({b, h, t, i}) * cos.at({t, i}) + rotated * sin.at({t, i});
          ASSERT_NEAR(y.at({b, h, t, i}), expected, 1e-15) << b << h << t << i;
        }
  expect_invalid([&] { rotary(x, randn64({4, 8}, 1), sin); }, {"rotary", "[5, 8]", "[4, 8]"});
  expect_invalid([&] { rotary(randn64({1, 1, 5, 7}, 2), randn64({5, 7}, 3), randn64({5, 7}, 4)); },
                 {"rotary", "D even"});
}

TEST(NnOps, CausalAttentionTakesStridedHeads) {
  // The usual layout: [B, T, H, D] permuted to [B, H, T, D] (a view, not a copy).
  const Tensor q = randn64({2, 5, 3, 4}, 47).permute({0, 2, 1, 3});
  const Tensor k = randn64({2, 5, 3, 4}, 48).permute({0, 2, 1, 3});
  const Tensor v = randn64({2, 5, 3, 4}, 49).permute({0, 2, 1, 3});
  ASSERT_FALSE(q.is_contiguous());
  const std::vector<double> a = causal_attention(q, k, v).to_vector();
  const std::vector<double> b = causal_attention(q.contiguous(), k.contiguous(), v.contiguous()).to_vector();
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-14);
}

TEST(NnOps, CausalAttentionErrorsNameShapes) {
  const Tensor q = Tensor::zeros({1, 2, 3, 4}, f64);
  expect_invalid([&] { causal_attention(q, Tensor::zeros({1, 2, 3, 5}, f64), q); },
                 {"causal_attention", "[1, 2, 3, 4]", "[1, 2, 3, 5]"});
  expect_invalid([&] { causal_attention(Tensor::zeros({2, 3, 4}, f64), Tensor::zeros({2, 3, 4}, f64),
                                        Tensor::zeros({2, 3, 4}, f64)); },
                 {"causal_attention", "[B, H, T, D]"});
  expect_invalid([&] { causal_attention(q, q.to(f32), q); }, {"causal_attention", "float32"});
}

// ---- gradients (float64, central differences) -----------------------------------------------------

// Inputs for pointwise ops: kept at |x| >= 0.2 so no perturbation crosses relu's kink at 0.
Tensor away_from_zero(const Shape& shape, std::uint64_t seed) {
  Tensor t = randn64(shape, seed);
  double* p = t.data<double>();
  for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = p[i] >= 0 ? p[i] + 0.2 : p[i] - 0.2;
  t.set_requires_grad(true);
  return t;
}

TEST(NnGrad, Pointwise) {
  EXPECT_GRADIENTS_MATCH([](const TensorList& x) { return relu(x[0]); }, {away_from_zero({3, 4}, 51)});
  EXPECT_GRADIENTS_MATCH([](const TensorList& x) { return gelu(x[0]); }, {leaf({3, 4}, 52)});
  EXPECT_GRADIENTS_MATCH([](const TensorList& x) { return meshgrad::tanh(x[0]); }, {leaf({3, 4}, 53)});
  EXPECT_GRADIENTS_MATCH([](const TensorList& x) { return meshgrad::exp(x[0]); }, {leaf({3, 4}, 54)});
  Tensor positive = random::rand({3, 4}, 55, f64, 0.5, 2.0);
  positive.set_requires_grad(true);
  EXPECT_GRADIENTS_MATCH([](const TensorList& x) { return meshgrad::log(x[0]); }, {positive});
}

TEST(NnGrad, GeluDerivativeAtLargeMagnitudes) {
  // Where tanh saturates (|x| ~ 4..6) the derivative tends to 1 / 0: checks the x (1 - tanh^2) term.
  Tensor x = Tensor::from_values({-6, -4, -2.5, 2.5, 4, 6}, {6}, f64);
  x.set_requires_grad(true);
  EXPECT_GRADIENTS_MATCH([](const TensorList& in) { return gelu(in[0]); }, {x});
}

TEST(NnGrad, SoftmaxAndLogSoftmax) {
  EXPECT_GRADIENTS_MATCH([](const TensorList& x) { return softmax(x[0]); }, {leaf({2, 3, 5}, 61)});
  EXPECT_GRADIENTS_MATCH([](const TensorList& x) { return log_softmax(x[0]); }, {leaf({4, 5}, 62)});
}

TEST(NnGrad, LayerNorm) {
  EXPECT_GRADIENTS_MATCH([](const TensorList& x) { return layer_norm(x[0], x[1], x[2]); },
                         (TensorList{leaf({2, 3, 6}, 71), leaf({6}, 72), leaf({6}, 73)}));
  // Without affine parameters, and with only a weight.
  EXPECT_GRADIENTS_MATCH([](const TensorList& x) { return layer_norm(x[0], Tensor(), Tensor()); },
                         {leaf({4, 5}, 74)});
  EXPECT_GRADIENTS_MATCH([](const TensorList& x) { return layer_norm(x[0], x[1], Tensor(), 1e-3); },
                         (TensorList{leaf({4, 5}, 75), leaf({5}, 76)}));
  // Only the parameters require grad (x is data).
  EXPECT_GRADIENTS_MATCH([](const TensorList& x) { return layer_norm(x[0], x[1], x[2]); },
                         (TensorList{randn64({3, 4}, 77), leaf({4}, 78), leaf({4}, 79)}));
}

TEST(NnGrad, Embedding) {
  const std::vector<std::int64_t> ids = {3, 0, 3, 1, 4, 3};
  const Tensor indices = Tensor::from_int64(ids, {2, 3});
  EXPECT_GRADIENTS_MATCH([&](const TensorList& x) { return embedding(x[0], indices); }, {leaf({5, 4}, 81)});
}

TEST(NnGrad, CrossEntropy) {
  const std::vector<std::int64_t> t = {2, -100, 0, 5, 5};
  const Tensor targets = Tensor::from_int64(t, {5});
  EXPECT_GRADIENTS_MATCH([&](const TensorList& x) { return cross_entropy(x[0], targets); }, {leaf({5, 6}, 91)});
  // Behind another op (the gradient flows through a non-leaf).
  EXPECT_GRADIENTS_MATCH([&](const TensorList& x) { return cross_entropy(scale(x[0], 2.0), targets); },
                         {leaf({5, 6}, 92)});
}

TEST(NnGrad, Dropout) {
  // A fresh generator with a fixed seed inside f: every evaluation draws the same mask.
  EXPECT_GRADIENTS_MATCH(
      [](const TensorList& x) {
        random::Generator gen(17);
        return dropout(x[0], 0.4, gen);
      },
      {leaf({6, 7}, 101)});
}

TEST(NnGrad, CausalAttention) {
  EXPECT_GRADIENTS_MATCH([](const TensorList& x) { return causal_attention(x[0], x[1], x[2]); },
                         (TensorList{leaf({2, 2, 4, 3}, 111), leaf({2, 2, 4, 3}, 112), leaf({2, 2, 4, 3}, 113)}));
  // Only some inputs require grad: the others get none, and the rest are still right.
  EXPECT_GRADIENTS_MATCH([](const TensorList& x) { return causal_attention(x[0], x[1], x[2]); },
                         (TensorList{randn64({1, 2, 5, 2}, 114), leaf({1, 2, 5, 2}, 115), randn64({1, 2, 5, 2}, 116)}));
}

// Across tiles: T = 70 is one full 64-row tile and a partial one, so the backward's recomputed
// tiles, the skipped upper tile and the dK / dV accumulation over query tiles are all exercised.
TEST(NnGrad, CausalAttentionAcrossTiles) {
  EXPECT_GRADIENTS_MATCH([](const TensorList& x) { return causal_attention(x[0], x[1], x[2]); },
                         (TensorList{leaf({1, 1, 70, 2}, 117), leaf({1, 1, 70, 2}, 118), leaf({1, 1, 70, 2}, 119)}));
}

}  // namespace
}  // namespace meshgrad::test_nn_ops

// The float32 GELU uses its own vectorisable tanh: it must agree with the float64 (libm) one to
// float32 precision over the whole range, including the saturated tails and around 0.
TEST(NnKernels, Float32GeluMatchesFloat64) {
  using namespace meshgrad;
  std::vector<double> xs;
  for (int i = -4000; i <= 4000; ++i) xs.push_back(i * 0.0025 * (1 + std::abs(i) / 400.0));   // [-110, 110]
  const Tensor x64 = Tensor::from_values(xs, {static_cast<std::int64_t>(xs.size())}, DType::Float64);
  const Tensor x32 = x64.to(DType::Float32);
  const auto y64 = kernels::unary(kernels::Unary::Gelu, x32.to(DType::Float64)).to_vector();
  const auto y32 = kernels::unary(kernels::Unary::Gelu, x32).to_vector();
  const auto g64 = kernels::gelu_backward(Tensor::ones({x64.numel()}, DType::Float64), x32.to(DType::Float64)).to_vector();
  const auto g32 = kernels::gelu_backward(Tensor::ones({x64.numel()}, DType::Float32), x32).to_vector();
  for (std::size_t i = 0; i < xs.size(); ++i) {
    EXPECT_NEAR(y32[i], y64[i], 4e-7 * std::max(1.0, std::abs(y64[i]))) << "gelu at " << xs[i];
    EXPECT_NEAR(g32[i], g64[i], 1e-6) << "gelu' at " << xs[i];
  }
}
