// GradientSynchronizer on 2-D meshes (rank threads): after finish() every gradient is the sum over
// dp of the per-rank gradients (and over tp when it was marked partial there), the reductions are
// launched from hooks during backward, and nothing is communicated when there is nothing to reduce.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "meshgrad/autograd/checkpoint.hpp"
#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/comm/threads.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/placement.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/optim/grad_sync.hpp"

namespace meshgrad::optim::test_grad_sync {
namespace {

// Runs fn(mesh) on dp * tp rank threads over the mesh "dp=..,tp=.." with a short deadline, so a
// mismatched collective fails the test in seconds instead of hanging it.
void run_mesh(int dp, int tp, const std::function<void(const dist::DeviceMeshPtr&)>& fn) {
  comm::ThreadsOptions options;
  options.timeout = std::chrono::milliseconds(20000);
  comm::run_ranks(
      dp * tp,
      [&](const comm::CommunicatorPtr& world) {
        fn(std::make_shared<const dist::DeviceMesh>(world, std::vector<dist::MeshAxis>{{"dp", dp}, {"tp", tp}}));
      },
      options);
}

// A parameter on the (dp, tp) mesh, replicated unless tp_placement says otherwise.
nn::Parameter make_param(const std::string& name, const Shape& shape, const dist::DeviceMeshPtr& mesh,
                         dist::Placement tp_placement = dist::Replicate()) {
  nn::Parameter p;
  p.name = name;
  p.value = Tensor::zeros(shape, DType::Float64);
  p.value.set_requires_grad(true);
  p.full_shape = shape;
  p.mesh = mesh;
  p.placements = {dist::Replicate(), tp_placement};
  return p;
}

// Each dp replica's loss is its share of the global loss: partial over dp (the models mark theirs
// so too: ParallelContext::loss_partial_over_dp), which is what makes the synchroniser reduce.
Tensor replica_loss(const Tensor& loss, const dist::DeviceMeshPtr& mesh) {
  return dist::mark_partial_grad(loss, mesh->axis_size("dp") > 1 ? dist::axis_bit(mesh->axis_index("dp")) : 0);
}

// A per-rank input that differs by world rank and element: x[i] = 10 * rank + i + 1.
Tensor rank_values(int rank, std::int64_t n) {
  std::vector<double> v;
  for (std::int64_t i = 0; i < n; ++i) v.push_back(10.0 * rank + static_cast<double>(i) + 1.0);
  return Tensor::from_values(v, {n}, DType::Float64);
}

// Sum of rank_values over the given world ranks.
std::vector<double> summed(const std::vector<int>& ranks, std::int64_t n) {
  std::vector<double> out(static_cast<std::size_t>(n), 0.0);
  for (int r : ranks) {
    const auto v = rank_values(r, n).to_vector();
    for (std::size_t i = 0; i < out.size(); ++i) out[i] += v[i];
  }
  return out;
}

// The world ranks of this rank's group along an axis.
std::vector<int> group_ranks(const dist::DeviceMesh& mesh, const std::string& axis) {
  std::vector<int> ranks;
  const int a = mesh.axis_index(axis);
  std::vector<int> coords = mesh.coordinates();
  for (int i = 0; i < mesh.axis_size(a); ++i) {
    coords[static_cast<std::size_t>(a)] = i;
    ranks.push_back(mesh.rank_of(coords));
  }
  return ranks;
}

class GradSyncMesh : public ::testing::TestWithParam<int> {};   // param: tp size (dp = 2)

TEST_P(GradSyncMesh, SumsOverDpDuringBackward) {
  const int tp = GetParam();
  run_mesh(2, tp, [&](const dist::DeviceMeshPtr& mesh) {
    nn::Parameter a = make_param("a.weight", {3}, mesh);
    nn::Parameter b = make_param("b.bias", {2}, mesh);
    GradientSynchronizer sync({&a, &b}, mesh);
    dist::CommCounter counter;
    dist::CountingScope counting(counter);
    for (int step = 0; step < 2; ++step) {   // twice: the synchroniser re-arms after finish()
      a.value.zero_grad();
      b.value.zero_grad();
      // loss = sum(a * x_r) + sum(b * 2 x_r): d/da = x_r, d/db = 2 x_r on world rank r.
      const Tensor loss = add(sum(mul(a.value, rank_values(mesh->rank(), 3))),
                              sum(mul(b.value, scale(rank_values(mesh->rank(), 2), 2.0))));
      counter.clear();
      backward(replica_loss(loss, mesh));
      // Both gradients share one bucket, all-reduced in place by the hook that filled it, inside backward.
      EXPECT_EQ(sync.buckets().size(), 1u);
      EXPECT_EQ(sync.launched(), 1);
      EXPECT_EQ(counter.count(dist::Phase::Backward, "all_reduce", "dp"), 1);
      EXPECT_EQ(counter.records().size(), 1u);
      sync.finish();
      EXPECT_EQ(counter.records().size(), 1u);   // finish only waits
      const auto dp_ranks = group_ranks(*mesh, "dp");
      EXPECT_EQ(a.value.grad().to_vector(), summed(dp_ranks, 3));
      auto expect_b = summed(dp_ranks, 2);
      for (double& x : expect_b) x *= 2;
      EXPECT_EQ(b.value.grad().to_vector(), expect_b);
      EXPECT_EQ(dist::partial_axes(a.value.grad()), 0u);
      EXPECT_EQ(a.value.grad().annotation(), nullptr) << "complete has one encoding: no annotation";
    }
  });
}

TEST_P(GradSyncMesh, ReducesPartialOverTpThenDp) {
  const int tp = GetParam();
  run_mesh(2, tp, [&](const dist::DeviceMeshPtr& mesh) {
    const dist::AxisMask tp_bit = dist::AxisMask{1} << mesh->axis_index("tp");
    // ln: replicated over tp but used on tp-sharded data -> its gradient is partial over tp.
    nn::Parameter ln = make_param("h.0.ln_1.weight", {4}, mesh);
    // w: this rank's tp shard; its local gradient is complete over tp, partial only over dp.
    nn::Parameter w = make_param("h.0.mlp.c_fc.weight", {3}, mesh, dist::Shard(0));
    GradientSynchronizer sync({&ln, &w}, mesh);
    dist::CommCounter counter;
    dist::CountingScope counting(counter);
    const Tensor loss = add(sum(mul(dist::mark_partial_grad(ln.value, tp_bit), rank_values(mesh->rank(), 4))),
                            sum(mul(w.value, rank_values(mesh->rank(), 3))));
    backward(replica_loss(loss, mesh));
    if (tp > 1) {
      EXPECT_EQ(dist::partial_axes(ln.value.grad()) & tp_bit, tp_bit) << "the test needs a gradient marked partial over tp";
    }
    sync.finish();
    // ln: summed over the whole mesh (tp then dp); w: over dp only.
    std::vector<int> all;
    for (int r = 0; r < mesh->size(); ++r) all.push_back(r);
    EXPECT_EQ(ln.value.grad().to_vector(), summed(tp > 1 ? all : group_ranks(*mesh, "dp"), 4));
    EXPECT_EQ(w.value.grad().to_vector(), summed(group_ranks(*mesh, "dp"), 3));
    EXPECT_EQ(dist::partial_axes(ln.value.grad()), 0u);
    // Every reduction ran during backward: the tp one for ln (when tp > 1) and one dp bucket.
    EXPECT_EQ(counter.count(dist::Phase::Backward, "all_reduce", "tp"), tp > 1 ? 1 : 0);
    EXPECT_EQ(counter.count(dist::Phase::Backward, "all_reduce", "dp"), 1);
    EXPECT_EQ(static_cast<int>(counter.records().size()), tp > 1 ? 2 : 1);
  });
}

INSTANTIATE_TEST_SUITE_P(DpTimesTp, GradSyncMesh, ::testing::Values(1, 2),
                         [](const auto& info) { return "dp2_tp" + std::to_string(info.param); });

TEST(GradSync, NothingCommunicatedWithOneReplica) {
  run_mesh(1, 2, [&](const dist::DeviceMeshPtr& mesh) {
    nn::Parameter w = make_param("w.weight", {3}, mesh, dist::Shard(0));
    GradientSynchronizer sync({&w}, mesh);
    dist::CommCounter counter;
    dist::CountingScope counting(counter);
    backward(sum(mul(w.value, rank_values(mesh->rank(), 3))));
    sync.finish();
    EXPECT_EQ(sync.launched(), 0);
    EXPECT_TRUE(counter.records().empty());
    EXPECT_EQ(w.value.grad().to_vector(), rank_values(mesh->rank(), 3).to_vector());   // untouched values
  });
}

TEST(GradSync, MissingGradientIsAnErrorNamingTheParameter) {
  run_mesh(2, 1, [&](const dist::DeviceMeshPtr& mesh) {
    nn::Parameter used = make_param("used.weight", {2}, mesh);
    nn::Parameter unused = make_param("unused.bias", {2}, mesh);
    GradientSynchronizer sync({&used, &unused}, mesh);
    backward(replica_loss(sum(used.value), mesh));
    try {
      sync.finish();
      ADD_FAILURE() << "finish() accepted a parameter without gradient";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("unused.bias"), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find("used.weight"), std::string::npos) << e.what();
    }
    // Nothing was half-synchronised: the used parameter keeps its local gradient.
    EXPECT_EQ(used.value.grad().to_vector(), (std::vector<double>{1.0, 1.0}));
  });
}

// Buckets of bucket_bytes: gradients are reduced in place, one all-reduce per bucket, each launched
// by the hook that completes it; the results equal the per-parameter sums.
TEST(GradSync, BucketsOfConfiguredSizeReduceInPlace) {
  run_mesh(2, 1, [&](const dist::DeviceMeshPtr& mesh) {
    std::vector<nn::Parameter> params;
    for (int k = 0; k < 5; ++k) params.push_back(make_param(fmt::format("p{}.weight", k), {3}, mesh));
    std::vector<nn::Parameter*> ptrs;
    for (auto& p : params) ptrs.push_back(&p);
    GradientSynchronizer sync(ptrs, mesh, {.bucket_bytes = 2 * 3 * 8});   // two float64 [3] per bucket
    ASSERT_EQ(sync.buckets().size(), 3u);
    EXPECT_EQ(sync.buckets()[0], (std::vector<std::string>{"p4.weight", "p3.weight"}));   // backward order
    dist::CommCounter counter;
    dist::CountingScope counting(counter);
    Tensor loss = Tensor::scalar(0.0, DType::Float64);
    for (int k = 0; k < 5; ++k) loss = add(loss, sum(mul(params[static_cast<std::size_t>(k)].value, scale(rank_values(mesh->rank(), 3), k + 1.0))));
    backward(replica_loss(loss, mesh));
    EXPECT_EQ(counter.count(dist::Phase::Backward, "all_reduce", "dp"), 3);
    sync.finish();
    const auto dp_ranks = group_ranks(*mesh, "dp");
    for (int k = 0; k < 5; ++k) {
      auto expected = summed(dp_ranks, 3);
      for (double& x : expected) x *= k + 1.0;
      EXPECT_EQ(params[static_cast<std::size_t>(k)].value.grad().to_vector(), expected) << k;
    }
  });
}

// A dp replica's gradient that is not marked partial over dp means the loss was not marked: the
// synchroniser refuses instead of silently skipping the reduction.
TEST(GradSync, UnmarkedLossWithDataParallelReplicasIsRefused) {
  EXPECT_THROW(run_mesh(2, 1,
                        [&](const dist::DeviceMeshPtr& mesh) {
                          nn::Parameter w = make_param("w.weight", {2}, mesh);
                          GradientSynchronizer sync({&w}, mesh);
                          backward(sum(w.value));
                        }),
               InvalidArgument);
}

TEST(GradSync, DestroyedSynchronizerDisarmsItsHooks) {
  run_mesh(2, 1, [&](const dist::DeviceMeshPtr& mesh) {
    nn::Parameter w = make_param("w.weight", {2}, mesh);
    { GradientSynchronizer sync({&w}, mesh); }
    dist::CommCounter counter;
    dist::CountingScope counting(counter);
    backward(sum(w.value));
    EXPECT_TRUE(counter.records().empty());
    EXPECT_EQ(w.value.grad().to_vector(), (std::vector<double>{1.0, 1.0}));
  });
}

// A parameter used inside two checkpointed regions is accumulated twice in one backward (each
// region's nested backward adds its part): the reduction launched after the first part must be
// finished before the second is added, and the final gradient is the dp sum of both parts.
TEST(GradientSynchronizer, ParameterAccumulatedTwiceInOneBackward) {
  run_mesh(2, 1, [](const dist::DeviceMeshPtr& mesh) {
    nn::Parameter w = make_param("w", {3}, mesh);
    w.value.detach().copy_from(Tensor::from_values({0.5, -1.0, 2.0}, {3}, DType::Float64));
    GradientSynchronizer sync({&w}, mesh);
    const double r = mesh->rank() + 1;   // rank-dependent data: dp ranks see different rows
    // x requires grad so each region really is checkpointed (recomputed in its own nested backward).
    Tensor x = Tensor::from_values({1.0 * r, 2.0 * r, 3.0 * r}, {3}, DType::Float64);
    x.set_requires_grad();
    auto region = [&](double factor) {
      return autograd::checkpoint(
          [&, factor](const TensorList& in) { return TensorList{scale(sum(mul(mul(w.value, w.value), in[0])), factor)}; },
          {x})[0];
    };
    backward(replica_loss(add(region(1.0), region(3.0)), mesh));   // d/dw = (1 + 3) * 2 w x
    sync.finish();
    // Sum over ranks r = 1, 2 of 8 w x_r = 8 w (x_1 + x_2) = 8 w * 3 * [1, 2, 3].
    const std::vector<double> expected{8 * 0.5 * 3, 8 * -1.0 * 6, 8 * 2.0 * 9};
    EXPECT_EQ(w.value.grad().to_vector(), expected);
  });
}

// TP-invariant mode's dp sum (GradSyncOptions::order = FixedTree) is the fixed tree (r0 + r1) + (r2 + r3),
// not the rank order ((r0 + r1) + r2) + r3. Per-rank gradients 1e16, 1, -1e16, 1 (float64) tell
// them apart: 1e16 + 1 rounds to 1e16, so the tree gives 1e16 + -1e16 = 0 and the rank order gives
// (1e16 + -1e16) + 1 = 1.
TEST(GradSyncTree, TreeDpAddsTheReplicasInTheFixedTree) {
  const std::vector<double> per_rank{1e16, 1.0, -1e16, 1.0};
  for (const bool tree : {true, false}) {
    SCOPED_TRACE(tree ? "fixed tree" : "rank order");
    std::vector<double> got(4, -7.0);
    run_mesh(4, 1, [&](const dist::DeviceMeshPtr& mesh) {
      nn::Parameter w = make_param("w", {1}, mesh);
      GradientSynchronizer sync({&w}, mesh,
                                {.order = tree ? dist::ReduceOrder::FixedTree : dist::ReduceOrder::RankOrder});
      const double x = per_rank[static_cast<std::size_t>(mesh->coordinate("dp"))];
      backward(replica_loss(sum(mul(w.value, Tensor::from_values({x}, {1}, DType::Float64))), mesh));
      sync.finish();
      got[static_cast<std::size_t>(mesh->rank())] = w.value.grad().to_vector().at(0);
    });
    for (int r = 0; r < 4; ++r) EXPECT_EQ(got[static_cast<std::size_t>(r)], tree ? 0.0 : 1.0) << "rank " << r;
  }
}

// --reduce-dtype bf16: the dp bucket crosses as bf16 (half the bytes of float32), each element the
// float32 sum of the replicas' bf16-rounded gradients, in rank order, rounded once to bf16; the
// gradient the optimizer sees is float32 again. Values chosen so that rounding each replica's
// gradient, the sum, or neither give three different results.
TEST(GradSync, Bf16ReductionHalvesTheBytesAndRoundsOnce) {
  const int dp = 3;
  // Replica r's gradient of element i: 1 + (r + 1) * 2^-9 + i * 2^-12 (not a bf16 value).
  auto local = [](int r, int i) { return 1.0f + (r + 1) * std::ldexp(1.0f, -9) + i * std::ldexp(1.0f, -12); };
  std::vector<std::int64_t> bytes(2, 0);
  std::vector<std::vector<float>> got(2);
  for (const DType wire : {DType::Float32, DType::BFloat16}) {
    const std::size_t w = wire == DType::Float32 ? 0 : 1;
    run_mesh(dp, 1, [&](const dist::DeviceMeshPtr& mesh) {
      nn::Parameter p;
      p.name = "w";
      p.value = Tensor::zeros({4}, DType::Float32);
      p.value.set_requires_grad(true);
      p.full_shape = {4};
      p.mesh = mesh;
      p.placements = {dist::Replicate(), dist::Replicate()};
      GradientSynchronizer sync({&p}, mesh, {.reduce_dtype = wire});
      std::vector<double> x;
      for (int i = 0; i < 4; ++i) x.push_back(local(mesh->rank(), i));
      dist::CommCounter counter;
      {
        dist::CountingScope counting(counter);
        backward(replica_loss(sum(mul(p.value, Tensor::from_values(x, {4}, DType::Float32))), mesh));
      }
      sync.finish();
      ASSERT_EQ(p.value.grad().dtype(), DType::Float32);
      if (mesh->rank() == 0) {
        for (const auto& r : counter.records()) bytes[w] += r.op == "all_reduce" && r.axis == "dp" ? r.bytes : 0;
        const auto g = p.value.grad().to_vector();
        got[w].assign(g.begin(), g.end());
      }
    });
  }
  EXPECT_EQ(bytes[1] * 2, bytes[0]);
  for (int i = 0; i < 4; ++i) {
    float sum32 = 0, sum_of_rounded = 0;
    for (int r = 0; r < dp; ++r) {
      sum32 += local(r, i);
      sum_of_rounded += float(bfloat16(local(r, i)));
    }
    EXPECT_EQ(got[0][static_cast<std::size_t>(i)], sum32) << i;
    EXPECT_EQ(got[1][static_cast<std::size_t>(i)], float(bfloat16(sum_of_rounded))) << i;
    EXPECT_NE(got[1][static_cast<std::size_t>(i)], sum32) << i;
  }
  // Not with a fixed tree: its nodes would round at other places on other meshes.
  run_mesh(2, 1, [&](const dist::DeviceMeshPtr& mesh) {
    nn::Parameter w = make_param("w", {1}, mesh);
    EXPECT_THROW(GradientSynchronizer({&w}, mesh, {.order = dist::ReduceOrder::FixedTree, .reduce_dtype = DType::BFloat16}),
                 InvalidArgument);
  });
}

TEST(GradSyncTree, RefusesADpThatIsNotAPowerOfTwo) {
  std::vector<std::string> messages(3);
  run_mesh(3, 1, [&](const dist::DeviceMeshPtr& mesh) {
    nn::Parameter w = make_param("w", {1}, mesh);
    try {
      GradientSynchronizer sync({&w}, mesh, {.order = dist::ReduceOrder::FixedTree});
    } catch (const InvalidArgument& e) {
      messages[static_cast<std::size_t>(mesh->rank())] = e.what();
    }
  });
  for (const std::string& m : messages) EXPECT_NE(m.find("dp=3"), std::string::npos) << m;
}

}  // namespace
}  // namespace meshgrad::optim::test_grad_sync
