#include "meshgrad/tensor/dtype.hpp"

namespace meshgrad {

DType parse_dtype(std::string_view name) {
  if (name == "float32") return DType::Float32;
  if (name == "float64") return DType::Float64;
  if (name == "int64") return DType::Int64;
  throw InvalidArgument(fmt::format("unknown dtype '{}' (expected float32, float64 or int64)", name));
}

}  // namespace meshgrad
