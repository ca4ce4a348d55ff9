// An FSDP unit's contract (nn/fsdp.hpp), on one parameter of uneven rows over fsdp=2: forward gathers
// exactly the full tensor, gives its bytes back after forward, the regather node refills them before
// the backward that reads them, the gradient leaves as the reduce-scatter of every rank's partial
// gradient (the rows of their sum), the bytes are given back after backward, and with accumulation on
// nothing is reduced until the last micro-batch, which reduces the sum.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/comm/threads.hpp"
#include "meshgrad/nn/fsdp.hpp"
#include "meshgrad/nn/layers.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/kernels.hpp"

namespace meshgrad::nn::test_fsdp_unit {
namespace {

void run_fsdp2(const std::function<void(const dist::DeviceMeshPtr&)>& fn) {
  comm::ThreadsOptions options;
  options.timeout = std::chrono::milliseconds(20000);
  comm::run_ranks(2, [&](const comm::CommunicatorPtr& world) {
    fn(std::make_shared<const dist::DeviceMesh>(world, dist::parse_mesh("fsdp=2")));
  }, options);
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  const std::vector<double> x = a.to_vector(), y = b.to_vector();
  double m = 0;
  for (std::size_t i = 0; i < x.size() && i < y.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

// loss_r = sum(c_r * W * W) with c_r = rank + 1, marked partial over fsdp as a model's loss is: the
// total is 3 sum(W^2), so the full gradient is 6 W and rank r's is its rows of it.
Tensor rank_loss(const Parameter& p, FsdpUnit& unit, const ParallelContext& ctx, bool regather) {
  const double c = 1.0 + ctx.mesh->coordinate("fsdp");
  Tensor y = scale(mul(p.operand(), p.operand()), c);
  if (regather) y = unit.regather_before_backward(y, nullptr);
  return ctx.loss_partial_over_dp(sum(y));
}

TEST(FsdpUnit, GathersGivesBackRegathersAndReduceScattersTheGradient) {
  run_fsdp2([](const dist::DeviceMeshPtr& mesh) {
    const ParallelContextPtr ctx = ParallelContext::on(mesh, ParallelConfig{});
    Parameter p = make_parameter("w", {5, 3}, ctx->replicated(), *ctx, 11, 1.0, 0.0, DType::Float64);
    const int r = mesh->coordinate("fsdp");
    ASSERT_EQ(p.value.size(0), r == 0 ? 3 : 2);   // 5 rows over 2: 3, 2
    const Tensor full = init_normal_piece("w", {5, 3}, dist::piece_layout({5, 3}, *mesh, dist::Placements(3), {0, 0, 0}),
                                          11, 1.0, DType::Float64);
    FsdpUnit unit("u", {&p}, ctx);
    EXPECT_EQ(unit.gathered_bytes(), 0) << "nothing gathered before the first forward";

    unit.begin_forward();
    ASSERT_TRUE(p.gathered.defined());
    EXPECT_TRUE(bitwise_equal(p.gathered, full));
    EXPECT_EQ(unit.gathered_bytes(), 5 * 3 * 8);
    const Tensor loss = rank_loss(p, unit, *ctx, /*regather=*/true);
    unit.end_forward(/*release=*/true);
    EXPECT_FALSE(p.gathered.defined());
    EXPECT_EQ(unit.gathered_bytes(), 0) << "given back after forward although the graph holds the tensor";

    backward(loss);   // the regather node refills the bytes mul's backward reads
    EXPECT_EQ(unit.gathered_bytes(), 0) << "given back after backward";
    const Tensor expected = kernels::scale(full.narrow(0, r == 0 ? 0 : 3, r == 0 ? 3 : 2).contiguous(), 6.0);
    ASSERT_TRUE(p.value.grad().defined());
    EXPECT_EQ(dist::partial_axes(p.value.grad()), 0u) << "complete over fsdp after the reduce-scatter";
    const double err = max_abs_diff(p.value.grad(), expected);
    EXPECT_LT(err, 1e-14) << "the shard's gradient is its rows of 6 W";

    // Two micro-batches: the first reduces nothing, the second reduces the sum of both.
    p.value.zero_grad();
    unit.set_accumulating(true);
    unit.begin_forward();
    const Tensor first = rank_loss(p, unit, *ctx, false);
    unit.end_forward(false);
    backward(first);
    EXPECT_FALSE(p.value.grad().defined()) << "accumulating: no reduce-scatter, no gradient yet";
    unit.set_accumulating(false);
    unit.begin_forward();
    const Tensor second = rank_loss(p, unit, *ctx, false);
    unit.end_forward(false);
    backward(second);
    ASSERT_TRUE(p.value.grad().defined());
    EXPECT_LT(max_abs_diff(p.value.grad(), kernels::scale(expected, 2.0)), 1e-13);
  });
}

// A shard written in place (an optimizer step) is gathered again; an unchanged one is not.
TEST(FsdpUnit, GathersAgainOnlyWhenAShardChanged) {
  run_fsdp2([](const dist::DeviceMeshPtr& mesh) {
    const ParallelContextPtr ctx = ParallelContext::on(mesh, ParallelConfig{});
    Parameter p = make_parameter("b", {4}, ctx->replicated(), *ctx, 0, 0.0, 1.0, DType::Float32);
    FsdpUnit unit("u", {&p}, ctx);
    unit.begin_forward();
    unit.end_forward(false);   // kept
    {
      autograd::NoGradGuard no_grad;
      p.value.detach().fill_(2.0);   // every rank's shard: the full tensor is all 2 now
    }
    unit.begin_forward();
    EXPECT_TRUE(bitwise_equal(p.gathered, Tensor::full({4}, 2.0, DType::Float32)))
        << "a stale gathered copy was used after the shard changed";
    unit.end_forward(true);
  });
}

}  // namespace
}  // namespace meshgrad::nn::test_fsdp_unit
