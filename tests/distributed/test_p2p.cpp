// Point to point in the graph (distributed/p2p.hpp): a function split over two ranks by send and
// recv has exactly the single-rank function's gradients (the transfers are identities: bitwise,
// and within 1e-7 of central differences in float64, the tolerance dist_test_util.hpp explains);
// the partial axes of a gradient travel with it; and bad transfers fail naming what was wrong
// instead of hanging.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>

#include "dist_test_util.hpp"
#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/distributed/p2p.hpp"
#include "meshgrad/distributed/placement.hpp"
#include "meshgrad/ops/ops.hpp"

namespace meshgrad::dist::test_p2p {
namespace {

using testing::global_randn;
using testing::run_on_mesh;

const Shape kShape{3, 4};

// Stage 0: y = tanh(x * w0); stage 1: loss = sum(tanh(y) * w1 * c). One rank: both.
Tensor stage0(const Tensor& x, const Tensor& w0) { return tanh(mul(x, w0)); }
Tensor stage1(const Tensor& y, const Tensor& w1, const Tensor& c) { return sum(mul(mul(tanh(y), w1), c)); }

TEST(P2P, AFunctionSplitOverTwoRanksHasTheSingleRankGradientsBitwise) {
  const Tensor x = global_randn(kShape, 1), c = global_randn(kShape, 2);
  const Tensor w0_init = global_randn(kShape, 3), w1_init = global_randn(kShape, 4);
  // The reference: one graph on one rank.
  Tensor w0 = w0_init.clone().set_requires_grad(true), w1 = w1_init.clone().set_requires_grad(true);
  backward(stage1(stage0(x, w0), w1, c));
  const Tensor ref0 = w0.grad(), ref1 = w1.grad();
  // Central differences of the whole function, float64.
  const Tensor fd0 = testing::central_differences(
      [&](const Tensor& w) { return stage1(stage0(x, w), w1_init, c).item(); }, w0_init);
  EXPECT_LT(testing::max_abs_diff(ref0, fd0), 1e-7);

  Tensor got0, got1;
  run_on_mesh(2, [&](const DeviceMeshPtr& mesh) {
    const ProcessGroup& g = mesh->group("pp");
    auto queue = std::make_shared<SendQueue>();
    if (g.rank() == 0) {
      Tensor w = w0_init.clone().set_requires_grad(true);
      const Tensor token = send(stage0(x, w), g, 1, tags_for(0), queue);
      EXPECT_TRUE(token.requires_grad());
      backward(token);   // receives y's gradient from rank 1
      got0 = w.grad();
    } else {
      Tensor w = w1_init.clone().set_requires_grad(true);
      const Tensor y = recv(kShape, DType::Float64, g, 0, tags_for(0), queue, /*requires_grad=*/true);
      backward(stage1(y, w, c));   // sends y's gradient back to rank 0
      got1 = w.grad();
    }
    queue->wait_all();
  }, {{"pp", 2}});
  EXPECT_TRUE(bitwise_equal(got0, ref0));
  EXPECT_TRUE(bitwise_equal(got1, ref1));
}

TEST(P2P, TheGradientKeepsItsPartialAxesAcrossTheTransfer) {
  AxisMask seen = 0;
  run_on_mesh(2, [&](const DeviceMeshPtr& mesh) {
    const ProcessGroup& g = mesh->group("pp");
    auto queue = std::make_shared<SendQueue>();
    if (g.rank() == 0) {
      Tensor w = global_randn(kShape, 5).set_requires_grad(true);
      // What the gradient of w looks like when it reaches it: partial over axis 0 ("dp").
      Tensor probe = mul(w, global_randn(kShape, 6));
      backward(send(probe, g, 1, tags_for(3), queue));
      seen = partial_axes(w.grad());
    } else {
      const Tensor y = recv(kShape, DType::Float64, g, 0, tags_for(3), queue, true);
      backward(sum(mark_partial_grad(y, axis_bit(0))));
    }
    queue->wait_all();
  }, {{"dp", 1}, {"pp", 2}});
  EXPECT_EQ(seen, axis_bit(0));
}

std::string error_of(const std::function<void(const DeviceMeshPtr&)>& fn, int timeout_ms = 20000) {
  try {
    comm::ThreadsOptions options;
    options.timeout = std::chrono::milliseconds(timeout_ms);
    comm::run_ranks(2, [&](const comm::CommunicatorPtr& world) {
      fn(std::make_shared<const DeviceMesh>(world, std::vector<MeshAxis>{{"pp", 2}}));
    }, options);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(P2P, ASendToItselfOrOutsideTheGroupIsRefusedNamingThePeer) {
  const std::string self = error_of([](const DeviceMeshPtr& mesh) {
    const ProcessGroup& g = mesh->group("pp");
    send_async(global_randn(kShape, 1), g, g.rank(), 0).wait();
  });
  EXPECT_NE(self.find("is not another rank of the group"), std::string::npos) << self;
  const std::string outside = error_of([](const DeviceMeshPtr& mesh) {
    recv(kShape, DType::Float64, mesh->group("pp"), 5, 0);
  });
  EXPECT_NE(outside.find("peer 5"), std::string::npos) << outside;
}

TEST(P2P, ASizeMismatchFailsInsteadOfReadingGarbage) {
  const std::string msg = error_of([](const DeviceMeshPtr& mesh) {
    const ProcessGroup& g = mesh->group("pp");
    if (g.rank() == 0) {
      send_async(global_randn({2, 3}, 1), g, 1, 7).wait();
    } else {
      recv({2, 4}, DType::Float64, g, 0, 7);
    }
  }, 3000);
  EXPECT_NE(msg, "") << "a 6-element send matched an 8-element receive";
}

TEST(P2P, AReceiveWhoseSenderNeverSendsFailsWithinTheDeadlineNamingTheRank) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string msg = error_of([](const DeviceMeshPtr& mesh) {
    const ProcessGroup& g = mesh->group("pp");
    if (g.rank() == 1) recv(kShape, DType::Float64, g, 0, tags_for(0).forward);   // rank 0 is gone
  }, 500);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(msg, "");
  EXPECT_NE(msg.find("rank"), std::string::npos) << msg;
  EXPECT_LT(seconds, 10.0) << msg;
}

// Review-3 section 6 #13: micro-batch 16000 used to get tag 32000, the tied weight's. No
// micro-batch may reach the reserved tags, and the two directions of one micro-batch differ.
TEST(P2P, MicroBatchTagsNeverReachTheReservedTags) {
  for (int micro = 0; micro < 4 * kMicroBatchTagWindow; ++micro) {
    const P2PTags tags = tags_for(micro);
    ASSERT_GE(tags.forward, 0) << "micro-batch " << micro;
    ASSERT_LT(tags.forward, kFirstReservedTag) << "micro-batch " << micro;
    ASSERT_LT(tags.backward, kFirstReservedTag) << "micro-batch " << micro;
    ASSERT_NE(tags.forward, tags.backward) << "micro-batch " << micro;
  }
  EXPECT_NE(tags_for(0).forward, tags_for(1).forward);
}

}  // namespace
}  // namespace meshgrad::dist::test_p2p
