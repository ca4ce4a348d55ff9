#include "meshgrad/autograd/node.hpp"

#include <atomic>
#include <limits>

#include "accumulate_grad.hpp"
#include "meshgrad/tensor/kernels.hpp"

namespace meshgrad::autograd {

std::uint64_t next_sequence_nr() {
  static std::atomic<std::uint64_t> counter{0};
  return counter.fetch_add(1, std::memory_order_relaxed) + 1;
}

AccumulateGrad::AccumulateGrad(std::shared_ptr<TensorImpl> leaf) : leaf_(std::move(leaf)) {
  // Accumulators run as soon as their gradient is complete, so post-accumulate hooks (data-parallel
  // all-reduces) start while the rest of backward still runs.
  sequence_nr = std::numeric_limits<std::uint64_t>::max();
  output_meta.push_back({leaf_->shape, leaf_->dtype});
}

TensorList AccumulateGrad::apply(TensorList&& grads) {
  Tensor leaf(leaf_);
  AutogradMeta& meta = leaf.autograd_meta();
  Tensor g = std::move(grads.at(0));
  if (!g.defined()) return {};
  for (auto& hook : meta.hooks) {
    Tensor replaced = hook(g);
    if (replaced.defined()) g = std::move(replaced);
  }
  if (!meta.grad) {
    // Take the buffer when this is its only handle (the common case: a fresh kernel result);
    // otherwise copy, so later in-place accumulation never writes into someone else's tensor.
    const bool exclusive = g.impl_ptr().use_count() == 1 && g.storage().use_count() == 1 && g.is_contiguous();
    meta.grad = exclusive ? g.detach().impl_ptr() : g.clone().impl_ptr();
    meta.grad->annotation = g.annotation();
  } else {
    Tensor acc(meta.grad);
    AnnotationPtr annotation = combine_annotations(acc.annotation(), g.annotation());
    kernels::binary_(kernels::Binary::Add, acc, g);
    acc.set_annotation(std::move(annotation));
  }
  for (auto& hook : meta.post_accumulate_hooks) hook(leaf);
  return {};
}

Edge gradient_edge(const Tensor& t) {
  if (!t.defined()) return {};
  const AutogradMeta* meta = t.autograd_meta_if_any();
  if (meta == nullptr) return {};
  if (meta->grad_fn) return {meta->grad_fn, meta->output_nr};
  if (meta->requires_grad) return {grad_accumulator(t), 0};
  return {};
}

void set_history(Tensor& output, const std::shared_ptr<Node>& node, std::uint32_t output_nr) {
  AutogradMeta& meta = output.autograd_meta();
  meta.grad_fn = node;
  meta.output_nr = output_nr;
}

std::shared_ptr<Node> grad_accumulator(const Tensor& leaf) {
  AutogradMeta& meta = leaf.autograd_meta();
  if (auto existing = meta.grad_accumulator.lock()) return existing;
  auto acc = std::make_shared<AccumulateGrad>(leaf.impl_ptr());
  meta.grad_accumulator = acc;
  return acc;
}

void register_hook(const Tensor& t, GradHook hook) {
  MG_CHECK(t.requires_grad(), "register_hook: tensor {} does not require grad", t.str());
  if (t.is_leaf()) {
    t.autograd_meta().hooks.push_back(std::move(hook));
  } else {
    t.grad_fn()->pre_hooks.emplace_back(t.output_nr(), std::move(hook));
  }
}

}  // namespace meshgrad::autograd
