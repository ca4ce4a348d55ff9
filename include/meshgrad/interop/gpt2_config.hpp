// Hugging Face GPT-2 config.json: the model sizes `meshgrad grads` builds, read as untrusted input
// (bounded size and nesting, every integer range-checked, messages naming the file and the key),
// and checked against a weights file before any model is built.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "meshgrad/nn/model.hpp"
#include "meshgrad/io/safetensors.hpp"

namespace meshgrad::interop {

// The largest config.json accepted (Hugging Face's are a few KB) and its deepest nesting (theirs
// nest 3 levels, e.g. task_specific_params > "text-generation" > key).
inline constexpr std::uint64_t kMaxConfigBytes = 16 << 20;
inline constexpr int kMaxConfigDepth = 16;

// The model configuration of a Hugging Face GPT-2 config.json (n_layer, n_head, n_embd, vocab_size,
// n_positions, layer_norm_epsilon, and n_inner: null or absent = 4 n_embd). The integer keys must be
// integers in [1, 2^31 - 1]; layer_norm_epsilon a number > 0; n_embd divisible by n_head.
// Keys that would make Hugging Face compute a different model than meshgrad's GPT-2 are refused
// naming the key when present with another value: activation_function (meshgrad's GELU is the tanh
// form, "gelu_new" = "gelu_pytorch_tanh"), scale_attn_weights (true), scale_attn_by_inverse_layer_idx
// (false), tie_word_embeddings (true), add_cross_attention (false). Other keys are ignored (dropout
// rates, token ids, task parameters). Throws InvalidArgument naming the file and the key when a key
// is missing, has the wrong type or is out of range, or when the file is not a readable regular file
// of at most kMaxConfigBytes of JSON nested at most kMaxConfigDepth deep.
nn::ModelConfig read_gpt2_config(const std::string& path);
// The same from the text of a config.json; `origin` names it in messages (a path, or e.g.
// "'w.safetensors' metadata \"gpt2_config\"").
nn::ModelConfig parse_gpt2_config(const std::string& text, const std::string& origin);

// What gpt2_config_json writes beyond the model's sizes.
struct Gpt2ConfigJsonOptions {
  std::string torch_dtype;                 // "" = the model's dtype ("float32", "float64")
  std::optional<std::int64_t> eot_token;   // bos_token_id = eos_token_id; none: both null
};

// A Hugging Face GPT-2 config.json for the model, as transformers' GPT2Config.save_pretrained
// writes one (keys sorted, indent 2): model_type "gpt2", architectures ["GPT2LMHeadModel"],
// activation_function "gelu_new", n_layer, n_embd, n_head, n_inner (null for 4 n_embd),
// n_positions and n_ctx (both the model's n_positions), vocab_size, layer_norm_epsilon,
// resid_pdrop and embd_pdrop (the model's dropout), attn_pdrop 0 (meshgrad has no attention
// dropout), tie_word_embeddings true, torch_dtype, bos/eos_token_id, and GPT2Config's defaults for
// the rest (initializer_range 0.02, scale_attn_weights true, summary_*, use_cache true).
// read_gpt2_config of it gives config back (with dropout 0).
std::string gpt2_config_json(const nn::ModelConfig& config, const Gpt2ConfigJsonOptions& options = {});

// Every parameter of meshgrad's GPT-2 for config (Hugging Face names, full shapes, in the model's
// order: wte, wpe, per block ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj, then ln_f;
// weights [in, out] as GPT-2's Conv1D stores them). nn::make_model's parameters() have exactly
// these names and full shapes (tests/launch/test_hf_io.cpp checks it), so a weights file can be
// checked whole before a model is built.
std::vector<std::pair<std::string, Shape>> gpt2_parameter_shapes(const nn::ModelConfig& config);

// Checks, from the weights file's header alone, that the model `config` describes matches it:
// wte.weight [vocab_size, n_embd], wpe.weight [n_positions, n_embd], ln_f.weight [n_embd] and, for
// each of the n_layer blocks, h.<i>.ln_1.weight [n_embd] and h.<i>.mlp.c_fc.weight
// [n_embd, n_inner or 4 n_embd]. So a config whose sizes disagree with the weights (a wrong n_positions, a
// huge n_layer) is refused at once, before a model of that size is allocated and initialised.
// load_parameters still checks every parameter afterwards. Throws InvalidArgument naming both
// files, the tensor, the config key and both shapes.
void check_gpt2_config_against_weights(const nn::ModelConfig& config, const std::string& config_path,
                                       const io::SafetensorsFile& weights);

}  // namespace meshgrad::interop
