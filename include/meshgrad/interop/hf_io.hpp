// Hugging Face directories in and out, GPT-2 and the Llama family (llama, qwen2, mistral):
// `meshgrad train --init-from DIR` starts from one, `meshgrad export` writes one from a meshgrad
// checkpoint. The Llama family's directories hold config.json (hf_config.hpp) and
// model.safetensors, or shards with model.safetensors.index.json (hf_weights.hpp), in its Hugging
// Face names with torch.nn.Linear weights [out, in] (model_tensors.hpp). GPT-2's:
//
// A Hugging Face GPT-2 directory (what GPT2LMHeadModel.save_pretrained writes and from_pretrained
// reads):
//   DIR/config.json         GPT2Config (gpt2_config.hpp reads and writes it)
//   DIR/model.safetensors   the parameters, full tensors, F32 / F16 / BF16, named
//                             wte.weight, wpe.weight, h.<i>.{ln_1, attn.c_attn, attn.c_proj, ln_2,
//                             mlp.c_fc, mlp.c_proj}.{weight, bias}, ln_f.{weight, bias}
//                           with Conv1D weights stored [in, out] (meshgrad's layout too), either as
//                           is (GPT2Model's names, and the hub's openai-community/gpt2 file) or under
//                           "transformer." (GPT2LMHeadModel.save_pretrained). A tied
//                           "lm_head.weight" (equal to wte.weight) and the attention-mask buffers of
//                           older files ("h.<i>.attn.bias", "h.<i>.attn.masked_bias", any dtype) are
//                           not parameters and are not loaded.
//   DIR/vocab.json, merges.txt, tokenizer_config.json   the GPT-2 BPE tokenizer (optional)
//
// meshgrad export writes the names without the prefix, as the hub's gpt2 file has them: every
// version of transformers loads that file into GPT2LMHeadModel and GPT2Model alike (from_pretrained
// adds or strips the base model prefix "transformer." as the class needs), and it is what
// `meshgrad grads --weights` and `train --save` use too.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/nn/model.hpp"
#include "meshgrad/nn/parameter.hpp"
#include "meshgrad/tensor/tensor.hpp"
#include "meshgrad/io/safetensors.hpp"
#include "meshgrad/interop/hf_weights.hpp"

namespace meshgrad::data {
class TokenDataset;
}

namespace meshgrad::interop {

inline constexpr const char* kHfConfigFile = "config.json";
inline constexpr const char* kHfWeightsFile = "model.safetensors";
// The __metadata__ key of a Llama-family `train --save` file holding its config.json
// (hf_config_json), as "gpt2_config" holds GPT-2's.
inline constexpr const char* kHfConfigMetadata = "hf_config";

// A config.json of either family: read_hf_config by its model_type, or read_gpt2_config when it has
// no model_type (files of older tools, which `grads --config` and export's --config always took).
nn::ModelConfig read_model_config(const std::string& path);

// ---- in: train --init-from DIR -------------------------------------------------------------------

// A GPT-2 weights file checked against a model configuration.
struct HfWeights {
  std::string prefix;              // "" or "transformer.": what the file's names start with
  std::vector<std::string> dtypes; // the stored dtypes of the parameters, e.g. {"BF16"}
  bool tied_head = false;          // it holds an lm_head.weight (equal to wte.weight)
};

// Checks that `weights` holds meshgrad's GPT-2 for config (`config_origin` names the config in
// messages): every parameter of gpt2_parameter_shapes(config), all with or all without the
// "transformer." prefix, with that full shape and a floating dtype meshgrad reads (F32, F64, F16,
// BF16); no block beyond n_layer ("h.<n_layer>..."); an lm_head.weight, when present, of wte's
// shape and bitwise equal to wte.weight (meshgrad's output layer is wte transposed; an untied head
// would be silently dropped). Everything else in the file is ignored. Reads the header only, and
// lm_head.weight and wte.weight when there is an lm_head. Throws InvalidArgument naming the file,
// the tensors (every missing one, up to 8) and both shapes.
HfWeights check_hf_weights(const io::SafetensorsFile& weights, const nn::ModelConfig& config,
                           const std::string& config_origin);
HfWeights check_hf_weights(const WeightFiles& weights, const nn::ModelConfig& config, const std::string& config_origin);
// Either family: GPT-2 by check_hf_weights, the Llama family by check_llama_weights (prefix "",
// tied_head when tie_word_embeddings and the files hold an lm_head.weight, equal to the embedding).
HfWeights check_model_weights(const WeightFiles& weights, const nn::ModelConfig& config, const std::string& config_origin);

// The model `train --init-from DIR` builds: `requested` (TrainOptions::model) with its sizes taken
// from DIR/config.json (read_model_config: GPT-2's n_layer, n_embd, n_head, vocab_size, n_positions,
// n_inner and layer_norm_epsilon; a Llama-family config's whole shape, also kv heads and head_dim,
// which a request > 0 must agree with too; seq, batch, dropout and dtype stay the request's). A size the request sets (> 0: layers, hidden, heads, vocab,
// positions, ffn) must agree with the file: otherwise InvalidArgument naming the option and the key
// with both values (0 takes the file's; the CLI passes 0 for the options not on its command line).
// seq must be <= n_positions. Then DIR's weights (WeightFiles::open_directory: whole or sharded) are
// checked whole (check_model_weights), so everything is checked before a model is built or a file
// written. `report`: print one line on
// stderr saying what was found.
nn::ModelConfig hf_init_config(const std::string& dir, const nn::ModelConfig& requested, bool report);

// Loads DIR's weights into the model's parameters (load_model_parameters with GPT-2's file prefix:
// every rank reads the full tensors, in meshgrad's layout, and keeps its shard, on any mesh; F16 /
// BF16 widen exactly, float32 -> float64 too). Call after hf_init_config with the model built from
// its config.
void hf_load_parameters(const std::string& dir, const std::vector<nn::Parameter*>& params,
                        const dist::ProcessGroup& tp);

// ---- out: train --save metadata, meshgrad export ---------------------------------------------------

// The __metadata__ of a `train --save` file: "format": "pt" (Hugging Face tools load the file),
// "producer", "gpt2_config" (gpt2_config_json(config): what the parameters are, read back by
// parse_gpt2_config) for GPT-2 or kHfConfigMetadata (hf_config_json) for the Llama family, "data" (TokenDataset::source), "data_tokens" (TokenDataset::description) and,
// for prepared data, "data_meta" (the absolute path of its meta.json: where export finds the
// tokenizer).
std::map<std::string, std::string> hf_checkpoint_metadata(const nn::ModelConfig& config, const data::TokenDataset& data);

// A checkpoint's full parameters with what describes them.
struct FullParameters {
  nn::ModelConfig config;                               // from its gpt2_config / hf_config (dropout kept)
  std::vector<std::pair<std::string, Tensor>> tensors;  // model_tensors' names and order, meshgrad's layout
  std::map<std::string, std::string> metadata;          // the --save file's (data_meta, ...)
};

// Reads a checkpoint: a safetensors file of full tensors in Hugging Face layout written by `train
// --save`, its model described by its "gpt2_config" / "hf_config" metadata, or by config_path (a
// config.json) when that is given or the file has none (files of older versions, Hugging Face
// files); a sharded training checkpoint (checkpoint_model_config); or a Hugging Face directory
// (config.json, whole or sharded weights). Its tensors are checked with check_model_weights.
// Anything else throws InvalidArgument naming the path and what it is.
FullParameters read_full_parameters(const std::string& checkpoint, const std::string& config_path = "");

struct ExportOptions {
  std::string checkpoint;           // read_full_parameters
  std::string out_dir;              // absent, or an empty directory
  std::string dtype = "float32";    // float32, float16 or bfloat16 (parse_float_storage)
  std::string config;               // optional config.json for a checkpoint without gpt2_config
  std::string tokenizer;            // optional directory with vocab.json + merges.txt (or encoder.json + vocab.bpe)
};

struct ExportResult {
  std::vector<std::string> files;   // written into out_dir, in order
  std::int64_t parameters = 0;      // elements
  std::string tokenizer;            // where the tokenizer files came from, or "" when none
  std::string note;                 // why there are no tokenizer files, or ""
};

// Writes out_dir as a Hugging Face directory: config.json (hf_config_json: GPT-2's, or the Llama
// family's with its model_type and architectures; torch_dtype = dtype and bos/eos = the tokenizer's
// <|endoftext|>), model.safetensors (write_model_tensors: Hugging Face names and layout, GPT-2's
// without "transformer.", no lm_head when tied, metadata {"format": "pt"}; float32: the parameters converted to
// float32, bitwise equal for a float32 checkpoint; float16 / bfloat16: rounded to nearest even)
// and, when a tokenizer is found, vocab.json + merges.txt (copied byte for byte) and
// tokenizer_config.json. The tokenizer comes from options.tokenizer, else from the checkpoint's
// data_meta (the prepared data's copies, checked against meta.json's sha256); byte-level data has
// none. Its vocabulary must fit the model's.
//
// Never clobbers: out_dir must be absent or an empty directory (not a symbolic link), its parent a
// writable directory; checked before anything is read. The files are written into a temporary
// directory beside out_dir, flushed, and renamed to out_dir at the end; on any error the temporary
// is removed and out_dir is as it was. Throws InvalidArgument naming the option and the path.
ExportResult export_hf(const ExportOptions& options);

}  // namespace meshgrad::interop
