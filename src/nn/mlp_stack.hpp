// The MLP stack (mlp_stack.cpp), made by make_model for kind "mlp".
#pragma once

#include <cstdint>
#include <memory>

#include "meshgrad/nn/model.hpp"

namespace meshgrad::nn {

std::unique_ptr<Model> make_mlp_stack(const ModelConfig& config, const ParallelConfig& parallel,
                                      dist::DeviceMeshPtr mesh, std::uint64_t seed);

}  // namespace meshgrad::nn
