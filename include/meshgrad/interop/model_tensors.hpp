// A model's parameters as tensors in files: meshgrad's names, full shapes and order for every family,
// and how each is laid out in a Hugging Face file.
//
// meshgrad stores every linear weight [in, out] (y = x W, layers.hpp). GPT-2's Hugging Face files do
// too (its Conv1D), so its tensors go to and from them as they are. The Llama family's files store
// torch.nn.Linear weights [out, in]: q/k/v/o_proj, gate/up/down_proj and lm_head are transposed on
// the way in and out (an exact copy). Every other tensor (embeddings, norms, biases) is the same in
// both. The names are the same in both: meshgrad names its parameters as Hugging Face does
// ("wte.weight", "h.0.attn.c_attn.weight"; "model.embed_tokens.weight",
// "model.layers.0.self_attn.q_proj.weight", "lm_head.weight").
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "meshgrad/nn/model.hpp"
#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::interop {

// One parameter of a model.
struct ModelTensor {
  std::string name;         // meshgrad's parameter name, also its name in a Hugging Face file
  Shape shape;              // meshgrad's full shape
  bool transposed = false;  // a Hugging Face file stores it transposed (a torch.nn.Linear weight)
  // A mixture of experts' stacked weight [experts, in, out] (nn/moe.hpp), "....experts.w1.weight":
  // a Hugging Face file holds one nn.Linear [out, in] per expert, "....experts.{e}.w1.weight".
  bool stacked_experts = false;
  // Its names in a Hugging Face file (one, or one per expert) and the shape of each there.
  std::vector<std::string> file_names() const;
  Shape file_shape() const;
};

// Every parameter of the model config describes (kind "gpt" or "llama"), in nn::make_model's
// parameters() order on one rank (tests/interop/test_model_tensors.cpp holds that):
//   gpt:   gpt2_parameter_shapes(config), none transposed;
//   llama: model.embed_tokens.weight [vocab, hidden]; per layer i, model.layers.i.
//            input_layernorm.weight [hidden],
//            self_attn.{q,k,v}_proj.weight [hidden, heads|kv_heads * head_dim] (+ .bias when
//              attention_bias), self_attn.o_proj.weight [heads * head_dim, hidden],
//            post_attention_layernorm.weight [hidden],
//            mlp.{gate,up}_proj.weight [hidden, ffn], mlp.down_proj.weight [ffn, hidden];
//          model.norm.weight [hidden]; lm_head.weight [hidden, vocab] unless tie_word_embeddings.
//          Every .weight of a linear (and lm_head) is transposed in a Hugging Face file.
//          Qwen2-MoE's sparse layers (config.sparse_layer(i)) have mlp.gate.weight [hidden, experts],
//            mlp.experts.{gate_proj,up_proj,down_proj}.weight (stacked, expert_ffn wide) and, with a
//            shared expert, mlp.shared_expert.{gate,up,down}_proj.weight and
//            mlp.shared_expert_gate.weight [hidden, 1] (transposed in a file).
//          A mixture of experts (config.experts > 0, Mixtral) has, instead of mlp.*, per layer
//            block_sparse_moe.gate.weight [hidden, experts] (transposed in a file),
//            block_sparse_moe.experts.w1.weight [experts, hidden, ffn], .w2.weight [experts, ffn,
//            hidden], .w3.weight [experts, hidden, ffn]: stacked_experts, each expert's slice an
//            nn.Linear of its own in a file (experts.{e}.w1.weight [ffn, hidden], ...).
// Throws InvalidArgument naming the kind for any other model (the MLP stack has no file format).
std::vector<ModelTensor> model_tensors(const nn::ModelConfig& config);
// The same as (name, meshgrad shape) pairs.
std::vector<std::pair<std::string, Shape>> model_parameter_shapes(const nn::ModelConfig& config);

// A full tensor of meshgrad's layout as a Hugging Face file stores it, and back: a contiguous copy,
// transposed when spec.transposed (exact: no value changes). Throws InvalidArgument naming the
// tensor when t's shape is not spec's (to_file_layout: spec.shape; from_file_layout: file_shape()).
// Not for stacked experts (one meshgrad tensor, several file tensors): the two below are for all.
Tensor to_file_layout(const ModelTensor& spec, const Tensor& t);
Tensor from_file_layout(const ModelTensor& spec, const Tensor& t);
// Every tensor: its file tensors (name, tensor) in file_names() order, and back from a reader of
// file tensors by name.
std::vector<std::pair<std::string, Tensor>> to_file_tensors(const ModelTensor& spec, const Tensor& t);
Tensor from_file_tensors(const ModelTensor& spec, const std::function<Tensor(const std::string&)>& read);

}  // namespace meshgrad::interop
