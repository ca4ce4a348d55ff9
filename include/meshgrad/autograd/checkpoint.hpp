// Activation checkpointing: run fn without keeping its graph, and recompute it in backward.
// Gradients are bitwise identical to running fn without checkpointing, provided fn is
// deterministic given its inputs and the listed generators (dropout masks are replayed by
// restoring each generator's counter before recomputing). The recomputation is anchored on the
// inputs: if none requires grad, fn simply runs with its graph kept (parameters it captures still
// get their gradients; no memory is saved).
#pragma once

#include <functional>
#include <vector>

#include "meshgrad/tensor/random.hpp"
#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::autograd {

using CheckpointFn = std::function<TensorList(const TensorList& inputs)>;

TensorList checkpoint(const CheckpointFn& fn, const TensorList& inputs,
                      std::vector<random::Generator*> generators = {});

}  // namespace meshgrad::autograd
