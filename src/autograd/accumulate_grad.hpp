// The node at the end of every path to a leaf: accumulates into the leaf's .grad.
#pragma once

#include "meshgrad/autograd/node.hpp"

namespace meshgrad::autograd {

class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(std::shared_ptr<TensorImpl> leaf);
  std::string_view name() const override { return "accumulate_grad"; }
  // Runs the leaf's hooks on grads[0], adds it to .grad (taking ownership when nobody else holds
  // it, else copying), then runs the post-accumulate hooks. Returns no gradients.
  TensorList apply(TensorList&& grads) override;
  Tensor leaf() const { return Tensor(leaf_); }

 private:
  std::shared_ptr<TensorImpl> leaf_;
};

}  // namespace meshgrad::autograd
