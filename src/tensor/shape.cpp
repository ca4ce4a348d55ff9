#include "meshgrad/tensor/shape.hpp"

#include <algorithm>

#include "meshgrad/tensor/error.hpp"
#include "meshgrad/tensor/iter.hpp"

namespace meshgrad {

std::int64_t shape_numel(const Shape& shape) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

Strides contiguous_strides(const Shape& shape) {
  Strides strides(shape.size());
  std::int64_t s = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= std::max<std::int64_t>(shape[i], 1);
  }
  return strides;
}

std::string shape_str(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

int normalize_dim(std::int64_t dim, const Shape& shape, const char* op) {
  const auto nd = static_cast<std::int64_t>(shape.size());
  MG_CHECK(dim >= -nd && dim < nd, "{}: dim {} out of range for shape {} (valid: {} to {})", op, dim,
           shape_str(shape), -nd, nd - 1);
  return static_cast<int>(dim < 0 ? dim + nd : dim);
}

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  const std::size_t nd = std::max(a.size(), b.size());
  Shape out(nd);
  for (std::size_t i = 0; i < nd; ++i) {
    const std::int64_t da = i < nd - a.size() ? 1 : a[i - (nd - a.size())];
    const std::int64_t db = i < nd - b.size() ? 1 : b[i - (nd - b.size())];
    MG_CHECK(da == db || da == 1 || db == 1, "{}: shapes {} and {} do not broadcast (dim {}: {} vs {})", op,
             shape_str(a), shape_str(b), i, da, db);
    out[i] = da == 1 ? db : da;
  }
  return out;
}

Strides broadcast_strides(const Shape& t_shape, const Strides& t_strides, const Shape& shape) {
  const std::size_t nd = shape.size();
  const std::size_t lead = nd - t_shape.size();
  Strides out(nd, 0);
  for (std::size_t i = 0; i < t_shape.size(); ++i) {
    out[lead + i] = t_shape[i] == 1 ? 0 : t_strides[i];
  }
  return out;
}

}  // namespace meshgrad
