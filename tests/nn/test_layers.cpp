// Individual layers against their unsharded computation: column- and row-parallel linear in both
// modes with their options, and the 2-D sharded linear.
#include <gtest/gtest.h>

#include "nn_test_util.hpp"
#include "meshgrad/distributed/mappings.hpp"
#include "meshgrad/nn/layers.hpp"
#include "meshgrad/nn/linear2d.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/kernels.hpp"

using namespace meshgrad;
using namespace meshgrad::testing;

namespace {

// y = row(gelu(column(x))) with gather_output / input_is_parallel=false around them: the column
// layer gathers its output features, the row layer scatters them again.
TEST(ParallelLinear, ColumnGatherOutputAndRowScatterInputMatchPlainLinear) {
  const std::int64_t T = 5, B = 2, in = 7, hidden = 9, out = 6;   // 9 over 2, 3, 4: uneven
  const Tensor X = global_randn({T, B, in}, 1);
  const Tensor G = global_randn({T, B, out}, 2);
  // Reference on one rank with the same initial weights (deterministic init by name).
  Tensor ref_x = X.clone();
  ref_x.set_requires_grad();
  Tensor ref_w1, ref_b1, ref_w2, ref_b2;
  run_on_mesh(1, [&](const dist::DeviceMeshPtr& mesh) {
    const auto ctx = nn::ParallelContext::on(mesh, {});
    nn::ColumnParallelLinear c1("c", in, hidden, {.gather_output = true}, ctx, 5, DType::Float64);
    nn::RowParallelLinear r1("r", hidden, out, {.input_is_parallel = false}, ctx, 5, DType::Float64);
    ref_w1 = c1.weight.value;
    ref_b1 = c1.bias.value;
    ref_w2 = r1.weight.value;
    ref_b2 = r1.bias.value;
    backward(sum(mul(r1.forward(gelu(c1.forward(ref_x, T))), G)));
  });
  for (int tp : {1, 2, 3, 4}) {
    for (bool sp : {false, true}) {
      run_on_mesh(tp, [&](const dist::DeviceMeshPtr& mesh) {
        nn::ParallelConfig pc;
        pc.sequence_parallel = sp;
        const auto ctx = nn::ParallelContext::on(mesh, pc);
        const auto& g = ctx.tp;
        nn::ColumnParallelLinear c1("c", in, hidden, {.gather_output = true}, ctx, 5, DType::Float64);
        nn::RowParallelLinear r1("r", hidden, out, {.input_is_parallel = false}, ctx, 5, DType::Float64);
        // Under SP the input and output are sharded along the sequence.
        const ShardRange rows = sp ? shard_range(T, tp, g.rank()) : ShardRange{0, T};
        Tensor x = X.narrow(0, rows.offset, rows.size).contiguous();
        x.set_requires_grad();
        Tensor y = r1.forward(gelu(c1.forward(x, T)));
        backward(sum(mul(y, G.narrow(0, rows.offset, rows.size))));
        EXPECT_LT(max_abs_diff(x.grad(), ref_x.grad().narrow(0, rows.offset, rows.size)), 1e-12);
        EXPECT_LT(max_abs_diff(nn::gather_full(c1.weight.value.grad(), c1.weight, g), ref_w1.grad()), 1e-12);
        EXPECT_LT(max_abs_diff(nn::gather_full(c1.bias.value.grad(), c1.bias, g), ref_b1.grad()), 1e-12);
        EXPECT_LT(max_abs_diff(nn::gather_full(r1.weight.value.grad(), r1.weight, g), ref_w2.grad()), 1e-12);
        Tensor b2 = r1.bias.value.grad();
        if (dist::partial_axes(b2)) b2 = dist::all_reduce(b2, g);   // SP: partial over tp
        EXPECT_LT(max_abs_diff(b2, ref_b2.grad()), 1e-12) << "tp " << tp << (sp ? " sp" : "");
      });
    }
  }
}

TEST(ParallelLinear, FusedBlocksKeepHeadsWhole) {
  // c_attn-like: [C, 3C] in 3 blocks of 4 heads of width 2; over 3 ranks: heads 2, 1, 1.
  nn::ShardSpec spec{1, 3, 2};
  const auto r1 = spec.ranges(24, 3, 1);
  ASSERT_EQ(r1.size(), 3u);
  EXPECT_EQ(r1[0].offset, 4);
  EXPECT_EQ(r1[0].size, 2);
  EXPECT_EQ(r1[2].offset, 16 + 4);
  const Tensor full = Tensor::arange(24, DType::Float64).view({1, 24});
  const Tensor shard = nn::take_shard(full, spec, 3, 1);
  EXPECT_EQ(shard.to_vector(), (std::vector<double>{4, 5, 12, 13, 20, 21}));
  EXPECT_THROW(nn::ShardSpec({1, 3, 5}).ranges(24, 2, 0), InvalidArgument);
}

TEST(Linear2D, WeightShardedOverBothMeshAxesHasCorrectGradients) {
  const std::int64_t n = 5, in = 7, out = 6;
  const Tensor X = global_randn({n, in}, 11);
  const Tensor G = global_randn({n, out}, 12);
  Tensor ref_x = X.clone(), ref_w;
  ref_x.set_requires_grad();
  run_on_mesh(
      1,
      [&](const dist::DeviceMeshPtr& mesh) {
        nn::Linear2D lin("l", in, out, mesh, "rows", "cols", 3, DType::Float64);
        ref_w = lin.weight().local();
        backward(sum(mul(matmul(ref_x, ref_w), G)));
      },
      {{"rows", 1}, {"cols", 1}});
  for (auto [rows, cols] : {std::pair{2, 2}, std::pair{2, 1}, std::pair{1, 3}}) {
    run_on_mesh(
        rows * cols,
        [&](const dist::DeviceMeshPtr& mesh) {
          nn::Linear2D lin("l", in, out, mesh, "rows", "cols", 3, DType::Float64);
          Tensor x = X.clone();
          x.set_requires_grad();
          dist::DTensor xd(x, mesh, {dist::Replicate(), dist::Replicate()}, X.shape());
          dist::DTensor y = lin.forward(xd);
          Tensor yf = dist::full_tensor(y);
          EXPECT_LT(max_abs_diff(yf, kernels::matmul(X, ref_w)), 1e-12);
          backward(sum(mul(yf, G)));
          const auto& w = lin.weight();
          const auto off = dist::local_offsets_of(w.shape(), *mesh, w.placements(), mesh->coordinates());
          const Tensor expected =
              ref_w.grad().narrow(0, off[0], w.local().size(0)).narrow(1, off[1], w.local().size(1));
          EXPECT_LT(max_abs_diff(w.local().grad(), expected), 1e-12) << rows << "x" << cols;
          // x is replicated and met column-sharded weights: its gradient is partial over "cols"
          // (and says so); summing over that axis gives the single-rank gradient.
          Tensor gx = x.grad();
          const dist::AxisMask partial = dist::partial_axes(gx);
          EXPECT_EQ(partial, cols > 1 ? (1u << mesh->axis_index("cols")) : partial);
          for (int axis = 0; axis < 2; ++axis) {
            if (partial & (1u << axis)) gx = dist::all_reduce(gx, mesh->group(axis));
          }
          EXPECT_LT(max_abs_diff(gx, ref_x.grad()), 1e-12) << rows << "x" << cols;
        },
        {{"rows", rows}, {"cols", cols}});
  }
}

}  // namespace

namespace {

TEST(ParallelLinear, SequenceAllGatherBufferIsReusedAcrossSteps) {
  run_on_mesh(2, [](const dist::DeviceMeshPtr& mesh) {
    nn::ParallelConfig pc;
    pc.sequence_parallel = true;
    const auto ctx = nn::ParallelContext::on(mesh, pc);
    nn::ColumnParallelLinear layer("c", 4, 6, {}, ctx, 1, DType::Float64);
    const Tensor x = global_randn({3, 2, 4}, 5 + static_cast<std::uint64_t>(mesh->rank()));   // 6 rows over 2 ranks
    std::vector<const void*> buffers;
    for (int step = 0; step < 3; ++step) {
      Tensor y = layer.forward(x, 6);
      backward(sum(y));
      buffers.push_back(layer.gather_buffer().storage().get());
    }
    EXPECT_EQ(buffers[0], buffers[1]);
    EXPECT_EQ(buffers[1], buffers[2]);
  });
}

TEST(DistCollectives, AllReduceInPlaceReducesTheCallersBuffer) {
  run_on_mesh(3, [](const dist::DeviceMeshPtr& mesh) {
    Tensor x = Tensor::full({4}, mesh->rank() + 1, DType::Float64);
    const void* storage = x.storage().get();
    Tensor y = dist::all_reduce_in_place_async(x, mesh->group("tp")).wait();
    EXPECT_EQ(y.storage().get(), storage);
    EXPECT_EQ(x.to_vector(), (std::vector<double>{6, 6, 6, 6}));
    EXPECT_THROW(dist::all_reduce_in_place_async(Tensor::zeros({2, 2}, DType::Float64).transpose(0, 1),
                                                 mesh->group("tp")),
                 InvalidArgument);
  });
}

}  // namespace
