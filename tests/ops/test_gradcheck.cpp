// The gradient checker: every op's case of the suite passes in both modes over several seeds, and
// the checker itself fails (with a useful message) on deliberately wrong backwards.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "meshgrad/autograd/function.hpp"
#include "meshgrad/ops/gradcheck.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/error.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/random.hpp"

namespace meshgrad::test_gradcheck {
namespace {

// EXPECT_TRUE(Contains(text, part)): prints both on failure.
::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << text << "' does not contain '" << part << "'";
}

// ---- the suite: one test per case, 3 seeds x 2 modes ------------------------------------------------

class GradcheckSuite : public ::testing::TestWithParam<std::string> {};

TEST_P(GradcheckSuite, PassesInFullAndProjectionMode) {
  for (std::uint64_t seed : {0u, 1u, 2u}) {
    const GradcheckCase c = make_gradcheck_case(GetParam(), seed);
    for (GradcheckMode mode : {GradcheckMode::Full, GradcheckMode::Projection}) {
      const GradcheckResult r = run_case(c, mode);
      EXPECT_TRUE(r.passed) << "seed " << seed << ", " << gradcheck_mode_name(mode) << ", " << r.shapes << ": "
                            << r.message;
      EXPECT_GT(r.compared, 0) << "nothing was compared for " << c.name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, GradcheckSuite, ::testing::ValuesIn(gradcheck_case_names()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '.', '_');
                           return name;
                         });

// Every differentiable op of ops.hpp and tree_reduce.hpp has at least one case.
TEST(GradcheckSuiteTable, CoversEveryOpOfOpsHpp) {
  const std::vector<std::string> ops = gradcheck_op_names();
  for (const char* op : {"add", "sub", "mul", "div", "neg", "scale", "add_scalar", "matmul", "linear", "sum", "mean",
                         "reshape", "transpose", "permute", "narrow", "expand", "contiguous", "cat", "split", "chunk",
                         "relu", "gelu", "silu", "tanh", "exp", "log", "softmax", "log_softmax", "layer_norm", "rms_norm", "embedding",
                         "cross_entropy", "dropout", "causal_attention", "linear_over_input_blocks", "add_bias",
                         "sum_over_blocks"}) {
    EXPECT_NE(std::find(ops.begin(), ops.end(), op), ops.end()) << "no gradcheck case for op " << op;
  }
}

TEST(GradcheckSuiteTable, CasesDependOnlyOnSeedAndName) {
  const GradcheckCase a = make_gradcheck_case("matmul.batched", 7);
  const GradcheckCase b = make_gradcheck_case("matmul.batched", 7);
  ASSERT_EQ(a.inputs.size(), b.inputs.size());
  for (std::size_t k = 0; k < a.inputs.size(); ++k) EXPECT_TRUE(bitwise_equal(a.inputs[k], b.inputs[k]));
  // Different seeds draw different shapes somewhere in the table.
  bool any_shape_differs = false;
  const auto s0 = gradcheck_cases(0);
  const auto s1 = gradcheck_cases(1);
  for (std::size_t i = 0; i < s0.size(); ++i) {
    any_shape_differs |= describe_inputs(s0[i].inputs, {}) != describe_inputs(s1[i].inputs, {});
  }
  EXPECT_TRUE(any_shape_differs);
}

TEST(GradcheckSuiteTable, SelectsByOpOrCaseNameAndRejectsUnknownOps) {
  const auto matmuls = select_gradcheck_cases(0, {"matmul"});
  ASSERT_FALSE(matmuls.empty());
  for (const auto& c : matmuls) EXPECT_EQ(c.op, "matmul");
  const auto one = select_gradcheck_cases(0, {"sum.dim"});
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].name, "sum.dim");
  try {
    select_gradcheck_cases(0, {"add", "frobnicate"});
    FAIL() << "an unknown op was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(Contains(std::string(e.what()), "unknown op 'frobnicate'"));
  }
}

// ---- the checker can fail ------------------------------------------------------------------------------

// y = x * x, with backward scaled by `factor` (1 = correct).
struct ScaledSquareFn final : autograd::Function {
  explicit ScaledSquareFn(double factor) : factor(factor) {}
  std::string_view name() const override { return "scaled_square"; }
  TensorList forward(const TensorList& x) override {
    save_for_backward({x[0]});
    return {kernels::binary(kernels::Binary::Mul, x[0], x[0])};
  }
  TensorList backward(const TensorList& g) override {
    return {kernels::scale(kernels::binary(kernels::Binary::Mul, g[0], saved()[0]), 2 * factor)};
  }
  double factor;
};

Tensor scaled_square(const Tensor& x, double factor) { return autograd::apply<ScaledSquareFn>({x}, factor)[0]; }

// y = a @ b with a wrong grad_a: g @ b instead of g @ b^T (a transpose forgotten). grad_b is right.
struct ForgotTransposeMatmulFn final : autograd::Function {
  std::string_view name() const override { return "forgot_transpose_matmul"; }
  TensorList forward(const TensorList& x) override {
    save_for_backward({x[0], x[1]});
    return {kernels::matmul(x[0], x[1])};
  }
  TensorList backward(const TensorList& g) override {
    const auto& s = saved();
    return {kernels::matmul(g[0], s[1]), kernels::matmul(s[0].transpose(0, 1), g[0])};
  }
};

// y = 3 x with one wrong gradient element: grad[row, col] += 0.5.
struct OneWrongElementFn final : autograd::Function {
  OneWrongElementFn(std::int64_t row, std::int64_t col) : row(row), col(col) {}
  std::string_view name() const override { return "one_wrong_element"; }
  TensorList forward(const TensorList& x) override { return {kernels::scale(x[0], 3.0)}; }
  TensorList backward(const TensorList& g) override {
    Tensor grad = kernels::scale(g[0], 3.0);
    grad.set({row, col}, grad.at({row, col}) + 0.5);
    return {grad};
  }
  std::int64_t row, col;
};

Tensor grad_leaf(const Shape& shape, std::uint64_t seed) {
  Tensor t = random::randn(shape, seed, DType::Float64);
  t.set_requires_grad(true);
  return t;
}

GradcheckOptions named(const char* op, std::vector<std::string> inputs) {
  GradcheckOptions o;
  o.op = op;
  o.input_names = std::move(inputs);
  return o;
}

TEST(Gradcheck, CorrectCustomFunctionPasses) {
  // The control for the failing cases below: the same function with the right backward passes.
  const Tensor x = grad_leaf({3, 4}, 1);
  auto f = [](const TensorList& in) { return scaled_square(in[0], 1.0); };
  for (GradcheckMode mode : {GradcheckMode::Full, GradcheckMode::Projection}) {
    const GradcheckResult r = gradcheck(f, {x}, mode, named("square", {"x"}));
    EXPECT_TRUE(r.passed) << r.message;
    EXPECT_LT(r.max_abs_error, 1e-8);
  }
}

TEST(Gradcheck, FullModeReportsDoubledGradientWithOpInputElementAndValues) {
  const Tensor x = grad_leaf({3, 4}, 2);
  auto f = [](const TensorList& in) { return scaled_square(in[0], 2.0); };
  const GradcheckResult r = gradcheck(f, {x}, GradcheckMode::Full, named("doubled_square", {"x"}));
  ASSERT_FALSE(r.passed);
  ASSERT_TRUE(r.first_failure.has_value());
  const GradcheckFailure& fail = *r.first_failure;
  // The first wrong Jacobian entry is the diagonal one of element [0, 0]: d(x^2)/dx = 2 x, reported 4 x.
  EXPECT_EQ(fail.input_index, 0u);
  EXPECT_EQ(fail.input_name, "x");
  EXPECT_EQ(fail.element, (std::vector<std::int64_t>{0, 0}));
  EXPECT_EQ(fail.output_element, (std::vector<std::int64_t>{0, 0}));
  const double x00 = x.at({0, 0});
  EXPECT_NEAR(fail.numeric, 2 * x00, 1e-8);
  EXPECT_NEAR(fail.analytic, 4 * x00, 1e-12);
  // The largest error is the largest diagonal one: |4 x - 2 x|.
  double largest = 0;
  for (double v : x.to_vector()) largest = std::max(largest, 2 * std::abs(v));
  EXPECT_NEAR(r.max_abs_error, largest, 1e-7);
  EXPECT_EQ(r.message, fail.message);
  EXPECT_TRUE(Contains(r.message, "op 'doubled_square'"));
  EXPECT_TRUE(Contains(r.message, "input 0 'x' float64[3, 4]"));
  EXPECT_TRUE(Contains(r.message, "element [0, 0]"));
  EXPECT_TRUE(Contains(r.message, fmt::format("numeric {:.12g}", fail.numeric)));
  EXPECT_TRUE(Contains(r.message, fmt::format("analytic {:.12g}", fail.analytic)));
}

TEST(Gradcheck, FullModeReportsForgottenTransposeOnTheRightInput) {
  // Square, non-symmetric operands so the wrong gradient has the right shape.
  const Tensor a = grad_leaf({3, 3}, 3);
  const Tensor b = grad_leaf({3, 3}, 4);
  auto f = [](const TensorList& in) { return autograd::apply<ForgotTransposeMatmulFn>(in)[0]; };
  const GradcheckResult r = gradcheck(f, {a, b}, GradcheckMode::Full, named("forgot_transpose", {"a", "b"}));
  ASSERT_FALSE(r.passed);
  ASSERT_TRUE(r.first_failure.has_value());
  EXPECT_EQ(r.first_failure->input_index, 0u);
  EXPECT_TRUE(Contains(r.message, "op 'forgot_transpose', input 0 'a'"));
  EXPECT_GT(r.max_abs_error, 1e-3);
}

TEST(Gradcheck, ProjectionModeDetectsDoubledGradientAndForgottenTranspose) {
  const Tensor x = grad_leaf({6, 5}, 5);
  const GradcheckResult r1 = gradcheck([](const TensorList& in) { return scaled_square(in[0], 2.0); }, {x},
                                       GradcheckMode::Projection, named("doubled_square", {"x"}));
  ASSERT_FALSE(r1.passed);
  EXPECT_TRUE(Contains(r1.message, "op 'doubled_square', input 0 'x' float64[6, 5], projection 0"));
  EXPECT_TRUE(Contains(r1.message, "numeric"));
  EXPECT_TRUE(Contains(r1.message, "analytic"));
  EXPECT_TRUE(Contains(r1.message, "element ["));

  const Tensor a = grad_leaf({4, 4}, 6);
  const Tensor b = grad_leaf({4, 4}, 7);
  const GradcheckResult r2 =
      gradcheck([](const TensorList& in) { return autograd::apply<ForgotTransposeMatmulFn>(in)[0]; }, {a, b},
                GradcheckMode::Projection, named("forgot_transpose", {"a", "b"}));
  ASSERT_FALSE(r2.passed);
  ASSERT_TRUE(r2.first_failure.has_value());
  EXPECT_EQ(r2.first_failure->input_name, "a");
}

TEST(Gradcheck, ProjectionModeLocalizesASingleWrongElement) {
  const Tensor x = grad_leaf({8, 16}, 8);
  auto f = [](const TensorList& in) { return autograd::apply<OneWrongElementFn>(in, 5, 11)[0]; };
  const GradcheckResult r = gradcheck(f, {x}, GradcheckMode::Projection, named("one_wrong", {"x"}));
  ASSERT_FALSE(r.passed);
  ASSERT_TRUE(r.first_failure.has_value());
  EXPECT_EQ(r.first_failure->element, (std::vector<std::int64_t>{5, 11}));
  EXPECT_NEAR(r.first_failure->analytic - r.first_failure->numeric, 0.5, 1e-6);
  EXPECT_TRUE(Contains(r.message, "element [5, 11]"));
  // Full mode finds the same element.
  const GradcheckResult full = gradcheck(f, {x}, GradcheckMode::Full, named("one_wrong", {"x"}));
  ASSERT_FALSE(full.passed);
  EXPECT_EQ(full.first_failure->element, (std::vector<std::int64_t>{5, 11}));
}

TEST(Gradcheck, ProjectionModeCostDoesNotGrowWithInputSize) {
  // 48x64 @ 64x32: the full Jacobian would need 2 * (3072 + 2048) evaluations and 1536 backwards.
  const Tensor a = grad_leaf({48, 64}, 13);
  const Tensor b = grad_leaf({64, 32}, 14);
  int calls = 0;
  auto f = [&](const TensorList& in) {
    ++calls;
    return matmul(in[0], in[1]);
  };
  GradcheckOptions options = named("big_matmul", {"a", "b"});
  options.projections = 4;
  const GradcheckResult r = gradcheck(f, {a, b}, GradcheckMode::Projection, options);
  EXPECT_TRUE(r.passed) << r.message;
  EXPECT_EQ(r.compared, 4 * 2);   // projections x inputs
  // 1 recorded + 2 determinism evaluations, then 2 per projection and input.
  EXPECT_EQ(calls, 3 + 4 * 2 * 2);
}

TEST(Gradcheck, ToleranceSeparatesRoundingFromBugs) {
  const Tensor x = grad_leaf({2, 3}, 9);
  for (GradcheckMode mode : {GradcheckMode::Full, GradcheckMode::Projection}) {
    // Off by 1e-10 relative: below what finite differences can resolve, passes.
    EXPECT_TRUE(gradcheck([](const TensorList& in) { return scaled_square(in[0], 1 + 1e-10); }, {x}, mode).passed);
    // Off by 1e-4 relative: a bug, fails.
    EXPECT_FALSE(gradcheck([](const TensorList& in) { return scaled_square(in[0], 1 + 1e-4); }, {x}, mode).passed);
  }
}

TEST(Gradcheck, PassesIntegerAndNoGradInputsThroughUnperturbed) {
  const Tensor x = grad_leaf({2, 3}, 10);
  const Tensor w = random::randn({2, 3}, 11, DType::Float64);   // requires_grad = false: not checked
  const Tensor idx = Tensor::from_int64(std::vector<std::int64_t>{2, 0, 1}, {3});
  const Tensor x_before = x.clone();
  int calls = 0;
  bool inputs_unchanged = true;
  auto f = [&](const TensorList& in) {
    ++calls;
    inputs_unchanged &= bitwise_equal(in[1], w) && bitwise_equal(in[2], idx);
    return mul(in[0], in[1]);
  };
  for (GradcheckMode mode : {GradcheckMode::Full, GradcheckMode::Projection}) {
    const GradcheckResult r = gradcheck(f, {x, w, idx}, mode);
    EXPECT_TRUE(r.passed) << r.message;
    if (mode == GradcheckMode::Full) {
      EXPECT_EQ(r.compared, x.numel() * x.numel());   // only x's Jacobian
    }
    EXPECT_EQ(r.shapes, "input 0=float64[2, 3] input 1=float64[2, 3] input 2=int64[3]");
  }
  EXPECT_GT(calls, 0);
  EXPECT_TRUE(inputs_unchanged);
  EXPECT_TRUE(bitwise_equal(x, x_before)) << "the caller's tensor was modified";
}

TEST(Gradcheck, ReportsNonDeterministicFunction) {
  const Tensor x = grad_leaf({2, 2}, 12);
  int calls = 0;
  auto f = [&](const TensorList& in) { return add_scalar(in[0], 1e-3 * calls++); };
  const GradcheckResult r = gradcheck(f, {x}, GradcheckMode::Full, named("drifting", {"x"}));
  EXPECT_FALSE(r.passed);
  EXPECT_TRUE(Contains(r.message, "op 'drifting': f is not deterministic"));
}

TEST(Gradcheck, RejectsFloat32AndNothingToCheck) {
  Tensor x32 = random::randn({2}, 1, DType::Float32);
  x32.set_requires_grad(true);
  auto identity = [](const TensorList& in) { return scale(in[0], 1.0); };
  try {
    gradcheck(identity, {x32}, GradcheckMode::Full, named("f32", {"x"}));
    FAIL() << "a float32 input was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(Contains(std::string(e.what()), "op 'f32': input 0 'x' is float32[2]"));
  }
  const Tensor constant = random::randn({2}, 1, DType::Float64);
  EXPECT_THROW(gradcheck(identity, {constant}, GradcheckMode::Full), InvalidArgument);
}

TEST(Gradcheck, ParsesModes) {
  EXPECT_EQ(parse_gradcheck_mode("full"), GradcheckMode::Full);
  EXPECT_EQ(parse_gradcheck_mode("projection"), GradcheckMode::Projection);
  EXPECT_THROW(parse_gradcheck_mode("fast"), InvalidArgument);
}

}  // namespace
}  // namespace meshgrad::test_gradcheck
