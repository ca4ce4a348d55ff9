// Text generation (generate/sample.hpp): greedy text is the same on every mesh, the same seed gives
// the same text and another seed another, top-k 1 is greedy, the draws follow softmax(logits / T),
// the cache changes nothing but the cost, the checkpoint and tokenizer sources resolve as
// documented, and bad input fails before any rank starts with a message naming it.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "meshgrad/comm/threads.hpp"
#include "meshgrad/nn/layers.hpp"
#include "meshgrad/tensor/error.hpp"
#include "meshgrad/text/utf8.hpp"
#include "meshgrad/checkpoint/parameter_file.hpp"
#include "meshgrad/interop/gpt2_config.hpp"
#include "meshgrad/generate/sample.hpp"
#include "text/gpt2_test_files.hpp"

namespace meshgrad::generate::test_sample {
namespace {

namespace fs = std::filesystem;

// The job's ranks as rank threads on a mesh of these axes.
dist::RunOnMesh threads_mesh(std::vector<dist::MeshAxis> axes) {
  int ranks = 1;
  for (const auto& a : axes) ranks *= a.size;
  return [axes, ranks](const std::function<void(const dist::DeviceMeshPtr&)>& fn) {
    comm::ThreadsOptions options;
    options.timeout = std::chrono::milliseconds(20000);
    comm::run_ranks(
        ranks, [&](const comm::CommunicatorPtr& world) { fn(std::make_shared<const dist::DeviceMesh>(world, axes)); },
        options);
  };
}

struct NamedMesh {
  std::string name;
  std::vector<dist::MeshAxis> axes;
};

const std::vector<NamedMesh>& meshes() {
  static const std::vector<NamedMesh> m = {{"tp=1", {{"dp", 1}, {"tp", 1}}},
                                           {"tp=2", {{"dp", 1}, {"tp", 2}}},
                                           {"tp=4", {{"dp", 1}, {"tp", 4}}},
                                           {"dp=2,tp=2", {{"dp", 2}, {"tp", 2}}},
                                           {"tp=2x2", {{"dp", 1}, {"tp_row", 2}, {"tp_col", 2}}}};
  return m;
}

nn::ModelConfig tiny_gpt(int vocab, DType dtype) {
  nn::ModelConfig c;
  c.kind = "gpt";
  c.layers = 2;
  c.hidden = 16;
  c.heads = 4;
  c.vocab = vocab;
  c.positions = 24;
  c.seq = 24;
  c.batch = 1;
  c.dtype = dtype;
  return c;
}

class SampleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = meshgrad::testing::fresh_temp_dir(
        std::string("sample_") + ::testing::UnitTest::GetInstance()->current_test_info()->name());
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A randomly initialised GPT saved with save_parameters at `path`, its weights scaled by `gain`
  // (GPT-2's init gives nearly uniform logits; larger weights give text with some structure). With
  // config_in_metadata its config.json goes into the metadata as `train --save` writes it.
  static void save_model(const std::string& path, const nn::ModelConfig& cfg, double gain = 6.0,
                         bool config_in_metadata = true) {
    threads_mesh({{"dp", 1}, {"tp", 1}})([&](const dist::DeviceMeshPtr& mesh) {
      auto model = nn::make_model(cfg, {}, mesh, 11);
      for (nn::Parameter* p : model->parameters()) {
        if (p->name.find(".ln_") != std::string::npos || p->name.rfind("ln_f", 0) == 0) continue;
        Tensor& v = p->value;
        for (std::int64_t i = 0; i < v.numel(); ++i) {
          if (cfg.dtype == DType::Float64) v.data<double>()[i] *= gain;
          else v.data<float>()[i] *= static_cast<float>(gain);
        }
        v.bump_version();
      }
      std::map<std::string, std::string> meta{{"format", "pt"}};
      if (config_in_metadata) meta["gpt2_config"] = interop::gpt2_config_json(cfg);
      checkpoint::save_parameters(path, model->parameters(), nn::tensor_parallel_group(*mesh), 0, meta);
    });
  }
  std::string path(const std::string& leaf) const { return (dir_ / leaf).string(); }

  fs::path dir_;
};

SampleJob job_for(const std::string& checkpoint, double temperature, std::uint64_t seed = 1, int tokens = 16) {
  SampleJob job;
  job.checkpoint = checkpoint;
  job.prompt = "The ";
  job.tokens = tokens;
  job.sampling.temperature = temperature;
  job.sampling.seed = seed;
  return job;
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

TEST_F(SampleTest, GreedyAndSampledTextAreTheSameOnEveryMesh) {
  const std::string w = path("w.safetensors");
  save_model(w, tiny_gpt(256, DType::Float64));
  for (const double temperature : {0.0, 1.0}) {
    const SampleJob job = job_for(w, temperature, 5);
    const SampleResult ref = run_sample_job(job, threads_mesh(meshes()[0].axes));
    ASSERT_EQ(ref.new_tokens.size(), 16u);
    EXPECT_EQ(ref.text.substr(0, 4), "The ");
    // Not a degenerate loop of one token (which every mesh would trivially agree on).
    EXPECT_GT(std::set<std::int64_t>(ref.new_tokens.begin(), ref.new_tokens.end()).size(), 3u) << ref.text;
    for (const NamedMesh& m : meshes()) {
      const SampleResult got = run_sample_job(job, threads_mesh(m.axes));
      EXPECT_EQ(got.new_tokens, ref.new_tokens) << m.name << " temperature " << temperature;
      EXPECT_EQ(got.text, ref.text) << m.name;
      EXPECT_FALSE(got.mesh.empty());
    }
  }
}

TEST_F(SampleTest, SeedsTopKAndTheCache) {
  const std::string w = path("w.safetensors");
  const nn::ModelConfig cfg = tiny_gpt(256, DType::Float32);
  save_model(w, cfg);
  const auto run = [&](const SampleJob& job) { return run_sample_job(job, threads_mesh(meshes()[1].axes)).new_tokens; };
  const auto a = run(job_for(w, 1.0, 7));
  EXPECT_EQ(run(job_for(w, 1.0, 7)), a) << "the same seed must give the same text";
  EXPECT_NE(run(job_for(w, 1.0, 8)), a) << "another seed gave the same 16 tokens";
  SampleJob top1 = job_for(w, 1.3, 9);
  top1.sampling.top_k = 1;
  EXPECT_EQ(run(top1), run(job_for(w, 0.0))) << "top-k 1 must be greedy";

  // Without the cache (the whole sequence recomputed per token): the same tokens, O(T^2) work.
  threads_mesh(meshes()[1].axes)([&](const dist::DeviceMeshPtr& mesh) {
    const SampleWeights weights = resolve_sample_weights(w);
    auto model = nn::make_model(weights.model, {}, mesh, 0);
    load_sample_weights(weights, model->parameters(), *mesh);
    GenerateOptions o;
    o.tokens = 12;
    o.sampling = {0.8, 0, 3};
    const std::vector<std::int64_t> prompt{84, 104, 101, 32};
    const Generation cached = generate(*model, prompt, o);
    o.use_cache = false;
    const Generation full = generate(*model, prompt, o);
    EXPECT_EQ(cached.tokens, full.tokens);
    EXPECT_LT(cached.attention_scores * 3, full.attention_scores);
  });
}

TEST(ChooseToken, GreedyTiesTopKAndAllowedIds) {
  const std::vector<double> logits{1.0, 3.0, 0.5, 3.0, -2.0};
  EXPECT_EQ(choose_token(logits, {0.0, 0, 1}, 0), 1) << "ties go to the lowest id";
  for (std::uint64_t step = 0; step < 50; ++step) {
    EXPECT_EQ(choose_token(logits, {1.0, 1, 1}, step), 1) << "top-k 1 is greedy";
    const std::int64_t two = choose_token(logits, {1.0, 2, 1}, step);
    EXPECT_TRUE(two == 1 || two == 3) << two;
    EXPECT_LT(choose_token(logits, {1.0, 0, 1}, step, /*allowed=*/3), 3);
  }
  EXPECT_EQ(choose_token(logits, {0.0, 0, 1}, 0, /*allowed=*/1), 0);
  const std::vector<double> bad{0.0, std::nan("")};
  EXPECT_NE(error_of([&] { choose_token(bad, {1.0, 0, 1}, 4); }).find("the logit of token 1 at step 4 is nan"),
            std::string::npos);
}

// --top-p keeps Hugging Face's nucleus (TopPLogitsWarper): in ascending order of probability the
// tokens whose cumulative probability is <= 1 - top_p are dropped, the most likely always kept. With
// p = {0.5, 0.3, 0.15, 0.05}: top_p 0.45 keeps {0}; 0.6 keeps {0, 1} (p(0) = 0.5 / 0.8 = 0.625 of the
// draws); 0.9 keeps {0, 1, 2}. Equal probabilities: the lower ids count as more likely.
TEST(ChooseToken, TopPKeepsTheNucleus) {
  const std::vector<double> logits{std::log(0.5), std::log(0.3), std::log(0.15), std::log(0.05)};
  auto with_p = [](double p) {
    SamplingOptions o{1.0, 0, 1};
    o.top_p = p;
    return o;
  };
  int zeros = 0, twos = 0;
  const int draws = 20000;
  for (std::uint64_t step = 0; step < static_cast<std::uint64_t>(draws); ++step) {
    EXPECT_EQ(choose_token(logits, with_p(0.45), step), 0);
    const std::int64_t two = choose_token(logits, with_p(0.6), step);
    ASSERT_TRUE(two == 0 || two == 1) << two;
    zeros += two == 0 ? 1 : 0;
    const std::int64_t three = choose_token(logits, with_p(0.9), step);
    ASSERT_LT(three, 3);
    twos += three == 2 ? 1 : 0;
  }
  EXPECT_NEAR(static_cast<double>(zeros) / draws, 0.625, 0.015);
  EXPECT_NEAR(static_cast<double>(twos) / draws, 0.15 / 0.95, 0.015);
  // After top-k: top-k 3 then top-p 0.9 renormalises over {0.5, 0.3, 0.15}: 0.15 / 0.95 <= 0.1 is false,
  // so all three stay; top-p 0.8 drops id 2 (0.158 <= 0.2).
  SamplingOptions k3{1.0, 3, 1};
  k3.top_p = 0.8;
  for (std::uint64_t step = 0; step < 200; ++step) EXPECT_LT(choose_token(logits, k3, step), 2);
  // Ties: three equal logits, top_p 0.5 drops the highest id only.
  const std::vector<double> flat{1.0, 1.0, 1.0};
  bool saw_one = false;
  for (std::uint64_t step = 0; step < 200; ++step) {
    const std::int64_t id = choose_token(flat, with_p(0.5), step);
    EXPECT_LT(id, 2);
    saw_one = saw_one || id == 1;
  }
  EXPECT_TRUE(saw_one);
  for (const double bad : {0.0, -0.5, 1.5, std::nan("")}) {
    EXPECT_NE(error_of([&] { choose_token(logits, with_p(bad), 0); }).find("--top-p must be in (0, 1]"),
              std::string::npos) << bad;
  }
}

// softmax(logits / T): logits {0, ln 3} give p(1) = 3/4 at T = 1 and sqrt(3) / (1 + sqrt(3)) at T = 2.
// 20000 draws: the standard error of the frequency is ~0.003, the bound 0.015 is 5 of them (and
// the draws are a fixed function of the seed: the test cannot flake).
TEST(ChooseToken, DrawsFollowTheTemperedSoftmax) {
  const std::vector<double> logits{0.0, std::log(3.0)};
  for (const auto& [temperature, expected] : {std::pair{1.0, 0.75}, std::pair{2.0, std::sqrt(3.0) / (1 + std::sqrt(3.0))}}) {
    int ones = 0;
    const int n = 20000;
    for (int step = 0; step < n; ++step) ones += choose_token(logits, {temperature, 0, 42}, step) == 1 ? 1 : 0;
    EXPECT_NEAR(static_cast<double>(ones) / n, expected, 0.015) << "temperature " << temperature;
  }
}

TEST_F(SampleTest, TheContextLimitStopsGenerationAndIsReported) {
  const std::string w = path("w.safetensors");
  save_model(w, tiny_gpt(256, DType::Float32));   // n_positions 24
  SampleJob job = job_for(w, 0.0, 1, 50);
  job.prompt = std::string(20, 'a');
  const SampleResult r = run_sample_job(job, threads_mesh(meshes()[0].axes));
  // 20 prompt tokens + 4 fed back fill the 24 positions; the 5th is chosen from the last one.
  EXPECT_EQ(r.new_tokens.size(), 5u);
  EXPECT_TRUE(r.context_full);
  EXPECT_EQ(r.n_positions, 24);
  job.prompt = std::string(24, 'a');
  EXPECT_EQ(run_sample_job(job, threads_mesh(meshes()[0].axes)).new_tokens.size(), 1u);
  job.tokens = 5;
  job.prompt = "ab";
  EXPECT_FALSE(run_sample_job(job, threads_mesh(meshes()[0].axes)).context_full);
}

TEST_F(SampleTest, StreamedTextIsTheResultInValidUtf8Pieces) {
  const std::string w = path("w.safetensors");
  save_model(w, tiny_gpt(256, DType::Float32));
  SampleJob job = job_for(w, 1.0, 3, 20);
  job.prompt = "caf\xC3\xA9 ";
  std::string streamed;
  int calls = 0;
  job.on_text = [&](std::string_view piece) {
    EXPECT_EQ(text::to_valid_utf8(piece), piece) << "a piece is not valid UTF-8 on its own";
    streamed += piece;
    ++calls;
  };
  const SampleResult r = run_sample_job(job, threads_mesh(meshes()[3].axes));   // dp=2,tp=2: printed once
  EXPECT_EQ(streamed, r.text);
  EXPECT_GT(calls, 1);
  EXPECT_EQ(r.text.substr(0, 6), "caf\xC3\xA9 ");
}

TEST_F(SampleTest, CheckpointSources) {
  const nn::ModelConfig cfg = tiny_gpt(256, DType::Float64);
  // (a) a file whose metadata holds the config: it wins over a config.json that lies beside it, even
  // one with the same shapes (other heads, another epsilon), which would change the text silently.
  const std::string w = path("w.safetensors");
  save_model(w, cfg);
  nn::ModelConfig stray = cfg;
  stray.heads = cfg.heads / 2;
  stray.layer_norm_epsilon = 0.1;
  std::ofstream(dir_ / "config.json") << interop::gpt2_config_json(stray);
  const SampleWeights meta = resolve_sample_weights(w);
  EXPECT_NE(meta.config_source.find("metadata \"gpt2_config\""), std::string::npos) << meta.config_source;
  EXPECT_EQ(meta.model.heads, cfg.heads);
  EXPECT_EQ(meta.model.layer_norm_epsilon, cfg.layer_norm_epsilon);
  EXPECT_EQ(meta.model.dtype, DType::Float64);
  EXPECT_EQ(meta.model.n_positions(), 24);
  const SampleResult from_file = run_sample_job(job_for(w, 0.0), threads_mesh(meshes()[0].axes));
  fs::remove(dir_ / "config.json");

  // (b) a Hugging Face style directory: config.json + model.safetensors (no metadata needed).
  const fs::path hf = dir_ / "hf";
  fs::create_directories(hf);
  save_model((hf / "model.safetensors").string(), cfg, 6.0, /*config_in_metadata=*/false);
  std::ofstream(hf / "config.json") << interop::gpt2_config_json(cfg);
  const SampleWeights dir = resolve_sample_weights(hf.string());
  EXPECT_EQ(dir.config_source, (hf / "config.json").string());
  EXPECT_EQ(run_sample_job(job_for(hf.string(), 0.0), threads_mesh(meshes()[1].axes)).text, from_file.text);
  EXPECT_EQ(resolve_sample_weights((hf / "model.safetensors").string()).config_source, (hf / "config.json").string());

  // No config anywhere.
  const std::string bare = path("bare.safetensors");
  save_model(bare, cfg, 6.0, false);
  EXPECT_NE(error_of([&] { resolve_sample_weights(bare); }).find("no model configuration for '" + bare + "'"),
            std::string::npos);
  // Neither a safetensors file nor a model directory.
  const std::string text_file = path("notes.txt");
  std::ofstream(text_file) << "hello";
  for (const std::string& p : {text_file, (dir_ / "empty").string()}) {
    fs::create_directories(dir_ / "empty");
    const std::string e = error_of([&] { resolve_sample_weights(p); });
    EXPECT_NE(e.find("'" + p + "' is not a safetensors file or model directory"), std::string::npos) << e;
  }
  EXPECT_NE(error_of([&] { resolve_sample_weights(path("missing.safetensors")); }).find("does not exist"),
            std::string::npos);
}

TEST_F(SampleTest, BadInputFailsBeforeAnyRankStarts) {
  const std::string w = path("w.safetensors");
  save_model(w, tiny_gpt(256, DType::Float32));
  struct Case {
    void (*change)(SampleJob&);
    const char* message;
  };
  const std::vector<Case> cases = {
      {[](SampleJob& j) { j.prompt = ""; }, "sample: --prompt is empty"},
      {[](SampleJob& j) { j.tokens = 0; }, "sample: --tokens must be >= 1, got 0"},
      {[](SampleJob& j) { j.sampling.temperature = -0.5; }, "sample: --temperature must be >= 0 (0 = greedy), got -0.5"},
      {[](SampleJob& j) { j.sampling.temperature = INFINITY; }, "--temperature must be >= 0"},
      {[](SampleJob& j) { j.sampling.top_k = -1; }, "sample: --top-k must be >= 0 (0 = all tokens), got -1"},
      {[](SampleJob& j) { j.prompt = std::string(25, 'x'); }, "the prompt is 25 tokens (bytes), longer than the model's "
                                                              "context n_positions = 24"},
      {[](SampleJob& j) { j.checkpoint = ""; }, "sample: --checkpoint is empty"},
      {[](SampleJob& j) { j.checkpoint += ".missing"; }, "does not exist"},
      {[](SampleJob& j) { j.tokenizer = "/no/such/dir"; }, "--tokenizer '/no/such/dir' is not a directory"},
  };
  for (const Case& c : cases) {
    SampleJob job = job_for(w, 1.0);
    c.change(job);
    bool ran = false;
    const std::string message = error_of([&] { run_sample_job(job, [&](const auto&) { ran = true; }); });
    EXPECT_FALSE(ran) << c.message;
    EXPECT_NE(message.find(c.message), std::string::npos) << "got: '" << message << "', expected '" << c.message << "'";
  }
  // More tensor-parallel ranks than heads: the model's own check, on the ranks, before any output.
  SampleJob job = job_for(w, 0.0);
  bool printed = false;
  job.on_text = [&](std::string_view) { printed = true; };
  const std::string e = error_of([&] { run_sample_job(job, threads_mesh({{"dp", 1}, {"tp", 8}})); });
  EXPECT_NE(e.find("8 ranks split the attention heads but there are only 4 heads"), std::string::npos) << e;
  EXPECT_FALSE(printed);
}

TEST_F(SampleTest, Gpt2TokenizerFromADirectoryOrAPreparedDataset) {
  ASSERT_TRUE(meshgrad::testing::gpt2_files_present());
  const std::string w = path("bpe.safetensors");
  nn::ModelConfig cfg = tiny_gpt(50257, DType::Float32);
  cfg.layers = 1;
  save_model(w, cfg);
  // A vocabulary that is not bytes needs a tokenizer.
  EXPECT_NE(error_of([&] { run_sample_job(job_for(w, 0.0), threads_mesh(meshes()[0].axes)); })
                .find("the model's vocabulary has 50257 tokens"),
            std::string::npos);
  SampleJob job = job_for(w, 1.0, 2, 12);
  job.prompt = "Hello, w\xC3\xB6rld \xE6\x9D\xB1\xE4\xBA\xAC";   // Hello, wörld 東京
  job.tokenizer = meshgrad::testing::gpt2_dir();
  std::string streamed;
  job.on_text = [&](std::string_view piece) {
    EXPECT_EQ(text::to_valid_utf8(piece), piece);
    streamed += piece;
  };
  const SampleResult r = run_sample_job(job, threads_mesh(meshes()[1].axes));
  EXPECT_EQ(r.new_tokens.size(), 12u);
  EXPECT_LT(r.prompt_tokens.size(), job.prompt.size()) << "BPE merges bytes";
  EXPECT_EQ(r.text.substr(0, job.prompt.size()), job.prompt);
  EXPECT_EQ(streamed, r.text);
  for (std::int64_t id : r.new_tokens) EXPECT_LT(id, 50257);

  // A `meshgrad prepare` directory: meta.json names the files (here only by their original paths).
  const fs::path prepared = dir_ / "prepared";
  fs::create_directories(prepared);
  std::ofstream(prepared / "meta.json") << nlohmann::json{
      {"vocab_size", 50257},
      {"tokenizer",
       {{"vocab", {{"file", meshgrad::testing::gpt2_vocab()}, {"copy", "vocab.json"}}},
        {"merges", {{"file", meshgrad::testing::gpt2_merges()}, {"copy", "merges.txt"}}}}}}.dump();
  job.tokenizer = prepared.string();
  job.on_text = nullptr;
  EXPECT_EQ(run_sample_job(job, threads_mesh(meshes()[0].axes)).new_tokens, r.new_tokens);

  // A tokenizer larger than the model's vocabulary is not its tokenizer.
  const std::string small = path("small.safetensors");
  save_model(small, tiny_gpt(256, DType::Float32));
  SampleJob wrong = job_for(small, 0.0);
  wrong.tokenizer = meshgrad::testing::gpt2_dir();
  EXPECT_NE(error_of([&] { run_sample_job(wrong, threads_mesh(meshes()[0].axes)); }).find("it is not this model's tokenizer"),
            std::string::npos);
}

}  // namespace
}  // namespace meshgrad::generate::test_sample
