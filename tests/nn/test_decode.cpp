// Incremental decoding with a key/value cache (Model::decode): each step's logits equal a full
// recompute of the whole prefix, on one rank and tensor-parallel (1-D and 2-D); a whole-sequence
// decode gives the logits whose cross-entropy is loss(); a step with T cached positions computes T
// attention scores per head (O(T) per token, not O(T^2)); misuse is refused.
//
// Tolerance: float64, 1e-12 relative to the largest logit. The cached step computes the same
// products as the full pass, only in BLAS calls of other shapes (one query row against the key
// tiles instead of 64), so results agree to a few ulps.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <mutex>

#include "nn_test_util.hpp"

namespace test_decode {

using namespace meshgrad;
using namespace meshgrad::testing;

namespace {

nn::ModelConfig decode_gpt() {
  nn::ModelConfig c;
  c.kind = "gpt";
  c.layers = 2;
  c.hidden = 12;
  c.heads = 4;
  c.vocab = 37;       // uneven over tp = 2, 3, 4
  c.positions = 12;
  c.seq = 12;
  c.batch = 2;
  c.dtype = DType::Float64;
  return c;
}

// max |a - b| / max |b|.
double rel_diff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  const auto va = a.to_vector(), vb = b.to_vector();
  double scale = 1e-300, diff = 0;
  for (std::size_t i = 0; i < vb.size(); ++i) {
    scale = std::max(scale, std::abs(vb[i]));
    diff = std::max(diff, std::abs(va[i] - vb[i]));
  }
  return diff / scale;
}

struct Mesh {
  std::string name;
  int ranks;
  std::vector<dist::MeshAxis> axes;
};

void PrintTo(const Mesh& m, std::ostream* os) { *os << m.name; }

std::vector<Mesh> meshes() {
  return {{"tp1", 1, {{"tp", 1}}},
          {"tp2", 2, {{"tp", 2}}},
          {"tp3", 3, {{"tp", 3}}},
          {"dp2_tp2", 4, {{"dp", 2}, {"tp", 2}}},
          {"tp2x2", 4, {{"tp_row", 2}, {"tp_col", 2}}}};
}

// Rank 0's logits of every step of a generation of `tokens` [B, N] after a prefill of `prompt`
// positions, with the cache (cached) and recomputing the whole prefix each step (full).
struct StepLogits {
  std::vector<Tensor> cached, full;
  std::vector<std::int64_t> step_scores;   // attention scores of each cached step after the prefill
  std::int64_t local_heads = 0;
};

StepLogits run_steps(const nn::ModelConfig& cfg, const Mesh& m, const Tensor& tokens, std::int64_t prompt) {
  StepLogits out;
  std::mutex mu;
  run_on_mesh(m.ranks, [&](const dist::DeviceMeshPtr& mesh) {
    auto model = nn::make_model(cfg, {}, mesh, 5);
    model->set_training(false);
    StepLogits mine;
    nn::KvCache cache = model->new_cache(tokens.size(0));
    mine.local_heads = cache.keys[0].size(1);
    mine.cached.push_back(model->decode(tokens.narrow(1, 0, prompt).contiguous(), cache));
    for (std::int64_t t = prompt; t < tokens.size(1); ++t) {
      const std::int64_t before = cache.attention_scores;
      mine.cached.push_back(model->decode(tokens.narrow(1, t, 1).contiguous(), cache));
      mine.step_scores.push_back(cache.attention_scores - before);
    }
    for (std::int64_t t = prompt; t <= tokens.size(1); ++t) {
      nn::KvCache fresh = model->new_cache(tokens.size(0));
      mine.full.push_back(model->decode(tokens.narrow(1, 0, t).contiguous(), fresh));
    }
    if (mesh->rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      out = std::move(mine);
    }
  }, m.axes);
  return out;
}

class DecodeOnMesh : public ::testing::TestWithParam<Mesh> {};

TEST_P(DecodeOnMesh, CachedStepsEqualTheFullRecomputeAndTouchTKeys) {
  const nn::ModelConfig cfg = decode_gpt();
  const Mesh& m = GetParam();
  const Tensor tokens = random::randint({2, 12}, 17, cfg.vocab);
  const std::int64_t prompt = 4;
  const StepLogits run = run_steps(cfg, m, tokens, prompt);
  ASSERT_EQ(run.cached.size(), run.full.size());
  for (std::size_t i = 0; i < run.cached.size(); ++i) {
    ASSERT_EQ(run.cached[i].shape(), (Shape{2, cfg.vocab}));
    EXPECT_LT(rel_diff(run.cached[i], run.full[i]), 1e-12) << m.name << " step " << i;
  }
  // A step at length T (the new position included) computes B x H_local x T scores per block.
  for (std::size_t i = 0; i < run.step_scores.size(); ++i) {
    const std::int64_t keys = prompt + static_cast<std::int64_t>(i) + 1;
    EXPECT_EQ(run.step_scores[i], cfg.layers * 2 * run.local_heads * keys) << m.name << " step " << i;
  }
  // And the same logits as one rank (a reordered sum: a few ulps).
  if (m.ranks > 1) {
    const StepLogits one = run_steps(cfg, meshes()[0], tokens, prompt);
    for (std::size_t i = 0; i < run.cached.size(); ++i) {
      EXPECT_LT(rel_diff(run.cached[i], one.cached[i]), 1e-12) << m.name << " vs tp=1, step " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Meshes, DecodeOnMesh, ::testing::ValuesIn(meshes()),
                         [](const ::testing::TestParamInfo<Mesh>& info) { return info.param.name; });

// A Mistral-style model (a sliding window of 3 positions, shorter than the 12 generated): each cached
// step sees the same window of keys as the full recompute of the prefix, on one rank and at tp=2.
TEST(Decode, SlidingWindowCachedStepsEqualTheFullRecompute) {
  nn::ModelConfig cfg = decode_gpt();
  cfg.kind = "llama";
  cfg.kv_heads = 1;
  cfg.heads = 2;   // head_dim 6: RoPE rotates pairs
  cfg.ffn = 24;
  cfg.sliding_window = 3;
  const Tensor tokens = random::randint({2, 12}, 19, cfg.vocab);
  const StepLogits one = run_steps(cfg, meshes()[0], tokens, 4);
  const StepLogits two = run_steps(cfg, meshes()[1], tokens, 4);
  ASSERT_FALSE(one.cached.empty());
  for (std::size_t i = 0; i < one.cached.size(); ++i) {
    EXPECT_LT(rel_diff(one.cached[i], one.full[i]), 1e-12) << "step " << i;
    EXPECT_LT(rel_diff(two.cached[i], one.cached[i]), 1e-12) << "tp=2 step " << i;
  }
  // Without the window the logits differ: the window is applied.
  cfg.sliding_window = 0;
  const StepLogits plain = run_steps(cfg, meshes()[0], tokens, 4);
  EXPECT_GT(rel_diff(plain.cached.back(), one.cached.back()), 1e-6);
}

// decode of whole sequences is the training forward: the mean cross-entropy of its logits is loss().
TEST(Decode, AllPositionLogitsGiveTheTrainingLoss) {
  nn::ModelConfig cfg = decode_gpt();
  const nn::Batch batch = make_batch(cfg, 23);
  for (int tp : {1, 2}) {
    std::mutex mu;
    double loss = 0, from_logits = 0;
    run_on_mesh(tp, [&](const dist::DeviceMeshPtr& mesh) {
      auto model = nn::make_model(cfg, {}, mesh, 5);
      model->set_training(false);
      nn::KvCache cache = model->new_cache(cfg.batch);
      const Tensor logits = model->decode(batch.inputs, cache, /*all_positions=*/true);
      ASSERT_EQ(logits.shape(), (Shape{cfg.batch, cfg.seq, cfg.vocab}));
      EXPECT_EQ(cache.length, cfg.seq);
      const double l = model->loss(batch, cfg.batch * cfg.seq).item();
      // Mean over positions of logsumexp - the target's logit, in float64.
      const auto z = logits.to_vector();
      const auto targets = batch.targets.to_int64_vector();
      double total = 0;
      for (std::size_t row = 0; row < targets.size(); ++row) {
        const double* r = z.data() + row * static_cast<std::size_t>(cfg.vocab);
        const double mx = *std::max_element(r, r + cfg.vocab);
        double se = 0;
        for (int v = 0; v < cfg.vocab; ++v) se += std::exp(r[v] - mx);
        total += mx + std::log(se) - r[targets[row]];
      }
      if (mesh->rank() == 0) {
        std::lock_guard<std::mutex> lock(mu);
        loss = l;
        from_logits = total / static_cast<double>(targets.size());
      }
    });
    EXPECT_NEAR(from_logits, loss, 1e-12 * loss) << "tp=" << tp;
  }
}

TEST(Decode, MisuseIsRefused) {
  nn::ModelConfig cfg = decode_gpt();
  run_on_mesh(1, [&](const dist::DeviceMeshPtr& mesh) {
    auto model = nn::make_model(cfg, {}, mesh, 5);
    nn::KvCache cache = model->new_cache(1);
    model->decode(random::randint({1, 10}, 3, cfg.vocab), cache);
    // Two more positions than n_positions = 12 leaves room for.
    try {
      model->decode(random::randint({1, 4}, 3, cfg.vocab), cache);
      ADD_FAILURE() << "decoding past n_positions must throw";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("do not fit in n_positions = 12"), std::string::npos) << e.what();
    }
    EXPECT_EQ(cache.length, 10) << "a refused call must not change the cache";
    EXPECT_THROW(model->decode(random::randint({2, 1}, 3, cfg.vocab), cache), InvalidArgument);    // batch 2 != 1
    EXPECT_THROW(model->decode(Tensor::zeros({1, 1}, DType::Float64), cache), InvalidArgument);    // not int64
    EXPECT_THROW(model->decode(Tensor::from_int64(std::vector<std::int64_t>{37}, {1, 1}), cache), InvalidArgument);
    EXPECT_THROW(model->new_cache(0), InvalidArgument);
    nn::ModelConfig mlp = cfg;
    mlp.kind = "mlp";
    EXPECT_THROW(nn::make_model(mlp, {}, mesh, 5)->new_cache(1), InvalidArgument);
  });
  run_on_mesh(2, [&](const dist::DeviceMeshPtr& mesh) {
    nn::ParallelConfig sp;
    sp.sequence_parallel = true;
    auto model = nn::make_model(cfg, sp, mesh, 5);
    nn::KvCache cache = model->new_cache(1);
    EXPECT_THROW(model->decode(random::randint({1, 3}, 3, cfg.vocab), cache), InvalidArgument);
  });
}

}  // namespace

}  // namespace test_decode
