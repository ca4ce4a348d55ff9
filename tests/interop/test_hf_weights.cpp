// Hugging Face weights of the Llama family (interop/hf_weights.hpp): a directory whole or sharded
// reads the same tensors, F16 / BF16 widen exactly, the file layout is transposed into meshgrad's,
// and every refusal names the file and the tensor.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <unistd.h>
#include <fmt/core.h>
#include <string>
#include <utility>
#include <vector>

#include "meshgrad/interop/hf_weights.hpp"
#include "meshgrad/interop/model_tensors.hpp"
#include "meshgrad/io/safetensors.hpp"
#include "meshgrad/tensor/error.hpp"
#include "meshgrad/tensor/random.hpp"

namespace test_hf_weights {

using namespace meshgrad;
namespace fs = std::filesystem;

namespace {

using Named = std::vector<std::pair<std::string, Tensor>>;

nn::ModelConfig llama(bool tied) {
  nn::ModelConfig c;
  c.kind = "llama";
  c.layers = 2;
  c.hidden = 16;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = 4;
  c.ffn = 24;
  c.vocab = 40;
  c.positions = 16;
  c.tie_word_embeddings = tied;
  c.attention_bias = true;
  return c;
}

// Random tensors of meshgrad's layout and the same in the file's layout (Hugging Face names).
struct Model {
  Named meshgrad, file;
};

Model random_model(const nn::ModelConfig& c) {
  Model m;
  std::uint64_t seed = 7;
  for (const interop::ModelTensor& t : interop::model_tensors(c)) {
    Tensor v = random::randn(t.shape, seed++);
    m.meshgrad.emplace_back(t.name, v);
    m.file.emplace_back(t.name, interop::to_file_layout(t, v));
  }
  return m;
}

class HfWeights : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / fmt::format("mg_hf_weights_{}_{}", ::getpid(),
                                                   ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& leaf) const { return (dir_ / leaf).string(); }
  // A directory `name` holding `tensors` split over `shards` files with an index (1: model.safetensors).
  std::string write_dir(const std::string& name, const Named& tensors, int shards) {
    const fs::path d = dir_ / name;
    fs::create_directories(d);
    if (shards == 1) {
      io::write_safetensors((d / "model.safetensors").string(), tensors, {{"format", "pt"}});
      return d.string();
    }
    nlohmann::json map = nlohmann::json::object();
    for (int s = 0; s < shards; ++s) {
      const std::string leaf = fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards);
      Named part;
      for (std::size_t i = s; i < tensors.size(); i += shards) {
        part.push_back(tensors[i]);
        map[tensors[i].first] = leaf;
      }
      io::write_safetensors((d / leaf).string(), part, {{"format", "pt"}});
    }
    write_index(d.string(), map);
    return d.string();
  }
  static void write_index(const std::string& d, const nlohmann::json& map) {
    std::ofstream((fs::path(d) / interop::kHfIndexFile).string())
        << nlohmann::json{{"metadata", {{"total_size", 1}}}, {"weight_map", map}}.dump();
  }
  fs::path dir_;
};

void expect_bitwise(const Named& a, const Named& b) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    ASSERT_EQ(a[i].second.shape(), b[i].second.shape()) << a[i].first;
    const std::vector<double> x = a[i].second.to_vector(), y = b[i].second.to_vector();
    for (std::size_t k = 0; k < x.size(); ++k) ASSERT_EQ(x[k], y[k]) << a[i].first << " element " << k;
  }
}

// The message of what `f` throws (InvalidArgument), or "" when it does not throw.
std::string refusal(const std::function<void()>& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_HAS(message, needle) EXPECT_NE((message).find(needle), std::string::npos) << (message)

}  // namespace

TEST_F(HfWeights, AShardedDirectoryReadsTheSameTensorsAsOneFileInMeshgradsLayout) {
  const nn::ModelConfig c = llama(false);
  Model m = random_model(c);
  Named with_buffers = m.file;   // old files carry RoPE's inv_freq buffers: ignored
  with_buffers.emplace_back("model.layers.0.self_attn.rotary_emb.inv_freq", Tensor::ones({2}));
  const std::string one = write_dir("one", with_buffers, 1), three = write_dir("three", with_buffers, 3);
  const interop::WeightFiles a = interop::WeightFiles::open_directory(one, "--init-from");
  const interop::WeightFiles b = interop::WeightFiles::open_directory(three, "--init-from");
  EXPECT_EQ(interop::check_llama_weights(a, c, "c.json"), std::vector<std::string>{"F32"});
  EXPECT_EQ(interop::check_llama_weights(b, c, "c.json"), std::vector<std::string>{"F32"});
  EXPECT_EQ(b.file_of("model.norm.weight").find(three), 0u);
  expect_bitwise(interop::read_model_tensors(a, c), m.meshgrad);
  expect_bitwise(interop::read_model_tensors(b, c), m.meshgrad);
}

TEST_F(HfWeights, F16AndBf16WidenExactly) {
  const nn::ModelConfig c = llama(true);
  const Model m = random_model(c);
  for (const auto& [storage, narrow] : {std::pair{io::FloatStorage::F16, &io::float_to_f16},
                                        std::pair{io::FloatStorage::BF16, &io::float_to_bf16}}) {
    const auto widen = storage == io::FloatStorage::F16 ? &io::f16_to_float : &io::bf16_to_float;
    Named expected;   // each value rounded once to the half type, then widened by hand
    for (const auto& [name, t] : m.meshgrad) {
      std::vector<double> v = t.to_vector();
      for (double& x : v) x = widen(narrow(x));
      expected.emplace_back(name, Tensor::from_values(v, t.shape()));
    }
    const std::string d = write_dir(storage == io::FloatStorage::F16 ? "f16" : "bf16", {}, 1);
    fs::remove(fs::path(d) / "model.safetensors");
    io::write_safetensors((fs::path(d) / "model.safetensors").string(), m.file, {}, storage);
    const interop::WeightFiles f = interop::WeightFiles::open_directory(d, "--init-from");
    EXPECT_EQ(interop::check_llama_weights(f, c, "c.json"),
              std::vector<std::string>{storage == io::FloatStorage::F16 ? "F16" : "BF16"});
    expect_bitwise(interop::read_model_tensors(f, c), expected);
  }
}

TEST_F(HfWeights, RefusesAMissingTensorAWrongShapeAndALayerBeyondTheConfig) {
  const nn::ModelConfig c = llama(false);
  Model m = random_model(c);
  Named missing = m.file;
  missing.erase(missing.begin() + 3);
  const std::string gone = m.file[3].first;
  write_dir("missing", missing, 1);
  std::string e = refusal([&] {
    interop::check_llama_weights(interop::WeightFiles::open_directory(path("missing"), "--init-from"), c, "c.json");
  });
  EXPECT_HAS(e, "miss 1 tensor");
  EXPECT_HAS(e, "'" + gone + "'");

  Named wrong = m.file;
  for (auto& [name, t] : wrong) {
    if (name == "model.layers.1.mlp.down_proj.weight") t = t.transpose(0, 1).contiguous();   // meshgrad's [in, out]
  }
  write_dir("wrong", wrong, 1);
  e = refusal([&] {
    interop::check_llama_weights(interop::WeightFiles::open_directory(path("wrong"), "--init-from"), c, "c.json");
  });
  EXPECT_HAS(e, "'model.layers.1.mlp.down_proj.weight' has shape [24, 16]");
  EXPECT_HAS(e, "gives it [16, 24]");

  Named deeper = m.file;
  deeper.emplace_back("model.layers.2.input_layernorm.weight", Tensor::ones({16}));
  write_dir("deeper", deeper, 1);
  e = refusal([&] {
    interop::check_llama_weights(interop::WeightFiles::open_directory(path("deeper"), "--init-from"), c, "c.json");
  });
  EXPECT_HAS(e, "'model.layers.2.input_layernorm.weight'");
  EXPECT_HAS(e, "num_hidden_layers = 2");
}

TEST_F(HfWeights, ATiedConfigTakesAnLmHeadEqualToTheEmbeddingAndRefusesAnotherOne) {
  const nn::ModelConfig c = llama(true);
  const Model m = random_model(c);
  Named same = m.file;
  same.emplace_back("lm_head.weight", m.file.front().second.clone());
  write_dir("same", same, 1);
  EXPECT_NO_THROW(
      interop::check_llama_weights(interop::WeightFiles::open_directory(path("same"), "--init-from"), c, "c.json"));
  Named other = m.file;
  other.emplace_back("lm_head.weight", random::randn(m.file.front().second.shape(), 99));
  write_dir("other", other, 2);
  const std::string e = refusal([&] {
    interop::check_llama_weights(interop::WeightFiles::open_directory(path("other"), "--init-from"), c, "c.json");
  });
  EXPECT_HAS(e, "'lm_head.weight' differs from 'model.embed_tokens.weight'");
  EXPECT_HAS(e, "tie_word_embeddings true");
  EXPECT_HAS(e, "model-0000");   // the shard that holds it
}

TEST_F(HfWeights, RefusesABadIndexNamingTheFileAndTheTensor) {
  const nn::ModelConfig c = llama(false);
  const Model m = random_model(c);
  const auto open = [&](const std::string& d) {
    return refusal([&] { (void)interop::WeightFiles::open_directory(d, "--init-from"); });
  };
  // A map naming a file that is not there.
  std::string d = write_dir("gone", m.file, 2);
  fs::remove(fs::path(d) / "model-00002-of-00002.safetensors");
  std::string e = open(d);
  EXPECT_HAS(e, "'model-00002-of-00002.safetensors', which is not a file");
  EXPECT_HAS(e, "tensor '");
  // A tensor in two shards.
  d = write_dir("twice", m.file, 2);
  io::write_safetensors((fs::path(d) / "model-00002-of-00002.safetensors").string(),
                        Named{m.file[0], m.file[1], m.file[3]}, {});
  e = open(d);
  EXPECT_HAS(e, "is in two shards");
  EXPECT_HAS(e, "'" + m.file[0].first + "'");
  // A shard file the map does not name.
  d = write_dir("stray", m.file, 2);
  io::write_safetensors((fs::path(d) / "model-00003-of-00003.safetensors").string(), Named{m.file[0]}, {});
  e = open(d);
  EXPECT_HAS(e, "'model-00003-of-00003.safetensors' is a shard file");
  // A tensor the map puts in a file that does not hold it, and an index that is not one.
  d = write_dir("elsewhere", m.file, 2);
  nlohmann::json map = nlohmann::json::object();
  for (std::size_t i = 0; i < m.file.size(); ++i) map[m.file[i].first] = fmt::format("model-0000{}-of-00002.safetensors", i % 2 + 1);
  map[m.file[1].first] = "model-00001-of-00002.safetensors";   // it is in the second
  write_index(d, map);
  e = open(d);
  EXPECT_HAS(e, "puts tensor '" + m.file[1].first + "' in 'model-00001-of-00002.safetensors', but it is in");
  std::ofstream((fs::path(d) / interop::kHfIndexFile).string()) << R"({"weight_map": {"a": "../x.safetensors"}})";
  EXPECT_HAS(open(d), "'../x.safetensors', which is not a file name in the directory");
  std::ofstream((fs::path(d) / interop::kHfIndexFile).string()) << R"({"metadata": {}})";
  EXPECT_HAS(open(d), "has no \"weight_map\" object");
  // Neither weights file.
  fs::create_directories(dir_ / "empty");
  EXPECT_HAS(open(path("empty")), "has neither model.safetensors nor model.safetensors.index.json");
}

}  // namespace test_hf_weights
