#include "meshgrad/tensor/allocator.hpp"

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <iterator>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

namespace meshgrad::memory {

namespace {

constexpr std::size_t kAlign = 64;

struct Cache {
  std::mutex mu;
  std::unordered_map<std::size_t, std::vector<void*>> free_lists;   // size class -> blocks
  std::size_t cached_bytes = 0;
  std::size_t limit = std::size_t{2} << 30;
  std::size_t hits = 0, misses = 0;

  // Frees cached blocks until cached_bytes <= target. Caller holds mu.
  void shrink_to(std::size_t target) {
    for (auto it = free_lists.begin(); it != free_lists.end() && cached_bytes > target;) {
      std::vector<void*>& blocks = it->second;
      while (!blocks.empty() && cached_bytes > target) {
        std::free(blocks.back());
        blocks.pop_back();
        cached_bytes -= it->first;
      }
      it = blocks.empty() ? free_lists.erase(it) : std::next(it);
    }
  }
};

// Never destroyed: tensors in static storage may be freed after other statics are gone.
Cache& cache() {
  static Cache* c = new Cache();
  return *c;
}

}  // namespace

std::size_t size_class(std::size_t nbytes) {
  if (nbytes <= 4 * kAlign) return kAlign * ((std::max<std::size_t>(nbytes, 1) + kAlign - 1) / kAlign);
  // Four classes per power of two: [2^k, 2^(k+1)) rounds up to a multiple of 2^(k-2).
  const std::size_t step = std::bit_floor(nbytes) / 4;
  return (nbytes + step - 1) / step * step;
}

void* allocate(std::size_t nbytes) {
  const std::size_t bytes = size_class(nbytes);
  Cache& c = cache();
  {
    std::lock_guard<std::mutex> lock(c.mu);
    auto it = c.free_lists.find(bytes);
    if (it != c.free_lists.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      c.cached_bytes -= bytes;
      ++c.hits;
      return p;
    }
    ++c.misses;
  }
  void* p = std::aligned_alloc(kAlign, bytes);
  if (p == nullptr) {   // memory is short: give the cache back and try once more
    release_cached();
    p = std::aligned_alloc(kAlign, bytes);
    if (p == nullptr) throw std::bad_alloc();
  }
  return p;
}

void deallocate(void* p, std::size_t nbytes) {
  if (p == nullptr) return;
  const std::size_t bytes = size_class(nbytes);
  Cache& c = cache();
  {
    std::lock_guard<std::mutex> lock(c.mu);
    if (c.cached_bytes + bytes <= c.limit) {
      c.free_lists[bytes].push_back(p);
      c.cached_bytes += bytes;
      return;
    }
  }
  std::free(p);
}

CacheStats cache_stats() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return {c.cached_bytes, c.hits, c.misses};
}

void release_cached() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  c.shrink_to(0);
}

void set_cache_limit(std::size_t bytes) {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  c.limit = bytes;
  c.shrink_to(bytes);
}

std::size_t cache_limit() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.limit;
}

}  // namespace meshgrad::memory
