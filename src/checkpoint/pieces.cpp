// Boxes, their bytes and piece hashes (contract in pieces.hpp).
#include "checkpoint/pieces.hpp"

#include <algorithm>
#include <utility>

namespace meshgrad::checkpoint {

std::vector<LocalBox> local_boxes(const dist::PieceLayout& layout) {
  const std::size_t nd = layout.ranges.size();
  int split = -1;
  for (std::size_t d = 0; d < nd; ++d) {
    MG_CHECK(!layout.ranges[d].empty(), "checkpoint: a piece layout with no range in dim {}", d);
    if (layout.ranges[d].size() > 1) split = static_cast<int>(d);
  }
  std::vector<LocalBox> out;
  const std::size_t blocks = split < 0 ? 1 : layout.ranges[static_cast<std::size_t>(split)].size();
  std::int64_t local = 0;
  for (std::size_t k = 0; k < blocks; ++k) {
    LocalBox lb;
    lb.split_dim = split;
    lb.local_offset = local;
    for (std::size_t d = 0; d < nd; ++d) {
      lb.box.push_back(static_cast<int>(d) == split ? layout.ranges[d][k] : layout.ranges[d][0]);
    }
    if (split >= 0) local += layout.ranges[static_cast<std::size_t>(split)][k].size;
    out.push_back(std::move(lb));
  }
  return out;
}

Tensor local_view(const Tensor& local, const LocalBox& lb) {
  if (lb.split_dim < 0) return local;
  return local.narrow(lb.split_dim, lb.local_offset, lb.box[static_cast<std::size_t>(lb.split_dim)].size);
}

bool same_box(const Box& a, const Box& b) {
  return a.size() == b.size() &&
         std::equal(a.begin(), a.end(), b.begin(), [](const ShardRange& x, const ShardRange& y) {
           return x.offset == y.offset && x.size == y.size;
         });
}

BoxBytes box_bytes(const Tensor& local, const LocalBox& lb) {
  MG_CHECK(local.is_contiguous(), "checkpoint: internal error: box bytes of a non-contiguous tensor");
  const std::uint64_t item = dtype_size(local.dtype());
  const auto* base = static_cast<const std::byte*>(local.raw_data());
  if (lb.split_dim < 0) return {base, 1, static_cast<std::uint64_t>(local.numel()) * item, 0};
  const Shape& shape = local.shape();
  const auto d = static_cast<std::size_t>(lb.split_dim);
  std::uint64_t outer = 1, inner = item;   // rows before d; bytes of one index of d
  for (std::size_t k = 0; k < d; ++k) outer *= static_cast<std::uint64_t>(shape[k]);
  for (std::size_t k = d + 1; k < shape.size(); ++k) inner *= static_cast<std::uint64_t>(shape[k]);
  const auto block = static_cast<std::uint64_t>(lb.box[d].size);
  return {base + static_cast<std::uint64_t>(lb.local_offset) * inner, outer, block * inner,
          static_cast<std::uint64_t>(shape[d]) * inner};
}

}  // namespace meshgrad::checkpoint
