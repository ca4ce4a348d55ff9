// The jobs the CLI and the Python module share (launch/jobs.hpp) and the trainer's per-step
// callback: options are checked with the option's name before any rank starts, the callback sees
// every step on rank 0, and the seed-mode gradients do not depend on the mesh.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <unistd.h>
#include <string>
#include <vector>

#include "meshgrad/comm/threads.hpp"
#include "meshgrad/tensor/error.hpp"
#include "meshgrad/checkpoint/parameter_file.hpp"
#include "meshgrad/interop/gpt2_config.hpp"
#include "meshgrad/io/safetensors.hpp"
#include "meshgrad/launch/jobs.hpp"

namespace meshgrad::launch::test_jobs {
namespace {

nn::ModelConfig tiny_gpt(int vocab) {
  return {.kind = "gpt", .layers = 1, .hidden = 16, .heads = 4, .vocab = vocab, .seq = 8, .batch = 4};
}

// The job's ranks as dp x tp rank threads.
dist::RunOnMesh threads_mesh(int dp, int tp) {
  return [dp, tp](const std::function<void(const dist::DeviceMeshPtr&)>& fn) {
    comm::run_ranks(dp * tp, [&](const comm::CommunicatorPtr& world) {
      fn(std::make_shared<const dist::DeviceMesh>(world, std::vector<dist::MeshAxis>{{"dp", dp}, {"tp", tp}}));
    });
  };
}

train::TrainOptions tiny_job(int steps) {
  train::TrainOptions o;
  o.model = tiny_gpt(256);   // byte tokens
  o.steps = steps;
  o.progress = false;
  return o;
}

// The message of the InvalidArgument fn throws ("" when it does not throw).
template <class Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(Jobs, OnStepSeesEveryStepOnRankZeroWithTheResultsLosses) {
  train::TrainOptions o = tiny_job(4);
  std::vector<train::StepMetrics> seen;   // only rank 0's thread calls on_step
  o.on_step = [&](const train::StepMetrics& m) { seen.push_back(m); };
  const train::TrainResult result = run_train_job(o, threads_mesh(2, 2));
  ASSERT_EQ(seen.size(), 4u);
  ASSERT_EQ(result.losses.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(seen[i].step, i + 1);
    EXPECT_EQ(seen[i].loss, result.losses[i]);
    EXPECT_DOUBLE_EQ(seen[i].lr, learning_rate(o, i));
    EXPECT_GT(seen[i].tokens_per_s, 0);
  }
}

TEST(Jobs, TrainOptionsAreCheckedByTheirCliName) {
  struct Case {
    void (*change)(train::TrainOptions&);
    const char* message;
  };
  const std::vector<Case> cases = {
      {[](train::TrainOptions& o) { o.steps = 0; }, "train: --steps must be >= 1, got 0"},
      {[](train::TrainOptions& o) { o.model.layers = 0; }, "train: --layers must be >= 1, got 0"},
      {[](train::TrainOptions& o) { o.model.heads = -2; }, "train: --heads must be >= 1, got -2"},
      {[](train::TrainOptions& o) { o.model.dropout = 1.0; }, "train: --dropout must be in [0, 1), got 1"},
      {[](train::TrainOptions& o) { o.model.dtype = DType::Int64; }, "train: --dtype must be float32 or float64"},
      {[](train::TrainOptions& o) { o.lr = 0; }, "train: --lr must be > 0, got 0"},
  };
  for (const Case& c : cases) {
    train::TrainOptions o = tiny_job(1);
    c.change(o);
    bool ran = false;   // the checks come before any rank starts
    const std::string message = error_of([&] { run_train_job(o, [&](const auto&) { ran = true; }); });
    EXPECT_FALSE(ran) << c.message;
    EXPECT_NE(message.find(c.message), std::string::npos) << "got: '" << message << "', expected '" << c.message << "'";
  }
}

// The Llama family trains through the job; its options given to a GPT-2 run are refused by name
// before any rank starts. (Its checkpoints, resume and --sample-every:
// tests/launch/test_llama_checkpoints.cpp; its Hugging Face files: tests/launch/test_hf_llama.cpp.)
TEST(Jobs, TheLlamaFamilyTrainsAndItsOptionsAreRefusedForGpt2) {
  train::TrainOptions o = tiny_job(3);
  o.model.kind = "llama";
  o.model.kv_heads = 2;
  const train::TrainResult result = run_train_job(o, threads_mesh(1, 2));
  ASSERT_EQ(result.losses.size(), 3u);
  EXPECT_TRUE(std::isfinite(result.losses.back()));
  train::TrainOptions gpt = tiny_job(3);
  gpt.model.kv_heads = 2;
  bool ran = false;
  const std::string message = error_of([&] { run_train_job(gpt, [&](const auto&) { ran = true; }); });
  EXPECT_FALSE(ran);
  EXPECT_NE(message.find("train: --kv-heads is an option of --model llama; the model is \"gpt\""), std::string::npos)
      << message;
}

// --model-config gives the shape of a new run only: with --resume (the checkpoint's shape) or
// --init-from (its directory's config.json) it is refused before any file is read.
TEST(Jobs, AModelConfigWithAResumeOrAnInitFromIsRefused) {
  train::TrainOptions o = tiny_job(1);
  o.model_config = "config.json";
  o.resume = "no-such-checkpoint";
  EXPECT_NE(error_of([&] { run_train_job(o, threads_mesh(1, 1)); }).find("--model-config with --resume"),
            std::string::npos);
  o.resume.clear();
  o.init_from = "no-such-directory";
  EXPECT_NE(error_of([&] { run_train_job(o, threads_mesh(1, 1)); }).find("--model-config and --init-from"),
            std::string::npos);
}

TEST(Jobs, GradsFilesGoTogether) {
  GradsJob job;
  job.config = "config.json";
  EXPECT_NE(error_of([&] { run_grads_job(job, threads_mesh(1, 1)); }).find("--config, --weights and --batch go together"),
            std::string::npos);
}

TEST(Jobs, GradsFromASeedAreTheSameOnEveryMesh) {
  GradsJob job;
  job.model = tiny_gpt(37);   // not divisible by tp: uneven vocabulary shards
  job.dtype = "float64";
  job.seed = 9;
  const GradsResult ref = run_grads_job(job, threads_mesh(1, 1));
  ASSERT_TRUE(ref.has_result);
  ASSERT_FALSE(ref.gradients.empty());
  EXPECT_EQ(ref.dtype, DType::Float64);
  for (const auto& [dp, tp] : {std::pair{1, 2}, std::pair{2, 2}}) {
    const std::string mesh = fmt::format("dp={},tp={}", dp, tp);
    const GradsResult got = run_grads_job(job, threads_mesh(dp, tp));
    ASSERT_EQ(got.gradients.size(), ref.gradients.size()) << mesh;
    EXPECT_NEAR(got.loss, ref.loss, 1e-12 * std::abs(ref.loss)) << mesh;
    for (std::size_t i = 0; i < ref.gradients.size(); ++i) {
      const auto a = got.gradients[i].second.to_vector();
      const auto b = ref.gradients[i].second.to_vector();
      ASSERT_EQ(a.size(), b.size()) << ref.gradients[i].first;
      double scale = 0, err = 0;
      for (std::size_t k = 0; k < b.size(); ++k) {
        scale = std::max(scale, std::abs(b[k]));
        err = std::max(err, std::abs(a[k] - b[k]));
      }
      EXPECT_GT(scale, 0.0) << ref.gradients[i].first;
      EXPECT_LE(err, 1e-12 * scale) << mesh << " " << ref.gradients[i].first;
    }
  }
  job.seed = 10;
  EXPECT_NE(run_grads_job(job, threads_mesh(1, 1)).loss, ref.loss) << "another seed must give another model and batch";
}

// A path option given empty (an unset $CK in `--resume $CK`, "" in a --config file) is refused
// naming it before any rank starts; left out, the same empty field means "none" (reliability-2
// C32-C35: --resume "" trained a fresh 1000-step run, --checkpoint-dir "" trained without checkpoints).
TEST(Jobs, AnEmptyPathThatWasGivenIsRefusedNamingTheOption) {
  for (const char* option : {"resume", "checkpoint-dir", "save", "metrics", "trace", "init-from", "data"}) {
    train::TrainOptions o = tiny_job(1);
    o.given_options.insert(option);
    bool ran = false;
    const std::string e = error_of([&] { run_train_job(o, [&](const auto&) { ran = true; }); });
    EXPECT_NE(e.find(fmt::format("--{}: the path is empty", option)), std::string::npos) << option << ": " << e;
    EXPECT_FALSE(ran) << option;
  }
  EXPECT_EQ(run_train_job(tiny_job(1), threads_mesh(1, 1)).losses.size(), 1u) << "left out, empty is none";
}

TEST(Jobs, WarmupAndGradAccumAreCheckedWithTheirNames) {
  train::TrainOptions o = tiny_job(1);
  o.warmup_steps = -5;
  EXPECT_NE(error_of([&] { run_train_job(o, threads_mesh(1, 1)); }).find("--warmup must be >= 0, got -5"),
            std::string::npos);
  o = tiny_job(1);
  o.grad_accum = 0;
  EXPECT_NE(error_of([&] { run_train_job(o, threads_mesh(1, 1)); }).find("--grad-accum must be >= 1, got 0"),
            std::string::npos);
}

// A batch file's bad token is named by its row and position in the file's [B, T] tensor (it used to
// be a flat index of the transposed [T, B] one), an empty batch as empty (reliability-2 #63, #64).
TEST(Jobs, GradsNamesABadTokenByItsRowAndPositionInTheBatchFile) {
  const std::string dir = (std::filesystem::temp_directory_path() / fmt::format("mg_jobs_batch_{}", ::getpid())).string();
  std::filesystem::create_directories(dir);
  const nn::ModelConfig c = tiny_gpt(256);
  GradsJob job;
  job.config = dir + "/config.json";
  job.weights = dir + "/w.safetensors";
  job.batch = dir + "/b.safetensors";
  // Weights and config.json of the tiny model, from a seed.
  threads_mesh(1, 1)([&](const dist::DeviceMeshPtr& mesh) {
    auto model = nn::make_model(c, {}, mesh, 3);
    checkpoint::save_parameters(job.weights, model->parameters(), mesh->group("tp"));
  });
  { std::ofstream(job.config) << interop::gpt2_config_json(c); }
  std::vector<std::int64_t> tokens(2 * 8, 7);
  tokens[1 * 8 + 3] = -5;   // inputs[1, 3]
  io::write_safetensors(job.batch, {{"inputs", Tensor::from_int64(tokens, {2, 8})},
                                    {"targets", Tensor::from_int64(std::vector<std::int64_t>(16, 7), {2, 8})}});
  EXPECT_NE(error_of([&] { run_grads_job(job, threads_mesh(1, 1)); }).find("inputs[1, 3] = -5 is outside the vocabulary [0, 256)"),
            std::string::npos);
  tokens[1 * 8 + 3] = 7;
  std::vector<std::int64_t> targets(16, 7);
  targets[5] = 256;   // targets[0, 5]
  io::write_safetensors(job.batch, {{"inputs", Tensor::from_int64(tokens, {2, 8})},
                                    {"targets", Tensor::from_int64(targets, {2, 8})}});
  EXPECT_NE(error_of([&] { run_grads_job(job, threads_mesh(1, 1)); }).find("targets[0, 5] = 256 is outside"),
            std::string::npos);
  io::write_safetensors(job.batch, {{"inputs", Tensor::from_int64({}, {2, 0})}, {"targets", Tensor::from_int64({}, {2, 0})}});
  EXPECT_NE(error_of([&] { run_grads_job(job, threads_mesh(1, 1)); }).find("hold no token"), std::string::npos);
  std::filesystem::remove_all(dir);
}

// The model names a bad token of a [B, T] batch by its row and position too.
TEST(Jobs, TheModelNamesABadTokenByItsRowAndPosition) {
  std::string message;
  threads_mesh(1, 2)([&](const dist::DeviceMeshPtr& mesh) {
    auto model = nn::make_model(tiny_gpt(256), {}, mesh, 3);
    std::vector<std::int64_t> in(4 * 8, 1);
    in[1 * 8 + 3] = 1000;
    const std::string e = error_of([&] {
      model->loss({Tensor::from_int64(in, {4, 8}), Tensor::from_int64(std::vector<std::int64_t>(32, 1), {4, 8})}, 32);
    });
    if (mesh->rank() == 0) message = e;
  });
  EXPECT_NE(message.find("input token 1000 at batch row 1, position 3"), std::string::npos) << message;
}

}  // namespace
}  // namespace meshgrad::launch::test_jobs
