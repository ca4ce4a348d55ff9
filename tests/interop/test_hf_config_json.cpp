// hf_config_json writes a config.json that parse_hf_config reads back to the same model, for every
// Llama-family variant meshgrad builds (and GPT-2), with the keys transformers' save_pretrained writes.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "meshgrad/interop/hf_config.hpp"
#include "meshgrad/tensor/error.hpp"

namespace test_hf_config_json {

using namespace meshgrad;

namespace {

nn::ModelConfig base(const std::string& type) {
  nn::ModelConfig c;
  c.kind = "llama";
  c.model_type = type;
  c.layers = 3;
  c.hidden = 48;
  c.ffn = 80;
  c.heads = 6;
  c.kv_heads = 2;
  c.head_dim = 16;   // heads * head_dim != hidden
  c.vocab = 300;
  c.positions = 64;
  c.layer_norm_epsilon = 1e-6;
  c.rope_theta = 500000.0;
  return c;
}

// Every field that defines the model (parse_hf_config leaves seq, batch, dtype at their defaults).
void expect_same_model(const nn::ModelConfig& a, const nn::ModelConfig& b) {
  EXPECT_EQ(a.kind, b.kind);
  EXPECT_EQ(a.model_type, b.model_type);
  EXPECT_EQ(a.layers, b.layers);
  EXPECT_EQ(a.hidden, b.hidden);
  EXPECT_EQ(a.ffn_size(), b.ffn_size());
  EXPECT_EQ(a.heads, b.heads);
  EXPECT_EQ(a.kv_head_count(), b.kv_head_count());
  EXPECT_EQ(a.head_size(), b.head_size());
  EXPECT_EQ(a.vocab, b.vocab);
  EXPECT_EQ(a.n_positions(), b.n_positions());
  EXPECT_EQ(a.layer_norm_epsilon, b.layer_norm_epsilon);   // bitwise: JSON keeps a double's 17 digits
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.rope_scaling, b.rope_scaling);
  if (!a.rope_scaling.empty()) {
    EXPECT_EQ(a.rope_factor, b.rope_factor);
  }
  if (a.rope_scaling == "llama3") {
    EXPECT_EQ(a.rope_low_freq_factor, b.rope_low_freq_factor);
    EXPECT_EQ(a.rope_high_freq_factor, b.rope_high_freq_factor);
    EXPECT_EQ(a.rope_original_positions, b.rope_original_positions);
  }
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.attention_bias, b.attention_bias);
  EXPECT_EQ(a.sliding_window, b.sliding_window);
  for (int i = 0; i < a.layers; ++i) EXPECT_EQ(a.attention_window(i), b.attention_window(i)) << "layer " << i;
}

}  // namespace

TEST(HfConfigJson, Llama3WithScalingAndTiedEmbeddingsRoundTrips) {
  nn::ModelConfig c = base("llama");
  c.rope_scaling = "llama3";
  c.rope_factor = 32;
  c.rope_low_freq_factor = 1;
  c.rope_high_freq_factor = 4;
  c.rope_original_positions = 32;
  c.tie_word_embeddings = true;
  const std::string text = interop::hf_config_json(c, {"bfloat16", 1, 2});
  expect_same_model(c, interop::parse_hf_config(text, "out.json"));
  const nlohmann::json j = nlohmann::json::parse(text);
  EXPECT_EQ(j.at("architectures"), nlohmann::json::array({"LlamaForCausalLM"}));
  EXPECT_EQ(j.at("hidden_act"), "silu");
  EXPECT_EQ(j.at("torch_dtype"), "bfloat16");
  EXPECT_EQ(j.at("bos_token_id"), 1);
  EXPECT_EQ(j.at("eos_token_id"), 2);
  EXPECT_EQ(j.at("rope_scaling").at("rope_type"), "llama3");
  EXPECT_EQ(j.at("rope_scaling").at("original_max_position_embeddings"), 32);
}

TEST(HfConfigJson, LlamaWithLinearScalingAndBiasesRoundTrips) {
  nn::ModelConfig c = base("llama");
  c.rope_scaling = "linear";
  c.rope_factor = 2.5;
  c.attention_bias = true;
  c.kv_heads = 6;
  const std::string text = interop::hf_config_json(c);
  expect_same_model(c, interop::parse_hf_config(text, "out.json"));
  const nlohmann::json j = nlohmann::json::parse(text);
  EXPECT_EQ(j.at("bos_token_id"), nullptr);   // unknown: null, as GPT2Config's
  EXPECT_EQ(j.at("torch_dtype"), "float32");
}

TEST(HfConfigJson, Qwen2RoundTripsWithAndWithoutASlidingWindow) {
  nn::ModelConfig c = base("qwen2");
  c.attention_bias = true;
  c.tie_word_embeddings = true;
  std::string text = interop::hf_config_json(c);
  expect_same_model(c, interop::parse_hf_config(text, "out.json"));
  nlohmann::json j = nlohmann::json::parse(text);
  EXPECT_EQ(j.at("architectures"), nlohmann::json::array({"Qwen2ForCausalLM"}));
  EXPECT_EQ(j.at("use_sliding_window"), false);
  EXPECT_EQ(j.at("max_window_layers"), 3);
  c.sliding_window = 8;
  text = interop::hf_config_json(c);
  expect_same_model(c, interop::parse_hf_config(text, "out.json"));
  j = nlohmann::json::parse(text);
  EXPECT_EQ(j.at("use_sliding_window"), true);
  EXPECT_EQ(j.at("sliding_window"), 8);
  c.max_window_layers = 2;   // full attention in layers 0 and 1, the window from layer 2 on
  text = interop::hf_config_json(c);
  const nn::ModelConfig back = interop::parse_hf_config(text, "out.json");
  expect_same_model(c, back);
  EXPECT_EQ(back.max_window_layers, 2);
  EXPECT_EQ(nlohmann::json::parse(text).at("max_window_layers"), 2);
  // What a model_type cannot say is refused, not dropped.
  nn::ModelConfig mistral = base("mistral");
  mistral.sliding_window = 8;
  mistral.max_window_layers = 1;
  EXPECT_THROW(interop::hf_config_json(mistral), InvalidArgument);
  nn::ModelConfig llama = base("llama");
  llama.sliding_window = 8;
  EXPECT_THROW(interop::hf_config_json(llama), InvalidArgument);
}

TEST(HfConfigJson, MistralRoundTripsWithItsSlidingWindow) {
  nn::ModelConfig c = base("mistral");
  c.sliding_window = 16;
  const std::string text = interop::hf_config_json(c);
  expect_same_model(c, interop::parse_hf_config(text, "out.json"));
  const nlohmann::json j = nlohmann::json::parse(text);
  EXPECT_EQ(j.at("architectures"), nlohmann::json::array({"MistralForCausalLM"}));
  EXPECT_FALSE(j.contains("attention_bias"));
  c.sliding_window = 0;
  EXPECT_EQ(nlohmann::json::parse(interop::hf_config_json(c)).at("sliding_window"), nullptr);
  expect_same_model(c, interop::parse_hf_config(interop::hf_config_json(c), "out.json"));
}

TEST(HfConfigJson, Gpt2GoesThroughItsOwnWriter) {
  nn::ModelConfig c = nn::ModelConfig::gpt(2, 32, 4, 100, 16);
  c.positions = 24;
  const nn::ModelConfig back = interop::parse_hf_config(interop::hf_config_json(c), "out.json");
  EXPECT_EQ(back.kind, "gpt");
  EXPECT_EQ(back.layers, 2);
  EXPECT_EQ(back.vocab, 100);
  EXPECT_EQ(back.n_positions(), 24);
}

TEST(HfConfigJson, RefusesWhatTheModelTypeCannotSay) {
  nn::ModelConfig qwen = base("qwen2");
  qwen.attention_bias = false;
  EXPECT_THROW(
      try { interop::hf_config_json(qwen); } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find("attention_bias false"), std::string::npos) << e.what();
        throw;
      },
      InvalidArgument);
  nn::ModelConfig mistral = base("mistral");
  mistral.attention_bias = true;
  EXPECT_THROW(interop::hf_config_json(mistral), InvalidArgument);
  nn::ModelConfig other = base("gemma");
  EXPECT_THROW(interop::hf_config_json(other), InvalidArgument);
}

}  // namespace test_hf_config_json
