#include "meshgrad/interop/checkpoint_model.hpp"

#include <fmt/format.h>

namespace meshgrad::interop {

#define MG_MODEL_FIELD(NAME, MEMBER, FIXED)                                                   \
  ModelConfigField {                                                                          \
    NAME, [](const nn::ModelConfig& m) -> nlohmann::json { return m.MEMBER; },                \
        [](nn::ModelConfig& m, const nlohmann::json& v) { v.get_to(m.MEMBER); }, FIXED        \
  }

const std::vector<ModelConfigField>& model_config_fields() {
  static const std::vector<ModelConfigField> fields = {
      MG_MODEL_FIELD("layers", layers, true),
      MG_MODEL_FIELD("hidden", hidden, true),
      MG_MODEL_FIELD("ffn", ffn, true),
      MG_MODEL_FIELD("heads", heads, true),
      MG_MODEL_FIELD("vocab", vocab, true),
      MG_MODEL_FIELD("positions", positions, true),
      MG_MODEL_FIELD("layer-norm-epsilon", layer_norm_epsilon, true),
      ModelConfigField{"dtype", [](const nn::ModelConfig& m) -> nlohmann::json { return std::string(dtype_name(m.dtype)); },
                       [](nn::ModelConfig& m, const nlohmann::json& v) { m.dtype = parse_dtype(v.get<std::string>()); },
                       true},
      MG_MODEL_FIELD("seq", seq, false),
      MG_MODEL_FIELD("batch", batch, false),
      MG_MODEL_FIELD("dropout", dropout, false),
  };
  return fields;
}
#undef MG_MODEL_FIELD

nn::ModelConfig checkpoint_model_config(const checkpoint::Manifest& manifest, const std::string& dir) {
  const auto config = manifest.state.find("config");
  if (config == manifest.state.end() || !config->is_object())
    throw checkpoint::CheckpointError(
        fmt::format("checkpoint '{}': its state has no \"config\" object (not written by meshgrad train?)", dir));
  nn::ModelConfig m;
  for (const ModelConfigField& f : model_config_fields()) {
    const auto it = config->find(f.name);
    if (it == config->end()) {
      if (f.fixed_by_checkpoint)
        throw checkpoint::CheckpointError(fmt::format("checkpoint '{}': the saved configuration has no \"{}\"", dir, f.name));
      continue;
    }
    try {
      f.set(m, *it);
    } catch (const std::exception& e) {
      throw checkpoint::CheckpointError(
          fmt::format("checkpoint '{}': the saved \"{}\" is {}: {}", dir, f.name, it->dump(), e.what()));
    }
  }
  const checkpoint::ManifestTensor* wte = manifest.find("wte.weight");
  if (wte == nullptr) throw checkpoint::CheckpointError(fmt::format("checkpoint '{}' has no tensor 'wte.weight'", dir));
  m.dtype = wte->dtype;
  return m;
}

std::map<std::string, std::string> checkpoint_data_metadata(const checkpoint::Manifest& manifest) {
  std::map<std::string, std::string> out;
  const auto data = manifest.state.find("data");
  if (data == manifest.state.end() || !data->is_object()) return out;
  if (data->contains("meta") && (*data)["meta"].is_string()) out["data_meta"] = (*data)["meta"].get<std::string>();
  if (data->contains("description") && (*data)["description"].is_string()) {
    out["data_tokens"] = (*data)["description"].get<std::string>();   // as --save records it ("bytes", ...)
  }
  return out;
}

}  // namespace meshgrad::interop
