// A Hugging Face config.json of any model_type meshgrad builds: "gpt2" (gpt2_config.hpp) and the
// Llama family, "llama" (Llama 2/3, TinyLlama, SmolLM), "qwen2" and "mistral" (nn/decoder_lm.hpp).
// Read as untrusted input, as read_gpt2_config: every refusal names the file, the key and the value.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "meshgrad/nn/model.hpp"

namespace meshgrad::interop {

// The model of a config.json, by its "model_type". The Llama family reads hidden_size,
// intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads (default: the
// heads), head_dim (default hidden_size / heads), vocab_size, max_position_embeddings, rms_norm_eps
// (default 1e-6), rope_theta (default 10000), rope_scaling (null, or rope_type / type "default",
// "linear" or "llama3" with their factors), tie_word_embeddings (default false), attention_bias
// (llama: default false; qwen2: always true, as Qwen2's q/k/v projections have biases) and
// sliding_window (mistral: every layer; qwen2 only with use_sliding_window, on the layers from
// max_window_layers (default 28) on; a layer_types list must agree). Refused naming the key and the
// value: an unknown model_type, a rope_scaling type not implemented, hidden_act other than "silu",
// mlp_bias true, pretraining_tp other than 1, a non-zero attention_dropout, heads not a multiple of
// the key/value heads; missing or ill-typed keys as read_gpt2_config.
nn::ModelConfig read_hf_config(const std::string& path);
nn::ModelConfig parse_hf_config(const std::string& text, const std::string& origin);

// What hf_config_json writes beyond the model's shape.
struct HfConfigJsonOptions {
  std::string torch_dtype;                    // "" = the model's dtype ("float32", "float64")
  std::optional<std::int64_t> bos_token_id;   // none: null
  std::optional<std::int64_t> eos_token_id;   // none: null
};

// A Hugging Face config.json for the model, as transformers' save_pretrained writes one (keys sorted,
// indent 2). gpt2: gpt2_config_json (eos_token_id is its <|endoftext|>). The Llama family, by
// config.model_type: "llama" (LlamaForCausalLM), "qwen2" (Qwen2ForCausalLM), "mistral"
// (MistralForCausalLM) with every key parse_hf_config reads (hidden_size, intermediate_size,
// num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, vocab_size,
// max_position_embeddings, rms_norm_eps, rope_theta, rope_scaling {rope_type, factor, and for llama3
// low/high_freq_factor, original_max_position_embeddings} or null, tie_word_embeddings) and
// hidden_act "silu", attention_dropout 0, initializer_range 0.02, use_cache true, torch_dtype,
// bos/eos_token_id; llama: attention_bias, mlp_bias false, pretraining_tp 1; qwen2:
// use_sliding_window, sliding_window (null without one), max_window_layers (0 with a window: every
// layer slides, as meshgrad computes; the layer count without); mistral: sliding_window (null
// without). parse_hf_config of it gives the model back. Throws InvalidArgument naming the field when
// the model_type cannot say the model: qwen2 without attention_bias (Qwen2's projections always have
// biases), mistral with attention_bias (Mistral's never do), another model_type or kind.
std::string hf_config_json(const nn::ModelConfig& config, const HfConfigJsonOptions& options = {});

}  // namespace meshgrad::interop
