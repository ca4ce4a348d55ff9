// Every mapping of the DESIGN table on 1..4 ranks, even and uneven shards, float64: the forward
// equals the single-rank computation bit for bit, the gradient equals central differences of the
// single-rank loss, and exactly one collective of the expected kind runs in each phase.
#include <gtest/gtest.h>

#include "dist_test_util.hpp"
#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/mappings.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/kernels.hpp"

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

// Rank r's slice of t along dim by the shard rule (a packed copy).
Tensor slice_of(const Tensor& t, int dim, int r, int p) {
  const auto range = shard_range(t.size(dim), p, r);
  return t.narrow(dim, range.offset, range.size).contiguous();
}

// sum(w * y) as a differentiable scalar.
Tensor weighted_sum(const Tensor& y, const Tensor& w) { return sum(mul(y, w)); }
// Per-rank loss weights (seeds 500 + r) and partial inputs (seeds 900 + r), with their rank-order sums.
Tensor rank_weight(const Shape& shape, int r) { return per_rank_randn(shape, 500, r); }
Tensor total_weight(const Shape& shape, int p) { return rank_order_sum(shape, 500, p); }
Tensor part(const Shape& shape, int r) { return per_rank_randn(shape, 900, r); }
Tensor sum_of_parts(const Shape& shape, int p) { return rank_order_sum(shape, 900, p); }

struct Case {
  std::string name;
  std::string forward_op, backward_op;   // collective recorded in each phase ("" = none)
  // Rank r's input given the global input X.
  std::function<Tensor(const Tensor& X, int r, int p)> local_input;
  std::function<Tensor(const Tensor& x, const ProcessGroup& g, const Shape& global)> mapping;
  // Rank r's expected output (the single-rank computation).
  std::function<Tensor(const Tensor& X, int r, int p)> expected_output;
  // Rank r's loss given its output; the total loss is the sum over ranks when per_rank_loss,
  // else every rank computes the same loss once.
  std::function<Tensor(const Tensor& y, const Tensor& W, int r, int p)> local_loss;
  // The single-rank loss of the global input.
  std::function<double(const Tensor& X, const Tensor& W, int p)> global_loss;
  // Rank r's expected gradient given the global gradient dL/dX.
  std::function<Tensor(const Tensor& G, int r, int p)> local_grad;
  bool partial_input = false;   // X is the sum of per-rank parts
};

std::vector<Case> cases() {
  auto identity_input = [](const Tensor& X, int, int) { return X.clone(); };
  auto full = [](const Tensor& X, int, int) { return X; };
  std::vector<Case> c;
  c.push_back({"copy_to_region", "", "all_reduce", identity_input,
               [](const Tensor& x, const ProcessGroup& g, const Shape& s) { return copy_to_region(x, g); }, full,
               [](const Tensor& y, const Tensor&, int r, int) { return weighted_sum(y, rank_weight(y.shape(), r)); },
               [](const Tensor& X, const Tensor&, int p) { return weighted_sum_value(X, total_weight(X.shape(), p)); },
               [](const Tensor& G, int, int) { return G; }});
  c.push_back({"reduce_from_region", "all_reduce", "",
               [](const Tensor& X, int r, int) { return part(X.shape(), r); },
               [](const Tensor& x, const ProcessGroup& g, const Shape& s) { return reduce_from_region(x, g); },
               [](const Tensor& X, int, int) { return X; },
               [](const Tensor& y, const Tensor& W, int, int) { return weighted_sum(y, W); },
               [](const Tensor& X, const Tensor& W, int) { return weighted_sum_value(X, W); },
               [](const Tensor& G, int, int) { return G; }, true});
  c.push_back({"scatter_to_region", "", "all_gather", identity_input,
               [](const Tensor& x, const ProcessGroup& g, const Shape& s) { return scatter_to_region(x, g); },
               [](const Tensor& X, int r, int p) { return slice_of(X, 1, r, p); },
               [](const Tensor& y, const Tensor& W, int r, int p) { return weighted_sum(y, slice_of(W, 1, r, p)); },
               [](const Tensor& X, const Tensor& W, int) { return weighted_sum_value(X, W); },
               [](const Tensor& G, int, int) { return G; }});
  c.push_back({"gather_from_region", "all_gather", "",
               [](const Tensor& X, int r, int p) { return slice_of(X, 1, r, p); },
               [](const Tensor& x, const ProcessGroup& g, const Shape& s) { return gather_from_region(x, g, -1, s[1]); }, full,
               [](const Tensor& y, const Tensor& W, int, int) { return weighted_sum(y, W); },
               [](const Tensor& X, const Tensor& W, int) { return weighted_sum_value(X, W); },
               [](const Tensor& G, int r, int p) { return slice_of(G, 1, r, p); }});
  c.push_back({"scatter_to_sequence", "", "all_gather", identity_input,
               [](const Tensor& x, const ProcessGroup& g, const Shape& s) { return scatter_to_sequence(x, g, 0); },
               [](const Tensor& X, int r, int p) { return slice_of(X, 0, r, p); },
               [](const Tensor& y, const Tensor& W, int r, int p) { return weighted_sum(y, slice_of(W, 0, r, p)); },
               [](const Tensor& X, const Tensor& W, int) { return weighted_sum_value(X, W); },
               [](const Tensor& G, int, int) { return G; }});
  c.push_back({"gather_from_sequence", "all_gather", "reduce_scatter",
               [](const Tensor& X, int r, int p) { return slice_of(X, 0, r, p); },
               [](const Tensor& x, const ProcessGroup& g, const Shape& s) { return gather_from_sequence(x, g, 0, s[0]); }, full,
               [](const Tensor& y, const Tensor&, int r, int) { return weighted_sum(y, rank_weight(y.shape(), r)); },
               [](const Tensor& X, const Tensor&, int p) { return weighted_sum_value(X, total_weight(X.shape(), p)); },
               [](const Tensor& G, int r, int p) { return slice_of(G, 0, r, p); }});
  c.push_back({"reduce_scatter_to_sequence", "reduce_scatter", "all_gather",
               [](const Tensor& X, int r, int) { return part(X.shape(), r); },
               [](const Tensor& x, const ProcessGroup& g, const Shape& s) { return reduce_scatter_to_sequence(x, g, 0); },
               [](const Tensor& X, int r, int p) { return slice_of(X, 0, r, p); },
               [](const Tensor& y, const Tensor& W, int r, int p) { return weighted_sum(y, slice_of(W, 0, r, p)); },
               [](const Tensor& X, const Tensor& W, int) { return weighted_sum_value(X, W); },
               [](const Tensor& G, int, int) { return G; }, true});
  c.push_back({"all_to_all", "all_to_all", "all_to_all",
               [](const Tensor& X, int r, int p) { return slice_of(X, 1, r, p); },
               [](const Tensor& x, const ProcessGroup& g, const Shape& s) { return dist::all_to_all(x, g, 0, 1, s[1]); },
               [](const Tensor& X, int r, int p) { return slice_of(X, 0, r, p); },
               [](const Tensor& y, const Tensor& W, int r, int p) { return weighted_sum(y, slice_of(W, 0, r, p)); },
               [](const Tensor& X, const Tensor& W, int) { return weighted_sum_value(X, W); },
               [](const Tensor& G, int r, int p) { return slice_of(G, 1, r, p); }});
  c.push_back({"all_gather_with_grad", "all_gather", "reduce_scatter",
               [](const Tensor& X, int r, int p) { return slice_of(X, 1, r, p); },
               [](const Tensor& x, const ProcessGroup& g, const Shape& s) { return all_gather_with_grad(x, g, 1, s[1]); }, full,
               [](const Tensor& y, const Tensor&, int r, int) { return weighted_sum(y, rank_weight(y.shape(), r)); },
               [](const Tensor& X, const Tensor&, int p) { return weighted_sum_value(X, total_weight(X.shape(), p)); },
               [](const Tensor& G, int r, int p) { return slice_of(G, 1, r, p); }});
  return c;
}

class MappingTest : public ::testing::TestWithParam<std::tuple<std::string, int, Shape>> {};

TEST_P(MappingTest, ForwardExactGradientMatchesCentralDifferencesAndCountsCollectives) {
  const auto& [name, ranks, shape] = GetParam();
  Case tc;
  for (auto& c : cases()) {
    if (c.name == name) tc = c;
  }
  ASSERT_FALSE(tc.name.empty());
  const Tensor X = tc.partial_input ? sum_of_parts(shape, ranks) : global_randn(shape, 1);
  const Tensor W = global_randn(shape, 2);
  const Tensor numeric = central_differences([&](const Tensor& x) { return tc.global_loss(x, W, ranks); }, X);

  run_on_mesh(ranks, [&](const DeviceMeshPtr& mesh) {
    const ProcessGroup& group = mesh->group("tp");
    const int r = group.rank();
    Tensor x = tc.local_input(X, r, ranks);
    x.set_requires_grad();
    CommCounter counter;
    CountingScope counting(counter);
    Tensor y = tc.mapping(x, group, shape);
    EXPECT_TRUE(bitwise_equal(y, tc.expected_output(X, r, ranks))) << name << " forward differs on rank " << r;
    backward(tc.local_loss(y, W, r, ranks));
    const double err = max_abs_diff(x.grad(), tc.local_grad(numeric, r, ranks));
    EXPECT_LT(err, 1e-7) << name << " gradient on rank " << r << " of " << ranks;
    const int expect_fwd = ranks > 1 && !tc.forward_op.empty() ? 1 : 0;
    const int expect_bwd = ranks > 1 && !tc.backward_op.empty() ? 1 : 0;
    EXPECT_EQ(counter.count(Phase::Forward), expect_fwd) << name;
    EXPECT_EQ(counter.count(Phase::Backward), expect_bwd) << name;
    if (expect_fwd) {
      EXPECT_EQ(counter.count(Phase::Forward, tc.forward_op, "tp"), 1) << name;
    }
    if (expect_bwd) {
      EXPECT_EQ(counter.count(Phase::Backward, tc.backward_op, "tp"), 1) << name;
    }
  });
}

std::vector<std::string> case_names() {
  std::vector<std::string> names;
  for (auto& c : cases()) names.push_back(c.name);
  return names;
}

INSTANTIATE_TEST_SUITE_P(
    AllMappings, MappingTest,
    ::testing::Combine(::testing::ValuesIn(case_names()), ::testing::Values(1, 2, 3, 4),
                       ::testing::Values(Shape{10, 6}, Shape{12, 12})),   // uneven (10 over 3, 4) and even
    [](const auto& info) {
      const Shape& s = std::get<2>(info.param);
      return std::get<0>(info.param) + "_p" + std::to_string(std::get<1>(info.param)) + "_" +
             std::to_string(s[0]) + "x" + std::to_string(s[1]);
    });

}  // namespace

TEST(MappingTable, MatchesTheDesignTable) {
  // The DESIGN.md table, row for row; mapping_table() describes the code's definitions.
  const std::vector<MappingRow> design = {
      {"copy to TP region", "identity", "all-reduce"},
      {"reduce from TP region", "all-reduce", "identity"},
      {"scatter to TP region (feature dim)", "keep own slice", "all-gather"},
      {"gather from TP region (feature dim)", "all-gather", "keep own slice"},
      {"scatter to sequence-parallel region", "keep own slice", "all-gather"},
      {"gather from sequence-parallel region", "all-gather", "reduce-scatter"},
      {"reduce-scatter to sequence-parallel region", "reduce-scatter", "all-gather"},
  };
  const auto table = mapping_table();
  for (const auto& row : design) {
    auto it = std::find_if(table.begin(), table.end(), [&](const MappingRow& m) { return m.name == row.name; });
    ASSERT_NE(it, table.end()) << row.name;
    EXPECT_EQ(it->forward, row.forward) << row.name;
    EXPECT_EQ(it->backward, row.backward) << row.name;
  }
}

TEST(Mappings, SizeOneGroupIsBitIdenticalAndSilent) {
  run_on_mesh(1, [](const DeviceMeshPtr& mesh) {
    Tensor x = global_randn({4, 5}, 3);
    x.set_requires_grad();
    CommCounter counter;
    CountingScope counting(counter);
    Tensor y = gather_from_sequence(copy_to_region(x, mesh->group("tp")), mesh->group("tp"));
    EXPECT_EQ(y.storage(), x.storage());   // no copy at all
    backward(sum(y));
    EXPECT_EQ(counter.records().size(), 0u);
  });
}

TEST(Mappings, GatherOfWrongShardSizeIsAnError) {
  EXPECT_THROW(run_on_mesh(2,
                           [](const DeviceMeshPtr& mesh) {
                             // Rank 1 holds 4 rows where the shard rule over 6 gives 3.
                             Tensor x = Tensor::zeros({mesh->rank() == 0 ? 3 : 4, 2}, DType::Float64);
                             gather_from_sequence(x, mesh->group("tp"), 0, 6);
                           }),
               InvalidArgument);
}

TEST(Mappings, UnknownGatherExtentIsLearntByARecordedSizeExchange) {
  run_on_mesh(3, [](const DeviceMeshPtr& mesh) {
    const ProcessGroup& g = mesh->group("tp");
    // 7 rows over 3 ranks: 3, 2, 2. No full size given: the ranks exchange their extents.
    Tensor x = Tensor::full({shard_range(7, 3, g.rank()).size, 2}, g.rank(), DType::Float64);
    CommCounter counter;
    CountingScope counting(counter);
    Tensor y = gather_from_sequence(x, g, 0);
    EXPECT_EQ(y.shape(), (Shape{7, 2}));
    EXPECT_EQ(y.at({3, 0}), 1.0);
    EXPECT_EQ(y.at({6, 1}), 2.0);
    EXPECT_EQ(counter.count(Phase::Forward, "all_gather(sizes)"), 1);
    EXPECT_EQ(counter.count(Phase::Forward, "all_gather"), 1);
  });
}
