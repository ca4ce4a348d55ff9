// The Llama family's model options for the commands that build a model without training it
// (`meshgrad check`, `meshgrad explain`): --kv-heads, --head-dim, --rope-theta, --rope-scaling and
// its factors, --tie-word-embeddings, --attention-bias, --sliding-window, --model-type, with the
// option table's help and checks (train::train_option_table(), as train takes them), and
// --model-config config.json (a Hugging Face config: the model's shape from the file).
#pragma once

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <map>
#include <string>

#include "meshgrad/interop/checkpoint_model.hpp"
#include "meshgrad/interop/hf_config.hpp"
#include "train_options.hpp"

namespace meshgrad::tools {

struct FamilyOptions {
  train::TrainOptions bound;                     // the options bind into bound.model
  std::map<std::string, CLI::Option*> options;   // by option name, to tell which were given
  std::string model_config;                      // --model-config
};

// The fields of the Llama family (interop::model_config_fields newer than GPT-2's: absent from old
// checkpoints), except "model", which each command declares with its own choices.
inline bool is_family_field(const interop::ModelConfigField& f) {
  return f.absent_means_default && std::string(f.name) != "model";
}

inline void add_family_options(CLI::App& app, FamilyOptions& f) {
  for (const interop::ModelConfigField& field : interop::model_config_fields()) {
    if (is_family_field(field)) {
      f.options[field.name] = add_train_option(app, train::train_option(field.name), f.bound, {});
    }
  }
  app.add_option("--model-config", f.model_config, train::train_option("model-config").help);
}

// The model the options describe: `config` (the command's own sizes, whose CLI options are in
// `given`: name -> option) with the Llama family's fields; with --model-config the file's shape,
// keeping seq, batch and dtype, a size option also given having to agree with the file. Throws
// InvalidArgument naming the command and the option: a Llama option given for another family, a
// given size that disagrees with --model-config.
inline nn::ModelConfig family_model(const char* command, nn::ModelConfig config, const FamilyOptions& f,
                                    const std::map<std::string, CLI::Option*>& given) {
  const auto was_given = [&](const std::string& name) {
    const auto own = given.find(name);
    const auto family = f.options.find(name);
    return (own != given.end() && own->second->count() > 0) || (family != f.options.end() && family->second->count() > 0);
  };
  for (const interop::ModelConfigField& field : interop::model_config_fields()) {
    if (!is_family_field(field)) continue;
    MG_CHECK(!was_given(field.name) || config.kind == "llama" || !f.model_config.empty(),
             "{}: --{} is an option of --model llama; the model is \"{}\"", command, field.name, config.kind);
    field.set(config, field.get(f.bound.model));
  }
  if (f.model_config.empty()) return config;
  nn::ModelConfig file = interop::read_hf_config(f.model_config);
  for (const interop::ModelConfigField& field : interop::model_config_fields()) {
    if (!field.fixed_by_checkpoint || std::string(field.name) == "dtype" || !was_given(field.name)) continue;
    MG_CHECK(field.get(config) == field.get(file), "{}: --{} {} disagrees with --model-config '{}', which gives {}: leave "
             "the option out or change the file", command, field.name, field.get(config).dump(), f.model_config,
             field.get(file).dump());
  }
  file.seq = config.seq;
  file.batch = config.batch;
  file.dtype = config.dtype;
  file.dropout = config.dropout;
  file.capacity_factor = config.capacity_factor;
  return file;
}

}  // namespace meshgrad::tools
