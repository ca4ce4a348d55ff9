#include "meshgrad/autograd/function.hpp"

#include <unordered_set>

#include "accumulate_grad.hpp"
#include "meshgrad/autograd/grad_mode.hpp"

namespace meshgrad::autograd {

namespace {

// The name of a leaf reachable from `from` whose data lives in `storage` (a parameter that was
// passed to the op as a view, e.g. a transposed weight), or "" when there is none. Error path only:
// walks the whole graph below `from`.
std::string leaf_name_sharing(const Node& from, const Storage* storage) {
  std::vector<const Node*> stack{&from};
  std::unordered_set<const Node*> seen{&from};
  while (!stack.empty()) {
    const Node* node = stack.back();
    stack.pop_back();
    if (const auto* acc = dynamic_cast<const AccumulateGrad*>(node)) {
      const Tensor leaf = acc->leaf();
      if (leaf.storage().get() == storage && !leaf.name().empty()) return leaf.name();
    }
    for (const Edge& e : node->next_edges) {
      if (e.valid() && seen.insert(e.node.get()).second) stack.push_back(e.node.get());
    }
  }
  return {};
}

}  // namespace

TensorList Function::apply(TensorList&& grads) { return backward(grads); }

void Function::release_saved() {
  saved_.clear();
  saved_.shrink_to_fit();
  saved_info_.clear();
  saved_info_.shrink_to_fit();
  released_ = true;
}

void Function::save_for_backward(TensorList tensors) {
  saved_.clear();
  saved_.reserve(tensors.size());
  saved_info_.clear();
  saved_info_.reserve(tensors.size());
  for (const Tensor& t : tensors) {
    if (!t.defined()) {
      saved_.emplace_back();
      saved_info_.emplace_back();
      continue;
    }
    // Detached handles: a saved output must not point back at this node (no reference cycle).
    // detach() shares the storage, so the saved handle sees the same version counter.
    saved_.push_back(t.detach());
    saved_info_.push_back({t.version(), t.impl_ptr()});
  }
}

const TensorList& Function::saved() const {
  MG_CHECK(!released_, "{}: backward through a graph a second time; its saved tensors were freed "
           "(pass retain_graph = true to the first backward)", name());
  for (std::size_t i = 0; i < saved_.size(); ++i) {
    if (saved_[i].defined() && saved_[i].version() != saved_info_[i].version) throw_changed_in_place(i);
  }
  return saved_;
}

void Function::throw_changed_in_place(std::size_t index) const {
  const Tensor& t = saved_[index];
  std::string what;
  const std::shared_ptr<TensorImpl> original = saved_info_[index].original.lock();
  if (original && !Tensor(original).name().empty()) {
    what = fmt::format("'{}', {}", Tensor(original).name(), t.str());
  } else if (const std::string leaf = leaf_name_sharing(*this, t.storage().get()); !leaf.empty()) {
    what = fmt::format("{}, a view of '{}'", t.str(), leaf);
  } else {
    what = fmt::format("{}, unnamed", t.str());
  }
  throw InvalidArgument(fmt::format(
      "{}: saved tensor {} of {} ({}) was saved at version {}, now {}: it was changed in place after the "
      "forward that saved it (e.g. an optimizer step between forward and backward); run backward before "
      "changing it, or pass the op a clone",
      name(), index, saved_.size(), what, saved_info_[index].version, t.version()));
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
  if (trace::enabled()) fn->trace_scope = trace::current_scope();
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
