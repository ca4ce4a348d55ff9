// Private to src/tensor: scalar math written so that GCC vectorises the loops that call it
// (libm's expf is a scalar call that blocks vectorisation). float64 always goes to libm, so
// double-precision results (the gradient checks) stay exactly those of std::exp.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace meshgrad::kernels::detail {

// exp for float32. x = k ln2 + r with |r| <= ln2/2; e^r by its Taylor series to r^7 (truncation
// (ln2/2)^8 / 8! ~ 5e-9, below float32's 6e-8); 2^k by adding k to the exponent. Inputs below
// -87 give 0 (so exp(-inf) = 0, as a masked logit needs; the true value is below 1.7e-38),
// above 88 give e^88 (not inf).
[[gnu::always_inline]] inline float exp_float(float x) {
  const bool underflow = x < -87.0f;
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
  return underflow ? 0.0f : std::bit_cast<float>(bits);
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

// Lanes of the float32 reductions below: 16 independent partial sums (one AVX-512 register, two
// AVX2 ones) that GCC vectorises without -ffast-math, because no sum is reassociated.
constexpr int kLanes = 16;

// sum_{j < n} f(j), in a fixed order (deterministic). float32: lane l sums f(j) for j = l mod 16
// (the tail goes straight to the total), lanes are added in double. float64: one double
// accumulator in index order, exactly the textbook loop.
template <class T, class F>
[[gnu::always_inline]] inline double row_sum(std::int64_t n, F&& f) {
  if constexpr (std::is_same_v<T, float>) {
    float acc[kLanes] = {};
    std::int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) acc[l] += f(j + l);
    }
    double total = 0;
    for (int l = 0; l < kLanes; ++l) total += static_cast<double>(acc[l]);
    for (; j < n; ++j) total += static_cast<double>(f(j));
    return total;
  } else {
    double total = 0;
    for (std::int64_t j = 0; j < n; ++j) total += static_cast<double>(f(j));
    return total;
  }
}

// max_{j < n} x[j] (-inf for n = 0), lane-wise for float32 like row_sum. NaN handling is not
// defined beyond "a NaN may or may not win": callers use it only to shift exponents.
template <class T>
[[gnu::always_inline]] inline T row_max(const T* x, std::int64_t n) {
  T m = -std::numeric_limits<T>::infinity();
  std::int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {
    float lanes[kLanes];
    for (int l = 0; l < kLanes; ++l) lanes[l] = m;
    for (; j + kLanes <= n; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) lanes[l] = std::max(lanes[l], x[j + l]);
    }
    for (int l = 0; l < kLanes; ++l) m = std::max(m, lanes[l]);
  }
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

}  // namespace meshgrad::kernels::detail
