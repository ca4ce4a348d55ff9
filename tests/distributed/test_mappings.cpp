// Every mapping of the DESIGN table on 1..4 ranks, even and uneven shards, float64: the forward
// equals the single-rank computation bit for bit, the gradient equals central differences of the
// single-rank loss, and exactly one collective of the expected kind runs in each phase.
#include <gtest/gtest.h>

#include "dist_test_util.hpp"
#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/mappings.hpp"
#include "meshgrad/distributed/placement.hpp"
#include "meshgrad/distributed/rule.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/kernels.hpp"

namespace test_mappings {

using namespace meshgrad;
using namespace meshgrad::dist;
using meshgrad::testing::central_differences;
using meshgrad::testing::global_randn;
using meshgrad::testing::max_abs_diff;
using meshgrad::testing::per_rank_randn;
using meshgrad::testing::rank_order_sum;
using meshgrad::testing::weighted_sum_value;
using meshgrad::dist::Partial;
using meshgrad::dist::Replicate;
using meshgrad::dist::Shard;
using meshgrad::testing::run_on_mesh;

namespace {

// Rank r's slice of t along dim by the shard rule (a packed copy).
Tensor slice_of(const Tensor& t, int dim, int r, int p) {
  const auto range = shard_range(t.size(dim), p, r);
  return t.narrow(dim, range.offset, range.size).contiguous();
}

// sum(w * y) as a differentiable scalar.
Tensor weighted_sum(const Tensor& y, const Tensor& w) { return sum(mul(y, w)); }
Tensor part(const Shape& shape, int r) { return per_rank_randn(shape, 900, r); }
Tensor sum_of_parts(const Shape& shape, int p) { return rank_order_sum(shape, 900, p); }

// A mapping as the change of placement it is; everything else (inputs, expected outputs and
// gradients, which collectives run) is derived from the placements and the one rule.
struct Case {
  std::string name;
  Placement from, to;
  std::function<Tensor(const Tensor& x, const ProcessGroup& g, const Shape& global)> mapping;
};

std::vector<Case> cases() {
  const Placement R = Replicate(), P = Partial(), S0 = Shard(0), S1 = Shard(1);
  std::vector<Case> c;
  c.push_back({"copy_to_region", R, R, [](const Tensor& x, const ProcessGroup& g, const Shape&) { return copy_to_region(x, g); }});
  c.push_back({"reduce_from_region", P, R, [](const Tensor& x, const ProcessGroup& g, const Shape&) { return reduce_from_region(x, g); }});
  c.push_back({"scatter_to_region", R, S1, [](const Tensor& x, const ProcessGroup& g, const Shape&) { return scatter_to_region(x, g); }});
  c.push_back({"gather_from_region", S1, R,
               [](const Tensor& x, const ProcessGroup& g, const Shape& s) { return gather_from_region(x, g, -1, s[1]); }});
  c.push_back({"scatter_to_sequence", R, S0, [](const Tensor& x, const ProcessGroup& g, const Shape&) { return scatter_to_sequence(x, g, 0); }});
  c.push_back({"gather_from_sequence", S0, R,
               [](const Tensor& x, const ProcessGroup& g, const Shape& s) { return gather_from_sequence(x, g, 0, s[0]); }});
  c.push_back({"reduce_scatter_to_sequence", P, S0,
               [](const Tensor& x, const ProcessGroup& g, const Shape&) { return reduce_scatter_to_sequence(x, g, 0); }});
  c.push_back({"all_to_all", S1, S0, [](const Tensor& x, const ProcessGroup& g, const Shape& s) { return dist::all_to_all(x, g, 0, 1, s[1]); }});
  return c;
}

std::string counted_name(Primitive p) {
  switch (p) {
    case Primitive::AllReduce: return "all_reduce";
    case Primitive::AllGather: return "all_gather";
    case Primitive::ReduceScatter: return "reduce_scatter";
    case Primitive::AllToAll: return "all_to_all";
    default: return "";
  }
}

// The two kinds of loss: every rank computes the same loss from a replicated output (Replicated),
// or each rank computes its own and the total is their sum (PerRank: the loss is marked P).
enum class LossKind { Replicated, PerRank };

// Runs one mapping over `group` (of the mesh) against the single-rank computation.
void check_mapping(const Case& tc, const DeviceMeshPtr& mesh, const ProcessGroup& group, const Shape& shape,
                   LossKind kind, const Tensor& X, const Tensor& W, const Tensor& numeric) {
  const int r = group.rank(), p = group.size();
  auto piece = [&](const Tensor& full, Placement pl) { return pl.is_shard() ? slice_of(full, pl.dim, r, p) : full; };
  Tensor x = tc.from.is_partial() ? part(shape, r) : piece(X, tc.from).clone();
  x.set_requires_grad();
  CommCounter counter;
  CountingScope counting(counter);
  Tensor y = tc.mapping(x, group, shape);
  EXPECT_TRUE(bitwise_equal(y, piece(X, tc.to))) << tc.name << " forward differs on rank " << r;
  // Loss: Replicated -> <y, W> on every rank, unmarked; PerRank -> <y, W_r> marked partial
  // (a sharded output uses W's slice: the sum over ranks is <Y, W> either way).
  Tensor loss;
  if (kind == LossKind::Replicated) {
    loss = weighted_sum(y, W);
  } else {
    const Tensor w = tc.to.is_shard() ? piece(W, tc.to) : per_rank_randn(shape, 500, r);
    loss = mark_partial_grad(weighted_sum(y, w), p > 1 ? group.axes : 0);
  }
  backward(loss);
  EXPECT_EQ(partial_axes(x.grad()) & group.axes, 0u) << tc.name << ": the gradient left the mapping still partial";
  const Tensor expected = piece(numeric, tc.from.is_partial() ? Replicate() : tc.from);
  EXPECT_LT(max_abs_diff(x.grad(), expected), 1e-7) << tc.name << " gradient on rank " << r << " of " << p;
  // Exactly the collectives the rule names, one per phase where it communicates.
  const Placement incoming = tc.to.is_shard() ? tc.to : (kind == LossKind::PerRank ? Partial() : Replicate());
  const std::string fwd = p > 1 ? counted_name(forward_primitive(tc.from, tc.to)) : "";
  const std::string bwd = p > 1 ? counted_name(backward_step(tc.from, tc.to, incoming).op) : "";
  EXPECT_EQ(counter.count(Phase::Forward), fwd.empty() ? 0 : 1) << tc.name;
  EXPECT_EQ(counter.count(Phase::Backward), bwd.empty() ? 0 : 1) << tc.name;
  if (!fwd.empty()) {
    EXPECT_EQ(counter.count(Phase::Forward, fwd, group.axis), 1) << tc.name;
  }
  if (!bwd.empty()) {
    EXPECT_EQ(counter.count(Phase::Backward, bwd, group.axis), 1) << tc.name;
  }
}

// The single-rank loss of the global input and its gradient by central differences.
struct Reference {
  Tensor X, W, numeric;
};
Reference reference_for(const Case& tc, const Shape& shape, int p, LossKind kind) {
  Reference ref;
  ref.X = tc.from.is_partial() ? sum_of_parts(shape, p) : global_randn(shape, 1);
  ref.W = global_randn(shape, 2);
  const Tensor total = kind == LossKind::PerRank && !tc.to.is_shard() ? rank_order_sum(shape, 500, p) : ref.W;
  ref.numeric = central_differences([&](const Tensor& x) { return weighted_sum_value(x, total); }, ref.X);
  return ref;
}

class MappingTest : public ::testing::TestWithParam<std::tuple<std::pair<std::string, LossKind>, int, Shape>> {};

TEST_P(MappingTest, ForwardExactGradientMatchesCentralDifferencesAndCountsCollectives) {
  const auto& [case_loss, ranks, shape] = GetParam();
  const auto& [name, kind] = case_loss;
  Case tc;
  for (auto& c : cases()) {
    if (c.name == name) tc = c;
  }
  ASSERT_FALSE(tc.name.empty());
  const Reference ref = reference_for(tc, shape, ranks, kind);
  run_on_mesh(ranks, [&](const DeviceMeshPtr& mesh) {
    check_mapping(tc, mesh, mesh->group("tp"), shape, kind, ref.X, ref.W, ref.numeric);
  });
}

// (mapping, loss kind) pairs: a sharded output has no replicated loss (each rank holds other rows).
std::vector<std::pair<std::string, LossKind>> case_losses() {
  std::vector<std::pair<std::string, LossKind>> out;
  for (auto& c : cases()) {
    if (!c.to.is_shard()) out.emplace_back(c.name, LossKind::Replicated);
    out.emplace_back(c.name, LossKind::PerRank);
  }
  return out;
}
std::string loss_suffix(LossKind k) { return k == LossKind::PerRank ? "_per_rank_loss" : "_replicated_loss"; }

INSTANTIATE_TEST_SUITE_P(
    AllMappings, MappingTest,
    ::testing::Combine(::testing::ValuesIn(case_losses()), ::testing::Values(1, 2, 3, 4),
                       ::testing::Values(Shape{10, 6}, Shape{12, 12})),   // uneven (10 over 3, 4) and even
    [](const auto& info) {
      const Shape& s = std::get<2>(info.param);
      const auto& case_loss = std::get<0>(info.param);
      return case_loss.first + "_p" + std::to_string(std::get<1>(info.param)) + "_" + std::to_string(s[0]) + "x" +
             std::to_string(s[1]) + loss_suffix(case_loss.second);
    });

// Every mapping on a 2-D mesh (2 x 3 = 6 ranks, uneven 10 x 7): over the row axis, the column axis
// and the whole grid (a group over both axes, whose gradient marks must cover both).
class MappingOn2DMesh : public ::testing::TestWithParam<std::tuple<std::pair<std::string, LossKind>, std::string>> {};

TEST_P(MappingOn2DMesh, MatchesTheSingleRankModel) {
  const auto& [case_loss, over] = GetParam();
  const auto& [name, kind] = case_loss;
  Case tc;
  for (auto& c : cases()) {
    if (c.name == name) tc = c;
  }
  const Shape shape{10, 7};
  const int p = over == "rows" ? 2 : over == "cols" ? 3 : 6;
  const Reference ref = reference_for(tc, shape, p, kind);
  run_on_mesh(
      6,
      [&](const DeviceMeshPtr& mesh) {
        const ProcessGroup group = over == "grid" ? mesh->make_group({0, 1}) : mesh->group(over);
        check_mapping(tc, mesh, group, shape, kind, ref.X, ref.W, ref.numeric);
      },
      {{"rows", 2}, {"cols", 3}});
}

INSTANTIATE_TEST_SUITE_P(AllMappings, MappingOn2DMesh,
                         ::testing::Combine(::testing::ValuesIn(case_losses()), ::testing::Values("rows", "cols", "grid")),
                         [](const auto& info) {
                           const auto& case_loss = std::get<0>(info.param);
                           return case_loss.first + "_" + std::get<1>(info.param) + loss_suffix(case_loss.second);
                         });

// all_gather_with_grad is gather_from_sequence for a loss that differs per rank: it reduce-scatters
// even when the loss itself is not marked.
TEST(Mappings, AllGatherWithGradReduceScattersForPerRankLosses) {
  const Shape shape{10, 6};
  for (int p : {2, 3}) {
    const Tensor X = global_randn(shape, 1);
    const Tensor total = rank_order_sum(shape, 500, p);
    const Tensor numeric = central_differences([&](const Tensor& x) { return weighted_sum_value(x, total); }, X);
    run_on_mesh(p, [&](const DeviceMeshPtr& mesh) {
      const ProcessGroup& g = mesh->group("tp");
      Tensor x = slice_of(X, 1, g.rank(), p);
      x.set_requires_grad();
      CommCounter counter;
      CountingScope counting(counter);
      backward(weighted_sum(all_gather_with_grad(x, g, 1, shape[1]), per_rank_randn(shape, 500, g.rank())));
      EXPECT_EQ(counter.count(Phase::Backward, "reduce_scatter", "tp"), 1);
      EXPECT_LT(max_abs_diff(x.grad(), slice_of(numeric, 1, g.rank(), p)), 1e-7);
    });
  }
}

// The rule table: every row's backward undoes its forward (checked here on the placements alone),
// and the combinations that cannot arrive are refused.
TEST(Rule, TableRowsAreConsistentAndImpossibleGradientsAreRefused) {
  const auto rows = rule_table();
  EXPECT_EQ(rows.size(), 11u);
  for (const RuleRow& r : rows) {
    EXPECT_FALSE(r.backward.result.is_partial()) << r.from.str() << " -> " << r.to.str();
    EXPECT_EQ(r.backward.result.is_shard(), r.from.is_shard()) << r.from.str() << " -> " << r.to.str();
  }
  EXPECT_THROW(backward_step(Replicate(), Shard(0), Partial()), InvalidArgument);
  EXPECT_THROW(backward_step(Shard(0), Replicate(), Shard(0)), InvalidArgument);
  EXPECT_THROW(forward_primitive(Shard(0), Partial()), InvalidArgument);
  EXPECT_NE(format_rule_table().find("reduce-scatter"), std::string::npos);
}

}  // namespace

TEST(MappingTable, MatchesTheDesignTable) {
  // The DESIGN.md table, row for row; mapping_table() describes the code's definitions.
  struct DesignRow {
    std::string name, forward, backward;
  };
  const std::vector<DesignRow> design = {
      {"copy to TP region", "identity", "all-reduce"},
      {"reduce from TP region", "all-reduce", "identity"},
      {"scatter to TP region (feature dim)", "keep own slice", "all-gather"},
      {"gather from TP region (feature dim)", "all-gather", "keep own slice"},
      {"scatter to sequence-parallel region", "keep own slice", "all-gather"},
      {"gather from sequence-parallel region", "all-gather", "reduce-scatter"},
      {"reduce-scatter to sequence-parallel region", "reduce-scatter", "all-gather"},
  };
  const auto table = mapping_table();
  // gather_from_sequence needs no flag: the rule answers for both gradients.
  auto gather = std::find_if(table.begin(), table.end(), [](const MappingRow& m) { return m.name == "gather from sequence-parallel region"; });
  ASSERT_NE(gather, table.end());
  EXPECT_EQ(gather->backward_if_partial, "reduce-scatter");
  EXPECT_EQ(gather->backward_if_replicated, "keep own slice");
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

}  // namespace test_mappings
