// The summation order is a policy of a step (dist::ReduceOrder, rule.hpp): run_primitive, the one
// executor, adds in rank order or in the fixed tree as the step's arguments say, and the
// differentiable mappings carry the order into both directions of their step, so the tp-invariant
// mode needs no differentiable collective of its own.
//
// Rank r holds 1e16, 1, -1e16, 1 (r = 0..3), float64: the rank order ((r0 + r1) + r2) + r3 gives 1
// (1e16 + 1 rounds to 1e16), the tree (r0 + r1) + (r2 + r3) gives 0.
#include <gtest/gtest.h>

#include <vector>

#include "dist_test_util.hpp"
#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/dtensor.hpp"
#include "meshgrad/distributed/mappings.hpp"
#include "meshgrad/distributed/rule.hpp"
#include "meshgrad/ops/ops.hpp"

namespace meshgrad::dist::test_reduce_order {
namespace {

using meshgrad::testing::run_on_mesh;

constexpr double kTerms[] = {1e16, 1.0, -1e16, 1.0};

// Rank r's term, as a [rows, 1] column (every row the same).
Tensor term(int rank, std::int64_t rows = 1) {
  return Tensor::full({rows, 1}, kTerms[rank], DType::Float64);
}

double expected(ReduceOrder order) { return order == ReduceOrder::FixedTree ? 0.0 : 1.0; }

StepArgs with(ReduceOrder order) {
  StepArgs a;
  a.order = order;
  return a;
}

TEST(ReduceOrder, TheExecutorAddsInTheOrderOfTheStep) {
  for (const ReduceOrder order : {ReduceOrder::RankOrder, ReduceOrder::FixedTree}) {
    SCOPED_TRACE(reduce_order_name(order));
    std::vector<double> all_reduce(4), reduce_scatter(4), scalar(4), in_place(4);
    run_on_mesh(4, [&](const DeviceMeshPtr& mesh) {
      const ProcessGroup& tp = mesh->group("tp");
      const int r = tp.rank();
      all_reduce[r] = run_primitive(Primitive::AllReduce, term(r), tp, with(order)).item();
      StepArgs rs = with(order);
      rs.sizes = shard_sizes(4, 4);
      reduce_scatter[r] = run_primitive(Primitive::ReduceScatter, term(r, 4), tp, rs).item();
      scalar[r] = sum_scalar_over(term(r), tp, order);
      const Tensor mine = term(r);
      in_place[r] = run_primitive_async(Primitive::AllReduce, mine, tp, with(order), /*in_place=*/true).wait().item();
    });
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(all_reduce[r], expected(order)) << "all-reduce, rank " << r;
      EXPECT_EQ(reduce_scatter[r], expected(order)) << "reduce-scatter, rank " << r;
      EXPECT_EQ(scalar[r], expected(order)) << "sum_scalar_over, rank " << r;
      EXPECT_EQ(in_place[r], expected(order)) << "in-place all-reduce, rank " << r;
    }
  }
}

// The mapping P -> R adds in its order forward; R -> R reduces a partial gradient in its order
// backward. Both through ChangePlacementFn: the rule's one differentiable step.
TEST(ReduceOrder, MappingsCarryTheOrderForwardAndBackward) {
  for (const ReduceOrder order : {ReduceOrder::RankOrder, ReduceOrder::FixedTree}) {
    SCOPED_TRACE(reduce_order_name(order));
    std::vector<double> forward(4), backward_grad(4);
    run_on_mesh(4, [&](const DeviceMeshPtr& mesh) {
      const ProcessGroup& tp = mesh->group("tp");
      const int r = tp.rank();
      forward[r] = reduce_from_region(term(r), tp, order).item();
      Tensor w = Tensor::full({1, 1}, 1.0, DType::Float64);
      w.set_requires_grad();
      // Rank r's loss is kTerms[r] * w: the gradient of w arrives partial and is summed over tp.
      const Tensor used = mark_partial_grad(copy_to_region(w, tp, order), tp.axes);
      backward(sum(mul(used, term(r))));
      backward_grad[r] = w.grad().item();
    });
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(forward[r], expected(order)) << "reduce_from_region forward, rank " << r;
      EXPECT_EQ(backward_grad[r], expected(order)) << "copy_to_region backward, rank " << r;
    }
  }
}

// DTensor's gradient reduction asks the rule too, in the order it is given.
TEST(ReduceOrder, DTensorPartialGradientsAreReducedByTheRule) {
  for (const ReduceOrder order : {ReduceOrder::RankOrder, ReduceOrder::FixedTree}) {
    std::vector<double> got(4);
    run_on_mesh(4, [&](const DeviceMeshPtr& mesh) {
      const int r = mesh->group("tp").rank();
      Tensor local = Tensor::full({1}, 0.0, DType::Float64);
      local.set_requires_grad();
      DTensor p(local, mesh, {Replicate()}, {1});
      Tensor g = Tensor::full({1}, kTerms[r], DType::Float64);
      set_partial_axes(g, mesh->group("tp").axes);
      local.set_grad(g);
      reduce_partial_grads({p}, order);
      got[r] = local.grad().item();
      check_grads_complete({p}, {"p"});
    });
    for (int r = 0; r < 4; ++r) EXPECT_EQ(got[r], expected(order)) << reduce_order_name(order) << ", rank " << r;
  }
}

// Two ranks add r0 + r1 in either order: the tree uses the backend's collective there (one
// collective of the same kind and size), and a tree over a group that is not a power of two is
// refused naming the group.
TEST(ReduceOrder, TwoRanksShareTheBackendsCollectiveAndThreeAreRefused) {
  run_on_mesh(2, [](const DeviceMeshPtr& mesh) {
    const ProcessGroup& tp = mesh->group("tp");
    CommCounter counter;
    {
      CountingScope counting(counter);
      (void)run_primitive(Primitive::AllReduce, term(tp.rank()), tp, with(ReduceOrder::FixedTree));
    }
    ASSERT_EQ(counter.records().size(), 1u);
    EXPECT_EQ(counter.records()[0].op, "all_reduce");
  });
  std::vector<std::string> messages(3);
  run_on_mesh(3, [&](const DeviceMeshPtr& mesh) {
    try {
      (void)run_primitive(Primitive::AllReduce, term(0), mesh->group("tp"), with(ReduceOrder::FixedTree));
    } catch (const InvalidArgument& e) {
      messages[static_cast<std::size_t>(mesh->rank())] = e.what();
    }
  });
  for (const std::string& m : messages) EXPECT_NE(m.find("3 ranks"), std::string::npos) << m;
}

}  // namespace
}  // namespace meshgrad::dist::test_reduce_order
