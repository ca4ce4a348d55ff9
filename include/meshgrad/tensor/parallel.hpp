// Elementwise work split over the cores a rank owns.
//
// The launch policy (blas::ThreadsPerRank) gives each rank max(1, cores / ranks on the node) BLAS
// threads: that count is also how many cores the rank may use for its own loops. A single rank on a
// 2-core machine (tp=1) would otherwise run every LayerNorm, GELU, add and optimizer update on one
// core while OpenBLAS's second thread spins idle; with tp >= cores each rank has one thread and
// nothing here starts a thread.
//
// Only for independent pieces of work (elements, attention's (batch, head) pairs): each output is
// computed by the same code whichever thread computes it, so the bits never depend on the split
// (tests compare 1 and 2 threads bytewise). Reductions keep their own fixed order and are not split
// here.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace meshgrad::parallel {

// Below this many elements an op runs on the caller's thread: starting a thread costs 20-50 us, about
// what a 256 Ki-element elementwise pass takes.
inline constexpr std::int64_t kMinElements = std::int64_t{1} << 18;

// Threads an elementwise op over `elements` elements should use: 1 below kMinElements, else
// blas::num_threads() (at least 1).
int workers_for(std::int64_t elements);

// Runs fn(begin, end) over [0, n) cut into `workers` contiguous ranges of near-equal size, the first
// on the caller's thread and the others on threads started for this call; returns when all are done.
// An exception from any range is rethrown on the caller's thread (the first by range order).
void for_ranges(std::int64_t n, int workers, const std::function<void(std::int64_t, std::int64_t)>& fn);// Each range of a split over more than one worker runs inside a blas::SplitWorkScope: products
// there (attention's tiles) do not start threads of their own.

// Elementwise op over a tensor of `shape` in slabs: calls fn(dim, begin, end) for contiguous ranges
// [begin, end) of dimension `dim`, the first dimension of size > 1 (every dimension before it has
// size 1, so a slab is the sub-tensor with that index range and every other index full). The caller
// offsets each operand by begin * stride[dim]. One call fn(0, 0, size) or fn(-1, 0, 1) for a
// scalar when the op is small or the rank has one thread.
void for_slabs(const std::vector<std::int64_t>& shape,
               const std::function<void(int dim, std::int64_t begin, std::int64_t end)>& fn);

// The slab [begin, end) of dimension dim of a tensor of `full` shape, as for_slabs hands it out: its
// shape, and the element offset of its first element for an operand of given strides.
struct Slab {
  std::vector<std::int64_t> shape;
  int dim;
  std::int64_t begin;
  Slab(const std::vector<std::int64_t>& full, int d, std::int64_t b, std::int64_t e) : shape(full), dim(d), begin(b) {
    if (d >= 0) shape[static_cast<std::size_t>(d)] = e - b;
  }
  std::int64_t offset(const std::vector<std::int64_t>& strides) const {
    return dim >= 0 ? begin * strides[static_cast<std::size_t>(dim)] : 0;
  }
};

}  // namespace meshgrad::parallel
