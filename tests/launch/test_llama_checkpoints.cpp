// Checkpoints of the Llama family (train --checkpoint-dir / --resume through run_train_job, as the
// CLI and Python run them): a resumed run continues the uninterrupted one bit for bit on the same
// mesh; a checkpoint written at tp=2 with SP resumes at tp=1, fsdp=2 and dp=2 (float64: losses,
// gradient norms and the final weights within rounding);
// under --mesh-invariant it resumes on another mesh bit for bit; the saved configuration gives back
// the model in every field; a record without the Llama fields (an older meshgrad's) reads as GPT-2.
//
// The resumed runs give no model option: the model comes from the checkpoint alone, so a field the
// record loses resumes another model. The Llama here has every recorded field away from its default,
// and its RoPE is chosen so that each scaling field moves a frequency: head_dim 12 over theta 1000
// gives wavelengths 6.3, 19.9, 62.8, ... against llama3's bands at original_positions / factor =
// 64 / 8 and 64 / 2: one unscaled, one smoothed (low and high factors), the rest divided by factor.
//
// Tolerance across meshes (float64): the meshes differ only in the order of split sums (about 1e-16
// relative per operation) carried through 3 AdamW steps; 1e-9 on losses near 5.5 is far above that
// and far below a wrong shard, moment or RoPE table (the 3rd digit); the same bound on the weights
// after the last step, relative to each tensor's largest value.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "meshgrad/checkpoint/directory.hpp"
#include "meshgrad/checkpoint/manifest.hpp"
#include "meshgrad/checkpoint/reader.hpp"
#include "meshgrad/interop/checkpoint_model.hpp"
#include "meshgrad/interop/model_tensors.hpp"
#include "meshgrad/launch/jobs.hpp"
#include "meshgrad/launch/launch.hpp"
#include "meshgrad/train/run_config.hpp"
#include "meshgrad/train/trainer.hpp"
#include "launch/invariant_runs.hpp"

namespace meshgrad::launch::test_llama_checkpoints {
namespace {

namespace fs = std::filesystem;

nn::ModelConfig recorded_llama(DType dtype) {
  nn::ModelConfig c = testing::small_gpt(dtype);   // 2 blocks of 32 features, 4 heads
  c.kind = "llama";
  c.vocab = 0;   // the built-in corpus's 256
  c.seq = 16;
  c.kv_heads = 2;
  c.head_dim = 12;
  c.ffn = 48;
  c.layer_norm_epsilon = 1e-6;
  c.rope_theta = 1000;
  c.rope_scaling = "llama3";
  c.rope_factor = 8;
  c.rope_low_freq_factor = 2;
  c.rope_high_freq_factor = 8;
  c.rope_original_positions = 64;
  c.tie_word_embeddings = true;
  c.attention_bias = true;
  c.sliding_window = 16;   // >= the positions (seq): recorded, plain causal attention
  c.model_type = "qwen2";
  return c;
}

class LlamaCheckpoints : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / fmt::format("mg_llama_ck_{}_{}", ::getpid(),
                                                   ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& leaf) const { return (dir_ / leaf).string(); }

  static train::TrainOptions options(DType dtype, int steps, nn::Invariance mode = nn::Invariance::None) {
    train::TrainOptions o;
    o.model = recorded_llama(dtype);
    o.parallel.sequence_parallel = true;
    o.parallel.invariance = mode;
    o.parallel.invariant_blocks = 2;   // the 2 key/value heads are 2 units: the tree cuts them whole
    o.steps = steps;
    o.warmup_steps = 2;
    o.lr = 3e-3;
    o.grad_clip = 0.5;
    o.progress = false;
    return o;
  }
  // The options of a resume: nothing of the model, the mesh given (it may differ from the record's).
  train::TrainOptions resume_from(const std::string& checkpoint, int steps) const {
    train::TrainOptions r;
    r.resume = checkpoint;
    r.steps = steps;
    r.progress = false;
    r.checkpoint_dir = path("resumed");
    r.given_options = {"steps", "checkpoint-dir", "mesh"};
    return r;
  }

  struct Run {
    std::vector<double> losses, grad_norms;
    int first_step = 0;
  };
  static Run run(train::TrainOptions o, const std::string& mesh) {
    Run r;
    o.on_step = [&r](const train::StepMetrics& s) { r.grad_norms.push_back(s.grad_norm); };
    const train::TrainResult result = run_train_job(o, mesh_runner("threads", mesh));
    r.losses = result.losses;
    r.first_step = result.first_step;
    return r;
  }

  fs::path dir_;
};

TEST_F(LlamaCheckpoints, AResumeOnTheSameMeshContinuesTheRunBitForBit) {
  const Run full = run(options(DType::Float64, 6), "tp=2");
  ASSERT_EQ(full.losses.size(), 6u);
  train::TrainOptions first = options(DType::Float64, 6);
  first.checkpoint_dir = path("ck");
  first.save_every = 3;
  run(first, "tp=2");
  fs::remove_all(path("ck/step_00000006"));   // as if killed after step 3's checkpoint
  const Run resumed = run(resume_from(path("ck"), 6), "tp=2");
  ASSERT_EQ(resumed.first_step, 3);
  ASSERT_EQ(resumed.losses.size(), 3u);
  ASSERT_EQ(resumed.grad_norms.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(resumed.losses[i], full.losses[3 + i]) << "step " << 4 + i;   // bitwise
    EXPECT_EQ(resumed.grad_norms[i], full.grad_norms[3 + i]) << "step " << 4 + i;
  }
}

// The largest difference of the two checkpoints' parameters relative to each tensor's largest value.
double max_parameter_difference(const std::string& a, const std::string& b) {
  const checkpoint::Manifest ma = checkpoint::read_manifest(a), mb = checkpoint::read_manifest(b);
  const auto shapes = interop::model_parameter_shapes(interop::checkpoint_model_config(ma, a));
  const auto ta = checkpoint::read_full_tensors(a, ma, shapes), tb = checkpoint::read_full_tensors(b, mb, shapes);
  double worst = 0;
  for (std::size_t i = 0; i < ta.size(); ++i) {
    const std::vector<double> x = ta[i].second.to_vector(), y = tb[i].second.to_vector();
    double scale = 0, diff = 0;
    for (std::size_t k = 0; k < x.size(); ++k) {
      scale = std::max(scale, std::abs(x[k]));
      diff = std::max(diff, std::abs(x[k] - y[k]));
    }
    worst = std::max(worst, diff / scale);
  }
  return worst;
}

TEST_F(LlamaCheckpoints, ACheckpointOfTpTwoWithSequenceParallelismResumesAtTpOneAndFsdpTwo) {
  train::TrainOptions uninterrupted = options(DType::Float64, 5);
  uninterrupted.checkpoint_dir = path("full");
  const Run full = run(uninterrupted, "tp=2");
  train::TrainOptions first = options(DType::Float64, 5);
  first.checkpoint_dir = path("ck");
  first.save_every = 2;
  run(first, "tp=2");
  for (const std::string mesh : {"tp=1", "fsdp=2", "dp=2"}) {
    SCOPED_TRACE("resumed on " + mesh);
    const Run resumed = run(resume_from(path("ck/step_00000002"), 5), mesh);
    ASSERT_EQ(resumed.losses.size(), 3u);
    for (int i = 0; i < 3; ++i) {
      EXPECT_NEAR(resumed.losses[i], full.losses[2 + i], 1e-9) << "step " << 3 + i;
      EXPECT_NEAR(resumed.grad_norms[i], full.grad_norms[2 + i], 1e-9 * full.grad_norms[2 + i]) << "step " << 3 + i;
    }
    // The weights after step 5, every parameter (the optimizer's moments moved them).
    EXPECT_LT(max_parameter_difference(path("resumed/step_00000005"), path("full/step_00000005")), 1e-9);
    fs::remove_all(path("resumed"));
  }
}

// Elastic resume: the mode's promise (the same bits on every mesh) holds across a checkpoint.
TEST_F(LlamaCheckpoints, UnderMeshInvariantAResumeOnAnotherMeshIsTheUninterruptedRunsBits) {
  const train::TrainOptions base = options(DType::Float32, 6, nn::Invariance::Mesh);
  const Run full = run(base, "tp=2");
  train::TrainOptions first = base;
  first.checkpoint_dir = path("ck");
  first.save_every = 3;
  run(first, "tp=2");
  for (const std::string mesh : {"tp=1", "dp=2", "fsdp=2", "pp=2"}) {
    SCOPED_TRACE("resumed on " + mesh);
    const Run resumed = run(resume_from(path("ck/step_00000003"), 6), mesh);
    ASSERT_EQ(resumed.losses.size(), 3u);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(resumed.losses[i], full.losses[3 + i]) << "step " << 4 + i;
      EXPECT_EQ(resumed.grad_norms[i], full.grad_norms[3 + i]) << "step " << 4 + i;
    }
    fs::remove_all(path("resumed"));
  }
}

// What sample, export and check read: every field of the model, written out here one by one (not
// through model_config_fields, which is what is tested).
void expect_same_model(const nn::ModelConfig& got, const nn::ModelConfig& want) {
  EXPECT_EQ(got.kind, want.kind);
  EXPECT_EQ(got.layers, want.layers);
  EXPECT_EQ(got.hidden, want.hidden);
  EXPECT_EQ(got.ffn, want.ffn);
  EXPECT_EQ(got.heads, want.heads);
  EXPECT_EQ(got.vocab, want.vocab);
  EXPECT_EQ(got.positions, want.positions);
  EXPECT_EQ(got.seq, want.seq);
  EXPECT_EQ(got.layer_norm_epsilon, want.layer_norm_epsilon);
  EXPECT_EQ(got.dtype, want.dtype);
  EXPECT_EQ(got.kv_heads, want.kv_heads);
  EXPECT_EQ(got.head_dim, want.head_dim);
  EXPECT_EQ(got.rope_theta, want.rope_theta);
  EXPECT_EQ(got.rope_scaling, want.rope_scaling);
  EXPECT_EQ(got.rope_factor, want.rope_factor);
  EXPECT_EQ(got.rope_low_freq_factor, want.rope_low_freq_factor);
  EXPECT_EQ(got.rope_high_freq_factor, want.rope_high_freq_factor);
  EXPECT_EQ(got.rope_original_positions, want.rope_original_positions);
  EXPECT_EQ(got.tie_word_embeddings, want.tie_word_embeddings);
  EXPECT_EQ(got.attention_bias, want.attention_bias);
  EXPECT_EQ(got.sliding_window, want.sliding_window);
  EXPECT_EQ(got.model_type, want.model_type);
}

TEST_F(LlamaCheckpoints, TheSavedConfigurationGivesBackTheModelInEveryField) {
  train::TrainOptions o = options(DType::Float64, 1);
  o.checkpoint_dir = path("ck");
  run(o, "tp=2");
  const std::string ck = checkpoint::list_checkpoints(path("ck")).back();
  const checkpoint::Manifest manifest = checkpoint::read_manifest(ck);
  nn::ModelConfig want = recorded_llama(DType::Float64);
  want.vocab = 256;
  expect_same_model(interop::checkpoint_model_config(manifest, ck), want);
  // The resume's options, as run_config gives them back to the trainer.
  const train::TrainOptions resumed = train::resume_options(train::TrainOptions{}, manifest.state["config"], ck);
  expect_same_model(resumed.model, want);

  // The configuration must describe the tensors, for this family too: an edited kv-heads is refused
  // naming a tensor of another shape before anything is built.
  checkpoint::Manifest edited = manifest;
  edited.state["config"]["kv-heads"] = 4;
  try {
    interop::checkpoint_model_config(edited, ck);
    ADD_FAILURE() << "a configuration of 4 kv heads was taken for tensors of 2";
  } catch (const checkpoint::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.0.self_attn.k_proj.weight"), std::string::npos) << e.what();
  }
}

// Checkpoints written before the Llama family record no "model", "kv-heads", ...: they hold a
// GPT-2, and read (sample, export, check) and resume as one.
TEST_F(LlamaCheckpoints, ARecordWithoutTheLlamaFieldsIsGptTwos) {
  train::TrainOptions o;
  o.model = nn::ModelConfig::gpt(1, 32, 4, 0, 16, 4, DType::Float32);
  o.steps = 1;
  o.progress = false;
  o.checkpoint_dir = path("ck");
  run(o, "tp=2");
  const std::string ck = checkpoint::list_checkpoints(path("ck")).back();
  checkpoint::Manifest old = checkpoint::read_manifest(ck);
  int dropped = 0;
  for (const interop::ModelConfigField& f : interop::model_config_fields()) {
    if (f.absent_means_default) dropped += static_cast<int>(old.state["config"].erase(f.name));
  }
  ASSERT_GE(dropped, 13);   // model, kv-heads, head-dim, rope-theta, ..., model-type
  const nn::ModelConfig read = interop::checkpoint_model_config(old, ck);
  EXPECT_EQ(read.kind, "gpt");
  EXPECT_EQ(read.hidden, 32);
  EXPECT_EQ(read.kv_heads, 0);
  train::TrainOptions given;
  given.model.kind = "llama";   // a caller's default is not what the record stands for
  const train::TrainOptions resumed = train::resume_options(given, old.state["config"], ck);
  EXPECT_EQ(resumed.model.kind, "gpt");
  // Given as another family, it is refused as another shape.
  given.given_options = {"model"};
  EXPECT_THROW(train::resume_options(given, old.state["config"], ck), checkpoint::CheckpointError);
}

}  // namespace
}  // namespace meshgrad::launch::test_llama_checkpoints
