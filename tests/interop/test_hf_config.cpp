// config.json by model_type: the Llama family's keys as Hugging Face's released configs spell
// them, and every refusal naming the key and the value.
#include <gtest/gtest.h>

#include <string>

#include "meshgrad/interop/hf_config.hpp"
#include "meshgrad/tensor/error.hpp"

namespace test_hf_config {

using namespace meshgrad;

namespace {

// Llama-3.2-1B's config.json (the keys that matter, as released).
const char* kLlama32 = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
  "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
  "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16", "use_cache": true,
  "vocab_size": 128256})";

// Qwen2-0.5B's.
const char* kQwen2 = R"({
  "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
  "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
  "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
  "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
  "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": true,
  "torch_dtype": "bfloat16", "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})";

// Mistral-7B-v0.1's.
const char* kMistral = R"({
  "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
  "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
  "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
  "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
  "sliding_window": 4096, "tie_word_embeddings": false, "torch_dtype": "bfloat16", "vocab_size": 32000})";

// TinyLlama-1.1B's: no head_dim, rope_scaling null.
const char* kTinyLlama = R"({
  "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 2048,
  "intermediate_size": 5632, "max_position_embeddings": 2048, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 22, "num_key_value_heads": 4, "pretraining_tp": 1,
  "rms_norm_eps": 1e-05, "rope_scaling": null, "tie_word_embeddings": false, "vocab_size": 32000})";

TEST(HfConfig, Llama32ReadsGroupedQueryAttentionLlama3RopeAndTiedEmbeddings) {
  const nn::ModelConfig c = interop::parse_hf_config(kLlama32, "config.json");
  EXPECT_EQ(c.kind, "llama");
  EXPECT_EQ(c.model_type, "llama");
  EXPECT_EQ(c.layers, 16);
  EXPECT_EQ(c.hidden, 2048);
  EXPECT_EQ(c.ffn, 8192);
  EXPECT_EQ(c.heads, 32);
  EXPECT_EQ(c.kv_head_count(), 8);
  EXPECT_EQ(c.head_size(), 64);
  EXPECT_EQ(c.vocab, 128256);
  EXPECT_EQ(c.n_positions(), 131072);
  EXPECT_DOUBLE_EQ(c.layer_norm_epsilon, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rope_scaling, "llama3");
  EXPECT_DOUBLE_EQ(c.rope_factor, 32.0);
  EXPECT_DOUBLE_EQ(c.rope_low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_original_positions, 8192);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.sliding_window, 0);
}

TEST(HfConfig, Qwen2HasQkvBiasesAndIgnoresAnUnusedSlidingWindow) {
  const nn::ModelConfig c = interop::parse_hf_config(kQwen2, "config.json");
  EXPECT_EQ(c.model_type, "qwen2");
  EXPECT_TRUE(c.attention_bias);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.kv_head_count(), 2);
  EXPECT_EQ(c.head_size(), 64);
  EXPECT_DOUBLE_EQ(c.layer_norm_epsilon, 1e-6);
  EXPECT_EQ(c.sliding_window, 0);   // use_sliding_window is false
  EXPECT_TRUE(c.rope_scaling.empty());
}

TEST(HfConfig, MistralKeepsItsSlidingWindowAndAnUntiedHead) {
  const nn::ModelConfig c = interop::parse_hf_config(kMistral, "config.json");
  EXPECT_EQ(c.model_type, "mistral");
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.head_size(), 128);
  const nn::ModelConfig tiny = interop::parse_hf_config(kTinyLlama, "config.json");
  EXPECT_EQ(tiny.kv_head_count(), 4);
  EXPECT_DOUBLE_EQ(tiny.rope_theta, 10000.0);
  EXPECT_TRUE(tiny.rope_scaling.empty());
}

// The config with `key` set to `value` (raw JSON), parsed: the message of the refusal.
std::string refusal(const std::string& config, const std::string& key, const std::string& value) {
  std::string text = config;
  const std::string quoted = "\"" + key + "\": ";
  const std::size_t at = text.find(quoted);
  if (at == std::string::npos) {
    text.insert(text.find('{') + 1, quoted + value + ", ");
  } else {
    const std::size_t begin = at + quoted.size();
    std::size_t end = begin;
    int depth = 0;
    while (end < text.size() && (depth > 0 || (text[end] != ',' && text[end] != '}'))) {
      depth += text[end] == '{' ? 1 : text[end] == '}' ? -1 : 0;
      ++end;
    }
    text.replace(begin, end - begin, value);
  }
  try {
    interop::parse_hf_config(text, "c.json");
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(HfConfig, WhatMeshgradDoesNotComputeIsRefusedNamingTheKeyAndTheValue) {
  EXPECT_NE(refusal(kLlama32, "model_type", "\"gemma\"").find("\"model_type\": \"gemma\" is not a model meshgrad builds"),
            std::string::npos);
  EXPECT_NE(refusal(kLlama32, "rope_scaling", R"({"rope_type": "yarn", "factor": 4.0})")
                .find("\"rope_scaling.rope_type\": \"yarn\" is not supported"),
            std::string::npos);
  EXPECT_NE(refusal(kLlama32, "hidden_act", "\"gelu\"").find("\"hidden_act\": string \"gelu\" is not supported"),
            std::string::npos);
  EXPECT_NE(refusal(kLlama32, "mlp_bias", "true").find("\"mlp_bias\": true is not supported"), std::string::npos);
  EXPECT_NE(refusal(kTinyLlama, "pretraining_tp", "2").find("\"pretraining_tp\": 2 is not supported"),
            std::string::npos);
  EXPECT_NE(refusal(kLlama32, "num_key_value_heads", "5").find("num_attention_heads = 32 is not a multiple of "
                                                               "num_key_value_heads = 5"),
            std::string::npos);
  EXPECT_NE(refusal(kLlama32, "hidden_size", "\"2048\"").find("key \"hidden_size\" must be an integer"),
            std::string::npos);
  EXPECT_NE(refusal(kMistral, "rope_theta", "0.5").find("rope_theta must be > 1"), std::string::npos);
  EXPECT_NE(refusal(kLlama32, "rope_scaling", R"({"rope_type": "llama3", "factor": 8.0})")
                .find("missing key \"low_freq_factor\""),
            std::string::npos);
}

}  // namespace

namespace {

// Qwen2 with use_sliding_window: the window applies from max_window_layers on (Qwen2Config's
// layer_types rule); a layer_types list that says otherwise is refused. Mistral's applies everywhere.
TEST(HfConfig, SlidingWindowLayersFollowQwen2sMaxWindowLayers) {
  std::string text = kQwen2;
  const std::string use = "\"use_sliding_window\": false", window = "\"sliding_window\": 32768";
  text.replace(text.find(use), use.size(), "\"use_sliding_window\": true");
  text.replace(text.find(window), window.size(), "\"sliding_window\": 4096");
  const nn::ModelConfig c = interop::parse_hf_config(text, "config.json");
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_EQ(c.max_window_layers, 24);
  for (int i = 0; i < c.layers; ++i) EXPECT_EQ(c.attention_window(i), 0) << i;   // 24 layers, max_window_layers 24
  std::string two = text;
  const std::string key = "\"max_window_layers\": 24";
  two.replace(two.find(key), key.size(), "\"max_window_layers\": 2");
  const nn::ModelConfig w = interop::parse_hf_config(two, "config.json");
  EXPECT_EQ(w.attention_window(1), 0);
  EXPECT_EQ(w.attention_window(2), 4096);
  const nn::ModelConfig m = interop::parse_hf_config(kMistral, "config.json");
  EXPECT_EQ(m.attention_window(0), 4096);
  std::string listed = text;
  listed.insert(listed.find('{') + 1, R"("layer_types": ["full_attention"], )");
  EXPECT_NE(refusal(listed, "max_window_layers", "24").find("\"layer_types\""), std::string::npos);
}

}  // namespace

}  // namespace test_hf_config
