// The local half of the summation-order policy (ops/tree_reduce.hpp): the one tree sum adds in the
// fixed tree and not left to right, plans cut a dimension into whole blocks, and the ops computed
// per block are, with one block, the plain ops bit for bit (the normal mode runs them that way).
//
// The values 1e16, 1, -1e16, 1 tell the orders apart in float64: 1e16 + 1 rounds to 1e16 (the
// spacing of doubles there is 2), so the tree (1e16 + 1) + (-1e16 + 1) gives 0 and the left-to-right
// sum ((1e16 + 1) + -1e16) + 1 gives 1.
#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/ops/tree_reduce.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/random.hpp"

namespace meshgrad::tree::test_tree_reduce {
namespace {

Tensor scalar(double v) { return Tensor::from_values({v}, {1}, DType::Float64); }

std::vector<Tensor> tell_apart() { return {scalar(1e16), scalar(1.0), scalar(-1e16), scalar(1.0)}; }

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && a.to_vector() == b.to_vector();
}

TEST(TreeSum, AddsInTheFixedTreeNotLeftToRight) {
  EXPECT_EQ(sum(tell_apart()).item(), 0.0);
  double left_to_right = 0;
  for (const Tensor& t : tell_apart()) left_to_right += t.item();
  EXPECT_EQ(left_to_right, 1.0) << "the values must tell the orders apart";
  PairwiseSum<double, std::plus<double>> scalars;
  for (double v : {1e16, 1.0, -1e16, 1.0}) scalars.push(v);
  EXPECT_EQ(scalars.root(), 0.0);
  // Eight leaves: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
  PairwiseSum<double, std::plus<double>> eight;
  for (double v : {1.0, 2.0, 3.0, 4.0, 1e16, 1.0, -1e16, 1.0}) eight.push(v);
  EXPECT_EQ(eight.root(), 10.0);
}

TEST(TreeSum, NeedsAPowerOfTwoLeaves) {
  PairwiseSum<double, std::plus<double>> three;
  for (double v : {1.0, 2.0, 3.0}) three.push(v);
  try {
    (void)three.root();
    ADD_FAILURE() << "three leaves were accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("3 leaves"), std::string::npos) << e.what();
  }
  EXPECT_THROW(sum({scalar(1), scalar(2), scalar(3)}), InvalidArgument);
  EXPECT_EQ(sum({scalar(7)}).item(), 7.0);   // one leaf is the leaf
}

TEST(TreeSum, StreamingSumIsTheTreeAndTakesUndefinedAsZero) {
  StreamingSum s;
  const std::vector<Tensor> leaves = tell_apart();
  for (const Tensor& t : leaves) s.push({t, Tensor()});
  ASSERT_EQ(s.root().size(), 2u);
  EXPECT_TRUE(same_bits(s.root()[0], sum(leaves)));
  EXPECT_FALSE(s.root()[1].defined());
  StreamingSum mixed;
  mixed.push({Tensor()});
  mixed.push({scalar(3)});
  EXPECT_EQ(mixed.root()[0].item(), 3.0);
}

TEST(SplitPlan, WholeIsOneBlockOverTheShard) {
  const SplitPlan p = SplitPlan::whole(12);
  ASSERT_EQ(p.segments.size(), 1u);
  EXPECT_EQ(p.segments[0].size, 12);
  EXPECT_EQ(p.local_blocks, 1);
  EXPECT_EQ(p.block_segments(0).size(), 1u);
  EXPECT_EQ(p.local_extent(), 12);
}

TEST(SplitPlan, FixedBlocksNestInTheShards) {
  // 3 fused parts of 8 units of 2 (QKV of 8 heads of width 2), 4 blocks, tp=2: rank 1 holds blocks
  // 2 and 3 of every part, 2 heads each.
  const SplitPlan p = plan_split("qkv", 3 * 16, 3, 2, 4, 2, 1);
  EXPECT_EQ(p.first_block, 2);
  EXPECT_EQ(p.local_blocks, 2);
  ASSERT_EQ(p.segments.size(), 6u);
  EXPECT_EQ(p.local_extent(), 24);
  const std::vector<Segment> block = p.block_segments(1);   // global block 3, one segment per part
  ASSERT_EQ(block.size(), 3u);
  for (int part = 0; part < 3; ++part) {
    EXPECT_EQ(block[static_cast<std::size_t>(part)].part, part);
    EXPECT_EQ(block[static_cast<std::size_t>(part)].block, 3);
    EXPECT_EQ(block[static_cast<std::size_t>(part)].size, 4);
  }
  EXPECT_TRUE(nests(16, 1, 1, 4, 4));
  EXPECT_FALSE(nests(16, 1, 1, 4, 8)) << "tp=8 does not divide 4 blocks";
  EXPECT_FALSE(nests(6, 1, 1, 4, 2)) << "6 units in 4 blocks: 2,2,1,1; tp=2's shards are 3,3";
  EXPECT_EQ(nesting_degrees(16, 1, 1, 4), "1, 2, 4");
  try {
    plan_split("the MLP width", 6, 1, 1, 4, 2, 0);
    ADD_FAILURE() << "a split that does not nest was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("the MLP width"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("Degrees that work"), std::string::npos) << e.what();
  }
}

// x [3, 2, in] @ w [in, out] by blocks: one block is ops' linear; four blocks are the tree of the
// per-block products (computed here with the kernels), in the forward and in both gradients.
TEST(BlockedOps, LinearOverInputBlocks) {
  const Tensor x = random::randn({3, 2, 8}, 1, DType::Float64);
  const Tensor w = random::randn({8, 5}, 2, DType::Float64);
  const Tensor dy = random::randn({3, 2, 5}, 3, DType::Float64);
  const auto run = [&](const SplitPlan& plan, Tensor* dx, Tensor* dw) {
    Tensor xl = x.clone(), wl = w.clone();
    xl.set_requires_grad();
    wl.set_requires_grad();
    const Tensor y = linear_over_input_blocks(xl, wl, plan);
    backward(sum(mul(y, dy)));
    *dx = xl.grad();
    *dw = wl.grad();
    return y.detach();
  };
  Tensor dx1, dw1, dx0, dw0;
  const Tensor one = run(SplitPlan::whole(8), &dx1, &dw1);
  Tensor xr = x.clone(), wr = w.clone();
  xr.set_requires_grad();
  wr.set_requires_grad();
  const Tensor plain = linear(xr, wr);
  backward(sum(mul(plain, dy)));
  EXPECT_TRUE(same_bits(one, plain.detach()));
  EXPECT_TRUE(same_bits(dx1, xr.grad()));
  EXPECT_TRUE(same_bits(dw1, wr.grad()));

  const SplitPlan four = plan_split("in", 8, 1, 1, 4, 1, 0);
  const Tensor blocked = run(four, &dx0, &dw0);
  const Tensor x2 = x.view({6, 8});
  std::vector<Tensor> products;
  for (const Segment& s : four.segments) {
    products.push_back(kernels::matmul(x2.narrow(1, s.local_offset, s.size).contiguous(),
                                       w.narrow(0, s.local_offset, s.size).contiguous()));
  }
  EXPECT_TRUE(same_bits(blocked, sum(products).view({3, 2, 5})));
  const double tolerance = 1e-12;   // float64 sums of 8 terms: the orders differ by a few ulps
  for (std::size_t i = 0; i < dx0.to_vector().size(); ++i) EXPECT_NEAR(dx0.to_vector()[i], dx1.to_vector()[i], tolerance);
  for (std::size_t i = 0; i < dw0.to_vector().size(); ++i) EXPECT_NEAR(dw0.to_vector()[i], dw1.to_vector()[i], tolerance);
}

// One row block is ops' add with a broadcast bias; four are the tree of the blocks' column sums.
TEST(BlockedOps, AddBiasSumsTheRowBlocksInTheTree) {
  const Tensor y = random::randn({4, 2, 3}, 4, DType::Float64);
  Tensor dy = Tensor::zeros({4, 2, 3}, DType::Float64);
  // Column 0 of the rows: 1e16 in block 0, 1 in block 1, -1e16 in block 2, 1 in block 3.
  const std::vector<double> column{1e16, 0, 1, 0, -1e16, 0, 1, 0};
  std::vector<double> values(24, 0.5);
  for (std::size_t r = 0; r < 8; ++r) values[r * 3] = column[r];
  dy = Tensor::from_values(values, {4, 2, 3}, DType::Float64);
  const auto bias_grad = [&](const std::vector<std::int64_t>& blocks) {
    Tensor b = Tensor::zeros({3}, DType::Float64);
    b.set_requires_grad();
    backward(sum(mul(add_bias(y, b, blocks), dy)));
    return b.grad();
  };
  EXPECT_EQ(bias_grad({2, 2, 2, 2}).to_vector()[0], 0.0) << "the tree over the four blocks";
  Tensor b = Tensor::zeros({3}, DType::Float64);
  b.set_requires_grad();
  backward(sum(mul(add(y, b), dy)));
  EXPECT_TRUE(same_bits(bias_grad({}), b.grad())) << "one block is the broadcast add";
  EXPECT_TRUE(same_bits(bias_grad({8}), b.grad()));
  EXPECT_THROW(bias_grad({2, 2, 2}), InvalidArgument);   // covers 6 of 8 rows
}

TEST(BlockedOps, SumOverBlocksAndLayerNormRowBlocks) {
  const Tensor x = Tensor::from_values({1e16, 1.0, -1e16, 1.0}, {4, 1}, DType::Float64);
  EXPECT_EQ(sum_over_blocks(x, {1, 1, 1, 1}).item(), 0.0);
  EXPECT_TRUE(same_bits(sum_over_blocks(x, {}), sum(x)));

  // LayerNorm: one block of every row is the plain LayerNorm's gradient, bit for bit.
  const Tensor in = random::randn({8, 4}, 5, DType::Float64);
  const Tensor dy = random::randn({8, 4}, 6, DType::Float64);
  const auto grads = [&](const std::vector<std::int64_t>& blocks) {
    Tensor w = Tensor::full({4}, 1.0, DType::Float64), b = Tensor::zeros({4}, DType::Float64);
    w.set_requires_grad();
    b.set_requires_grad();
    backward(sum(mul(layer_norm(in, w, b, 1e-5, blocks), dy)));
    return std::pair{w.grad(), b.grad()};
  };
  const auto plain = grads({});
  const auto one = grads({8});
  EXPECT_TRUE(same_bits(plain.first, one.first));
  EXPECT_TRUE(same_bits(plain.second, one.second));
  const auto four = grads({2, 2, 2, 2});
  for (int c = 0; c < 4; ++c) EXPECT_NEAR(four.second.to_vector()[c], plain.second.to_vector()[c], 1e-12);
}

// The per-block GEMMs write their segment of a wider output in place.
TEST(BlockedOps, MatmulIntoAColumnSlice) {
  Tensor c = Tensor::full({2, 5}, -1.0, DType::Float64);
  const Tensor a = Tensor::from_values({1, 2, 3, 4}, {2, 2}, DType::Float64);
  const Tensor b = Tensor::from_values({1, 0, 0, 1}, {2, 2}, DType::Float64);
  Tensor slice = c.narrow(1, 2, 2);
  kernels::matmul_into(slice, a, b, false);
  EXPECT_EQ(c.to_vector(), (std::vector<double>{-1, -1, 1, 2, -1, -1, -1, 3, 4, -1}));
  Tensor strided = c.transpose(0, 1).narrow(0, 0, 2);   // [2, 2] with column stride 5
  EXPECT_THROW(kernels::matmul_into(strided, a, b, false), InvalidArgument);
}

// OrderedSum, the one accumulator of micro-batches: left to right or the fixed tree, told apart by
// values whose sum depends on the order (in float64 1e16 + 1 rounds to 1e16), entry by entry, with an
// undefined entry adding nothing.
TEST(OrderedSum, AddsLeftToRightOrInTheFixedTree) {
  const std::vector<double> v = {1e16, 1.0, -1e16, 1.0};
  OrderedSum left(false), tree(true);
  for (std::size_t k = 0; k < v.size(); ++k) {
    // Entry 1 is undefined in micro-batch 1: it sums the other three.
    const Tensor second = k == 1 ? Tensor() : Tensor::full({2}, 2.0 * static_cast<double>(k), DType::Float64);
    left.push({Tensor::full({1}, v[k], DType::Float64), second});
    tree.push({Tensor::full({1}, v[k], DType::Float64), second});
  }
  EXPECT_EQ(left.total()[0].item(), 1.0) << "((1e16 + 1) - 1e16) + 1";
  EXPECT_EQ(tree.total()[0].item(), 0.0) << "(1e16 + 1) + (-1e16 + 1)";
  EXPECT_EQ(left.total()[1].at({1}), 0.0 + 4.0 + 6.0);
  EXPECT_EQ(tree.total()[1].at({1}), 0.0 + 4.0 + 6.0);
  EXPECT_EQ(left.count(), 4);
  left.clear();
  EXPECT_EQ(left.count(), 0);
  EXPECT_THROW(left.total(), InvalidArgument);
  left.push({Tensor::full({1}, 3.0, DType::Float64)});
  EXPECT_EQ(left.total()[0].item(), 3.0) << "a cleared sum starts again";
  EXPECT_THROW(left.push({Tensor(), Tensor()}), InvalidArgument) << "a push of another length";
  EXPECT_EQ(left.count(), 1) << "a refused push is not counted";
  tree.push({Tensor::full({1}, 1.0, DType::Float64), Tensor()});
  EXPECT_THROW(tree.total(), InvalidArgument) << "five leaves are not a tree";
}

// The embedding's gradient under row blocks is, for every row, the tree over the blocks of each
// block's own gradient: what one dense table per block, added in the tree, holds (bitwise; a row not
// read in a block is that block's zero).
TEST(EmbeddingRowBlocks, EachRowIsTheTreeOfTheBlocksGradients) {
  const Tensor table = random::randn({7, 5}, 11, DType::Float32);
  const std::vector<std::int64_t> ids = {3, 1, 3, 3, 0, 6, 1, 3, 2, 2, 3, 5, 1, 0, 3, 3};
  const Tensor idx = Tensor::from_int64(ids, {8, 2});
  const Tensor dy = random::randn({8, 2, 5}, 12, DType::Float32);
  const auto grad_with = [&](const std::vector<std::int64_t>& blocks, const Tensor& rows, const Tensor& g) {
    Tensor w = table.detach().set_requires_grad(true);
    backward(meshgrad::sum(mul(embedding(w, rows, blocks), g)));
    return w.grad();
  };
  const Tensor blocked = grad_with({4, 4, 4, 4}, idx, dy);
  std::vector<Tensor> leaves;
  for (int b = 0; b < 4; ++b) {
    leaves.push_back(grad_with({}, idx.narrow(0, 2 * b, 2), dy.narrow(0, 2 * b, 2)));
  }
  const Tensor expected = tree::sum(leaves);
  EXPECT_EQ(blocked.to_vector(), expected.to_vector());
  // And not the single block's order, where row 3 (read six times) adds left to right.
  EXPECT_NE(grad_with({}, idx, dy).to_vector(), expected.to_vector());
}

}  // namespace
}  // namespace meshgrad::tree::test_tree_reduce
