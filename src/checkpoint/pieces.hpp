// Internal to the checkpoint layer: a piece of a tensor as the saver, the write plan and the readers
// see it: the boxes of a rank's piece, where their bytes lie in the rank's local tensor, and the hash
// every piece carries.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "meshgrad/checkpoint/manifest.hpp"
#include "meshgrad/distributed/layout.hpp"
#include "meshgrad/io/xxh128.hpp"
#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::checkpoint {

// One box of a rank's piece: where it lies in the full tensor, and where in the local (packed) piece.
// A piece is the product of one range per dim, except the dim split in blocks (at most one), which
// holds several ranges side by side in the local tensor.
struct LocalBox {
  Box box;
  int split_dim = -1;              // the blocked dim, -1 when the piece is one box
  std::int64_t local_offset = 0;   // along split_dim in the local tensor
};

// The boxes of a piece laid out as `layout`, in the order they lie in the local tensor.
std::vector<LocalBox> local_boxes(const dist::PieceLayout& layout);

// The part of `local` (the packed piece) that holds lb's box.
Tensor local_view(const Tensor& local, const LocalBox& lb);

// The same ranges in every dim.
bool same_box(const Box& a, const Box& b);

// Where a box's bytes lie in a contiguous local tensor, in the order the checkpoint stores them
// (row-major over the box): `runs` runs of `run_bytes`, `stride` bytes apart. A box of a blocked dim
// d is one run per index of the dims before d (each run: the block's extent of d times every later
// dim); any other box is one run. Saves pack a box from this directly into the snapshot or the
// write buffers, without a packed copy of the view first.
struct BoxBytes {
  const std::byte* base = nullptr;
  std::uint64_t runs = 1, run_bytes = 0, stride = 0;
  std::uint64_t bytes() const { return runs * run_bytes; }
  // Calls fn(pointer, n) for each run in order.
  template <class Fn>
  void for_each_run(Fn&& fn) const {
    for (std::uint64_t r = 0; r < runs; ++r) fn(base + r * stride, run_bytes);
  }
};
BoxBytes box_bytes(const Tensor& local, const LocalBox& lb);

// The hash of one piece, XXH3-128, which the manifest records per piece and every read checks. (The
// files' SHA-256 is the content hash a user can check with sha256sum; a piece hash must be cheap
// enough to compute on every save and every partial read.) hex() is the manifest's "xxh3".
using PieceHash = io::Xxh128;

}  // namespace meshgrad::checkpoint
