// The one rule for splitting a dimension over ranks, used by every part of meshgrad (communicators'
// default counts, placements, parallel layers, initialisation, checkpoint sharding):
//   n elements over p parts: part i gets n / p elements, plus one if i < n % p.
//   e.g. 10 over 4 -> 3, 3, 2, 2 at offsets 0, 3, 6, 8.
// Parts may be empty (3 over 4 -> 1, 1, 1, 0).
#pragma once

#include <cstdint>
#include <vector>

#include "meshgrad/tensor/error.hpp"

namespace meshgrad {

struct ShardRange {
  std::int64_t offset;
  std::int64_t size;
};

inline ShardRange shard_range(std::int64_t n, int parts, int index) {
  MG_CHECK(parts > 0 && index >= 0 && index < parts && n >= 0,
           "shard_range: need n >= 0 and 0 <= index < parts, got n={} parts={} index={}", n, parts, index);
  const std::int64_t base = n / parts;
  const std::int64_t extra = n % parts;
  const std::int64_t size = base + (index < extra ? 1 : 0);
  const std::int64_t offset = base * index + (index < extra ? index : extra);
  return {offset, size};
}

inline std::vector<std::int64_t> shard_sizes(std::int64_t n, int parts) {
  std::vector<std::int64_t> sizes(static_cast<std::size_t>(parts));
  for (int i = 0; i < parts; ++i) sizes[static_cast<std::size_t>(i)] = shard_range(n, parts, i).size;
  return sizes;
}

}  // namespace meshgrad
