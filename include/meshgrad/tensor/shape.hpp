// Shapes and strides. Strides and offsets are in elements, not bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace meshgrad {

using Shape = std::vector<std::int64_t>;
using Strides = std::vector<std::int64_t>;

// Product of the dims; 1 for a scalar (empty shape).
std::int64_t shape_numel(const Shape& shape);
// Row-major strides of a contiguous tensor of this shape.
Strides contiguous_strides(const Shape& shape);
// "[2, 3, 4]"
std::string shape_str(const Shape& shape);
// Maps dim in [-ndim, ndim) to [0, ndim); throws InvalidArgument naming op, dim and shape otherwise.
int normalize_dim(std::int64_t dim, const Shape& shape, const char* op);
// NumPy broadcasting of two shapes; throws naming op and both shapes when they do not broadcast.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);

}  // namespace meshgrad
