// config.json by model_type (contract in include/meshgrad/interop/hf_config.hpp).
#include "meshgrad/interop/hf_config.hpp"

#include <algorithm>

#include "config_keys.hpp"
#include "meshgrad/interop/gpt2_config.hpp"
#include "meshgrad/io/json_input.hpp"

namespace meshgrad::interop {

namespace {

using namespace detail;

// An optional number, `fallback` when absent or null.
double number_or(const json& j, const std::string& path, const char* key, double fallback) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  return number_key(j, path, key);
}

int int_or(const json& j, const std::string& path, const char* key, int fallback) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  return int_key(j, path, key);
}

bool bool_or(const json& j, const std::string& path, const char* key, bool fallback) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  const json& v = j.at(key);
  MG_CHECK(v.is_boolean(), "config '{}': key \"{}\" must be true or false but is {}", path, key, io::json_excerpt(v));
  return v.get<bool>();
}

// rope_scaling: null / absent, or {"rope_type" (or the older "type"): "default" | "linear" | "llama3", ...}.
void read_rope_scaling(const json& j, const std::string& path, nn::ModelConfig& c) {
  if (!j.contains("rope_scaling") || j.at("rope_scaling").is_null()) return;
  const json& s = j.at("rope_scaling");
  MG_CHECK(s.is_object(), "config '{}': key \"rope_scaling\" must be null or an object but is {}", path,
           io::json_excerpt(s));
  const char* type_key = s.contains("rope_type") ? "rope_type" : "type";
  MG_CHECK(s.contains(type_key) && s.at(type_key).is_string(), "config '{}': \"rope_scaling\" needs a string "
           "\"rope_type\" (or \"type\"), got {}", path, io::json_excerpt(s));
  const std::string type = s.at(type_key).get<std::string>();
  const std::string key = std::string("rope_scaling.") + type_key;
  MG_CHECK(type == "default" || type == "linear" || type == "llama3", "config '{}': \"{}\": \"{}\" is not "
           "supported (meshgrad implements \"default\", \"linear\" and \"llama3\")", path, key, type);
  if (type == "default") return;
  c.rope_scaling = type;
  const std::string where = path + "' key 'rope_scaling";
  c.rope_factor = number_key(s, where, "factor");
  MG_CHECK(c.rope_factor > 0, "config '{}': rope_scaling.factor must be > 0, got {}", path, c.rope_factor);
  if (type == "llama3") {
    c.rope_low_freq_factor = number_key(s, where, "low_freq_factor");
    c.rope_high_freq_factor = number_key(s, where, "high_freq_factor");
    c.rope_original_positions = int_key(s, where, "original_max_position_embeddings");
    MG_CHECK(c.rope_high_freq_factor > c.rope_low_freq_factor && c.rope_low_freq_factor > 0, "config '{}': "
             "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got {} and {}", path, c.rope_low_freq_factor,
             c.rope_high_freq_factor);
  }
}

// Mistral: sliding_window (null or absent: none) on every layer. Qwen2: only with use_sliding_window,
// on the layers from max_window_layers (Qwen2Config's default 28) on, as its layer_types say. A
// "layer_types" list given in the file must be the one these keys imply (meshgrad has no other
// layout of windowed layers).
void read_sliding_window(const json& j, const std::string& path, const std::string& model_type, nn::ModelConfig& c) {
  if (model_type == "mistral" || model_type == "mixtral") c.sliding_window = int_or(j, path, "sliding_window", 0);
  if ((model_type == "qwen2" || model_type == "qwen2_moe") && bool_or(j, path, "use_sliding_window", false)) {
    c.sliding_window = int_or(j, path, "sliding_window", 0);
    // 0 is allowed here (every layer slides), unlike the sizes int_key reads.
    const bool zero = j.contains("max_window_layers") && j.at("max_window_layers").is_number_integer() &&
                      j.at("max_window_layers").get<std::int64_t>() == 0;
    c.max_window_layers = zero ? 0 : int_or(j, path, "max_window_layers", 28);
  }
  if (!j.contains("layer_types") || j.at("layer_types").is_null()) return;
  const json& types = j.at("layer_types");
  json implied = json::array();
  for (int i = 0; i < c.layers; ++i) implied.push_back(c.attention_window(i) > 0 ? "sliding_attention" : "full_attention");
  MG_CHECK(types == implied, "config '{}': \"layer_types\": {} differs from the layers that sliding_window, "
           "use_sliding_window and max_window_layers give ({}); meshgrad builds only that layout", path,
           io::json_excerpt(types), io::json_excerpt(implied));
}

// Mixtral's mixture of experts (MixtralConfig): num_local_experts SwiGLU experts of intermediate_size,
// num_experts_per_tok per token, the load-balancing loss's coefficient and switch.
void read_mixtral(const json& j, const std::string& path, nn::ModelConfig& c) {
  const bool qwen = c.model_type == "qwen2_moe";
  c.experts = int_key(j, path, qwen ? "num_experts" : "num_local_experts");
  c.experts_per_token = int_or(j, path, "num_experts_per_tok", 2);
  MG_CHECK(c.experts_per_token <= c.experts, "config '{}': \"num_experts_per_tok\": {} is more than the {} experts "
           "({})", path, c.experts_per_token, c.experts, qwen ? "num_experts" : "num_local_experts");
  if (qwen) {
    // Qwen2-MoE: routed experts of moe_intermediate_size, a gated shared expert, the k weights as the
    // softmax gave them unless norm_topk_prob, sparse blocks every decoder_sparse_step but mlp_only_layers.
    c.expert_ffn = int_key(j, path, "moe_intermediate_size");
    c.shared_expert_ffn = int_or(j, path, "shared_expert_intermediate_size", 0);
    c.norm_topk_prob = bool_or(j, path, "norm_topk_prob", false);
    c.decoder_sparse_step = int_or(j, path, "decoder_sparse_step", 1);
    if (j.contains("mlp_only_layers") && !j.at("mlp_only_layers").is_null()) {
      const json& v = j.at("mlp_only_layers");
      MG_CHECK(v.is_array() && std::all_of(v.begin(), v.end(), [](const json& x) { return x.is_number_integer(); }),
               "config '{}': \"mlp_only_layers\": {} is not a list of layer numbers", path, io::json_excerpt(v));
      for (const json& x : v) {
        const auto layer = x.get<std::int64_t>();
        MG_CHECK(layer >= 0 && layer < c.layers, "config '{}': \"mlp_only_layers\" names layer {}, and the model "
                 "has {} (num_hidden_layers)", path, layer, c.layers);
        c.mlp_only_layers.push_back(static_cast<int>(layer));
      }
    }
  }
  c.router_aux_loss_coef = number_or(j, path, "router_aux_loss_coef", 0.001);
  MG_CHECK(c.router_aux_loss_coef >= 0, "config '{}': \"router_aux_loss_coef\" must be >= 0, got {}", path,
           c.router_aux_loss_coef);
  c.output_router_logits = bool_or(j, path, "output_router_logits", false);
  if (j.contains("router_jitter_noise")) MG_CHECK(number_or(j, path, "router_jitter_noise", 0.0) == 0.0, "config '{}': \"router_jitter_noise\": {} is not "
           "supported (meshgrad routes without noise; 0 is the released models' value)", path,
           j.at("router_jitter_noise").dump());
}

nn::ModelConfig parse_llama_config(const json& j, const std::string& path, const std::string& model_type) {
  nn::ModelConfig c;
  c.kind = "llama";
  c.model_type = model_type;
  c.layers = int_key(j, path, "num_hidden_layers");
  c.hidden = int_key(j, path, "hidden_size");
  c.ffn = int_key(j, path, "intermediate_size");
  c.heads = int_key(j, path, "num_attention_heads");
  c.kv_heads = int_or(j, path, "num_key_value_heads", c.heads);
  c.vocab = int_key(j, path, "vocab_size");
  c.positions = int_key(j, path, "max_position_embeddings");
  c.layer_norm_epsilon = number_or(j, path, "rms_norm_eps", 1e-6);
  MG_CHECK(c.layer_norm_epsilon > 0, "config '{}': rms_norm_eps must be > 0, got {}", path, c.layer_norm_epsilon);
  c.rope_theta = number_or(j, path, "rope_theta", 10000.0);
  MG_CHECK(c.rope_theta > 1, "config '{}': rope_theta must be > 1, got {}", path, c.rope_theta);
  MG_CHECK(c.heads % c.kv_heads == 0, "config '{}': num_attention_heads = {} is not a multiple of "
           "num_key_value_heads = {}", path, c.heads, c.kv_heads);
  if (j.contains("head_dim") && !j.at("head_dim").is_null()) {
    c.head_dim = int_key(j, path, "head_dim");
  } else {
    MG_CHECK(c.hidden % c.heads == 0, "config '{}': hidden_size = {} is not divisible by num_attention_heads = {} "
             "(and no head_dim is given)", path, c.hidden, c.heads);
  }
  read_rope_scaling(j, path, c);
  c.tie_word_embeddings = bool_or(j, path, "tie_word_embeddings", false);
  // Qwen2's q, k and v projections always have biases (its config has no key for it).
  c.attention_bias = model_type == "qwen2" || model_type == "qwen2_moe" || bool_or(j, path, "attention_bias", false);
  read_sliding_window(j, path, model_type, c);
  if (j.contains("hidden_act")) {
    const json& v = j.at("hidden_act");
    MG_CHECK(v.is_string() && v.get<std::string>() == "silu", "config '{}': \"hidden_act\": {} is not supported: the "
             "Llama family's MLP is SwiGLU (\"silu\")", path, io::json_excerpt(v));
  }
  require_bool_key(j, path, "mlp_bias", false, "the Llama family's MLP projections have no biases in meshgrad");
  MG_CHECK(int_or(j, path, "pretraining_tp", 1) == 1, "config '{}': \"pretraining_tp\": {} is not supported (it "
           "splits the products into slices that change rounding; 1 is the model's definition)", path,
           j.at("pretraining_tp").dump());
  MG_CHECK(number_or(j, path, "attention_dropout", 0.0) == 0.0, "config '{}': \"attention_dropout\": {} is not "
           "supported (meshgrad's Llama family has no dropout)", path, j.at("attention_dropout").dump());
  c.dropout = 0.0;
  if (model_type == "mixtral" || model_type == "qwen2_moe") read_mixtral(j, path, c);
  return c;
}

}  // namespace

nn::ModelConfig read_hf_config(const std::string& path) { return parse_hf_config(read_config_file(path), path); }

nn::ModelConfig parse_hf_config(const std::string& text, const std::string& path) {
  const json j = parse_config_object(text, path);
  MG_CHECK(j.contains("model_type") && j.at("model_type").is_string(), "config '{}': missing string key "
           "\"model_type\"", path);
  const std::string type = j.at("model_type").get<std::string>();
  if (type == "gpt2") return parse_gpt2_config(text, path);
  if (type == "llama" || type == "qwen2" || type == "mistral" || type == "mixtral" || type == "qwen2_moe") {
    return parse_llama_config(j, path, type);
  }
  throw InvalidArgument(fmt::format("config '{}': \"model_type\": \"{}\" is not a model meshgrad builds (gpt2, llama, "
                                    "qwen2, mistral, mixtral, qwen2_moe)", path, type));
}

namespace {

json llama_family_json(const nn::ModelConfig& c, const HfConfigJsonOptions& o) {
  const std::string& type = c.model_type;
  MG_CHECK(type == "llama" || type == "qwen2" || type == "mistral" || type == "mixtral" || type == "qwen2_moe",
           "hf_config_json: model_type \"{}\" is not one of the Llama family's (llama, qwen2, mistral, mixtral, "
           "qwen2_moe)", type);
  const bool moe_type = type == "mixtral" || type == "qwen2_moe";
  MG_CHECK(moe_type == c.moe(), "hf_config_json: {} experts and model_type \"{}\": a mixture of experts is written "
           "as \"mixtral\" or \"qwen2_moe\", and only one is", c.experts, type);
  MG_CHECK(type == "qwen2_moe" || (c.expert_ffn == 0 && c.shared_expert_ffn == 0 && c.norm_topk_prob &&
                                   c.decoder_sparse_step == 1 && c.mlp_only_layers.empty()),
           "hf_config_json: a {} model has no moe_intermediate_size, shared expert, norm_topk_prob false, "
           "decoder_sparse_step or mlp_only_layers: write it as model_type \"qwen2_moe\"", type);
  MG_CHECK(type != "qwen2_moe" || c.attention_bias, "hf_config_json: a qwen2_moe model always has q/k/v biases, and "
           "this one has attention_bias false");
  MG_CHECK(type != "mixtral" || !c.attention_bias, "hf_config_json: a mixtral model has no q/k/v biases");
  MG_CHECK(type != "qwen2" || c.attention_bias, "hf_config_json: a qwen2 model always has q/k/v biases, and this one "
           "has attention_bias false: write it as model_type \"llama\"");
  MG_CHECK(type != "mistral" || !c.attention_bias, "hf_config_json: a mistral model has no q/k/v biases, and this one "
           "has attention_bias true: write it as model_type \"llama\"");
  MG_CHECK(type != "llama" || c.sliding_window == 0, "hf_config_json: a llama model has no sliding window, and this one "
           "has sliding_window {}: write it as model_type \"mistral\" or \"qwen2\"", c.sliding_window);
  MG_CHECK((type != "mistral" && type != "mixtral") || c.sliding_window == 0 || c.max_window_layers == 0,
           "hf_config_json: a mistral or mixtral model "
           "slides on every layer, and this one from layer {} on: write it as model_type \"qwen2\"", c.max_window_layers);
  const auto token = [](const std::optional<std::int64_t>& id) { return id ? json(*id) : json(nullptr); };
  json rope = nullptr;
  if (!c.rope_scaling.empty()) {
    rope = {{"rope_type", c.rope_scaling}, {"factor", c.rope_factor}};
    if (c.rope_scaling == "llama3") {
      rope["low_freq_factor"] = c.rope_low_freq_factor;
      rope["high_freq_factor"] = c.rope_high_freq_factor;
      rope["original_max_position_embeddings"] = c.rope_original_positions;
    }
  }
  const char* architecture = type == "llama"       ? "LlamaForCausalLM"
                             : type == "qwen2"     ? "Qwen2ForCausalLM"
                             : type == "mixtral"   ? "MixtralForCausalLM"
                             : type == "qwen2_moe" ? "Qwen2MoeForCausalLM"
                                                   : "MistralForCausalLM";
  json j = {{"architectures", {architecture}},
            {"attention_dropout", 0.0},
            {"bos_token_id", token(o.bos_token_id)},
            {"eos_token_id", token(o.eos_token_id)},
            {"head_dim", c.head_size()},
            {"hidden_act", "silu"},
            {"hidden_size", c.hidden},
            {"initializer_range", 0.02},
            {"intermediate_size", c.ffn_size()},
            {"max_position_embeddings", c.n_positions()},
            {"model_type", type},
            {"num_attention_heads", c.heads},
            {"num_hidden_layers", c.layers},
            {"num_key_value_heads", c.kv_head_count()},
            {"rms_norm_eps", c.layer_norm_epsilon},
            {"rope_scaling", rope},
            {"rope_theta", c.rope_theta},
            {"tie_word_embeddings", c.tie_word_embeddings},
            {"torch_dtype", o.torch_dtype.empty() ? std::string(dtype_name(c.dtype)) : o.torch_dtype},
            {"use_cache", true},
            {"vocab_size", c.vocab}};
  const json window = c.sliding_window > 0 ? json(c.sliding_window) : json(nullptr);
  if (type == "llama") {
    j["attention_bias"] = c.attention_bias;
    j["mlp_bias"] = false;
    j["pretraining_tp"] = 1;
  } else if (type == "qwen2" || type == "qwen2_moe") {
    j["use_sliding_window"] = c.sliding_window > 0;
    j["sliding_window"] = window;
    j["max_window_layers"] = c.sliding_window > 0 ? c.max_window_layers : c.layers;
  } else {
    j["sliding_window"] = window;
  }
  if (type == "qwen2_moe") {
    j["num_experts"] = c.experts;
    j["num_experts_per_tok"] = c.experts_per_token;
    j["moe_intermediate_size"] = c.expert_ffn_size();
    j["shared_expert_intermediate_size"] = c.shared_expert_ffn;
    j["norm_topk_prob"] = c.norm_topk_prob;
    j["decoder_sparse_step"] = c.decoder_sparse_step;
    j["mlp_only_layers"] = c.mlp_only_layers;
    j["router_aux_loss_coef"] = c.router_aux_loss_coef;
    j["output_router_logits"] = c.output_router_logits;
  }
  if (type == "mixtral") {
    j["num_local_experts"] = c.experts;
    j["num_experts_per_tok"] = c.experts_per_token;
    j["router_aux_loss_coef"] = c.router_aux_loss_coef;
    j["output_router_logits"] = c.output_router_logits;
    j["router_jitter_noise"] = 0.0;
  }
  return j;
}

}  // namespace

std::string hf_config_json(const nn::ModelConfig& config, const HfConfigJsonOptions& options) {
  if (config.kind == "gpt") {
    MG_CHECK(options.bos_token_id == options.eos_token_id, "hf_config_json: GPT-2's bos and eos tokens are the same "
             "<|endoftext|>, got {} and {}", options.bos_token_id.value_or(-1), options.eos_token_id.value_or(-1));
    return gpt2_config_json(config, {options.torch_dtype, options.eos_token_id});
  }
  MG_CHECK(config.kind == "llama", "hf_config_json: model \"{}\" has no Hugging Face config (gpt and llama have one)",
           config.kind);
  return llama_family_json(config, options).dump(2) + "\n";
}

}  // namespace meshgrad::interop
