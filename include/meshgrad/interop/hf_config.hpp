// A Hugging Face config.json of any model_type meshgrad builds: "gpt2" (gpt2_config.hpp) and the
// Llama family, "llama" (Llama 2/3, TinyLlama, SmolLM), "qwen2" and "mistral" (nn/decoder_lm.hpp).
// Read as untrusted input, as read_gpt2_config: every refusal names the file, the key and the value.
#pragma once

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

}  // namespace meshgrad::interop
