#include "meshgrad/autograd/checkpoint.hpp"

#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/autograd/function.hpp"
#include "meshgrad/autograd/grad_mode.hpp"

namespace meshgrad::autograd {

namespace {

// forward: fn(inputs) without a graph, keeping only the inputs.
// backward: restore the generators, recompute fn(inputs) with a graph, backpropagate through it
// (parameters used inside fn accumulate their .grad there), return the inputs' gradients.
class CheckpointFunction final : public Function {
 public:
  CheckpointFunction(CheckpointFn fn, std::vector<random::Generator*> generators)
      : fn_(std::move(fn)), generators_(std::move(generators)) {}
  std::string_view name() const override { return "checkpoint"; }

  TensorList forward(const TensorList& inputs) override {
    for (auto* g : generators_) counters_at_forward_.push_back(g->counter());
    save_for_backward(inputs);
    return fn_(inputs);
  }

  TensorList backward(const TensorList& grad_outputs) override {
    const TensorList& saved_inputs = saved();
    TensorList inputs;
    for (std::size_t i = 0; i < saved_inputs.size(); ++i) {
      Tensor t = saved_inputs[i].defined() ? saved_inputs[i].detach() : Tensor();
      if (needs_input_grad(i)) t.set_requires_grad(true);
      inputs.push_back(t);
    }
    // Replay the random draws of the forward, then put the generators back where they were.
    std::vector<std::uint64_t> counters_now;
    for (std::size_t i = 0; i < generators_.size(); ++i) {
      counters_now.push_back(generators_[i]->counter());
      generators_[i]->set_counter(counters_at_forward_[i]);
    }
    TensorList outputs;
    {
      trace::Span span("recompute", "recompute");
      EnableGradGuard enable;
      RecomputeGuard recomputing;
      outputs = fn_(inputs);
    }
    for (std::size_t i = 0; i < generators_.size(); ++i) generators_[i]->set_counter(counters_now[i]);

    TensorList roots, root_grads;
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && grad_outputs[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grad_outputs[i]);
      }
    }
    if (!roots.empty()) meshgrad::autograd::backward(roots, root_grads);
    TensorList grads;
    for (std::size_t i = 0; i < inputs.size(); ++i) grads.push_back(needs_input_grad(i) ? inputs[i].grad() : Tensor());
    return grads;
  }

 private:
  CheckpointFn fn_;
  std::vector<random::Generator*> generators_;
  std::vector<std::uint64_t> counters_at_forward_;
};

}  // namespace

TensorList checkpoint(const CheckpointFn& fn, const TensorList& inputs, std::vector<random::Generator*> generators) {
  // The recomputation hangs off the inputs' graph. With no input that requires grad there is
  // nothing to hang it on, and parameters that fn uses (captured, not passed) would silently get no
  // gradient: run fn normally instead, keeping its graph (correct gradients, no memory saved).
  bool anchored = false;
  for (const Tensor& t : inputs) anchored = anchored || (t.defined() && t.requires_grad());
  if (GradMode::is_enabled() && !anchored) return fn(inputs);
  return apply<CheckpointFunction>(inputs, fn, std::move(generators));
}

}  // namespace meshgrad::autograd
