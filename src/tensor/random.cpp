#include "meshgrad/tensor/random.hpp"

#include <cmath>
#include <numbers>

namespace meshgrad::random {

std::array<std::uint32_t, 4> philox(std::uint64_t counter, std::uint64_t key) {
  // Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11).
  constexpr std::uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr std::uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  std::uint32_t c0 = static_cast<std::uint32_t>(counter), c1 = static_cast<std::uint32_t>(counter >> 32);
  std::uint32_t c2 = 0, c3 = 0;
  std::uint32_t k0 = static_cast<std::uint32_t>(key), k1 = static_cast<std::uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    const std::uint64_t p0 = static_cast<std::uint64_t>(kMul0) * c0;
    const std::uint64_t p1 = static_cast<std::uint64_t>(kMul1) * c2;
    const std::uint32_t hi0 = static_cast<std::uint32_t>(p0 >> 32), lo0 = static_cast<std::uint32_t>(p0);
    const std::uint32_t hi1 = static_cast<std::uint32_t>(p1 >> 32), lo1 = static_cast<std::uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return {c0, c1, c2, c3};
}

namespace {
// 53 random bits from two 32-bit words -> [0, 1).
double to_unit(std::uint32_t hi, std::uint32_t lo) {
  const std::uint64_t bits = (static_cast<std::uint64_t>(hi) << 32 | lo) >> 11;
  return static_cast<double>(bits) * 0x1.0p-53;
}
}  // namespace

double uniform(std::uint64_t seed, std::uint64_t index) {
  const auto r = philox(index, seed);
  return to_unit(r[0], r[1]);
}

double normal(std::uint64_t seed, std::uint64_t index) {
  const auto r = philox(index, seed);
  const double u1 = 1.0 - to_unit(r[0], r[1]);  // (0, 1]: log is finite
  const double u2 = to_unit(r[2], r[3]);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

namespace {

// Fills a tensor of the box's shape with value(global_index) for each element of the box of a
// global tensor of global_shape.
template <class Value>
Tensor generate(const Shape& global_shape, const Box& box_in, DType dtype, const char* op, Value&& value) {
  Box box = box_in;
  if (box.empty()) {
    for (std::int64_t d : global_shape) box.push_back({0, d});
  }
  MG_CHECK(box.size() == global_shape.size(), "{}: box has {} dims, global shape {} has {}", op, box.size(),
           shape_str(global_shape), global_shape.size());
  Shape local_shape;
  for (std::size_t d = 0; d < box.size(); ++d) {
    MG_CHECK(box[d].offset >= 0 && box[d].size >= 0 && box[d].offset + box[d].size <= global_shape[d],
             "{}: box [{}, {}) out of range for dim {} of global shape {}", op, box[d].offset,
             box[d].offset + box[d].size, d, shape_str(global_shape));
    local_shape.push_back(box[d].size);
  }
  Tensor out = Tensor::empty(local_shape, dtype);
  const std::int64_t n = out.numel();
  if (n == 0) return out;
  const Strides global_strides = contiguous_strides(global_shape);
  const std::size_t nd = local_shape.size();
  std::vector<std::int64_t> index(nd, 0);
  auto fill = [&]<class T>(T* p) {
    for (std::int64_t i = 0; i < n; ++i) {
      std::int64_t g = 0;
      for (std::size_t d = 0; d < nd; ++d) g += (box[d].offset + index[d]) * global_strides[d];
      p[i] = static_cast<T>(value(static_cast<std::uint64_t>(g)));
      for (std::size_t d = nd; d-- > 0;) {
        if (++index[d] < local_shape[d]) break;
        index[d] = 0;
      }
    }
  };
  switch (dtype) {
    case DType::Float32: fill(out.data<float>()); break;
    case DType::Float64: fill(out.data<double>()); break;
    case DType::Int64: fill(out.data<std::int64_t>()); break;
    case DType::BFloat16: fill(out.data<bfloat16>()); break;
  }
  return out;
}

}  // namespace

Tensor randn(const Shape& global_shape, std::uint64_t seed, DType dtype, double mean, double std, const Box& box) {
  MG_CHECK(dtype != DType::Int64, "randn: dtype must be floating, got {}", dtype);
  return generate(global_shape, box, dtype, "randn",
                  [&](std::uint64_t g) { return mean + std * normal(seed, g); });
}

Tensor rand(const Shape& global_shape, std::uint64_t seed, DType dtype, double low, double high, const Box& box) {
  MG_CHECK(dtype != DType::Int64, "rand: dtype must be floating, got {}", dtype);
  return generate(global_shape, box, dtype, "rand",
                  [&](std::uint64_t g) { return low + (high - low) * uniform(seed, g); });
}

Tensor randint(const Shape& global_shape, std::uint64_t seed, std::int64_t high, const Box& box) {
  MG_CHECK(high > 0, "randint: high must be positive, got {}", high);
  return generate(global_shape, box, DType::Int64, "randint", [&](std::uint64_t g) {
    return std::min<std::int64_t>(high - 1, static_cast<std::int64_t>(uniform(seed, g) * static_cast<double>(high)));
  });
}

std::uint64_t Generator::next_seed() {
  // Each draw gets its own key: Philox keyed by a hash of (seed, counter).
  const auto r = philox(counter_++, seed_ ^ 0x5bd1e9955bd1e995ull);
  return static_cast<std::uint64_t>(r[0]) << 32 | r[1];
}

}  // namespace meshgrad::random
