// The custom Function API: an op written as one class with forward and backward side by side.
//
//   struct MulFn final : autograd::Function {
//     std::string_view name() const override { return "mul"; }
//     TensorList forward(const TensorList& x) override {    // x = {a, b}
//       save_for_backward({x[0], x[1]});
//       return {kernels::binary(kernels::Binary::Mul, x[0], x[1])};
//     }
//     TensorList backward(const TensorList& g) override {   // one grad per output
//       const auto& s = saved();
//       return {needs_input_grad(0) ? g[0] * s[1] : Tensor(), needs_input_grad(1) ? g[0] * s[0] : Tensor()};
//     }
//   };
//   Tensor mul(const Tensor& a, const Tensor& b) { return autograd::apply<MulFn>({a, b})[0]; }
//
// forward runs with recording off and must not keep Tensor members that alias its outputs other
// than through save_for_backward (which stores them detached: no reference cycles, and records
// their versions: saved() refuses a tensor that was written in place after this forward, since
// backward would then compute with values the forward never saw). Non-tensor
// state (dims, flags, a communicator) goes in ordinary members set by the constructor. backward
// returns one gradient per input, or an undefined Tensor for an input that gets none; the engine
// checks count, shapes and dtypes and names this op when they are wrong.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "meshgrad/autograd/node.hpp"

namespace meshgrad::autograd {

class Function : public Node {
 public:
  virtual TensorList forward(const TensorList& inputs) = 0;
  virtual TensorList backward(const TensorList& grad_outputs) = 0;

  TensorList apply(TensorList&& grads) final;
  void release_saved() override;

  // Whether input i needs a gradient (it requires grad and recording was on).
  bool needs_input_grad(std::size_t i) const { return i < needs_input_grad_.size() && needs_input_grad_[i]; }
  void set_needs_input_grad(std::vector<bool> v) { needs_input_grad_ = std::move(v); }

 protected:
  // Keeps tensors for backward (detached: the saved handle does not hold the graph) with the
  // version of each (Tensor::version).
  void save_for_backward(TensorList tensors);
  // The saved tensors. Throws InvalidArgument if they were released (backward through a freed
  // graph), or if one was changed in place since save_for_backward (an optimizer step or a
  // checkpoint load between forward and backward): the message names this op, the saved tensor
  // (index, name of the tensor or of the parameter whose storage it shares) and both versions.
  const TensorList& saved() const;

 private:
  // What saved() needs beyond the tensor: the version to compare and, for the error message
  // only, the handle that was passed in (its name; weak, so a saved output does not keep
  // itself alive through this node).
  struct SavedInfo {
    std::uint64_t version = 0;
    std::weak_ptr<TensorImpl> original;
  };
  [[noreturn]] void throw_changed_in_place(std::size_t index) const;

  TensorList saved_;
  std::vector<SavedInfo> saved_info_;
  bool released_ = false;
  std::vector<bool> needs_input_grad_;
};

// Runs fn->forward(inputs) and, when recording is on and some input requires grad, records fn as
// the node of the outputs. Returns the outputs.
TensorList apply_function(const std::shared_ptr<Function>& fn, const TensorList& inputs);

template <class F, class... Args>
TensorList apply(const TensorList& inputs, Args&&... args) {
  return apply_function(std::make_shared<F>(std::forward<Args>(args)...), inputs);
}

}  // namespace meshgrad::autograd
