// The Llama family (nn/llama.cpp) against an independent PyTorch model written with Hugging Face's
// semantics (tests/train/llama_reference.py), and on every mesh against itself on one rank.
//
// Tolerances. float64 against PyTorch: 1e-12 relative on the loss and on every gradient (the
// largest element difference over the largest element). Both sides compute the same formulas in
// float64 in different orders (OpenBLAS and meshgrad's kernels against PyTorch's), a few hundred
// operations deep: rounding alone is ~1e-15; llama_reference.py shows that a wrong model (RoPE
// interleaved instead of rotate-half, rms_norm_eps off by 10x, kv heads repeated in the wrong
// order) moves the loss or a gradient by far more than that. Meshes against one rank: 1e-12
// relative, the same float64 sums in other orders.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>

#include <fmt/format.h>

#include "meshgrad/data/synthetic.hpp"
#include "meshgrad/io/safetensors.hpp"
#include "meshgrad/nn/model.hpp"
#include "meshgrad/tensor/random.hpp"
#include "meshgrad/train/step.hpp"
#include "run_on_spec.hpp"

namespace test_llama {

using namespace meshgrad;

namespace {

// Llama 3 style: grouped-query attention (4 query heads, 2 key/value heads), untied head, llama3
// RoPE scaling with a short original context so every frequency band is hit.
nn::ModelConfig llama3_config() {
  nn::ModelConfig c = nn::ModelConfig::gpt(/*layers=*/3, /*hidden=*/32, /*heads=*/4, /*vocab=*/53, /*seq=*/12,
                                           /*batch=*/4, DType::Float64);
  c.kind = "llama";
  c.ffn = 40;
  c.kv_heads = 2;
  c.layer_norm_epsilon = 1e-5;
  c.rope_theta = 500000.0;
  c.rope_scaling = "llama3";
  c.rope_factor = 8;
  c.rope_low_freq_factor = 1;
  c.rope_high_freq_factor = 4;
  c.rope_original_positions = 16;
  return c;
}

// Qwen2 style: q/k/v biases, tied embeddings, head_dim given (heads x head_dim != hidden), linear
// RoPE scaling.
nn::ModelConfig qwen2_config() {
  nn::ModelConfig c = llama3_config();
  c.hidden = 24;
  c.head_dim = 8;
  c.heads = 4;
  c.kv_heads = 2;
  c.attention_bias = true;
  c.tie_word_embeddings = true;
  c.rope_theta = 10000.0;
  c.rope_scaling = "linear";
  c.rope_factor = 2;
  c.layer_norm_epsilon = 1e-6;
  return c;
}

// Every parameter replaced by a fixed random tensor (by name, the same on every mesh): norms near 1,
// the rest (biases included) normal with std 0.2, so every term of the model shows in the loss.
void randomize(nn::Model& model) {
  for (nn::Parameter* p : model.parameters()) {
    const bool norm = p->name.find("norm") != std::string::npos;
    const Tensor full = random::randn(p->full_shape, nn::seed_of(77, p->name), p->value.dtype(), norm ? 1.0 : 0.0,
                                      norm ? 0.1 : 0.2);
    p->value.detach().copy_from(nn::take_shard(full, *p));
  }
}

struct MeshRun {
  double loss = 0;
  std::map<std::string, Tensor> gradients, parameters;
};

MeshRun run(const nn::ModelConfig& cfg, const std::string& spec, const nn::ParallelConfig& parallel, const nn::Batch& batch) {
  MeshRun out;
  std::mutex mu;
  train::run_on(spec, [&](const dist::DeviceMeshPtr& mesh) {
    auto model = nn::make_model(cfg, parallel, mesh, 5);
    randomize(*model);
    std::map<std::string, Tensor> values;
    for (nn::Parameter* p : model->parameters()) values[p->name] = nn::gather_full(p->value, *p);
    const train::GradientDump dump = train::compute_gradients(*model, batch, mesh);
    const std::lock_guard<std::mutex> lock(mu);
    out.loss = dump.loss;
    for (const auto& [name, g] : dump.gradients) out.gradients.emplace(name, g);
    if (mesh->rank() == 0) out.parameters.insert(values.begin(), values.end());
  });
  return out;
}

double relative_difference(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_vector(), y = b.to_vector();
  if (x.size() != y.size()) return INFINITY;
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    diff = std::max(diff, std::abs(x[i] - y[i]));
    scale = std::max(scale, std::abs(y[i]));
  }
  return diff / std::max(scale, 1e-300);
}

nn::Batch batch_for(const nn::ModelConfig& cfg) {
  nn::Batch b = data::make_synthetic_batch(cfg, 1, 0, 31);
  // One ignored target: the mean is over the others, as Hugging Face's loss.
  std::vector<std::int64_t> t = b.targets.to_int64_vector();
  t[3] = -100;
  b.targets = Tensor::from_int64(t, b.targets.shape());
  return b;
}

// The config as Hugging Face's config.json spells it, for the reference.
std::string hf_config_json(const nn::ModelConfig& c) {
  std::string scaling = "null";
  if (c.rope_scaling == "linear") scaling = fmt::format(R"({{"rope_type": "linear", "factor": {}}})", c.rope_factor);
  if (c.rope_scaling == "llama3") {
    scaling = fmt::format(R"({{"rope_type": "llama3", "factor": {}, "low_freq_factor": {}, "high_freq_factor": {}, )"
                          R"("original_max_position_embeddings": {}}})",
                          c.rope_factor, c.rope_low_freq_factor, c.rope_high_freq_factor, c.rope_original_positions);
  }
  return fmt::format(R"({{"hidden_size": {}, "num_attention_heads": {}, "num_key_value_heads": {}, "head_dim": {}, )"
                     R"("num_hidden_layers": {}, "rms_norm_eps": {}, "rope_theta": {}, "rope_scaling": {}, )"
                     R"("tie_word_embeddings": {}, "attention_bias": {}, "sliding_window": {}, "max_window_layers": {}}})",
                     c.hidden, c.heads, c.kv_head_count(), c.head_size(), c.layers, c.layer_norm_epsilon, c.rope_theta,
                     scaling, c.tie_word_embeddings ? "true" : "false", c.attention_bias ? "true" : "false",
                     c.sliding_window, c.max_window_layers);
}

// Multi-query attention (one key/value head, Falcon / PaLM style; SmolLM-135M has 3 for 9 heads):
// at tp > 1 the key/value head is replicated over the ranks.
nn::ModelConfig mqa_config() {
  nn::ModelConfig c = llama3_config();
  c.kv_heads = 1;
  c.attention_bias = true;
  return c;
}

// Mistral style: a sliding window of 5 positions on every layer (sequences of 12), plain RoPE.
nn::ModelConfig mistral_config() {
  nn::ModelConfig c = llama3_config();
  c.rope_scaling.clear();
  c.rope_theta = 10000.0;
  c.sliding_window = 5;
  return c;
}

// Qwen2 with use_sliding_window: full attention in layer 0, a window of 4 from max_window_layers 1 on.
nn::ModelConfig qwen2_window_config() {
  nn::ModelConfig c = qwen2_config();
  c.sliding_window = 4;
  c.max_window_layers = 1;
  return c;
}

class LlamaFamily : public ::testing::TestWithParam<std::string> {
 protected:
  nn::ModelConfig config() const {
    if (GetParam() == "mqa") return mqa_config();
    if (GetParam() == "mistral") return mistral_config();
    if (GetParam() == "qwen2_window") return qwen2_window_config();
    return GetParam() == "llama3" ? llama3_config() : qwen2_config();
  }
};

TEST_P(LlamaFamily, Float64LossAndGradientsEqualAPyTorchModelWithHuggingFaceSemantics) {
  const nn::ModelConfig cfg = config();
  const nn::Batch batch = batch_for(cfg);
  const MeshRun one = run(cfg, "tp=1", {}, batch);
  std::vector<std::pair<std::string, Tensor>> tensors{{"batch.inputs", batch.inputs}, {"batch.targets", batch.targets},
                                                      {"loss", Tensor::scalar(one.loss, DType::Float64)}};
  for (const auto& [name, t] : one.parameters) tensors.emplace_back("param." + name, t);
  for (const auto& [name, t] : one.gradients) tensors.emplace_back("grad." + name, t);
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / fmt::format("mg-llama-{}", ::getpid());
  std::filesystem::create_directories(dir);
  const std::string file = (dir / (GetParam() + ".safetensors")).string();
  io::write_safetensors(file, tensors, {{"config", hf_config_json(cfg)}});
  const std::string command = fmt::format("{} {}/tests/train/llama_reference.py {} > {}.log 2>&1", MESHGRAD_REFERENCE_PYTHON,
                                          MESHGRAD_SOURCE_DIR, file, file);
  const int rc = std::system(command.c_str());
  std::string log;
  {
    std::FILE* f = std::fopen((file + ".log").c_str(), "r");
    char buf[4096];
    while (f != nullptr && std::fgets(buf, sizeof buf, f) != nullptr) log += buf;
    if (f != nullptr) std::fclose(f);
  }
  std::filesystem::remove_all(dir);
  std::printf("%s", log.c_str());   // the measured differences, in ctest's output
  EXPECT_EQ(rc, 0) << "the PyTorch reference disagrees (or could not run):\n" << log;
}

TEST_P(LlamaFamily, EveryMeshGivesTheOneRankGradients) {
  const nn::ModelConfig cfg = config();
  const nn::Batch batch = batch_for(cfg);
  const MeshRun one = run(cfg, "tp=1", {}, batch);
  ASSERT_FALSE(one.gradients.empty());
  struct Case {
    std::string mesh;
    nn::ParallelConfig parallel;
  };
  const std::vector<Case> cases = {
      {"tp=2", {}},
      {"tp=2", {.sequence_parallel = true, .overlap = true}},
      {"tp=2x2", {}},
      {"dp=2,tp=2", {.sequence_parallel = true}},
      {"fsdp=2,tp=2", {.checkpoint_blocks = true}},
      {"pp=3", {}},
      {"pp=2,tp=2", {.sequence_parallel = true}},
      {"pp=2,fsdp=2", {}},
      {"tp=4", {}},   // 2 key/value heads (llama3, qwen2) or 1 (mqa): replicated over 2 or 4 ranks
      {"tp=4", {.sequence_parallel = true}},
  };
  for (const Case& c : cases) {
    // A grid splits heads over tp_col and does not replicate key/value heads (refused, tested below).
    if (c.mesh == "tp=2x2" && cfg.kv_head_count() < 2) continue;
    const MeshRun got = run(cfg, c.mesh, c.parallel, batch);
    EXPECT_NEAR(got.loss, one.loss, 1e-12 * std::abs(one.loss)) << c.mesh;
    ASSERT_EQ(got.gradients.size(), one.gradients.size()) << c.mesh;
    for (const auto& [name, g] : one.gradients) {
      ASSERT_TRUE(got.gradients.count(name)) << c.mesh << " lacks " << name;
      EXPECT_LT(relative_difference(got.gradients.at(name), g), 1e-12) << c.mesh << " " << name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, LlamaFamily, ::testing::Values("llama3", "qwen2", "mqa", "mistral", "qwen2_window"));

TEST(LlamaFamilyRefusals, WhatIsNotSupportedYetIsRefusedByName) {
  auto refusal = [](const nn::ModelConfig& cfg, const std::string& spec) {
    std::string message;
    train::run_on(spec, [&](const dist::DeviceMeshPtr& mesh) {
      try {
        nn::make_model(cfg, {}, mesh, 1);
      } catch (const std::exception& e) {
        if (mesh->rank() == 0) message = e.what();
      }
    });
    return message;
  };
  nn::ModelConfig kv2 = llama3_config();
  EXPECT_NE(refusal(kv2, "tp=3").find("the 2 key/value heads (num_key_value_heads) neither split evenly over them nor "
                                      "divide them"),
            std::string::npos);
  EXPECT_NE(refusal(mqa_config(), "tp=1x2").find("a 2-D grid does not replicate key/value heads"), std::string::npos);
  nn::ModelConfig window = llama3_config();
  window.sliding_window = -4;
  EXPECT_NE(refusal(window, "tp=1").find("sliding_window -4 and max_window_layers 0 must be >= 0"), std::string::npos);
  nn::ModelConfig dropout = llama3_config();
  dropout.dropout = 0.1;
  EXPECT_NE(refusal(dropout, "tp=1").find("has no dropout"), std::string::npos);
  nn::ModelConfig odd = llama3_config();
  odd.rope_scaling = "yarn";
  EXPECT_NE(refusal(odd, "tp=1").find("rope_scaling type 'yarn' is not supported"), std::string::npos);
}

}  // namespace

}  // namespace test_llama
