// DTensor: every redistribution pair with complete and partial gradients on 1..4 ranks; the
// contrastive-loss example; placement propagation of ops and the refusals; partial gradients of
// replicated parameters.
#include <gtest/gtest.h>

#include "dist_test_util.hpp"
#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/dtensor.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/kernels.hpp"

namespace test_dtensor {

using namespace meshgrad;
using namespace meshgrad::dist;
using meshgrad::testing::central_differences;
using meshgrad::testing::global_randn;
using meshgrad::testing::max_abs_diff;
using meshgrad::testing::per_rank_randn;
using meshgrad::testing::rank_order_sum;
using meshgrad::testing::weighted_sum_value;
using meshgrad::testing::run_on_mesh;

namespace {

Tensor piece_of(const Tensor& X, const DeviceMesh& mesh, const Placements& pl) {
  const Shape local = local_shape_of(X.shape(), mesh, pl, mesh.coordinates());
  const auto off = local_offsets_of(X.shape(), mesh, pl, mesh.coordinates());
  Tensor t = X;
  for (int d = 0; d < X.dim(); ++d) t = t.narrow(d, off[static_cast<std::size_t>(d)], local[static_cast<std::size_t>(d)]);
  return t.contiguous();
}

// Per-rank loss weights (seeds 700 + r) and their rank-order total (losses that differ per rank).
Tensor rank_weight(const Shape& shape, int r) { return per_rank_randn(shape, 700, r); }
Tensor total_weight(const Shape& shape, int p) { return rank_order_sum(shape, 700, p); }

using Param = std::tuple<std::string, std::string, int, bool>;   // from, to, ranks, partial loss

class RedistributeTest : public ::testing::TestWithParam<Param> {};

TEST_P(RedistributeTest, ForwardAndGradientMatchTheSingleRankComputation) {
  const auto& [from_s, to_s, ranks, per_rank_loss] = GetParam();
  const Placement from = parse_placement(from_s), to = parse_placement(to_s);
  for (const Shape& shape : {Shape{10, 6}, Shape{12, 12}}) {
    // The global input: for a Partial source it is the rank-order sum of the ranks' parts.
    std::vector<Tensor> parts;
    for (int r = 0; r < ranks; ++r) parts.push_back(global_randn(shape, 40 + static_cast<std::uint64_t>(r)));
    Tensor X = parts[0];
    if (from.is_partial()) {
      for (int r = 1; r < ranks; ++r) X = kernels::binary(kernels::Binary::Add, X, parts[static_cast<std::size_t>(r)]);
    }
    const Tensor W = per_rank_loss ? total_weight(shape, ranks) : global_randn(shape, 3);
    const Tensor numeric = central_differences([&](const Tensor& x) { return weighted_sum_value(x, W); }, X);

    run_on_mesh(ranks, [&](const DeviceMeshPtr& mesh) {
      const int r = mesh->rank();
      Tensor local = from.is_partial() ? parts[static_cast<std::size_t>(r)].clone() : piece_of(X, *mesh, {from});
      local.set_requires_grad();
      DTensor x(local, mesh, {from}, shape);
      DTensor y = redistribute(x, {to});
      ASSERT_EQ(y.placements(), Placements{to});
      // Forward: the local piece is the single-rank value's piece (exact: rank-order sums).
      if (!to.is_partial()) {
        EXPECT_TRUE(bitwise_equal(y.local(), piece_of(X, *mesh, {to}))) << x.str() << " -> " << to.str();
      }
      Tensor yf = full_tensor(y);
      EXPECT_TRUE(bitwise_equal(yf, X)) << "full_tensor after " << from.str() << " -> " << to.str();
      // The loss: identical on every rank (R), or different per rank and summed (P).
      Tensor loss_local = per_rank_loss ? sum(mul(yf, rank_weight(shape, r))) : sum(mul(yf, W));
      DTensor loss = from_local(loss_local, mesh, {per_rank_loss ? Partial() : Replicate()}, {});
      backward(loss.local());
      Tensor grad = local.grad();
      // A replicated leaf's gradient may legitimately be partial; its sum over ranks is the gradient.
      if (partial_axes(grad) & 1u) grad = all_reduce(grad, mesh->group(0));
      const Tensor expected = from.is_partial() ? numeric : piece_of(numeric, *mesh, {from});
      EXPECT_LT(max_abs_diff(grad, expected), 1e-7)
          << from.str() << " -> " << to.str() << " ranks " << ranks << (per_rank_loss ? " per-rank loss" : "");
    });
  }
}

INSTANTIATE_TEST_SUITE_P(AllPairs, RedistributeTest,
                         ::testing::Combine(::testing::Values("S(0)", "S(1)", "R", "P"),
                                            ::testing::Values("S(0)", "S(1)", "R", "P"), ::testing::Values(1, 2, 3, 4),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           auto clean = [](std::string s) {
                             std::string out;
                             for (char c : s) {
                               if (std::isalnum(static_cast<unsigned char>(c))) out += c;
                             }
                             return out;
                           };
                           return clean(std::get<0>(info.param)) + "_to_" + clean(std::get<1>(info.param)) + "_p" +
                                  std::to_string(std::get<2>(info.param)) +
                                  (std::get<3>(info.param) ? "_partial_grad" : "_replicated_grad");
                         });

// The backward is derived from the gradient: S(0) -> R runs a slice (no communication) for a
// replicated loss and a reduce-scatter for a per-rank loss.
TEST(Redistribute, BackwardCommunicationDependsOnTheArrivingGradient) {
  for (bool per_rank : {false, true}) {
    run_on_mesh(2, [&](const DeviceMeshPtr& mesh) {
      Tensor local = global_randn({2, 3}, 5 + static_cast<std::uint64_t>(mesh->rank()));
      local.set_requires_grad();
      CommCounter counter;
      CountingScope counting(counter);
      DTensor x(local, mesh, {Shard(0)}, {4, 3});
      Tensor full = redistribute(x, {Replicate()}).local();
      DTensor loss = from_local(sum(full), mesh, {per_rank ? Partial() : Replicate()}, {});
      backward(loss.local());
      EXPECT_EQ(counter.count(Phase::Forward, "all_gather"), 1);
      EXPECT_EQ(counter.count(Phase::Backward), per_rank ? 1 : 0);
      EXPECT_EQ(counter.count(Phase::Backward, "reduce_scatter"), per_rank ? 1 : 0);
      // d/dx of sum over all ranks' (identical) sums = 2 per element for the per-rank loss at p=2.
      for (double g : local.grad().to_vector()) EXPECT_EQ(g, per_rank ? 2.0 : 1.0);
    });
  }
}

// A contrastive loss over embeddings gathered from all ranks, computed (a) identically on every
// rank and (b) per rank over its own rows and summed: both give the single-process gradient.
TEST(Redistribute, ContrastiveLossOverGatheredEmbeddings) {
  const std::int64_t n = 7, d = 5;   // 7 rows: uneven over 2, 3 and 4 ranks
  const Tensor E = global_randn({n, d}, 11);
  std::vector<std::int64_t> target_values;
  for (std::int64_t i = 0; i < n; ++i) target_values.push_back((i + 1) % n);
  const Tensor targets = Tensor::from_int64(target_values, {n});
  auto reference_loss = [&](const Tensor& e) {
    Tensor logits = matmul(e, transpose(e, 0, 1));
    return cross_entropy(logits, targets);
  };
  Tensor e_ref = E.clone();
  e_ref.set_requires_grad();
  backward(reference_loss(e_ref));
  const Tensor numeric = central_differences([&](const Tensor& e) { return reference_loss(e).item(); }, E);
  ASSERT_LT(max_abs_diff(e_ref.grad(), numeric), 1e-7);

  for (int ranks : {1, 2, 3, 4}) {
    for (bool per_rank : {false, true}) {
      run_on_mesh(ranks, [&](const DeviceMeshPtr& mesh) {
        const int r = mesh->rank();
        const ShardRange rows = shard_range(n, ranks, r);
        Tensor local = E.narrow(0, rows.offset, rows.size).contiguous();
        local.set_requires_grad();
        Tensor all = full_tensor(DTensor(local, mesh, {Shard(0)}, {n, d}));
        Tensor logits = matmul(all, transpose(all, 0, 1));
        Tensor loss_local;
        if (per_rank) {
          // Own rows only: sum of their cross-entropies / n; the ranks' losses add up to the mean.
          Tensor own = narrow(logits, 0, rows.offset, rows.size);
          Tensor own_targets = targets.narrow(0, rows.offset, rows.size);
          loss_local = rows.size > 0 ? scale(cross_entropy(own, own_targets), static_cast<double>(rows.size) / n)
                                     : sum(scale(own, 0.0));
        } else {
          loss_local = cross_entropy(logits, targets);
        }
        DTensor loss = from_local(loss_local, mesh, {per_rank ? Partial() : Replicate()}, {});
        backward(loss.local());
        const Tensor expected = e_ref.grad().narrow(0, rows.offset, rows.size);
        const double err = max_abs_diff(local.grad(), expected);
        EXPECT_LT(err, 1e-12) << "ranks " << ranks << (per_rank ? " per-rank" : " replicated") << " loss";
        EXPECT_LT(max_abs_diff(local.grad(), numeric.narrow(0, rows.offset, rows.size)), 1e-7);
      });
    }
  }
}

TEST(Redistribute, TwoDimensionalMesh) {
  // dp=2 x tp=2; [S(0), S(1)] -> [R, R] -> [S(1), S(0)] and back.
  const Tensor X = global_randn({6, 5}, 21);
  run_on_mesh(
      4,
      [&](const DeviceMeshPtr& mesh) {
        Tensor local = piece_of(X, *mesh, {Shard(0), Shard(1)});
        local.set_requires_grad();
        DTensor x(local, mesh, {Shard(0), Shard(1)}, X.shape());
        DTensor swapped = redistribute(x, {Shard(1), Shard(0)});
        EXPECT_TRUE(bitwise_equal(swapped.local(), piece_of(X, *mesh, {Shard(1), Shard(0)})));
        Tensor full = full_tensor(swapped);
        EXPECT_TRUE(bitwise_equal(full, X));
        backward(sum(full));
        for (double g : local.grad().to_vector()) EXPECT_EQ(g, 1.0);
      },
      {{"dp", 2}, {"tp", 2}});
}

// ---- ops ----------------------------------------------------------------------------------------

TEST(DTensorOps, MatmulPlacementRulesAndGradients) {
  // x [6, 4] @ w [4, 5]: S(1).S(0) -> P, S(0).R -> S(0), R.S(1) -> S(1); gradients checked
  // against the single-rank product.
  const Tensor Xg = global_randn({6, 4}, 31), Wg = global_randn({4, 5}, 32), G = global_randn({6, 5}, 33);
  Tensor xr = Xg.clone(), wr = Wg.clone();
  xr.set_requires_grad();
  wr.set_requires_grad();
  backward(sum(mul(matmul(xr, wr), G)));
  struct Rule {
    Placement x, w, out;
  };
  for (const Rule& rule : {Rule{Shard(1), Shard(0), Partial()}, Rule{Shard(0), Replicate(), Shard(0)},
                           Rule{Replicate(), Shard(1), Shard(1)}, Rule{Replicate(), Replicate(), Replicate()}}) {
    for (int ranks : {1, 2, 3}) {
      run_on_mesh(ranks, [&](const DeviceMeshPtr& mesh) {
        Tensor xl = piece_of(Xg, *mesh, {rule.x}), wl = piece_of(Wg, *mesh, {rule.w});
        xl.set_requires_grad();
        wl.set_requires_grad();
        DTensor y = matmul(DTensor(xl, mesh, {rule.x}, Xg.shape()), DTensor(wl, mesh, {rule.w}, Wg.shape()));
        ASSERT_EQ(y.placements(), Placements{rule.out});
        Tensor yf = full_tensor(y);
        EXPECT_LT(max_abs_diff(yf, kernels::matmul(Xg, Wg)), 1e-12);
        backward(sum(mul(yf, G)));
        auto reduce_if_partial = [&](Tensor g) {
          return (partial_axes(g) & 1u) ? all_reduce(g, mesh->group(0)) : g;
        };
        EXPECT_LT(max_abs_diff(reduce_if_partial(xl.grad()), piece_of(xr.grad(), *mesh, {rule.x})), 1e-12)
            << rule.x.str() << "." << rule.w.str();
        EXPECT_LT(max_abs_diff(reduce_if_partial(wl.grad()), piece_of(wr.grad(), *mesh, {rule.w})), 1e-12)
            << rule.x.str() << "." << rule.w.str();
      });
    }
  }
}

TEST(DTensorOps, RefusesWhatWouldBeSilentlyWrong) {
  run_on_mesh(2, [](const DeviceMeshPtr& mesh) {
    DTensor p(Tensor::ones({4, 4}, DType::Float64), mesh, {Partial()}, {4, 4});
    DTensor rep(Tensor::ones({4, 4}, DType::Float64), mesh, {Replicate()}, {4, 4});
    DTensor s0(Tensor::ones({2, 4}, DType::Float64), mesh, {Shard(0)}, {4, 4});
    DTensor s1(Tensor::ones({4, 2}, DType::Float64), mesh, {Shard(1)}, {4, 4});
    auto expect_refusal = [](const std::function<void()>& f, const std::string& op, const std::string& a,
                             const std::string& b) {
      try {
        f();
        ADD_FAILURE() << op << " of " << a << " and " << b << " was not refused";
      } catch (const InvalidArgument& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find(op + ":"), std::string::npos) << what;
        EXPECT_NE(what.find(a + " with " + b), std::string::npos) << what;
      }
    };
    expect_refusal([&] { add(p, rep); }, "add", "P", "R");
    expect_refusal([&] { mul(p, p); }, "mul", "P", "P");
    expect_refusal([&] { add(s0, s1); }, "add", "S(0)", "S(1)");
    expect_refusal([&] { matmul(s0, s0); }, "matmul", "S(0)", "S(0)");
    expect_refusal([&] { matmul(s1, s1); }, "matmul", "S(1)", "S(1)");
    // What is allowed: P + P -> P, P * R -> P, S(0) + R -> S(0).
    EXPECT_EQ(add(p, p).placements(), Placements{Partial()});
    EXPECT_EQ(mul(p, rep).placements(), Placements{Partial()});
    EXPECT_EQ(add(s0, rep).placements(), Placements{Shard(0)});
    EXPECT_EQ(sum(s0, {0}).placements(), Placements{Partial()});
    EXPECT_EQ(sum(s1, {0}).placements(), Placements{Shard(0)});
  });
}

// A replicated parameter used on sharded data gets a partial gradient: the optimizer check refuses
// it until it is reduced, and the reduced gradient is the single-rank one.
TEST(DTensorOps, ReplicatedParameterOnShardedDataHasAPartialGradient) {
  const Tensor Xg = global_randn({5, 3}, 41), Bg = global_randn({3}, 42);
  Tensor br = Bg.clone();
  br.set_requires_grad();
  backward(sum(mul(add(Xg, br), Xg)));
  run_on_mesh(2, [&](const DeviceMeshPtr& mesh) {
    Tensor bl = Bg.clone();
    bl.set_requires_grad();
    DTensor bias(bl, mesh, {Replicate()}, {3});
    DTensor x(piece_of(Xg, *mesh, {Shard(0)}), mesh, {Shard(0)}, Xg.shape());
    DTensor y = mul(add(x, bias), x);
    backward(full_tensor(sum(y)));
    EXPECT_THROW(check_grads_complete({bias}, {"bias"}), InvalidArgument);
    try {
      check_grads_complete({bias}, {"bias"});
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("parameter bias"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("tp"), std::string::npos) << e.what();
    }
    reduce_partial_grads({bias});
    EXPECT_NO_THROW(check_grads_complete({bias}, {"bias"}));
    EXPECT_LT(max_abs_diff(bl.grad(), br.grad()), 1e-12);
  });
}

TEST(DTensor, ShapeChecksNameRankAndPlacements) {
  EXPECT_THROW(run_on_mesh(2,
                           [](const DeviceMeshPtr& mesh) {
                             DTensor bad(Tensor::zeros({4, 4}), mesh, {Shard(0)}, {4, 4});
                           }),
               InvalidArgument);
  EXPECT_THROW(run_on_mesh(2,
                           [](const DeviceMeshPtr& mesh) {
                             DTensor nested(Tensor::zeros({2, 2}), mesh, {Shard(0), Shard(0)}, {4, 4});
                           }),
               InvalidArgument);
}

}  // namespace

}  // namespace test_dtensor
