// Parameters as file tensors (contract in include/meshgrad/interop/model_tensors.hpp).
#include "meshgrad/interop/model_tensors.hpp"

#include <fmt/core.h>

#include "meshgrad/interop/gpt2_config.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad::interop {

namespace {

std::vector<ModelTensor> llama_tensors(const nn::ModelConfig& c) {
  const std::int64_t hidden = c.hidden, ffn = c.ffn_size(), d = c.head_size();
  const std::int64_t q_out = c.heads * d, kv_out = c.kv_head_count() * d;
  std::vector<ModelTensor> out{{"model.embed_tokens.weight", {c.vocab, hidden}, false}};
  for (int i = 0; i < c.layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    out.push_back({p + "input_layernorm.weight", {hidden}, false});
    const std::pair<const char*, std::int64_t> qkv[] = {{"q_proj", q_out}, {"k_proj", kv_out}, {"v_proj", kv_out}};
    for (const auto& [proj, width] : qkv) {
      out.push_back({p + "self_attn." + proj + ".weight", {hidden, width}, true});
      if (c.attention_bias) out.push_back({p + "self_attn." + proj + ".bias", {width}, false});
    }
    out.push_back({p + "self_attn.o_proj.weight", {q_out, hidden}, true});
    out.push_back({p + "post_attention_layernorm.weight", {hidden}, false});
    if (c.sparse_layer(i) && c.model_type == "qwen2_moe") {
      const std::int64_t e = c.experts, fe = c.expert_ffn_size(), fs = c.shared_expert_ffn;
      out.push_back({p + "mlp.gate.weight", {hidden, e}, true});
      out.push_back({p + "mlp.experts.gate_proj.weight", {e, hidden, fe}, true, true});
      out.push_back({p + "mlp.experts.up_proj.weight", {e, hidden, fe}, true, true});
      out.push_back({p + "mlp.experts.down_proj.weight", {e, fe, hidden}, true, true});
      if (fs > 0) {
        out.push_back({p + "mlp.shared_expert.gate_proj.weight", {hidden, fs}, true});
        out.push_back({p + "mlp.shared_expert.up_proj.weight", {hidden, fs}, true});
        out.push_back({p + "mlp.shared_expert.down_proj.weight", {fs, hidden}, true});
        out.push_back({p + "mlp.shared_expert_gate.weight", {hidden, 1}, true});
      }
      continue;
    }
    if (c.sparse_layer(i)) {
      const std::int64_t e = c.experts, fe = c.expert_ffn_size();
      out.push_back({p + "block_sparse_moe.gate.weight", {hidden, e}, true});
      out.push_back({p + "block_sparse_moe.experts.w1.weight", {e, hidden, fe}, true, true});
      out.push_back({p + "block_sparse_moe.experts.w2.weight", {e, fe, hidden}, true, true});
      out.push_back({p + "block_sparse_moe.experts.w3.weight", {e, hidden, fe}, true, true});
      continue;
    }
    out.push_back({p + "mlp.gate_proj.weight", {hidden, ffn}, true});
    out.push_back({p + "mlp.up_proj.weight", {hidden, ffn}, true});
    out.push_back({p + "mlp.down_proj.weight", {ffn, hidden}, true});
  }
  out.push_back({"model.norm.weight", {hidden}, false});
  if (!c.tie_word_embeddings) out.push_back({"lm_head.weight", {hidden, c.vocab}, true});
  return out;
}

}  // namespace

std::vector<ModelTensor> model_tensors(const nn::ModelConfig& config) {
  if (config.kind == "llama") return llama_tensors(config);
  MG_CHECK(config.kind == "gpt", "model '{}' has no file layout (gpt and llama have one)", config.kind);
  std::vector<ModelTensor> out;
  for (auto& [name, shape] : gpt2_parameter_shapes(config)) out.push_back({std::move(name), std::move(shape), false});
  return out;
}

std::vector<std::pair<std::string, Shape>> model_parameter_shapes(const nn::ModelConfig& config) {
  std::vector<std::pair<std::string, Shape>> out;
  for (ModelTensor& t : model_tensors(config)) out.emplace_back(std::move(t.name), std::move(t.shape));
  return out;
}

std::vector<std::string> ModelTensor::file_names() const {
  if (!stacked_experts) return {name};
  // "....experts.w1.weight" -> "....experts.{e}.w1.weight"
  const std::string marker = ".experts.";
  const std::size_t at = name.rfind(marker);
  MG_CHECK(at != std::string::npos, "tensor '{}': stacked experts without '{}' in the name", name, marker);
  std::vector<std::string> out;
  for (std::int64_t e = 0; e < shape[0]; ++e) {
    out.push_back(fmt::format("{}{}{}.{}", name.substr(0, at), marker, e, name.substr(at + marker.size())));
  }
  return out;
}

Shape ModelTensor::file_shape() const {
  if (stacked_experts) return {shape[2], shape[1]};   // one expert's nn.Linear [out, in]
  return transposed ? Shape{shape[1], shape[0]} : shape;
}

std::vector<std::pair<std::string, Tensor>> to_file_tensors(const ModelTensor& spec, const Tensor& t) {
  if (!spec.stacked_experts) return {{spec.name, to_file_layout(spec, t)}};
  MG_CHECK(t.shape() == spec.shape, "tensor '{}': expected meshgrad's shape {}, got {}", spec.name,
           shape_str(spec.shape), shape_str(t.shape()));
  std::vector<std::pair<std::string, Tensor>> out;
  const std::vector<std::string> names = spec.file_names();
  for (std::size_t e = 0; e < names.size(); ++e) {
    const Tensor expert = t.narrow(0, static_cast<std::int64_t>(e), 1).view({spec.shape[1], spec.shape[2]});
    out.emplace_back(names[e], expert.transpose(0, 1).contiguous());
  }
  return out;
}

Tensor from_file_tensors(const ModelTensor& spec, const std::function<Tensor(const std::string&)>& read) {
  if (!spec.stacked_experts) return from_file_layout(spec, read(spec.name));
  const std::vector<std::string> names = spec.file_names();
  Tensor out;
  for (std::size_t e = 0; e < names.size(); ++e) {
    const Tensor t = read(names[e]);
    MG_CHECK(t.shape() == spec.file_shape(), "tensor '{}': expected the file's shape {}, got {}", names[e],
             shape_str(spec.file_shape()), shape_str(t.shape()));
    if (!out.defined()) out = Tensor::empty(spec.shape, t.dtype());
    out.narrow(0, static_cast<std::int64_t>(e), 1).view({spec.shape[1], spec.shape[2]}).copy_from(t.transpose(0, 1));
  }
  return out;
}

Tensor to_file_layout(const ModelTensor& spec, const Tensor& t) {
  MG_CHECK(!spec.stacked_experts, "tensor '{}' is a stack of experts: to_file_tensors writes it", spec.name);
  MG_CHECK(t.shape() == spec.shape, "tensor '{}': expected meshgrad's shape {}, got {}", spec.name,
           shape_str(spec.shape), shape_str(t.shape()));
  return spec.transposed ? t.transpose(0, 1).contiguous() : t.contiguous();
}

Tensor from_file_layout(const ModelTensor& spec, const Tensor& t) {
  MG_CHECK(!spec.stacked_experts, "tensor '{}' is a stack of experts: from_file_tensors reads it", spec.name);
  MG_CHECK(t.shape() == spec.file_shape(), "tensor '{}': expected the file's shape {}, got {}", spec.name,
           shape_str(spec.file_shape()), shape_str(t.shape()));
  return spec.transposed ? t.transpose(0, 1).contiguous() : t.contiguous();
}

}  // namespace meshgrad::interop
