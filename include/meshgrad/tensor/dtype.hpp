// Element types. float32 is the training type, float64 the type gradient checks run in, int64 the
// type of token ids and targets (indices only: no arithmetic ops take it), bfloat16 the operands of
// --precision bf16's matrix products (storage and products only: bfloat16.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "meshgrad/tensor/bfloat16.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad {

enum class DType : std::uint8_t { Float32, Float64, Int64, BFloat16 };

constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::Float32: return 4;
    case DType::Float64: return 8;
    case DType::Int64: return 8;
    case DType::BFloat16: return 2;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::Float32: return "float32";
    case DType::Float64: return "float64";
    case DType::Int64: return "int64";
    case DType::BFloat16: return "bfloat16";
  }
  return "?";
}

// Parses "float32" / "float64" / "int64"; throws InvalidArgument naming the text otherwise (also for
// "bfloat16": no model or job computes in it; the message points to --precision bf16).
DType parse_dtype(std::string_view name);

template <class T>
constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::Float32; }
template <> constexpr DType dtype_of<double>() { return DType::Float64; }
template <> constexpr DType dtype_of<std::int64_t>() { return DType::Int64; }
template <> constexpr DType dtype_of<bfloat16>() { return DType::BFloat16; }

// Calls f.template operator()<T>() with T the C++ type of a floating dtype:
//   dispatch_floating(t, "op", [&]<class T>() { ... });
// Throws naming `op` when t is not floating.
template <class F>
decltype(auto) dispatch_floating(DType t, std::string_view op, F&& f) {
  switch (t) {
    case DType::Float32: return f.template operator()<float>();
    case DType::Float64: return f.template operator()<double>();
    default: break;
  }
  throw InvalidArgument(fmt::format("{}: dtype {} is not supported (float32 or float64 expected)", op,
                                    dtype_name(t)));
}

}  // namespace meshgrad

template <>
struct fmt::formatter<meshgrad::DType> : fmt::formatter<std::string_view> {
  auto format(meshgrad::DType t, format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(meshgrad::dtype_name(t), ctx);
  }
};
