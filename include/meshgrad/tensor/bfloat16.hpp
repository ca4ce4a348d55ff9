// bfloat16: the upper 16 bits of an IEEE float32 (1 sign, 8 exponent, 7 mantissa bits). meshgrad
// stores it (DType::BFloat16) and multiplies it (blas::gemm's bf16 overload: bf16 operands, float32
// accumulation and output) but does no other arithmetic in it: --precision bf16 keeps weights,
// gradients, optimizer moments, softmax, normalisation and loss in float32 (kernels::ProductPrecision,
// tensor/kernels.hpp).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace meshgrad {

// Round to nearest, ties to even, as every anchor's conversion does (PyTorch's, oneDNN's and the
// AVX512_BF16 instruction vcvtneps2bf16). NaN stays NaN (quiet); infinities stay infinite; finite
// values beyond bf16's largest round to infinity.
constexpr std::uint16_t bf16_bits_from_float(float value) {
  std::uint32_t u = std::bit_cast<std::uint32_t>(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

constexpr float float_from_bf16_bits(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

// A double rounded once to bfloat16 (not through float, which would round twice: a double just
// above a bf16 tie can round to the tie in float and then to even). The float is rounded toward
// zero and marked inexact in its lowest bit (round to odd), which float's 16 spare bits keep apart
// from every bf16 tie.
inline std::uint16_t bf16_bits_from_double(double value) {
  float f = static_cast<float>(value);
  if (std::isfinite(value) && static_cast<double>(f) != value) {
    if (std::fabs(static_cast<double>(f)) > std::fabs(value)) f = std::nextafter(f, 0.0f);
    f = std::bit_cast<float>(std::bit_cast<std::uint32_t>(f) | 1u);
  }
  return bf16_bits_from_float(f);
}

struct bfloat16 {
  std::uint16_t bits = 0;

  constexpr bfloat16() = default;
  explicit bfloat16(double value) : bits(bf16_bits_from_double(value)) {}
  explicit constexpr bfloat16(float value) : bits(bf16_bits_from_float(value)) {}
  explicit bfloat16(std::int64_t value) : bfloat16(static_cast<double>(value)) {}
  constexpr operator float() const { return float_from_bf16_bits(bits); }   // exact
};
static_assert(sizeof(bfloat16) == 2);

}  // namespace meshgrad
