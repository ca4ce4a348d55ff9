// A model's tensors in Hugging Face files, for every family model_tensors knows: reading a
// directory (one model.safetensors, or shards with model.safetensors.index.json), checking it against
// a configuration, loading it into a model on any mesh, and writing a model's tensors in the files'
// names and layout (Llama's linears transposed, model_tensors.hpp).
//
// A sharded directory (what save_pretrained writes above its max_shard_size):
//   DIR/model.safetensors.index.json   {"metadata": {...}, "weight_map": {tensor name: shard file}}
//   DIR/model-00001-of-0000N.safetensors ... the shards, each a safetensors file of whole tensors
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/io/safetensors.hpp"
#include "meshgrad/nn/model.hpp"
#include "meshgrad/nn/parameter.hpp"
#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::interop {

inline constexpr const char* kHfIndexFile = "model.safetensors.index.json";

// The tensors of one safetensors file or of a sharded set, by name. Reads headers only until get().
class WeightFiles {
 public:
  // The single file at path.
  static WeightFiles open_file(const std::string& path);
  // DIR/model.safetensors when it exists (as from_pretrained prefers it), else DIR/kHfIndexFile and
  // the shards its weight_map names. The index is refused, naming it with the file and tensor, when
  // it is not {"weight_map": {name: file}} of plain file names in DIR, when it names a file that is
  // missing, a tensor its file does not hold, or a tensor that two shards hold; a file of DIR named
  // like a shard (model-*-of-*.safetensors) that the map does not name is refused too (a copy of
  // another model's shards would otherwise go unnoticed). `option` starts every message
  // ("--init-from", "sample: checkpoint").
  static WeightFiles open_directory(const std::string& dir, const std::string& option);

  const std::string& origin() const { return origin_; }   // the file, or the directory's index
  std::vector<std::string> names() const;                 // every tensor, sorted
  bool contains(const std::string& name) const { return where_.count(name) > 0; }
  // Throws InvalidArgument naming origin() and the tensor when there is none of that name.
  const io::SafetensorsEntry& entry(const std::string& name) const;
  const std::string& file_of(const std::string& name) const;
  // The tensor as SafetensorsFile::get reads it (F16 / BF16 widened to float32, exactly).
  Tensor get(const std::string& name) const;
  // The single file's metadata, or the index's "metadata" strings.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::string origin_;
  std::vector<io::SafetensorsFile> files_;
  std::map<std::string, std::size_t> where_;   // tensor -> files_ index
  std::map<std::string, std::string> metadata_;
};

// Checks files against the Llama-family `config` (`config_origin` names it): every tensor of
// model_tensors(config) present with its file shape (both shapes in the message) and a floating
// dtype meshgrad reads; no layer beyond the config's ("model.layers.<n>..."); with
// tie_word_embeddings an lm_head.weight, when present, equal to model.embed_tokens.weight (an untied
// head would be dropped silently). Anything else (rotary inv_freq buffers) is ignored. Returns the
// stored dtypes of the parameters. Throws InvalidArgument naming the files and the tensors.
std::vector<std::string> check_llama_weights(const WeightFiles& files, const nn::ModelConfig& config,
                                             const std::string& config_origin);

// Every parameter's full tensor in meshgrad's layout (from_file_layout), model_tensors' order,
// read from files whose names start with `prefix` ("" or GPT-2's "transformer."). Check first.
std::vector<std::pair<std::string, Tensor>> read_model_tensors(const WeightFiles& files, const nn::ModelConfig& config,
                                                               const std::string& prefix = "");

// Loads the model's parameters (a whole model, or one pipeline stage's) from files: every rank reads
// the full tensors, turns them into meshgrad's layout, converts them to the parameter's dtype and
// keeps its own piece (nn::take_shard), in place and without autograd history. All-or-nothing:
// every parameter's name and file shape is checked before any is changed; a parameter model_tensors
// does not list, or a tensor missing, throws InvalidArgument naming it.
void load_model_parameters(const WeightFiles& files, const nn::ModelConfig& config,
                           const std::vector<nn::Parameter*>& params, const std::string& prefix = "");

// Writes full tensors of meshgrad's layout (model_tensors' names and shapes) as a Hugging Face
// safetensors file: each in the file layout (to_file_layout), model_tensors' order, atomically
// (io::write_safetensors). For GPT-2 the same bytes as writing the tensors as they are.
void write_model_tensors(const std::string& path, const nn::ModelConfig& config,
                         const std::vector<std::pair<std::string, Tensor>>& tensors,
                         const std::map<std::string, std::string>& metadata,
                         io::FloatStorage storage = io::FloatStorage::Native);

// `train --save`: gathers every parameter (checkpoint::gather_full_parameters over `group`, every
// stage's on stage 0 with `stages`) and its writer writes them with write_model_tensors. Collective
// over group (and stages) as checkpoint::save_parameters, which GPT-2 still uses (the same bytes).
void save_model_parameters(const std::string& path, const nn::ModelConfig& config,
                           const std::vector<nn::Parameter*>& params, const dist::ProcessGroup& group,
                           const std::map<std::string, std::string>& metadata, const dist::ProcessGroup* stages);

}  // namespace meshgrad::interop
