// The backward engine: runs the nodes reachable from the roots in reverse topological order
// (ties: later-created first), sums gradients flowing into the same tensor, accumulates into the
// .grad of leaves, runs hooks, and frees the graph unless asked to keep it.
#pragma once

#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::autograd {

struct BackwardOptions {
  // Keep saved tensors so backward can run through this graph again.
  bool retain_graph = false;
};

// Backpropagates from roots with the given gradients (undefined = ones for a one-element root).
void backward(const TensorList& roots, const TensorList& root_grads = {}, const BackwardOptions& options = {});

// Returns d(roots)/d(inputs) without touching any .grad: one gradient per input (undefined when
// an input does not affect the roots).
TensorList grad(const TensorList& roots, const TensorList& inputs, const TensorList& root_grads = {},
                const BackwardOptions& options = {});

}  // namespace meshgrad::autograd

namespace meshgrad {
// loss.backward() in the usual libraries.
inline void backward(const Tensor& root, const Tensor& root_grad = Tensor(), bool retain_graph = false) {
  autograd::backward({root}, {root_grad}, {retain_graph});
}
}  // namespace meshgrad
