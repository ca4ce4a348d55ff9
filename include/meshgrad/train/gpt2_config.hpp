// Hugging Face GPT-2 config.json: the model sizes `meshgrad grads` builds, read as untrusted input
// (bounded size and nesting, every integer range-checked, messages naming the file and the key),
// and checked against a weights file before any model is built.
#pragma once

#include <cstdint>
#include <string>

#include "meshgrad/nn/model.hpp"
#include "meshgrad/train/safetensors.hpp"

namespace meshgrad::train {

// The largest config.json accepted (Hugging Face's are a few KB) and its deepest nesting (theirs
// nest 3 levels, e.g. task_specific_params > "text-generation" > key).
inline constexpr std::uint64_t kMaxConfigBytes = 16 << 20;
inline constexpr int kMaxConfigDepth = 16;

// The model configuration of a Hugging Face GPT-2 config.json (n_layer, n_head, n_embd, vocab_size,
// n_positions, layer_norm_epsilon; other keys are ignored). The integer keys must be integers in
// [1, 2^31 - 1]; layer_norm_epsilon a number > 0; n_embd divisible by n_head. Throws
// InvalidArgument naming the file and the key when a key is missing, has the wrong type or is out
// of range, or when the file is not a readable regular file of at most kMaxConfigBytes of JSON
// nested at most kMaxConfigDepth deep.
nn::ModelConfig read_gpt2_config(const std::string& path);
// The same from JSON text; `path` names its source in messages (a file, or e.g. "'w.safetensors'
// metadata gpt2_config").
nn::ModelConfig parse_gpt2_config(const std::string& text, const std::string& path);

// A config.json for the model (Hugging Face GPT-2 keys: model_type, n_layer, n_head, n_embd, n_inner,
// vocab_size, n_positions, n_ctx, layer_norm_epsilon, activation_function), compact. What
// `meshgrad train --save` writes into the safetensors metadata as "gpt2_config", so `meshgrad
// sample` can rebuild the model from the file alone. parse_gpt2_config reads it back.
std::string gpt2_config_json(const nn::ModelConfig& config);

// Checks, from the weights file's header alone, that the model `config` describes matches it:
// wte.weight [vocab_size, n_embd], wpe.weight [n_positions, n_embd], ln_f.weight [n_embd] and, for
// each of the n_layer blocks, h.<i>.ln_1.weight [n_embd] and h.<i>.mlp.c_fc.weight
// [n_embd, 4 n_embd]. So a config whose sizes disagree with the weights (a wrong n_positions, a
// huge n_layer) is refused at once, before a model of that size is allocated and initialised.
// load_parameters still checks every parameter afterwards. Throws InvalidArgument naming both
// files, the tensor, the config key and both shapes.
void check_gpt2_config_against_weights(const nn::ModelConfig& config, const std::string& config_path,
                                       const SafetensorsFile& weights);

}  // namespace meshgrad::train
