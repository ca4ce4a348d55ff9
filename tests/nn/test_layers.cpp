// Individual layers against their unsharded computation: column- and row-parallel linear in both
// modes with their options, and the 2-D sharded linear.
#include <gtest/gtest.h>

#include "nn_test_util.hpp"
#include "meshgrad/autograd/node.hpp"
#include "meshgrad/distributed/mappings.hpp"
#include "meshgrad/nn/layers.hpp"
#include "meshgrad/distributed/dtensor.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/kernels.hpp"

namespace test_layers {

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
        const auto& g = ctx->tp;
        nn::ColumnParallelLinear c1("c", in, hidden, {.gather_output = true}, ctx, 5, DType::Float64);
        nn::RowParallelLinear r1("r", hidden, out, {.input_is_parallel = false}, ctx, 5, DType::Float64);
        // Under SP the input and output are sharded along the sequence.
        const ShardRange rows = sp ? shard_range(T, tp, g.rank()) : ShardRange{0, T};
        Tensor x = X.narrow(0, rows.offset, rows.size).contiguous();
        x.set_requires_grad();
        Tensor y = r1.forward(gelu(c1.forward(x, T)));
        backward(sum(mul(y, G.narrow(0, rows.offset, rows.size))));
        EXPECT_LT(max_abs_diff(x.grad(), ref_x.grad().narrow(0, rows.offset, rows.size)), 1e-12);
        EXPECT_LT(max_abs_diff(nn::gather_full(c1.weight.value.grad(), c1.weight), ref_w1.grad()), 1e-12);
        EXPECT_LT(max_abs_diff(nn::gather_full(c1.bias.value.grad(), c1.bias), ref_b1.grad()), 1e-12);
        EXPECT_LT(max_abs_diff(nn::gather_full(r1.weight.value.grad(), r1.weight), ref_w2.grad()), 1e-12);
        Tensor b2 = r1.bias.value.grad();
        if (dist::partial_axes(b2)) b2 = dist::all_reduce(b2, g);   // SP: partial over tp
        EXPECT_LT(max_abs_diff(b2, ref_b2.grad()), 1e-12) << "tp " << tp << (sp ? " sp" : "");
      });
    }
  }
}

TEST(ParallelLinear, FusedBlocksKeepHeadsWhole) {
  // c_attn-like: [C, 3C] in 3 blocks of 4 heads of width 2; over 3 ranks: heads 2, 1, 1.
  const dist::Placement spec = dist::Placement::shard(1, 3, 2);
  EXPECT_EQ(spec.str(), "S(1)x3/2");
  const auto r1 = spec.ranges(24, 3, 1);
  ASSERT_EQ(r1.size(), 3u);
  EXPECT_EQ(r1[0].offset, 4);
  EXPECT_EQ(r1[0].size, 2);
  EXPECT_EQ(r1[2].offset, 16 + 4);
  run_on_mesh(3, [&](const dist::DeviceMeshPtr& mesh) {
    const Tensor full = Tensor::arange(24, DType::Float64).view({1, 24});
    const dist::Placements pl{spec};   // mesh (tp=3)
    const Tensor shard = dist::take_piece(full, dist::piece_layout({1, 24}, *mesh, pl, mesh->coordinates()));
    if (mesh->coordinate("tp") == 1) {
      EXPECT_EQ(shard.to_vector(), (std::vector<double>{4, 5, 12, 13, 20, 21}));
    }
    // Gathering every rank's piece gives the full tensor back.
    EXPECT_TRUE(bitwise_equal(dist::gather_pieces(shard, {1, 24}, *mesh, pl), full));
  });
  EXPECT_THROW(dist::Placement::shard(1, 3, 5).ranges(24, 2, 0), InvalidArgument);
}

// Two mesh axes sharding one dim split it as one axis of their product: the ranks of the grid
// group in order, uneven (10 rows over 2 x 2 -> 3, 3, 2, 2).
TEST(ParallelLinear, NestedShardIsTheGridGroupsShard) {
  run_on_mesh(
      4,
      [](const dist::DeviceMeshPtr& mesh) {
        const Tensor full = global_randn({10, 3}, 7);
        const dist::Placements pl{dist::Placement::shard(0), dist::Placement::shard(0)};
        const auto layout = dist::piece_layout({10, 3}, *mesh, pl, mesh->coordinates());
        const dist::ProcessGroup grid = mesh->make_group({0, 1});
        const ShardRange expected = shard_range(10, 4, grid.rank());
        ASSERT_EQ(layout.ranges[0].size(), 1u);
        EXPECT_EQ(layout.ranges[0][0].offset, expected.offset);
        EXPECT_EQ(layout.ranges[0][0].size, expected.size);
        const Tensor piece = dist::take_piece(full, layout);
        EXPECT_TRUE(bitwise_equal(dist::gather_pieces(piece, {10, 3}, *mesh, pl), full));
      },
      {{"rows", 2}, {"cols", 2}});
}

// A linear whose weight is sharded over both axes of a 2-D mesh, written with DTensor ops.
TEST(DTensorLinear, WeightShardedOverBothMeshAxesHasCorrectGradients) {
  const std::int64_t n = 5, in = 7, out = 6;
  const Tensor X = global_randn({n, in}, 11);
  const Tensor G = global_randn({n, out}, 12);
  const Tensor W = global_randn({in, out}, 13);
  Tensor ref_x = X.clone(), ref_w = W.clone();
  ref_x.set_requires_grad();
  ref_w.set_requires_grad();
  backward(sum(mul(matmul(ref_x, ref_w), G)));
  for (auto [rows, cols] : {std::pair{2, 2}, std::pair{2, 1}, std::pair{1, 3}}) {
    run_on_mesh(
        rows * cols,
        [&](const dist::DeviceMeshPtr& mesh) {
          using dist::Replicate;
          using dist::Shard;
          const dist::Placements w_pl{Shard(0), Shard(1)};
          const auto layout = dist::piece_layout(W.shape(), *mesh, w_pl, mesh->coordinates());
          Tensor w = dist::take_piece(W, layout);
          w.set_requires_grad();
          const dist::DTensor wd(w, mesh, w_pl, W.shape());
          Tensor x = X.clone();
          x.set_requires_grad();
          const dist::DTensor xd(x, mesh, {Replicate(), Replicate()}, X.shape());
          const dist::DTensor y =
              dist::redistribute(dist::matmul(dist::redistribute(xd, {Shard(1), Replicate()}), wd), {Replicate(), Shard(1)});
          Tensor yf = dist::full_tensor(y);
          EXPECT_LT(max_abs_diff(yf, kernels::matmul(X, W)), 1e-12);
          backward(sum(mul(yf, G)));
          EXPECT_LT(max_abs_diff(w.grad(), dist::take_piece(ref_w.grad(), layout)), 1e-12) << rows << "x" << cols;
          // x is replicated and met column-sharded weights: its gradient is partial over "cols"
          // (and says so); summing over that axis gives the single-rank gradient.
          Tensor gx = x.grad();
          const dist::AxisMask partial = dist::partial_axes(gx);
          if (cols > 1) {
            EXPECT_EQ(partial, 1u << mesh->axis_index("cols"));
          }
          for (int axis = 0; axis < 2; ++axis) {
            if (partial & (1u << axis)) gx = dist::all_reduce(gx, mesh->group(axis));
          }
          EXPECT_LT(max_abs_diff(gx, ref_x.grad()), 1e-12) << rows << "x" << cols;
        },
        {{"rows", rows}, {"cols", cols}});
  }
}

// DTensor and the nn layers in one graph: a column-parallel layer's sharded output becomes a
// DTensor, is gathered by redistribute and feeds a loss that differs per rank (P). The rule reads
// the placements both kinds of node leave, so the input and weight gradients are the single-rank
// ones and no gradient stays marked partial on tp after the layers reduced it.
TEST(DTensorLinear, MixesWithParallelLayersInOneGraph) {
  const std::int64_t T = 4, B = 2, in = 5, out = 7;
  const Tensor X = global_randn({T, B, in}, 21);
  Tensor ref_x = X.clone(), ref_w;
  ref_x.set_requires_grad();
  const auto per_rank_weight = [&](int r) { return per_rank_randn({T, B, out}, 600, r); };
  for (int tp : {2, 3}) {
    // Single rank: loss = sum_r <Y, W_r> = <Y, sum_r W_r>.
    Tensor total = rank_order_sum({T, B, out}, 600, tp);
    run_on_mesh(1, [&](const dist::DeviceMeshPtr& mesh) {
      const auto ctx = nn::ParallelContext::on(mesh, {});
      nn::ColumnParallelLinear c("c", in, out, {}, ctx, 9, DType::Float64);
      ref_w = c.weight.value;
      ref_x.zero_grad();
      backward(sum(mul(c.forward(ref_x, T), total)));
    });
    run_on_mesh(tp, [&](const dist::DeviceMeshPtr& mesh) {
      const auto ctx = nn::ParallelContext::on(mesh, {});
      nn::ColumnParallelLinear c("c", in, out, {}, ctx, 9, DType::Float64);
      Tensor x = X.clone();
      x.set_requires_grad();
      const Tensor y_local = c.forward(x, T);                    // [T, B, out_local]: S(2) on tp
      const dist::Placements on_tp{dist::Shard(2)};   // mesh (tp)
      const dist::DTensor y = dist::from_local(y_local, mesh, on_tp, {T, B, out});
      const Tensor y_full = dist::redistribute(y, {dist::Replicate()}).local();
      const dist::DTensor loss = dist::from_local(sum(mul(y_full, per_rank_weight(mesh->coordinate("tp")))), mesh,
                                                  {dist::Partial()}, {});
      backward(loss.local());
      EXPECT_EQ(dist::partial_axes(x.grad()), 0u) << "the column layer reduced dX over tp";
      EXPECT_LT(max_abs_diff(x.grad(), ref_x.grad()), 1e-12) << "tp " << tp;
      EXPECT_LT(max_abs_diff(nn::gather_full(c.weight.value.grad(), c.weight), ref_w.grad()), 1e-12) << "tp " << tp;
    });
  }
}

}  // namespace

namespace {

// Regather mode keeps one sequence all-gather buffer per (shape, dtype) for the whole model,
// shared by its column layers and reused across steps (Megatron's global memory buffer), and the
// gradients equal those without regather bit for bit. Without regather nothing is kept.
TEST(ParallelLinear, RegatherSharesOneGatherBufferAcrossLayersAndSteps) {
  for (bool regather : {false, true}) {
    run_on_mesh(2, [&](const dist::DeviceMeshPtr& mesh) {
      nn::ParallelConfig pc;
      pc.sequence_parallel = true;
      pc.recompute_allgather = regather;
      const auto ctx = nn::ParallelContext::on(mesh, pc);
      nn::ColumnParallelLinear first("c1", 4, 6, {}, ctx, 1, DType::Float64);
      nn::ColumnParallelLinear second("c2", 4, 6, {}, ctx, 2, DType::Float64);
      const Tensor x = global_randn({3, 2, 4}, 5 + static_cast<std::uint64_t>(mesh->rank()));   // 6 rows over 2 ranks
      std::vector<const void*> storages;
      for (int step = 0; step < 3; ++step) {
        backward(add(sum(first.forward(x, 6)), sum(second.forward(x, 6))));
        if (regather) {
          ASSERT_EQ(ctx->gather_buffers.size(), 1u) << "one buffer for both layers";
        } else {
          EXPECT_EQ(ctx->gather_buffers.size(), 0u);
        }
      }
    });
  }
}

// The tied LM head passes wte^T (a transposed view of a [V, C] leaf) as its weight. Its gradient
// must be the plain linear's, and must reach the leaf already in the leaf's row-major layout (one
// GEMM, dW^T = dY^T X), not as a transposed view that the accumulator would have to copy.
TEST(ParallelLinear, TransposedWeightGradientArrivesInTheParametersLayout) {
  const std::int64_t T = 5, B = 3, C = 7, V = 11;
  const Tensor X = global_randn({T, B, C}, 3);
  const Tensor G = global_randn({T, B, V}, 4);
  const Tensor W = global_randn({V, C}, 5);
  // Reference: y = X W^T with the transpose materialised (a contiguous [C, V] weight).
  Tensor ref_wt = W.transpose(0, 1).contiguous();
  ref_wt.set_requires_grad();
  backward(sum(mul(matmul(X, ref_wt), G)));
  const Tensor ref_grad = ref_wt.grad().transpose(0, 1).contiguous();   // [V, C]
  for (int tp : {1, 2, 3}) {
    run_on_mesh(tp, [&](const dist::DeviceMeshPtr& mesh) {
      const auto ctx = nn::ParallelContext::on(mesh, {});
      const ShardRange rows = shard_range(V, tp, ctx->tp.rank());
      nn::ColumnParallelLinear head("head", C, V, {.bias = false, .owns_weight = false}, ctx, 1, DType::Float64);
      Tensor wte = W.narrow(0, rows.offset, rows.size).contiguous();   // this rank's [V_local, C]
      wte.set_requires_grad();
      bool contiguous_at_leaf = false;
      autograd::register_hook(wte, [&](const Tensor& g) {
        contiguous_at_leaf = g.is_contiguous();
        return Tensor();
      });
      const Tensor y = head.forward_with(X, T, transpose(wte, 0, 1), Tensor());   // [T, B, V_local]
      backward(sum(mul(y, G.narrow(2, rows.offset, rows.size))));
      EXPECT_TRUE(contiguous_at_leaf) << "tp " << tp << ": the gradient reached wte as a strided view";
      ASSERT_TRUE(wte.grad().is_contiguous());
      EXPECT_LT(max_abs_diff(wte.grad(), ref_grad.narrow(0, rows.offset, rows.size)), 1e-12) << "tp " << tp;
    });
  }
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

}  // namespace test_layers
