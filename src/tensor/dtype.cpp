#include "meshgrad/tensor/dtype.hpp"

namespace meshgrad {

DType parse_dtype(std::string_view name) {
  if (name == "float32") return DType::Float32;
  if (name == "float64") return DType::Float64;
  if (name == "int64") return DType::Int64;
  if (name == "bfloat16" || name == "bf16")
    throw InvalidArgument(fmt::format("dtype '{}': weights and arithmetic are float32 or float64; bf16 training is "
                                      "--precision bf16 (float32 weights, bf16 matrix products)", name));
  throw InvalidArgument(fmt::format("unknown dtype '{}' (expected float32, float64 or int64)", name));
}

}  // namespace meshgrad
