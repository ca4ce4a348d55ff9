#include "meshgrad/interop/checkpoint_model.hpp"

#include <fmt/format.h>

#include "meshgrad/interop/model_tensors.hpp"
#include "meshgrad/tensor/shape.hpp"

namespace meshgrad::interop {

#define MG_MODEL_FIELD(NAME, MEMBER, FIXED)                                                   \
  ModelConfigField {                                                                          \
    NAME, [](const nn::ModelConfig& m) -> nlohmann::json { return m.MEMBER; },                \
        [](nn::ModelConfig& m, const nlohmann::json& v) { v.get_to(m.MEMBER); }, FIXED        \
  }
// A field newer than the first checkpoints (the Llama family's): fixed, and absent means GPT-2's default.
#define MG_FAMILY_FIELD(NAME, MEMBER)                                                         \
  ModelConfigField {                                                                          \
    NAME, [](const nn::ModelConfig& m) -> nlohmann::json { return m.MEMBER; },                \
        [](nn::ModelConfig& m, const nlohmann::json& v) { v.get_to(m.MEMBER); }, true, true   \
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
      // The family and what fixes a Llama's parameters (kv-heads, head-dim, attention-bias,
      // tie-word-embeddings) and its function (RoPE, the sliding window); model-type is what export
      // writes as config.json's model_type.
      MG_FAMILY_FIELD("model", kind),
      MG_FAMILY_FIELD("kv-heads", kv_heads),
      MG_FAMILY_FIELD("head-dim", head_dim),
      MG_FAMILY_FIELD("rope-theta", rope_theta),
      MG_FAMILY_FIELD("tie-word-embeddings", tie_word_embeddings),
      MG_FAMILY_FIELD("attention-bias", attention_bias),
      MG_FAMILY_FIELD("rope-scaling", rope_scaling),
      MG_FAMILY_FIELD("rope-factor", rope_factor),
      MG_FAMILY_FIELD("rope-low-freq-factor", rope_low_freq_factor),
      MG_FAMILY_FIELD("rope-high-freq-factor", rope_high_freq_factor),
      MG_FAMILY_FIELD("rope-original-positions", rope_original_positions),
      MG_FAMILY_FIELD("sliding-window", sliding_window),
      MG_FAMILY_FIELD("max-window-layers", max_window_layers),
      MG_FAMILY_FIELD("model-type", model_type),
      MG_FAMILY_FIELD("experts", experts),
      MG_FAMILY_FIELD("experts-per-token", experts_per_token),
      MG_FAMILY_FIELD("router-aux-loss-coef", router_aux_loss_coef),
      MG_FAMILY_FIELD("output-router-logits", output_router_logits),
      MG_FAMILY_FIELD("expert-ffn", expert_ffn),
      MG_FAMILY_FIELD("shared-expert-ffn", shared_expert_ffn),
      MG_FAMILY_FIELD("norm-topk-prob", norm_topk_prob),
      MG_FAMILY_FIELD("decoder-sparse-step", decoder_sparse_step),
      MG_FAMILY_FIELD("mlp-only-layers", mlp_only_layers),
      MG_MODEL_FIELD("capacity-factor", capacity_factor, false),
  };
  return fields;
}
#undef MG_MODEL_FIELD
#undef MG_FAMILY_FIELD

nlohmann::json absent_field_value(const ModelConfigField& field) {
  return field.absent_means_default ? field.get(nn::ModelConfig{}) : nlohmann::json(nullptr);
}

nn::ModelConfig checkpoint_model_config(const checkpoint::Manifest& manifest, const std::string& dir) {
  const auto config = manifest.state.find("config");
  if (config == manifest.state.end() || !config->is_object())
    throw checkpoint::CheckpointError(
        fmt::format("checkpoint '{}': its state has no \"config\" object (not written by meshgrad train?)", dir));
  nn::ModelConfig m;
  for (const ModelConfigField& f : model_config_fields()) {
    const auto it = config->find(f.name);
    if (it == config->end()) {
      // An older checkpoint (no Llama fields): the default ModelConfig's value, GPT-2's, stays in m.
      if (f.fixed_by_checkpoint && !f.absent_means_default)
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
  if (m.kind != "gpt" && m.kind != "llama")
    throw checkpoint::CheckpointError(fmt::format(
        "checkpoint '{}': the saved \"model\" is \"{}\", which is no model family meshgrad reads (gpt, llama)", dir, m.kind));
  // The token embedding is every family's first parameter; its dtype is the tensors'. (Named from a
  // copy without layers: the layer count is not checked against the tensors yet.)
  nn::ModelConfig no_layers = m;
  no_layers.layers = 0;
  const std::string embedding = model_parameter_shapes(no_layers).front().first;
  const checkpoint::ManifestTensor* first = manifest.find(embedding);
  if (first == nullptr) throw checkpoint::CheckpointError(fmt::format("checkpoint '{}' has no tensor '{}'", dir, embedding));
  m.dtype = first->dtype;
  check_config_describes_tensors(m, manifest, dir);
  return m;
}

void check_config_describes_tensors(const nn::ModelConfig& config, const checkpoint::Manifest& manifest,
                                    const std::string& dir) {
  const std::size_t tensors = manifest.tensors.size();
  if (config.layers < 0 || static_cast<std::size_t>(config.layers) > tensors)
    throw checkpoint::CheckpointError(fmt::format(
        "checkpoint '{}': its configuration says {} layers but it holds {} tensors in all: the configuration does "
        "not describe its tensors (was the manifest edited?)", dir, config.layers, tensors));
  for (const auto& [name, shape] : model_parameter_shapes(config)) {
    const checkpoint::ManifestTensor* t = manifest.find(name);
    if (t == nullptr)
      throw checkpoint::CheckpointError(fmt::format(
          "checkpoint '{}': its configuration ({} {} layers, hidden {}, vocabulary {}) needs a tensor '{}', which the "
          "checkpoint does not hold (was the manifest edited?)", dir, config.kind, config.layers, config.hidden, config.vocab, name));
    if (t->shape != shape)
      throw checkpoint::CheckpointError(fmt::format(
          "checkpoint '{}': tensor '{}' has shape {} but its configuration ({} {} layers, hidden {}, vocabulary {}) "
          "needs {} (was the manifest edited?)", dir, name, shape_str(t->shape), config.kind, config.layers, config.hidden,
          config.vocab, shape_str(shape)));
  }
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
