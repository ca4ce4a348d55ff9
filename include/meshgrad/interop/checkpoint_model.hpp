// A training checkpoint as a model: the sizes its state records and the data it was trained on, for
// the tools that read one without training (export, sample) and for the trainer that writes them.
//
// The model's sizes are spelled as the run configuration spells them: the options of `meshgrad
// train` by their command-line names ({"layers": 2, "hidden": 64, "ffn": 0, "heads": 4, "vocab": 256,
// ...}). model_config_fields() is the one list of those keys: the trainer writes the run
// configuration with it (train/run_config.hpp) and checkpoint_model_config reads it back.
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "meshgrad/checkpoint/manifest.hpp"
#include "meshgrad/nn/model.hpp"

namespace meshgrad::interop {

// One size of the model: its key, how it goes to JSON and back, and whether a checkpoint fixes it
// (the shape fields: a checkpoint only loads into a model of the same shape; seq, batch and dropout
// a resumed run may change).
struct ModelConfigField {
  const char* name;
  nlohmann::json (*get)(const nn::ModelConfig&);
  void (*set)(nn::ModelConfig&, const nlohmann::json&);
  bool fixed_by_checkpoint;
  // Checkpoints written before the Llama family lack the field: absent, it means the value of a
  // default nn::ModelConfig (GPT-2's), so such a checkpoint still reads as the GPT-2 it holds.
  bool absent_means_default = false;
};
// layers, hidden, ffn, heads, vocab, positions, layer-norm-epsilon, dtype, seq, batch, dropout, then
// what fixes the family and a Llama's shape and function (absent_means_default): model (the kind),
// kv-heads, head-dim, rope-theta, tie-word-embeddings, attention-bias, rope-scaling, rope-factor,
// rope-low-freq-factor, rope-high-freq-factor, rope-original-positions, sliding-window, model-type.
const std::vector<ModelConfigField>& model_config_fields();
// A field's value when the record lacks it: the default nn::ModelConfig's for absent_means_default
// fields; null for the others (the record must hold those).
nlohmann::json absent_field_value(const ModelConfigField& field);

// The model a checkpoint holds: the family, sizes and dropout of its saved configuration (state
// "config"; a configuration without "model" is GPT-2's), the dtype of its tensors. Throws CheckpointError naming dir when the state lacks the
// configuration or a shape field, or holds a value of the wrong type.
nn::ModelConfig checkpoint_model_config(const checkpoint::Manifest& manifest, const std::string& dir);
// Throws CheckpointError naming dir when config (any family of model_parameter_shapes) does not
// describe the manifest's tensors: a layer count above the tensor count (checked first, so an edited
// "layers": 1e9 lists nothing), a parameter it needs missing, or one of another shape. Before any
// model is built from config.
void check_config_describes_tensors(const nn::ModelConfig& config, const checkpoint::Manifest& manifest,
                                    const std::string& dir);

// The metadata a `train --save` file carries about its data, from a checkpoint's state: "data_meta"
// (the prepared directory's meta.json, which names the tokenizer) and "data_tokens" (its
// description, "bytes" for byte tokens), when the checkpoint recorded them.
std::map<std::string, std::string> checkpoint_data_metadata(const checkpoint::Manifest& manifest);

}  // namespace meshgrad::interop
