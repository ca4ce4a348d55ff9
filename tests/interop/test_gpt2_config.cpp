// config.json as untrusted input: nesting, integer ranges, non-files, and the check against the
// weights that runs before a model is built.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "meshgrad/interop/gpt2_config.hpp"

namespace meshgrad::interop::test_gpt2_config {
namespace {

namespace fs = std::filesystem;

class Gpt2ConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           fmt::format("meshgrad_cfg_{}_{}", ::getpid(), ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& text) const {
    const std::string p = (dir_ / "config.json").string();
    std::ofstream(p) << text;
    return p;
  }
  // A config with one key's value replaced by `value` (raw JSON text).
  static std::string config_with(const std::string& key, const std::string& value) {
    std::string text = R"({"n_layer": 1, "n_head": 4, "n_embd": 8, "vocab_size": 16, "n_positions": 4,
                          "layer_norm_epsilon": 1e-5})";
    const std::string needle = "\"" + key + "\": ";
    const auto at = text.find(needle) + needle.size();
    const auto end = text.find_first_of(",}", at);
    return text.substr(0, at) + value + text.substr(end);
  }
  // Expects read_gpt2_config to throw InvalidArgument whose message holds the path and every needle.
  void expect_error(const std::string& path, const std::vector<std::string>& needles) const {
    try {
      (void)read_gpt2_config(path);
      ADD_FAILURE() << "accepted " << path;
    } catch (const InvalidArgument& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(path), std::string::npos) << message;
      EXPECT_LT(message.size(), 600u) << message.substr(0, 300);
      for (const auto& n : needles) EXPECT_NE(message.find(n), std::string::npos) << "no \"" << n << "\" in " << message;
    }
  }
  fs::path dir_;
};

TEST_F(Gpt2ConfigTest, DeepNestingIsRefusedNotACrash) {
  const std::string deep = std::string(200'000, '[') + "1" + std::string(200'000, ']');
  expect_error(write(config_with("n_layer", deep)), {"nested deeper than 16 levels", "'n_layer'"});
  // In a key meshgrad ignores, too: the whole document is bounded.
  expect_error(write(R"({"task_specific_params": )" + deep + "}"), {"nested deeper than 16 levels"});
  // A shallow array is a type error naming the key, with a short excerpt of the value.
  expect_error(write(config_with("n_layer", "[[[1]]]")), {"\"n_layer\" must be an integer but is array [[[1]]]"});
}

TEST_F(Gpt2ConfigTest, IntegersOutOfRangeAreRefusedNamingTheKey) {
  expect_error(write(config_with("n_positions", "99999999999")), {"\"n_positions\" is 99999999999", "larger than"});
  expect_error(write(config_with("n_positions", "18446744073709551615")), {"\"n_positions\"", "larger than"});
  expect_error(write(config_with("n_layer", "-3")), {"\"n_layer\" must be positive, got -3"});
  expect_error(write(config_with("n_embd", "1000000000")), {"\"n_embd\"", "larger than the 536870911"});
  expect_error(write(config_with("n_head", "3")), {"n_embd = 8 is not divisible by n_head = 3"});
  expect_error(write(config_with("layer_norm_epsilon", "0")), {"layer_norm_epsilon must be > 0"});
  // Within range: accepted as is (no truncation).
  const nn::ModelConfig c = read_gpt2_config(write(config_with("n_positions", "2147483647")));
  EXPECT_EQ(c.n_positions(), 2147483647);
}

TEST_F(Gpt2ConfigTest, NotARegularFileIsNamed) {
  expect_error(dir_.string(), {"is not a regular file (a directory)"});
  expect_error((dir_ / "missing.json").string(), {"cannot be opened", "No such file"});
}

TEST_F(Gpt2ConfigTest, SizesAreCheckedAgainstTheWeightsFromTheHeaderAlone) {
  const std::string weights = (dir_ / "w.safetensors").string();
  const std::int64_t C = 8;
  io::write_safetensors(weights, {{"wte.weight", Tensor::zeros({16, C})},
                              {"wpe.weight", Tensor::zeros({4, C})},
                              {"ln_f.weight", Tensor::zeros({C})},
                              {"h.0.ln_1.weight", Tensor::zeros({C})},
                              {"h.0.mlp.c_fc.weight", Tensor::zeros({C, 4 * C})}});
  const io::SafetensorsFile file(weights);
  const std::string ok = write(config_with("n_layer", "1"));
  check_gpt2_config_against_weights(read_gpt2_config(ok), ok, file);   // matches: no throw

  const auto expect_mismatch = [&](const std::string& key, const std::string& value,
                                   const std::vector<std::string>& needles) {
    const std::string p = write(config_with(key, value));
    try {
      check_gpt2_config_against_weights(read_gpt2_config(p), p, file);
      ADD_FAILURE() << key << " = " << value << " accepted";
    } catch (const InvalidArgument& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(p), std::string::npos) << message;
      EXPECT_NE(message.find(weights), std::string::npos) << message;
      for (const auto& n : needles) EXPECT_NE(message.find(n), std::string::npos) << "no \"" << n << "\" in " << message;
    }
  };
  expect_mismatch("n_positions", "30000000", {"n_positions", "'wpe.weight'", "[30000000, 8]", "[4, 8]"});
  expect_mismatch("vocab_size", "50257", {"vocab_size", "'wte.weight'", "[50257, 8]"});
  expect_mismatch("n_embd", "16", {"n_embd", "[16, 16]"});
  expect_mismatch("n_layer", "1000000000", {"n_layer = 1000000000"});
  expect_mismatch("n_layer", "2", {"no tensor 'h.1.ln_1.weight'"});
}

// What `train --save` writes into the weights' metadata reads back as the same model sizes.
TEST(Gpt2ConfigJson, RoundTripsAndNamesItsSource) {
  nn::ModelConfig c;
  c.layers = 3;
  c.heads = 2;
  c.hidden = 10;
  c.vocab = 300;
  c.seq = 24;   // positions 0: n_positions = seq
  c.layer_norm_epsilon = 1e-6;
  const nn::ModelConfig back = parse_gpt2_config(gpt2_config_json(c), "metadata");
  EXPECT_EQ(back.layers, 3);
  EXPECT_EQ(back.heads, 2);
  EXPECT_EQ(back.hidden, 10);
  EXPECT_EQ(back.vocab, 300);
  EXPECT_EQ(back.n_positions(), 24);
  EXPECT_EQ(back.layer_norm_epsilon, 1e-6);
  try {
    (void)parse_gpt2_config(R"({"n_layer": 1})", "'w.safetensors' metadata \"gpt2_config\"");
    ADD_FAILURE() << "an incomplete config was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'w.safetensors' metadata \"gpt2_config\"': missing key \"n_head\""),
              std::string::npos) << e.what();
  }
}

TEST(Gpt2Config, ErrorsNameTheFileAndKey) {
  const auto path = std::filesystem::temp_directory_path() / "meshgrad_test_config.json";
  auto write = [&](const std::string& text) { std::ofstream(path) << text; };
  write(R"({"n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 50257, "n_positions": 1024,
            "layer_norm_epsilon": 1e-5, "model_type": "gpt2"})");
  const nn::ModelConfig c = interop::read_gpt2_config(path.string());
  EXPECT_EQ(c.layers, 2);
  EXPECT_EQ(c.heads, 4);
  EXPECT_EQ(c.hidden, 64);
  EXPECT_EQ(c.vocab, 50257);
  EXPECT_EQ(c.n_positions(), 1024);
  EXPECT_DOUBLE_EQ(c.layer_norm_epsilon, 1e-5);
  auto expect_error = [&](const std::string& text, const std::string& key) {
    write(text);
    try {
      interop::read_gpt2_config(path.string());
      ADD_FAILURE() << "accepted: " << text;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
  };
  expect_error(R"({"n_head": 4, "n_embd": 64, "vocab_size": 9, "n_positions": 8, "layer_norm_epsilon": 1e-5})",
               "n_layer");
  expect_error(R"({"n_layer": 2, "n_head": "4", "n_embd": 64, "vocab_size": 9, "n_positions": 8,
                   "layer_norm_epsilon": 1e-5})",
               "n_head");
  expect_error(R"({"n_layer": 2, "n_head": 4, "n_embd": 64.5, "vocab_size": 9, "n_positions": 8,
                   "layer_norm_epsilon": 1e-5})",
               "n_embd");
  expect_error("{not json", "JSON");
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace meshgrad::interop::test_gpt2_config
