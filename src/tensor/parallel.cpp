#include "meshgrad/tensor/parallel.hpp"

#include <algorithm>
#include <exception>
#include <thread>
#include <vector>

#include "meshgrad/tensor/blas.hpp"

namespace meshgrad::parallel {

int workers_for(std::int64_t elements) {
  if (elements < kMinElements) return 1;
  return std::max(1, blas::num_threads());
}

void for_ranges(std::int64_t n, int workers, const std::function<void(std::int64_t, std::int64_t)>& fn) {
  const std::int64_t w = std::clamp<std::int64_t>(workers, 1, std::max<std::int64_t>(n, 1));
  if (w <= 1) {
    if (n > 0) fn(0, n);
    return;
  }
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(w));
  const auto run = [&](std::int64_t k) {
    const blas::SplitWorkScope split;   // products inside run on this thread alone
    try {
      fn(k * n / w, (k + 1) * n / w);
    } catch (...) {
      errors[static_cast<std::size_t>(k)] = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(w - 1));
  try {
    for (std::int64_t k = 1; k < w; ++k) threads.emplace_back(run, k);
  } catch (...) {   // no thread to be had (system limits): the ranges without one run here
    for (std::int64_t k = static_cast<std::int64_t>(threads.size()) + 1; k < w; ++k) run(k);
  }
  run(0);
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

void for_slabs(const std::vector<std::int64_t>& shape,
               const std::function<void(int dim, std::int64_t begin, std::int64_t end)>& fn) {
  std::int64_t elements = 1;
  for (const std::int64_t d : shape) elements *= d;
  int dim = 0;
  while (dim < static_cast<int>(shape.size()) && shape[static_cast<std::size_t>(dim)] == 1) ++dim;
  if (dim == static_cast<int>(shape.size())) {   // a scalar or all dims 1: one element
    fn(shape.empty() ? -1 : 0, 0, 1);
    return;
  }
  const std::int64_t size = shape[static_cast<std::size_t>(dim)];
  const int workers = workers_for(elements);
  if (workers <= 1 || size < 2) {
    fn(dim, 0, size);
    return;
  }
  for_ranges(size, workers, [&](std::int64_t b, std::int64_t e) { fn(dim, b, e); });
}

}  // namespace meshgrad::parallel
