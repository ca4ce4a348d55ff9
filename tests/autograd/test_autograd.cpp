// The engine and the Function API, tested with small Functions defined here (the autograd layer
// sits below ops/, so these tests do not use the ops library).
#include <gtest/gtest.h>

#include <thread>

#include "meshgrad/autograd/checkpoint.hpp"
#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/autograd/function.hpp"
#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/tensor/kernels.hpp"

namespace test_autograd {

using namespace meshgrad;
using autograd::Function;
using kernels::Binary;

namespace {

// y = a * b (same shapes).
struct Mul final : Function {
  std::string_view name() const override { return "test_mul"; }
  TensorList forward(const TensorList& x) override {
    save_for_backward({x[0], x[1]});
    return {kernels::binary(Binary::Mul, x[0], x[1])};
  }
  TensorList backward(const TensorList& g) override {
    const auto& s = saved();
    return {needs_input_grad(0) ? kernels::binary(Binary::Mul, g[0], s[1]) : Tensor(),
            needs_input_grad(1) ? kernels::binary(Binary::Mul, g[0], s[0]) : Tensor()};
  }
};
Tensor mul(const Tensor& a, const Tensor& b) { return autograd::apply<Mul>({a, b})[0]; }

// y = sum(a) (scalar).
struct Sum final : Function {
  Shape shape;
  std::string_view name() const override { return "test_sum"; }
  TensorList forward(const TensorList& x) override {
    shape = x[0].shape();
    return {kernels::sum(x[0], {}, false)};
  }
  TensorList backward(const TensorList& g) override { return {g[0].expand(shape).contiguous()}; }
};
Tensor sum(const Tensor& a) { return autograd::apply<Sum>({a})[0]; }

// y = a + b
struct Add final : Function {
  std::string_view name() const override { return "test_add"; }
  TensorList forward(const TensorList& x) override { return {kernels::binary(Binary::Add, x[0], x[1])}; }
  TensorList backward(const TensorList& g) override { return {g[0], g[0]}; }
};
Tensor add(const Tensor& a, const Tensor& b) { return autograd::apply<Add>({a, b})[0]; }

// Identity forward that returns its input tensor itself (as copy-to-region ops do).
struct Identity final : Function {
  std::string_view name() const override { return "test_identity"; }
  TensorList forward(const TensorList& x) override { return {x[0]}; }
  TensorList backward(const TensorList& g) override { return {g[0]}; }
};

// A broken op: backward returns the wrong number of gradients.
struct WrongCount final : Function {
  std::string_view name() const override { return "wrong_count"; }
  TensorList forward(const TensorList& x) override { return {x[0].clone()}; }
  TensorList backward(const TensorList& g) override { return {g[0], g[0]}; }
};
// A broken op: backward returns a gradient of the wrong shape.
struct WrongShape final : Function {
  std::string_view name() const override { return "wrong_shape"; }
  TensorList forward(const TensorList& x) override { return {x[0].clone()}; }
  TensorList backward(const TensorList& g) override { return {Tensor::zeros({7}, g[0].dtype())}; }
};

Tensor leaf(std::initializer_list<double> v) {
  Tensor t = Tensor::from_values(v, {static_cast<std::int64_t>(v.size())}, DType::Float64);
  t.set_requires_grad();
  return t;
}

}  // namespace

TEST(Autograd, ProductRuleAndAccumulation) {
  Tensor a = leaf({1, 2, 3});
  Tensor b = leaf({4, 5, 6});
  // loss = sum(a*b + a*a): da = b + 2a, db = a. a is used three times: contributions are summed.
  Tensor loss = sum(add(mul(a, b), mul(a, a)));
  EXPECT_FALSE(loss.is_leaf());
  backward(loss);
  EXPECT_EQ(a.grad().to_vector(), (std::vector<double>{6, 9, 12}));
  EXPECT_EQ(b.grad().to_vector(), (std::vector<double>{1, 2, 3}));
  // A second pass accumulates into .grad.
  backward(sum(mul(a, b)));
  EXPECT_EQ(a.grad().to_vector(), (std::vector<double>{10, 14, 18}));
}

TEST(Autograd, GraphIsFreedUnlessRetained) {
  Tensor a = leaf({1, 2});
  Tensor loss = sum(mul(a, a));
  backward(loss, Tensor(), /*retain_graph=*/true);
  backward(loss);   // allowed: the first pass kept the graph
  EXPECT_EQ(a.grad().to_vector(), (std::vector<double>{4, 8}));
  try {
    backward(loss);
    FAIL() << "a third pass through a freed graph must throw";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("test_mul"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("second time"), std::string::npos) << e.what();
  }
}

TEST(Autograd, NoGradGuardRecordsNothing) {
  Tensor a = leaf({1, 2});
  {
    autograd::NoGradGuard guard;
    Tensor y = mul(a, a);
    EXPECT_FALSE(y.requires_grad());
    EXPECT_EQ(y.grad_fn(), nullptr);
  }
  EXPECT_TRUE(mul(a, a).requires_grad());
  EXPECT_TRUE(autograd::GradMode::is_enabled());
}

TEST(Autograd, GradModeIsPerThread) {
  autograd::NoGradGuard guard;
  bool other_thread_enabled = false;
  std::thread t([&] { other_thread_enabled = autograd::GradMode::is_enabled(); });
  t.join();
  EXPECT_TRUE(other_thread_enabled);
  EXPECT_FALSE(autograd::GradMode::is_enabled());
}

TEST(Autograd, EngineChecksGradientCountAndShape) {
  Tensor a = leaf({1, 2});
  Tensor y = autograd::apply<WrongCount>({a})[0];
  try {
    backward(sum(y));
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("wrong_count returned 2 gradients for 1 inputs"), std::string::npos)
        << e.what();
  }
  Tensor z = autograd::apply<WrongShape>({a})[0];
  try {
    backward(sum(z));
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("wrong_shape"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[7]"), std::string::npos) << e.what();
  }
}

TEST(Autograd, RootMustBeScalarOrGetAGradient) {
  Tensor a = leaf({1, 2});
  Tensor y = mul(a, a);
  EXPECT_THROW(backward(y), InvalidArgument);
  backward(y, Tensor::from_values({1, 10}, {2}, DType::Float64));
  EXPECT_EQ(a.grad().to_vector(), (std::vector<double>{2, 40}));
  Tensor c = Tensor::from_values({1}, {1}, DType::Float64);
  EXPECT_THROW(backward(c), InvalidArgument);   // nothing requires grad
}

TEST(Autograd, IdentityForwardDoesNotRewriteTheInputsHistory) {
  Tensor a = leaf({3, 4});
  Tensor y = autograd::apply<Identity>({a})[0];
  EXPECT_TRUE(a.is_leaf());       // a keeps being a leaf
  EXPECT_FALSE(y.is_leaf());
  EXPECT_EQ(y.storage(), a.storage());
  backward(sum(mul(y, y)));
  EXPECT_EQ(a.grad().to_vector(), (std::vector<double>{6, 8}));
}

TEST(Autograd, HooksOnLeavesAndNonLeaves) {
  Tensor a = leaf({1, 2});
  Tensor y = mul(a, a);
  std::vector<double> seen_y;
  autograd::register_hook(y, [&](const Tensor& g) {
    seen_y = g.to_vector();
    return kernels::scale(g, 10.0);   // replaces the gradient flowing on
  });
  int post_calls = 0;
  std::vector<double> grad_in_post;
  a.register_post_accumulate_hook([&](Tensor& t) {
    ++post_calls;
    grad_in_post = t.grad().to_vector();
  });
  backward(sum(y));
  EXPECT_EQ(seen_y, (std::vector<double>{1, 1}));
  EXPECT_EQ(a.grad().to_vector(), (std::vector<double>{20, 40}));
  EXPECT_EQ(post_calls, 1);
  EXPECT_EQ(grad_in_post, (std::vector<double>{20, 40}));
}

TEST(Autograd, GradReturnsGradientsWithoutTouchingDotGrad) {
  Tensor a = leaf({1, 2});
  Tensor b = leaf({3, 5});
  Tensor m = mul(a, b);
  auto g = autograd::grad({sum(mul(m, m))}, {a, m});
  // d/da sum((ab)^2) = 2 a b^2; d/dm = 2m
  EXPECT_EQ(g[0].to_vector(), (std::vector<double>{18, 100}));
  EXPECT_EQ(g[1].to_vector(), (std::vector<double>{6, 20}));
  EXPECT_FALSE(a.grad().defined());
  EXPECT_FALSE(b.grad().defined());
}

TEST(Autograd, ReadyOrderIsReverseCreation) {
  // Two independent branches: backward visits the later-created one first.
  Tensor a = leaf({1});
  Tensor b = leaf({2});
  std::vector<char> order;
  Tensor ya = mul(a, a);
  Tensor yb = mul(b, b);
  autograd::register_hook(ya, [&](const Tensor&) { order.push_back('a'); return Tensor(); });
  autograd::register_hook(yb, [&](const Tensor&) { order.push_back('b'); return Tensor(); });
  backward(add(sum(ya), sum(yb)));
  EXPECT_EQ(order, (std::vector<char>{'b', 'a'}));
}

TEST(Checkpoint, GradientsBitwiseEqualToPlainRun) {
  auto block = [](const TensorList& in) -> TensorList {
    Tensor h = mul(in[0], in[1]);
    return {mul(h, add(h, in[0]))};
  };
  auto make = [] {
    Tensor x = Tensor::from_values({0.3, -1.7, 2.9}, {3}, DType::Float64);
    Tensor w = Tensor::from_values({1.1, 0.2, -0.7}, {3}, DType::Float64);
    x.set_requires_grad();
    w.set_requires_grad();
    return std::make_pair(x, w);
  };
  auto [x1, w1] = make();
  backward(sum(block({x1, w1})[0]));
  auto [x2, w2] = make();
  Tensor out = autograd::checkpoint(block, {x2, w2})[0];
  EXPECT_TRUE(out.requires_grad());
  backward(sum(out));
  EXPECT_TRUE(bitwise_equal(x1.grad(), x2.grad()));
  EXPECT_TRUE(bitwise_equal(w1.grad(), w2.grad()));
}

TEST(Checkpoint, ReplaysGeneratorDraws) {
  random::Generator gen(11);
  std::vector<std::uint64_t> seeds;
  auto block = [&](const TensorList& in) -> TensorList {
    seeds.push_back(gen.next_seed());   // a dropout would draw its mask from this seed
    return {mul(in[0], in[0])};
  };
  Tensor x = leaf({1, 2});
  Tensor y = autograd::checkpoint(block, {x}, {&gen})[0];
  const auto counter_after_forward = gen.counter();
  backward(sum(y));
  ASSERT_EQ(seeds.size(), 2u);
  EXPECT_EQ(seeds[0], seeds[1]);                     // recomputation drew the same seed
  EXPECT_EQ(gen.counter(), counter_after_forward);   // and left the generator where it was
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{2, 4}));
}

namespace {
// A test annotation: a label; summing two different labels is refused.
struct Label final : Annotation {
  explicit Label(std::string l) : label(std::move(l)) {}
  std::string label;
  std::string str() const override { return label; }
  AnnotationPtr combine(const AnnotationPtr& other) const override {
    auto* same = dynamic_cast<const Label*>(other.get());
    if (other && (same == nullptr || same->label != label)) throw InvalidArgument("labels " + label + " and " + other->str() + " differ");
    return std::make_shared<Label>(label);
  }
};
}  // namespace

TEST(Autograd, AnnotationsFlowFromIncomingToReturnedGradients) {
  Tensor a = leaf({1, 2});
  Tensor b = leaf({3, 4});
  Tensor y = add(mul(a, b), a);            // a receives two gradients: summed, labels combined
  Tensor g = Tensor::ones({2}, DType::Float64);
  g.set_annotation(std::make_shared<Label>("partial"));
  autograd::backward({y}, {g});
  ASSERT_TRUE(a.grad().annotation());
  EXPECT_EQ(a.grad().annotation()->str(), "partial");
  ASSERT_TRUE(b.grad().annotation());
  EXPECT_EQ(b.grad().annotation()->str(), "partial");
  EXPECT_EQ(a.grad().to_vector(), (std::vector<double>{4, 5}));
}

TEST(Autograd, IncompatibleAnnotationsMeetingIsAnError) {
  Tensor a = leaf({1, 2});
  Tensor y1 = mul(a, a);
  Tensor y2 = mul(a, a);
  Tensor g1 = Tensor::ones({2}, DType::Float64);
  Tensor g2 = Tensor::ones({2}, DType::Float64);
  g1.set_annotation(std::make_shared<Label>("x"));
  g2.set_annotation(std::make_shared<Label>("y"));
  EXPECT_THROW(autograd::backward({y1, y2}, {g1, g2}), InvalidArgument);
}

TEST(Checkpoint, WithoutAnInputThatRequiresGradCapturedParametersStillGetGradients) {
  Tensor w = leaf({2, 3});
  Tensor x = Tensor::from_values({5, 7}, {2}, DType::Float64);   // data: no grad
  Tensor y = autograd::checkpoint([&](const TensorList& in) { return TensorList{mul(w, in[0])}; }, {x})[0];
  ASSERT_TRUE(y.requires_grad());
  backward(sum(y));
  EXPECT_EQ(w.grad().to_vector(), (std::vector<double>{5, 7}));
}

// ---- version counters: a saved tensor changed in place before backward -----------------------------

namespace {

// y = a @ b for 2-D a: [m, k], b: [k, n]; saves both, like the real matmul.
struct MatMul final : Function {
  std::string_view name() const override { return "test_matmul"; }
  TensorList forward(const TensorList& x) override {
    save_for_backward({x[0], x[1]});
    return {kernels::matmul(x[0], x[1])};
  }
  TensorList backward(const TensorList& g) override {
    const auto& s = saved();
    return {needs_input_grad(0) ? kernels::matmul(g[0], s[1].transpose(0, 1)) : Tensor(),
            needs_input_grad(1) ? kernels::matmul(s[0].transpose(0, 1), g[0]) : Tensor()};
  }
};
Tensor matmul(const Tensor& a, const Tensor& b) { return autograd::apply<MatMul>({a, b})[0]; }

// y = a^T as a view of a's storage (the output shares the input's data and so its version).
struct Transpose final : Function {
  std::string_view name() const override { return "test_transpose"; }
  TensorList forward(const TensorList& x) override { return {x[0].transpose(0, 1)}; }
  TensorList backward(const TensorList& g) override { return {g[0].transpose(0, 1).contiguous()}; }
};

// x: [2, 3] = [[1, 2, 3], [4, 5, 6]]; w: [3, 2] = [[1, 0], [0, 1], [1, 1]], named like a GPT weight.
// loss = sum(x @ w): dx rows = row sums of w = [1, 1, 2]; dw rows = column sums of x = 5, 7, 9.
struct MatmulCase {
  Tensor x = Tensor::from_values({1, 2, 3, 4, 5, 6}, {2, 3}, DType::Float64);
  Tensor w = Tensor::from_values({1, 0, 0, 1, 1, 1}, {3, 2}, DType::Float64);
  MatmulCase() {
    x.set_requires_grad();
    w.set_requires_grad().set_name("h.0.attn.c_attn.weight");
  }
  Tensor loss() const { return sum(matmul(x, w)); }
  void expect_gradients(double times) const {
    EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{times, times, 2 * times, times, times, 2 * times}));
    EXPECT_EQ(w.grad().to_vector(), (std::vector<double>{5 * times, 5 * times, 7 * times, 7 * times, 9 * times,
                                                         9 * times}));
  }
};

// Runs backward(loss) expecting the version error; returns its message.
std::string changed_in_place_error(const Tensor& loss) {
  try {
    backward(loss);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  ADD_FAILURE() << "backward through a tensor changed in place after forward must throw";
  return {};
}

void expect_contains(const std::string& message, const std::string& part) {
  EXPECT_NE(message.find(part), std::string::npos) << "missing \"" << part << "\" in: " << message;
}

}  // namespace

TEST(VersionCounter, UnchangedSavedTensorsBackpropagate) {
  MatmulCase c;
  backward(c.loss());
  c.expect_gradients(1);
}

TEST(VersionCounter, WeightCopiedIntoAfterForwardIsRefusedNamingOpTensorAndVersions) {
  MatmulCase c;
  ASSERT_EQ(c.w.version(), 0u);
  Tensor loss = c.loss();
  // What a checkpoint load does: copy new values into the leaf's storage through a detached handle.
  c.w.detach().copy_from(Tensor::zeros({3, 2}, DType::Float64));
  const std::string message = changed_in_place_error(loss);
  expect_contains(message, "test_matmul: saved tensor 1 of 2 ('h.0.attn.c_attn.weight', float64[3, 2])");
  expect_contains(message, "saved at version 0, now 1");
  expect_contains(message, "changed in place after the forward that saved it");
  expect_contains(message, "optimizer step between forward and backward");
}

TEST(VersionCounter, WriteThroughAViewOfASavedTensorIsRefused) {
  MatmulCase c;
  Tensor loss = c.loss();
  c.w.narrow(0, 2, 1).fill_(0.5);   // one row of w, through a view
  const std::string message = changed_in_place_error(loss);
  expect_contains(message, "'h.0.attn.c_attn.weight'");
  expect_contains(message, "saved at version 0, now 1");
}

TEST(VersionCounter, UnnamedInputIsDescribedByShape) {
  MatmulCase c;
  Tensor loss = c.loss();
  kernels::axpy_(c.x, 1.0, c.x.detach().clone());   // x += x: x has no name
  const std::string message = changed_in_place_error(loss);
  expect_contains(message, "test_matmul: saved tensor 0 of 2 (float64[2, 3], unnamed)");
}

TEST(VersionCounter, SavedViewOfAParameterNamesTheParameter) {
  // The op saves w^T, a view made by another op: the saved handle has no name of its own, so the
  // message names the leaf whose storage it shares (as for a tied embedding used transposed).
  Tensor x = Tensor::from_values({1, 2, 3, 4, 5, 6}, {2, 3}, DType::Float64);
  Tensor wt = Tensor::from_values({1, 0, 1, 0, 1, 1}, {2, 3}, DType::Float64);
  wt.set_requires_grad().set_name("wte.weight");
  Tensor loss = sum(matmul(x, autograd::apply<Transpose>({wt})[0]));
  wt.set({0, 0}, 2.0);
  const std::string message = changed_in_place_error(loss);
  expect_contains(message, "test_matmul: saved tensor 1 of 2 (float64[3, 2], a view of 'wte.weight')");
}

TEST(VersionCounter, AccumulatingIntoDotGradInPlaceTripsNothing) {
  MatmulCase c;
  Tensor loss = c.loss();
  backward(loss, Tensor(), /*retain_graph=*/true);   // .grad takes the first gradient's buffer
  const std::uint64_t grad_version = c.w.grad().version();
  backward(loss, Tensor(), /*retain_graph=*/true);   // accumulates into .grad in place
  EXPECT_GT(c.w.grad().version(), grad_version);     // it did write in place...
  backward(loss);                                     // ...and the saved x and w are untouched
  c.expect_gradients(3);
  EXPECT_EQ(c.w.version(), 0u);
  EXPECT_EQ(c.x.version(), 0u);
}

}  // namespace test_autograd
