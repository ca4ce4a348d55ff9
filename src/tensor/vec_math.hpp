// Private to src/tensor: scalar math written so that GCC vectorises the loops that call it
// (libm's expf is a scalar call that blocks vectorisation). float64 always goes to libm, so
// double-precision results (the gradient checks) stay exactly those of std::exp.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace meshgrad::kernels::detail {

// exp for float32. x = k ln2 + r with |r| <= ln2/2; e^r by its Taylor series to r^7 (truncation
// (ln2/2)^8 / 8! ~ 5e-9, below float32's 6e-8); 2^k by adding k to the exponent. Inputs below
// -87 give e^-87 (not 0), above 88 give e^88 (not inf); -inf gives e^-87 ~ 1.6e-38, so callers
// that need an exact 0 for masked entries must write it themselves.
[[gnu::always_inline]] inline float exp_float(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;         // ln 2 split so k * kLn2Hi is exact
  constexpr float kLn2Lo = 1.42860682030941723212e-6f;
  constexpr float kRound = 12582912.0f;                 // 1.5 * 2^23: (v + kRound) - kRound rounds v
  x = std::min(std::max(x, -87.0f), 88.0f);            // 2^k stays a normal float
  // k = nearest integer to x / ln2, so |r| <= ln2/2. Rounded by adding and subtracting 1.5 * 2^23
  // (exact for |v| < 2^22) rather than std::floor, which GCC does not vectorise here.
  const float k = (x * kLog2e + kRound) - kRound;
  const float r = (x - k * kLn2Hi) - k * kLn2Lo;
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const std::int32_t bits = std::bit_cast<std::int32_t>(p) + (static_cast<std::int32_t>(k) << 23);
  return std::bit_cast<float>(bits);
}

// e^x: exp_float for float32, std::exp for float64. Only for x <= 0 or moderate x (callers
// subtract a row max first), where exp_float's clamp changes nothing that matters.
template <class T>
[[gnu::always_inline]] inline T exp_fast(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return exp_float(x);
  } else {
    return std::exp(x);
  }
}

}  // namespace meshgrad::kernels::detail
