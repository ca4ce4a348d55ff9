#include "meshgrad/autograd/function.hpp"

#include "meshgrad/autograd/grad_mode.hpp"

namespace meshgrad::autograd {

TensorList Function::apply(TensorList&& grads) { return backward(grads); }

void Function::release_saved() {
  saved_.clear();
  saved_.shrink_to_fit();
  released_ = true;
}

void Function::save_for_backward(TensorList tensors) {
  saved_.clear();
  saved_.reserve(tensors.size());
  // Detached handles: a saved output must not point back at this node (no reference cycle).
  for (const Tensor& t : tensors) saved_.push_back(t.defined() ? t.detach() : Tensor());
}

const TensorList& Function::saved() const {
  MG_CHECK(!released_, "{}: backward through a graph a second time; its saved tensors were freed "
           "(pass retain_graph = true to the first backward)", name());
  return saved_;
}

TensorList apply_function(const std::shared_ptr<Function>& fn, const TensorList& inputs) {
  bool record = false;
  if (GradMode::is_enabled()) {
    for (const Tensor& t : inputs) record = record || (t.defined() && t.requires_grad());
  }
  if (record) {
    std::vector<bool> needs(inputs.size());
    for (std::size_t i = 0; i < inputs.size(); ++i) needs[i] = inputs[i].defined() && inputs[i].requires_grad();
    fn->set_needs_input_grad(std::move(needs));
  }
  TensorList outputs;
  {
    NoGradGuard no_grad;
    outputs = fn->forward(inputs);
  }
  if (!record) return outputs;

  fn->sequence_nr = next_sequence_nr();
  fn->next_edges.reserve(inputs.size());
  fn->input_meta.reserve(inputs.size());
  for (const Tensor& t : inputs) {
    fn->next_edges.push_back(t.defined() && t.requires_grad() ? gradient_edge(t) : Edge{});
    fn->input_meta.push_back(t.defined() ? TensorMeta{t.shape(), t.dtype()} : TensorMeta{});
  }
  fn->output_meta.reserve(outputs.size());
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    Tensor& out = outputs[i];
    fn->output_meta.push_back(out.defined() ? TensorMeta{out.shape(), out.dtype()} : TensorMeta{});
    if (!out.defined() || !out.is_floating()) continue;  // indices etc. carry no gradient
    // An output that is an input (identity forward) or otherwise shared gets its own handle, so
    // recording never rewrites the history of a tensor someone else holds.
    if (out.impl_ptr().use_count() > 1 || out.autograd_meta_if_any() != nullptr) out = out.detach();
    set_history(out, fn, static_cast<std::uint32_t>(i));
  }
  return outputs;
}

}  // namespace meshgrad::autograd
