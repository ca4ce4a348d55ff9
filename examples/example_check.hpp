// What decides the examples' exit status: the largest element difference of two tensors and a line
// saying whether it is within tolerance.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "meshgrad/tensor/tensor.hpp"

namespace example {

// max |a - b| over the elements; shapes must agree (infinity when they do not).
inline double max_abs_diff(const meshgrad::Tensor& a, const meshgrad::Tensor& b) {
  if (a.shape() != b.shape()) return INFINITY;
  const meshgrad::Tensor x = a.to(meshgrad::DType::Float64).contiguous();
  const meshgrad::Tensor y = b.to(meshgrad::DType::Float64).contiguous();
  double m = 0;
  for (std::int64_t i = 0; i < x.numel(); ++i) m = std::max(m, std::abs(x.data<double>()[i] - y.data<double>()[i]));
  return m;
}

// Prints "what: max |diff| = d (ok|FAILED)" and returns whether d <= tolerance.
inline bool report(const std::string& what, double diff, double tolerance) {
  const bool ok = diff <= tolerance;
  fmt::print("{:<40} max |diff| = {:.3g} ({})\n", what, diff, ok ? "ok" : "FAILED");
  return ok;
}

}  // namespace example
