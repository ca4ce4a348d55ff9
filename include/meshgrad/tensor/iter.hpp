// Strided iteration: the one loop every elementwise kernel is built on.
//
// for_each_row(shape, {strides of operand 0, ..., K-1}, fn) walks the shape in row-major order and
// calls fn(offsets, n, inner_strides) once per innermost row, where offsets[k] is the element
// offset of operand k at the row's start and inner_strides[k] its stride along the row. Operands
// may have stride 0 (broadcast or reduced dims). Rows are as long as possible: trailing dims
// that are contiguous for every operand are merged into one.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "meshgrad/tensor/shape.hpp"

namespace meshgrad {

template <std::size_t K, class Fn>
void for_each_row(const Shape& shape, const std::array<const Strides*, K>& strides, Fn&& fn) {
  const int nd = static_cast<int>(shape.size());
  std::array<std::int64_t, K> offsets{};
  for (std::int64_t extent : shape) {
    if (extent == 0) return;
  }
  if (nd == 0) {
    std::array<std::int64_t, K> one{};
    fn(offsets, std::int64_t{1}, one);
    return;
  }
  // Merge trailing dims that are laid out contiguously for every operand into one row.
  int inner = nd - 1;
  std::int64_t row = shape[inner];
  while (inner > 0) {
    bool mergeable = true;
    for (std::size_t k = 0; k < K; ++k) {
      const Strides& s = *strides[k];
      if (s[inner - 1] != s[inner] * shape[inner]) mergeable = false;
    }
    if (!mergeable) break;
    --inner;
    row *= shape[inner];
  }
  std::array<std::int64_t, K> inner_strides;
  for (std::size_t k = 0; k < K; ++k) inner_strides[k] = (*strides[k])[nd - 1];
  // Odometer over the outer dims [0, inner).
  std::vector<std::int64_t> index(static_cast<std::size_t>(inner), 0);
  while (true) {
    fn(offsets, row, inner_strides);
    int d = inner - 1;
    for (; d >= 0; --d) {
      ++index[d];
      for (std::size_t k = 0; k < K; ++k) offsets[k] += (*strides[k])[d];
      if (index[d] < shape[d]) break;
      for (std::size_t k = 0; k < K; ++k) offsets[k] -= (*strides[k])[d] * shape[d];
      index[d] = 0;
    }
    if (d < 0) return;
  }
}

// Strides of `t_strides` (a tensor of shape t_shape) broadcast to `shape`: 0 on new or size-1 dims.
Strides broadcast_strides(const Shape& t_shape, const Strides& t_strides, const Shape& shape);

}  // namespace meshgrad
