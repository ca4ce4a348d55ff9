// AdamW: a hand-computed two-step update, decay only on 2-D weights, per-shard state, and the
// refusal of gradients that were never synchronised.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>

#include "meshgrad/comm/threads.hpp"
#include "meshgrad/distributed/placement.hpp"
#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/nn/model.hpp"
#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/parallel.hpp"
#include "meshgrad/tensor/random.hpp"
#include "meshgrad/optim/grad_sync.hpp"
#include "meshgrad/optim/adamw.hpp"

namespace meshgrad::optim::test_adamw {
namespace {

nn::Parameter make_param(const std::string& name, const std::vector<double>& values, const Shape& full_shape,
                         DType dtype, dist::Placements placements = {}, dist::DeviceMeshPtr mesh = nullptr) {
  nn::Parameter p;
  p.name = name;
  p.value = Tensor::from_values(values, {static_cast<std::int64_t>(values.size())}, dtype);
  p.value.set_requires_grad(true);
  p.full_shape = full_shape;
  p.placements = std::move(placements);
  p.mesh = std::move(mesh);
  return p;
}

void set_grad(nn::Parameter& p, const std::vector<double>& g) {
  p.value.set_grad(Tensor::from_values(g, p.value.shape(), p.value.dtype()));
}

// lr 0.1, betas (0.9, 0.95), eps 1e-8, weight decay 0.1.
//
// w.weight (2-D: decayed), w = [1, -2], g1 = [0.5, -1], g2 = [0.1, 0.2].
//   step 1: m = 0.1 g1, v = 0.05 g1^2; bias-corrected m^ = g1, v^ = g1^2, so the step is
//           lr * g1 / (|g1| + eps) = 0.1 * sign(g1) * (1 - 2e-8 / |g1|... ):
//           w1 = 0.99 * 1  - 0.1 * 0.5 / (0.5 + 1e-8)  = 0.890000002
//           w1 = 0.99 * -2 + 0.1 * 1.0 / (1.0 + 1e-8)  = -1.880000001
//   step 2: m = 0.9 m + 0.1 g2, v = 0.95 v + 0.05 g2^2, m^ = m / 0.19, v^ = v / 0.0975,
//           w2 = 0.99 w1 - 0.1 m^ / (sqrt(v^) + eps)  -> 0.7998471188087057, -1.8094936200644078
// b.bias (not decayed), b = [0.3], g1 = [0.5], g2 = [-0.25]:
//           b1 = 0.3 - 0.1 * 0.5 / (0.5 + 1e-8) = 0.200000002, b2 = 0.1731630578758274
// (step 2 values from the same formulas evaluated in double precision by an independent script).
TEST(AdamW, TwoStepsMatchHandComputedUpdate) {
  nn::Parameter w = make_param("w.weight", {1.0, -2.0}, {1, 2}, DType::Float64);
  nn::Parameter b = make_param("b.bias", {0.3}, {1}, DType::Float64);
  AdamW opt({&w, &b}, nullptr, AdamWOptions{0.1, 0.9, 0.95, 1e-8, 0.1});
  set_grad(w, {0.5, -1.0});
  set_grad(b, {0.5});
  opt.step();
  EXPECT_NEAR(w.value.at_flat(0), 0.890000002, 1e-15);
  EXPECT_NEAR(w.value.at_flat(1), -1.880000001, 1e-15);
  EXPECT_NEAR(b.value.at_flat(0), 0.200000002, 1e-15);
  set_grad(w, {0.1, 0.2});
  set_grad(b, {-0.25});
  opt.step();
  EXPECT_NEAR(w.value.at_flat(0), 0.7998471188087057, 1e-14);
  EXPECT_NEAR(w.value.at_flat(1), -1.8094936200644078, 1e-14);
  EXPECT_NEAR(b.value.at_flat(0), 0.1731630578758274, 1e-14);
  EXPECT_EQ(opt.steps(), 2);
  // State: m = 0.9 * 0.1 g1 + 0.1 g2.
  EXPECT_NEAR(opt.exp_avg(0).at_flat(0), 0.09 * 0.5 + 0.1 * 0.1, 1e-15);
  EXPECT_FALSE(w.value.requires_grad() && w.value.grad_fn() != nullptr) << "the update must not record a graph";
}

// The update is split over the rank's cores when a parameter is large (tensor/parallel.hpp): one
// and two threads must give the same bytes for parameters and both moments, over three steps.
TEST(AdamW, LargeParametersUpdateToTheSameBytesOnOneAndTwoThreads) {
  const std::int64_t n = 3 * parallel::kMinElements + 17;   // split, with uneven ranges
  const auto run = [&](int threads) {
    const int before = blas::num_threads();
    blas::set_num_threads(threads);
    nn::Parameter w;
    w.name = "w.weight";
    w.value = random::randn({n / 17, 17}, 5, DType::Float32);
    w.value.set_requires_grad(true);
    w.full_shape = w.value.shape();
    AdamW opt({&w}, nullptr, AdamWOptions{0.01, 0.9, 0.95, 1e-8, 0.1});
    for (std::uint64_t step = 0; step < 3; ++step) {
      w.value.set_grad(random::randn(w.value.shape(), 100 + step, DType::Float32));
      opt.step();
    }
    blas::set_num_threads(before);
    return std::vector<Tensor>{w.value.detach().clone(), opt.exp_avg(0).clone(), opt.exp_avg_sq(0).clone()};
  };
  const std::vector<Tensor> one = run(1), two = run(2);
  for (std::size_t k = 0; k < one.size(); ++k) {
    ASSERT_EQ(one[k].numel(), two[k].numel());
    EXPECT_EQ(std::memcmp(one[k].raw_data(), two[k].raw_data(), static_cast<std::size_t>(one[k].numel()) * sizeof(float)), 0)
        << "tensor " << k << " (parameter, exp_avg, exp_avg_sq) differs between one and two threads";
  }
}

TEST(AdamW, Float32MatchesFloat64WithinRounding) {
  nn::Parameter w32 = make_param("w.weight", {1.0, -2.0, 0.25}, {3, 1}, DType::Float32);
  nn::Parameter w64 = make_param("w.weight", {1.0, -2.0, 0.25}, {3, 1}, DType::Float64);
  AdamW o32({&w32}, nullptr, AdamWOptions{0.01});
  AdamW o64({&w64}, nullptr, AdamWOptions{0.01});
  for (int s = 0; s < 5; ++s) {
    const std::vector<double> g{0.3 - s * 0.1, 1.0 / (s + 1), -0.5};
    set_grad(w32, g);
    set_grad(w64, g);
    o32.step();
    o64.step();
  }
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(w32.value.at_flat(i), w64.value.at_flat(i), 1e-6);
}

TEST(AdamW, DecayOnlyOnTwoDimensionalWeights) {
  nn::Parameter p;
  p.name = "h.0.attn.c_attn.weight";
  p.full_shape = {4, 12};
  EXPECT_TRUE(decays(p));
  p.name = "h.0.ln_1.weight";
  p.full_shape = {4};
  EXPECT_FALSE(decays(p));
  p.name = "h.0.attn.c_attn.bias";
  p.full_shape = {12};
  EXPECT_FALSE(decays(p));
  p.name = "wte.weight";
  p.full_shape = {256, 4};
  EXPECT_TRUE(decays(p));
}

// Expects opt.step() to throw InvalidArgument whose message contains every needle.
void expect_refused(AdamW& opt, const std::vector<std::string>& needles) {
  try {
    opt.step();
    ADD_FAILURE() << "AdamW::step accepted a gradient that was not synchronised";
  } catch (const InvalidArgument& e) {
    for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
}

TEST(AdamW, RefusesGradientPartialOverReplicatedAxis) {
  comm::ThreadsOptions options;
  options.timeout = std::chrono::milliseconds(20000);
  comm::run_ranks(
      2,
      [&](const comm::CommunicatorPtr& world) {
        auto mesh = std::make_shared<const dist::DeviceMesh>(world, std::vector<dist::MeshAxis>{{"dp", 1}, {"tp", 2}});
        const dist::AxisMask tp_bit = dist::AxisMask{1} << mesh->axis_index("tp");
        nn::Parameter ln = make_param("h.0.ln_1.weight", {1.0, 1.0}, {2}, DType::Float32,
                                      {dist::Replicate(), dist::Replicate()}, mesh);
        nn::Parameter fc = make_param("h.0.mlp.c_fc.weight", {0.5, 0.5}, {2, 2}, DType::Float32,
                                      {dist::Replicate(), dist::Shard(1)}, mesh);
        AdamW opt({&fc, &ln}, mesh);
        set_grad(ln, {1.0, 1.0});
        set_grad(fc, {1.0, 1.0});
        dist::set_partial_axes(ln.value.grad(), tp_bit);   // replicated over tp: must have been summed
        dist::set_partial_axes(fc.value.grad(), tp_bit);   // sharded over tp: its local gradient is complete
        expect_refused(opt, {"h.0.ln_1.weight", "'tp'", "GradientSynchronizer"});
        // A refused step changes nothing, not even the parameters checked before the bad one.
        EXPECT_EQ(fc.value.to_vector(), (std::vector<double>{0.5, 0.5}));
        EXPECT_EQ(opt.steps(), 0);
        dist::set_partial_axes(ln.value.grad(), 0);
        opt.step();
        EXPECT_NE(fc.value.to_vector(), (std::vector<double>{0.5, 0.5}));
      },
      options);
}

TEST(AdamW, RefusesGradientNotReducedOverDp) {
  comm::run_ranks(2, [&](const comm::CommunicatorPtr& world) {
    auto mesh = std::make_shared<const dist::DeviceMesh>(world, std::vector<dist::MeshAxis>{{"dp", 2}, {"tp", 1}});
    nn::Parameter w = make_param("w.weight", {1.0}, {1, 1}, DType::Float64, {dist::Replicate(), dist::Replicate()}, mesh);
    AdamW opt({&w}, mesh);
    set_grad(w, {1.0});
    // What backward leaves from a replica's loss (marked partial over dp): no synchroniser ran.
    dist::set_partial_axes(w.value.grad(), dist::axis_bit(mesh->axis_index("dp")));
    expect_refused(opt, {"w.weight", "dp", "GradientSynchronizer::finish"});
    dist::set_partial_axes(w.value.grad(), 0);   // what finish() does
    opt.step();
    EXPECT_EQ(opt.steps(), 1);
  });
}

TEST(AdamW, RefusesPartialGradientWithoutMesh) {
  nn::Parameter w = make_param("w.weight", {1.0}, {1, 1}, DType::Float64);
  AdamW opt({&w}, nullptr);
  set_grad(w, {1.0});
  dist::set_partial_axes(w.value.grad(), 1);
  expect_refused(opt, {"w.weight", "partial"});
}

TEST(AdamW, ZeroGradAndSkipsParametersWithoutGradient) {
  nn::Parameter w = make_param("w.weight", {1.0}, {1, 1}, DType::Float64);
  nn::Parameter b = make_param("b.bias", {1.0}, {1}, DType::Float64);
  AdamW opt({&w, &b}, nullptr, AdamWOptions{0.1});
  set_grad(w, {1.0});
  opt.step();
  EXPECT_EQ(b.value.at_flat(0), 1.0);   // no gradient: untouched (and no decay)
  EXPECT_NE(w.value.at_flat(0), 1.0);
  opt.zero_grad();
  EXPECT_FALSE(w.value.grad().defined());
}

// A step between a forward and its backward (the gradients of the previous step are still set, as
// when zero_grad is forgotten) updates parameters that the forward saved: the backward must refuse
// instead of computing gradients from values the forward never saw, and name the parameter.
TEST(AdamW, StepBetweenForwardAndBackwardIsRefusedNamingTheParameter) {
  comm::run_ranks(1, [&](const comm::CommunicatorPtr& world) {
    auto mesh = std::make_shared<const dist::DeviceMesh>(world, std::vector<dist::MeshAxis>{{"dp", 1}, {"tp", 1}});
    nn::ModelConfig config;
    config.layers = 1;
    config.hidden = 8;
    config.heads = 2;
    config.vocab = 11;
    config.seq = 4;
    config.batch = 2;
    config.dtype = DType::Float64;
    auto model = nn::make_model(config, nn::ParallelConfig{}, mesh, 3);
    const std::vector<nn::Parameter*> params = model->parameters();
    GradientSynchronizer sync(params, mesh);
    AdamW opt(params, mesh);
    const nn::Batch batch{random::randint({2, 4}, 1, 11), random::randint({2, 4}, 2, 11)};

    // The right order works: forward, backward, step.
    meshgrad::backward(model->loss(batch, 8));
    sync.finish();
    opt.step();

    // Forward, step, backward: refused.
    Tensor loss = model->loss(batch, 8);
    opt.step();
    std::string message;
    try {
      meshgrad::backward(loss);
      ADD_FAILURE() << "backward after an optimizer step that changed saved parameters must throw";
    } catch (const InvalidArgument& e) {
      message = e.what();
    }
    EXPECT_NE(message.find("was saved at version"), std::string::npos) << message;
    EXPECT_NE(message.find("changed in place after the forward that saved it"), std::string::npos) << message;
    bool names_a_parameter = false;
    for (const nn::Parameter* p : params) {
      names_a_parameter = names_a_parameter || message.find("'" + p->name + "'") != std::string::npos;
    }
    EXPECT_TRUE(names_a_parameter) << message;
  });
}

}  // namespace
}  // namespace meshgrad::optim::test_adamw