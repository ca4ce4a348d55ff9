// Context parallelism (nn/context_parallel.hpp): the chunk layout, and GPT-2 and a Mistral-style
// Llama (grouped-query attention, RoPE, a sliding window that crosses the chunks) trained on cp
// meshes against the same model on one rank, in float64, with every axis cp combines with; dropout
// masks by global position; the collectives cp adds; the refusals.
//
// Tolerance: 1e-9 relative on every gradient and 1e-12 on the loss. The cp model computes the same
// products in another grouping (each chunk's attention against the keys up to it, the weight
// gradients summed over cp ranks), so it agrees to a few float64 ulps over a few hundred terms
// (measured: <= 1e-14); a wrong mask, position or reduction moves a gradient by far more.
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>
#include <string>
#include <vector>

#include "meshgrad/data/synthetic.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/nn/context_parallel.hpp"
#include "meshgrad/train/step.hpp"
#include "run_on_spec.hpp"

namespace meshgrad::train::test_context_parallel {
namespace {

nn::ModelConfig gpt(int seq) {
  nn::ModelConfig c = nn::ModelConfig::gpt(2, 24, 4, 41, seq, 4, DType::Float64);
  return c;
}

nn::ModelConfig mistral(int seq) {
  nn::ModelConfig c = gpt(seq);
  c.kind = "llama";
  c.model_type = "mistral";
  c.kv_heads = 2;
  c.ffn = 40;
  c.sliding_window = 5;   // crosses every chunk boundary at these lengths
  c.max_window_layers = 0;
  c.tie_word_embeddings = false;
  return c;
}

struct CpRun {
  GradientDump dump;
  dist::CommCounter counter;   // rank 0's
};

CpRun run(const nn::ModelConfig& cfg, const std::string& mesh, nn::ParallelConfig parallel = {}) {
  const nn::Batch batch = data::make_synthetic_batch(cfg, 1, 0, 77);
  CpRun out;
  std::mutex mu;
  run_on(mesh, [&](const dist::DeviceMeshPtr& m) {
    dist::CommCounter counter;
    GradientDump d;
    {
      dist::CountingScope counting(counter);
      auto model = nn::make_model(cfg, parallel, m, 5);
      d = compute_gradients(*model, batch, m);
    }
    if (m->rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      out.dump = std::move(d);
      out.counter = counter;
    }
  });
  return out;
}

double worst_relative_difference(const GradientDump& a, const GradientDump& b) {
  EXPECT_EQ(a.gradients.size(), b.gradients.size());
  double worst = std::abs(a.loss - b.loss) / std::abs(b.loss);
  for (std::size_t i = 0; i < std::min(a.gradients.size(), b.gradients.size()); ++i) {
    EXPECT_EQ(a.gradients[i].first, b.gradients[i].first);
    const std::vector<double> x = a.gradients[i].second.to_vector(), y = b.gradients[i].second.to_vector();
    if (x.size() != y.size()) return INFINITY;
    double diff = 0, scale = 1e-300;
    for (std::size_t k = 0; k < x.size(); ++k) {
      diff = std::max(diff, std::abs(x[k] - y[k]));
      scale = std::max(scale, std::abs(y[k]));
    }
    worst = std::max(worst, diff / scale);
  }
  return worst;
}

TEST(ContextChunks, EachRankHoldsChunkRAndItsMirror) {
  using nn::PositionRun;
  EXPECT_EQ(nn::context_chunks(12, 1, 0), (std::vector<PositionRun>{{0, 0, 12}}));
  EXPECT_EQ(nn::context_chunks(16, 2, 0), (std::vector<PositionRun>{{0, 0, 4}, {4, 12, 4}}));
  EXPECT_EQ(nn::context_chunks(16, 2, 1), (std::vector<PositionRun>{{0, 4, 4}, {4, 8, 4}}));
  EXPECT_EQ(nn::context_chunks(16, 4, 3), (std::vector<PositionRun>{{0, 6, 2}, {2, 8, 2}}));
  // Every position is held once, and every rank computes 2 cp + 1 chunk products under the mask.
  for (const int cp : {2, 4, 8}) {
    std::vector<int> held(static_cast<std::size_t>(32), 0);
    for (int r = 0; r < cp; ++r) {
      std::int64_t products = 0;
      for (const PositionRun& c : nn::context_chunks(32, cp, r)) {
        for (std::int64_t p = c.global; p < c.global + c.size; ++p) ++held[static_cast<std::size_t>(p)];
        products += (c.global + c.size) / c.size;   // key chunks up to this one
      }
      EXPECT_EQ(products, 2 * cp + 1) << "cp=" << cp << " rank " << r;
    }
    for (const int h : held) EXPECT_EQ(h, 1) << "cp=" << cp;
  }
  // A sequence-parallel shard of the local rows, across the two chunks.
  EXPECT_EQ(nn::rows_of(nn::context_chunks(16, 2, 0), 2, 4), (std::vector<PositionRun>{{0, 2, 2}, {2, 12, 2}}));
  EXPECT_EQ(nn::rows_of(nn::context_chunks(16, 2, 1), 4, 4), (std::vector<PositionRun>{{0, 8, 4}}));
  EXPECT_THROW(nn::context_chunks(10, 2, 0), InvalidArgument);
}

// --mesh-invariant's sequence blocks: each rank's blocks in the leaf order 0, N-1, 1, N-2, ... of the
// blocks' tree, so that a rank's blocks at cp are the union of ranks 2r and 2r + 1's at 2 cp (a
// subtree), and any run of consecutive local blocks of a power-of-two length on its boundary too.
TEST(ContextChunks, SequenceBlocksAreLaidOutInTheTreesLeafOrder) {
  using nn::PositionRun;
  // N = 8 blocks of 2 positions: one rank holds them all in leaf order.
  std::vector<std::int64_t> first;
  for (const PositionRun& r : nn::context_runs(16, 1, 0, 8)) first.push_back(r.global / 2);
  EXPECT_EQ(first, (std::vector<std::int64_t>{0, 7, 1, 6, 2, 5, 3, 4}));
  EXPECT_EQ(nn::context_runs(16, 2, 1, 8),
            (std::vector<PositionRun>{{0, 4, 2}, {2, 10, 2}, {4, 6, 2}, {6, 8, 2}}));   // blocks 2 5 3 4
  // Two blocks per rank are its two chunks: the normal layout.
  EXPECT_EQ(nn::context_runs(16, 4, 3, 8), nn::context_chunks(16, 4, 3));
  // The subtree property, for every cp up to N / 2.
  const int n = 16;
  const auto blocks_of = [&](int cp, int r) {
    std::vector<std::int64_t> out;
    for (const PositionRun& run : nn::context_runs(64, cp, r, n)) out.push_back(run.global / (64 / n));
    return out;
  };
  const std::vector<std::int64_t> leaves = blocks_of(1, 0);
  for (int cp = 1; cp <= n / 2; cp *= 2) {
    for (int r = 0; r < cp; ++r) {
      const std::vector<std::int64_t> mine = blocks_of(cp, r);
      const std::vector<std::int64_t> subtree(leaves.begin() + r * (n / cp), leaves.begin() + (r + 1) * (n / cp));
      EXPECT_EQ(mine, subtree) << "cp=" << cp << " rank " << r;
    }
  }
  EXPECT_THROW(nn::context_runs(16, 4, 0, 4), InvalidArgument);   // 4 blocks cannot give 4 ranks two chunks
}

class CpGrads : public ::testing::TestWithParam<std::string> {};

// The meshes of the issue (cp=2, cp=4, cp=2 x tp=2, dp=2 x cp=2) and every axis cp combines with.
TEST_P(CpGrads, Float64GradientsEqualTheOneRankModel) {
  const nn::ModelConfig cfg = GetParam() == "gpt" ? gpt(16) : mistral(16);
  const CpRun one = run(cfg, "tp=1");
  ASSERT_FALSE(one.dump.gradients.empty());
  struct Mesh {
    std::string spec;
    bool sp = false, checkpoint = false, gather = false;   // gather: --cp-schedule all-gather
  };
  for (const Mesh& m : {Mesh{"cp=2"}, Mesh{"cp=4"}, Mesh{"cp=2,tp=2"}, Mesh{"cp=2,tp=2", true}, Mesh{"dp=2,cp=2"},
                        Mesh{"fsdp=2,cp=2"}, Mesh{"pp=2,cp=2"}, Mesh{"cp=2", false, true}, Mesh{"cp=2,tp=2x1"},
                        Mesh{"cp=2", false, false, true}, Mesh{"cp=4", false, false, true},
                        Mesh{"cp=2,tp=2", true, true, true}}) {
    nn::ParallelConfig parallel;
    parallel.sequence_parallel = m.sp;
    parallel.checkpoint_blocks = m.checkpoint;
    parallel.cp_ring = !m.gather;
    const double worst = worst_relative_difference(run(cfg, m.spec, parallel).dump, one.dump);
    const std::string what = m.spec + (m.sp ? " +sp" : "") + (m.checkpoint ? " +checkpoint-blocks" : "") +
                             (m.gather ? " all-gather" : " ring");
    EXPECT_LE(worst, 1e-9) << what;
    std::fprintf(stderr, "%s %s: largest relative difference to one rank %.2e\n", GetParam().c_str(), what.c_str(),
                 worst);
  }
}

INSTANTIATE_TEST_SUITE_P(Family, CpGrads, ::testing::Values("gpt", "mistral"));

// Chunks that are not whole attention tiles (160 positions: chunks of 40 at cp=2, the tile 64): the
// kernel's tiles cross the chunk boundaries.
TEST(CpGrads, ChunksAcrossTheKernelsTiles) {
  const nn::ModelConfig cfg = mistral(160);
  const CpRun one = run(cfg, "tp=1");
  EXPECT_LE(worst_relative_difference(run(cfg, "cp=2").dump, one.dump), 1e-9);
  nn::ParallelConfig gather;
  gather.cp_ring = false;
  EXPECT_LE(worst_relative_difference(run(cfg, "cp=2", gather).dump, one.dump), 1e-9);
}

// Dropout masks are drawn by global position: a rank's chunks draw their slice of the one-rank mask,
// with sequence parallelism splitting the chunks further.
TEST(CpGrads, DropoutMasksFollowTheGlobalPositions) {
  nn::ModelConfig cfg = gpt(16);
  cfg.dropout = 0.2;
  const CpRun one = run(cfg, "tp=1");
  nn::ModelConfig plain = cfg;
  plain.dropout = 0;
  ASSERT_NE(run(plain, "tp=1").dump.loss, one.dump.loss) << "dropout does nothing: the test shows nothing";
  nn::ParallelConfig sp;
  sp.sequence_parallel = true;
  EXPECT_LE(worst_relative_difference(run(cfg, "cp=2").dump, one.dump), 1e-9);
  EXPECT_LE(worst_relative_difference(run(cfg, "cp=2,tp=2", sp).dump, one.dump), 1e-9);
}

// What crosses cp with --cp-schedule all-gather: per block the keys' and the values' all-gather in
// forward, the same gathers again in backward (no block keeps the whole sequence's keys) and the
// reduce-scatter of their gradients (the rule's dual), and nothing else in forward.
TEST(CpGrads, CollectivesAreTheKeysGatherAndItsDual) {
  const nn::ModelConfig cfg = gpt(16);
  nn::ParallelConfig gather;
  gather.cp_ring = false;
  const CpRun two = run(cfg, "cp=2", gather);
  EXPECT_EQ(two.counter.count(dist::Phase::Forward, "all_gather", "cp"), 2 * cfg.layers) << "keys and values per block";
  EXPECT_EQ(two.counter.count(dist::Phase::Backward, "all_gather", "cp"), 2 * cfg.layers) << "gathered again";
  EXPECT_EQ(two.counter.count(dist::Phase::Backward, "reduce_scatter", "cp"), 2 * cfg.layers) << "their gradients";
  EXPECT_EQ(two.counter.count(dist::Phase::Forward, "all_reduce", "cp"), 0) << "nothing else crosses cp in forward";
}

// The ring (the default): per block in forward cp - 1 transfers of a rank's keys and values (one
// tensor) to the next rank; in backward the same again, and cp transfers of the pieces' gradient
// sums (the last one home to the owner); no collective over cp in forward.
TEST(CpGrads, TheRingPassesEachPieceOnceAroundAndItsGradientsHome) {
  const nn::ModelConfig cfg = gpt(16);
  for (const int cp : {2, 4}) {
    SCOPED_TRACE("cp=" + std::to_string(cp));
    const CpRun ring = run(cfg, "cp=" + std::to_string(cp));
    EXPECT_EQ(ring.counter.count(dist::Phase::Forward, "send", "cp"), (cp - 1) * cfg.layers);
    EXPECT_EQ(ring.counter.count(dist::Phase::Forward, "recv", "cp"), (cp - 1) * cfg.layers);
    EXPECT_EQ(ring.counter.count(dist::Phase::Backward, "send", "cp"), (2 * cp - 1) * cfg.layers);
    EXPECT_EQ(ring.counter.count(dist::Phase::Backward, "recv", "cp"), (2 * cp - 1) * cfg.layers);
    EXPECT_EQ(ring.counter.count(dist::Phase::Forward, "all_gather", "cp"), 0);
    EXPECT_EQ(ring.counter.count(dist::Phase::Forward, "all_reduce", "cp"), 0);
  }
}

TEST(CpRefusals, SequenceAndInvariantModesAreRefusedByName) {
  const nn::ModelConfig cfg = gpt(12);   // 12 does not cut into 2 x 4 chunks
  try {
    run(cfg, "cp=4");
    ADD_FAILURE() << "a sequence of 12 on cp=4 was accepted";
  } catch (const InvalidArgument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("cp = 4"), std::string::npos) << msg;
    EXPECT_NE(msg.find("12 positions"), std::string::npos) << msg;
    EXPECT_NE(msg.find("multiple of 8"), std::string::npos) << msg;
  }
  // --tp-invariant cannot fix the sums over cp; --mesh-invariant can with sequence blocks, and says so.
  for (const nn::Invariance mode : {nn::Invariance::Tp, nn::Invariance::Mesh}) {
    nn::ParallelConfig parallel;
    parallel.invariance = mode;
    try {
      run(gpt(16), "cp=2", parallel);
      ADD_FAILURE() << "an invariant mode on cp=2 without --sequence-blocks was accepted";
    } catch (const InvalidArgument& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(mode == nn::Invariance::Tp ? "--tp-invariant with context parallelism"
                                                     : "give --sequence-blocks a multiple of 2 x cp = 4"),
                std::string::npos) << msg;
      EXPECT_NE(msg.find("cp=2"), std::string::npos) << msg;
    }
  }
}

}  // namespace
}  // namespace meshgrad::train::test_context_parallel
