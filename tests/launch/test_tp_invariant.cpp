// TP-invariant mode (--tp-invariant, docs/mesh-invariance.md): loss, every gradient, the gradient norm
// and every optimizer step are bitwise the same at tp = 1, 2 and 4, with and without sequence
// parallelism and overlap, in float32 and float64. Every comparison here is of bytes, never of a
// tolerance; the normal mode's tests (test_trainer, test_equivalence) keep checking that it is
// unchanged.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <unistd.h>

#include "meshgrad/comm/threads.hpp"
#include "meshgrad/nn/invariant.hpp"
#include "meshgrad/tensor/random.hpp"
#include "meshgrad/generate/sample.hpp"
#include "meshgrad/train/trainer.hpp"
#include "launch/invariant_runs.hpp"

namespace meshgrad::launch::test_tp_invariant {
namespace {

void run_mesh(int dp, int tp, const std::function<void(const dist::DeviceMeshPtr&)>& fn) {
  comm::ThreadsOptions options;
  options.timeout = std::chrono::milliseconds(60000);
  const std::vector<dist::MeshAxis> axes{{"dp", dp}, {"tp", tp}};
  comm::run_ranks(dp * tp, [&](const comm::CommunicatorPtr& world) {
    fn(std::make_shared<const dist::DeviceMesh>(world, axes));
  }, options);
}

using testing::read_file;
using testing::RunBits;
using testing::small_gpt;

struct Case {
  int dp = 1, tp = 1;
  bool sp = false, overlap = false;
  int grad_accum = 1;
  std::string str() const {
    return fmt::format("dp={} tp={} sp={} overlap={} grad-accum={}", dp, tp, sp, overlap, grad_accum);
  }
};

nn::ParallelConfig invariant_config(const Case& m) {
  nn::ParallelConfig parallel;
  parallel.sequence_parallel = m.sp;
  parallel.overlap = m.overlap;
  parallel.invariance = nn::Invariance::Tp;
  return parallel;
}

std::string bytes_of(const Tensor& t) {
  const Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.raw_data()), static_cast<std::size_t>(c.numel()) * dtype_size(c.dtype()));
}

train::GradientDump dump_on(const Case& m, const nn::ModelConfig& cfg, const nn::Batch& batch) {
  train::GradientDump result;
  run_mesh(m.dp, m.tp, [&](const dist::DeviceMeshPtr& mesh) {
    auto model = nn::make_model(cfg, invariant_config(m), mesh, 5);
    model->set_training(false);
    train::GradientDump d = train::compute_gradients(*model, batch, mesh);
    if (mesh->rank() == 0) result = std::move(d);
  });
  return result;
}

// The bytes of every gradient and of the loss, across tp = 1, 2, 4 and every mode.
void expect_same_gradients(const nn::ModelConfig& cfg, const std::vector<Case>& cases) {
  const nn::Batch batch{random::randint({cfg.batch, cfg.seq}, 11, cfg.vocab),
                        random::randint({cfg.batch, cfg.seq}, 12, cfg.vocab)};
  const train::GradientDump ref = dump_on(cases.front(), cfg, batch);
  ASSERT_FALSE(ref.gradients.empty());
  for (const auto& [name, g] : ref.gradients) {
    const auto v = g.to_vector();
    EXPECT_TRUE(std::any_of(v.begin(), v.end(), [](double x) { return x != 0; })) << name << " has a zero gradient";
  }
  for (std::size_t c = 1; c < cases.size(); ++c) {
    SCOPED_TRACE(cases[c].str() + " against " + cases.front().str() + ", " + std::string(dtype_name(cfg.dtype)));
    const train::GradientDump got = dump_on(cases[c], cfg, batch);
    EXPECT_EQ(std::memcmp(&got.loss, &ref.loss, sizeof(double)), 0) << got.loss << " vs " << ref.loss;
    ASSERT_EQ(got.gradients.size(), ref.gradients.size());
    for (std::size_t i = 0; i < ref.gradients.size(); ++i) {
      EXPECT_EQ(got.gradients[i].first, ref.gradients[i].first);
      EXPECT_TRUE(bytes_of(got.gradients[i].second) == bytes_of(ref.gradients[i].second))
          << ref.gradients[i].first << ": the gradients differ in their bytes";
    }
  }
}

const std::vector<Case> kTpCases = {{1, 1},       {1, 2},       {1, 4},       {1, 2, true},
                                    {1, 4, true}, {1, 2, false, true}, {1, 4, true, true}};

TEST(TpInvariant, GptGradientsAreTheSameBytesAtTp124Float32) { expect_same_gradients(small_gpt(DType::Float32), kTpCases); }
TEST(TpInvariant, GptGradientsAreTheSameBytesAtTp124Float64) { expect_same_gradients(small_gpt(DType::Float64), kTpCases); }

TEST(TpInvariant, MlpGradientsAreTheSameBytesAtTp124) {
  nn::ModelConfig cfg = small_gpt(DType::Float32);
  cfg.kind = "mlp";
  expect_same_gradients(cfg, kTpCases);
}

// The normal mode is not invariant (so the tests above can fail): at tp=2 some gradient differs.
TEST(TpInvariant, TheNormalModeDiffersInTheLowBits) {
  const nn::ModelConfig cfg = small_gpt(DType::Float32);
  const nn::Batch batch{random::randint({4, 8}, 11, 61), random::randint({4, 8}, 12, 61)};
  auto normal = [&](int tp) {
    train::GradientDump result;
    run_mesh(1, tp, [&](const dist::DeviceMeshPtr& mesh) {
      auto model = nn::make_model(cfg, nn::ParallelConfig{}, mesh, 5);
      train::GradientDump d = train::compute_gradients(*model, batch, mesh);
      if (mesh->rank() == 0) result = std::move(d);
    });
    return result;
  };
  const train::GradientDump a = normal(1), b = normal(2);
  int differing = 0;
  for (std::size_t i = 0; i < a.gradients.size(); ++i) {
    differing += bytes_of(a.gradients[i].second) != bytes_of(b.gradients[i].second) ? 1 : 0;
  }
  EXPECT_GT(differing, 0);
}

// 30 steps of training (dropout on, gradient clipping on) on the built-in corpus.
RunBits train_on(const Case& m, DType dtype, const std::string& tag) {
  train::TrainOptions o;
  o.model = small_gpt(dtype);
  o.model.vocab = 0;   // the bytes of the corpus: 256
  o.model.seq = 16;
  o.model.dropout = 0.1;
  o.parallel = invariant_config(m);
  o.steps = 30;
  o.lr = 3e-3;
  o.grad_clip = 0.5;
  o.grad_accum = m.grad_accum;
  o.progress = false;
  const std::string path = (std::filesystem::temp_directory_path() /
                            fmt::format("meshgrad_tpinv_{}_{}.safetensors", ::getpid(), tag)).string();
  o.save_path = path;
  RunBits bits;
  o.on_step = [&](const train::StepMetrics& s) { bits.grad_norms.push_back(s.grad_norm); };
  std::vector<double> losses;
  run_mesh(m.dp, m.tp, [&](const dist::DeviceMeshPtr& mesh) {
    train::TrainResult r = train::train(o, mesh);
    if (mesh->rank() == 0) losses = r.losses;
  });
  bits.losses = losses;
  bits.parameters = read_file(path);
  std::filesystem::remove(path);
  return bits;
}

void expect_same_training(DType dtype, const std::vector<Case>& cases) {
  const RunBits ref = train_on(cases.front(), dtype, "ref");
  ASSERT_EQ(ref.losses.size(), 30u);
  ASSERT_FALSE(ref.parameters.empty());
  EXPECT_LT(ref.losses.back(), ref.losses.front());
  for (std::size_t c = 1; c < cases.size(); ++c) {
    SCOPED_TRACE(cases[c].str() + ", " + std::string(dtype_name(dtype)));
    const RunBits got = train_on(cases[c], dtype, fmt::format("case{}", c));
    ASSERT_EQ(got.losses.size(), ref.losses.size());
    EXPECT_EQ(std::memcmp(got.losses.data(), ref.losses.data(), ref.losses.size() * sizeof(double)), 0)
        << "losses differ: last " << got.losses.back() << " vs " << ref.losses.back();
    ASSERT_EQ(got.grad_norms.size(), ref.grad_norms.size());
    EXPECT_EQ(std::memcmp(got.grad_norms.data(), ref.grad_norms.data(), ref.grad_norms.size() * sizeof(double)), 0)
        << "gradient norms differ";
    EXPECT_TRUE(got.parameters == ref.parameters) << "the trained parameters differ in their bytes";
  }
}

TEST(TpInvariant, ThirtyTrainingStepsAreTheSameBytesFloat32) {
  expect_same_training(DType::Float32, {{1, 1}, {1, 2}, {1, 4, true}, {1, 2, true, true}, {1, 4, false, true}});
}
TEST(TpInvariant, ThirtyTrainingStepsAreTheSameBytesFloat64) {
  expect_same_training(DType::Float64, {{1, 1}, {1, 4}, {1, 2, true, true}});
}

// dp x tp: at a fixed dp the tp degree changes nothing either (the dp sum is the backend's rank-order
// all-reduce of replicas that are each tp-invariant).
TEST(TpInvariant, DpTimesTpMeshesMatchTheirDpOnlyRun) {
  expect_same_gradients(small_gpt(DType::Float32), {{2, 1}, {2, 2}, {2, 2, true, true}});
}

// dp too: the micro-batches (dp x grad-accum of them, equal rows) are added in the fixed tree, locally
// and over dp, so every mesh with the same dp x grad-accum trains the same bytes as one rank with
// that many micro-batches (dropout and clipping on; batch 4 rows: dp x grad-accum = 4 is one row each).
TEST(TpInvariant, DpMeshesTrainTheBytesOfOneRankWithAsManyMicroBatches) {
  expect_same_training(DType::Float32, {{.grad_accum = 4},
                                        {.dp = 4},
                                        {.dp = 2, .grad_accum = 2},
                                        {.dp = 2, .tp = 2, .sp = true, .overlap = true, .grad_accum = 2},
                                        {.dp = 4, .tp = 1, .overlap = true}});
  expect_same_training(DType::Float64, {{.grad_accum = 2}, {.dp = 2, .tp = 2, .sp = true}});
}

// What the test above would catch: the micro-batch count changes the bits (another tree), so a dp
// mesh must be compared with one rank running as many micro-batches.
TEST(TpInvariant, TheMicroBatchCountChangesTheBits) {
  const RunBits one = train_on({}, DType::Float32, "k1");
  const RunBits four = train_on({.dp = 4}, DType::Float32, "dp4");
  ASSERT_EQ(one.losses.size(), four.losses.size());
  EXPECT_NE(std::memcmp(one.losses.data(), four.losses.data(), one.losses.size() * sizeof(double)), 0);
  EXPECT_FALSE(one.parameters == four.parameters);
}

TEST(TpInvariant, RefusesABatchThatDoesNotSplitIntoEqualMicroBatches) {
  EXPECT_NO_THROW(train::check_invariant_batch_split(8, 2, 4, "dp=2"));
  try {
    train::check_invariant_batch_split(6, 2, 2, "dp=2");
    ADD_FAILURE() << "6 rows into 4 micro-batches was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of 4"), std::string::npos) << e.what();
  }
  EXPECT_THROW(train::check_invariant_batch_split(12, 1, 3, "tp=2"), InvalidArgument);   // 3 micro-batches: no binary tree
}

// A degree that cannot keep the tree is refused, naming the degrees that work.
// Sampling: the decode logits (prefill and cached steps) are the same bytes at tp = 1, 2, 4, so a
// seeded sample is the same text at every degree (in the normal mode only greedy is promised).
TEST(TpInvariant, DecodeLogitsAreTheSameBytesAtTp124) {
  const nn::ModelConfig c = small_gpt(DType::Float32);
  std::vector<std::vector<float>> per_tp;
  std::vector<std::vector<std::int64_t>> tokens_per_tp;
  for (int tp : {1, 2, 4}) {
    std::vector<float> logits;
    std::vector<std::int64_t> tokens;
    run_mesh(1, tp, [&](const dist::DeviceMeshPtr& mesh) {
      auto model = nn::make_model(c, invariant_config({1, tp}), mesh, 11);
      model->set_training(false);
      nn::KvCache cache = model->new_cache(1);
      const Tensor prompt = Tensor::from_int64(std::vector<std::int64_t>{3, 14, 15, 9}, {1, 4});
      Tensor step = model->decode(prompt, cache);
      std::vector<float> mine;
      for (int i = 0; i < 3; ++i) {
        for (double v : step.to_vector()) mine.push_back(static_cast<float>(v));
        step = model->decode(Tensor::from_int64(std::vector<std::int64_t>{(7 * i + 2) % c.vocab}, {1, 1}), cache);
      }
      generate::GenerateOptions g;
      g.tokens = 3;
      g.sampling.temperature = 0.9;
      g.sampling.seed = 5;
      const generate::Generation gen = generate::generate(*model, {1, 2, 3}, g);
      if (mesh->rank() == 0) {
        logits = mine;
        tokens = gen.tokens;
      }
    });
    per_tp.push_back(logits);
    tokens_per_tp.push_back(tokens);
  }
  ASSERT_FALSE(per_tp[0].empty());
  for (std::size_t k = 1; k < per_tp.size(); ++k) {
    ASSERT_EQ(per_tp[k].size(), per_tp[0].size());
    EXPECT_EQ(std::memcmp(per_tp[k].data(), per_tp[0].data(), per_tp[0].size() * sizeof(float)), 0) << "tp case " << k;
    EXPECT_EQ(tokens_per_tp[k], tokens_per_tp[0]);
  }
}

TEST(TpInvariant, RefusesADegreeThatCannotKeepTheTree) {
  auto message_at = [](const nn::ModelConfig& cfg, int tp) {
    std::string message;
    run_mesh(1, tp, [&](const dist::DeviceMeshPtr& mesh) {
      try {
        nn::make_model(cfg, invariant_config({1, tp}), mesh, 5);
      } catch (const InvalidArgument& e) {
        if (mesh->rank() == 0) message = e.what();
      }
    });
    return message;
  };
  const std::string three = message_at(small_gpt(DType::Float32), 3);
  EXPECT_NE(three.find("tp=3"), std::string::npos) << three;
  EXPECT_NE(three.find("Degrees that work for this model: tp = 1, 2, 4"), std::string::npos) << three;
  // 6 tokens over 4 blocks are 2, 2, 1, 1; tp=2 holds 3 and 3: block 1 would be cut.
  nn::ModelConfig cfg = small_gpt(DType::Float32);
  cfg.vocab = 6;
  const std::string two = message_at(cfg, 2);
  EXPECT_NE(two.find("vocabulary"), std::string::npos) << two;
  EXPECT_NE(two.find("tp = 1, 4"), std::string::npos) << two;
  // The advice leaves out degrees above the heads, which the mesh check refuses (reliability-2 R8b:
  // --invariant-blocks 64 advised tp=64 for a 4-head model).
  nn::ModelConfig three_heads = small_gpt(DType::Float32);
  three_heads.heads = 3;
  three_heads.hidden = 24;
  const std::string advice = message_at(three_heads, 3);
  EXPECT_NE(advice.find("Degrees that work for this model: tp = 1, 2 ("), std::string::npos) << advice;
}

}  // namespace
}  // namespace meshgrad::launch::test_tp_invariant
