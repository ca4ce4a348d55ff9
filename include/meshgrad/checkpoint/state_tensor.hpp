// What a save takes: the training state as one rank holds it, tensor by tensor.
#pragma once

#include <string>

#include "meshgrad/distributed/placement.hpp"
#include "meshgrad/tensor/shape.hpp"
#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::checkpoint {

// One tensor of the training state as this rank holds it: its piece of the full tensor, laid out by
// dist::piece_layout at this rank's mesh coordinates (a parameter's value, an optimizer moment).
struct StateTensor {
  std::string name;
  Shape full_shape;
  dist::Placements placements;
  Tensor local;
};

}  // namespace meshgrad::checkpoint
