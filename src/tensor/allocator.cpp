#include "meshgrad/tensor/allocator.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cstdlib>
#include <iterator>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include "meshgrad/tensor/error.hpp"

namespace meshgrad::memory {

namespace {

constexpr std::size_t kAlign = 64;

struct Cache {
  std::mutex mu;
  std::unordered_map<std::size_t, std::vector<void*>> free_lists;   // size class -> blocks
  std::size_t cached_bytes = 0;
  std::size_t limit = std::size_t{2} << 30;
  std::size_t hits = 0, misses = 0;
  // Accounting (allocator.hpp), under mu.
  std::array<MemoryStats, kMaxDomains> domains{};
  TotalMemoryStats total{};

  void count_in(int domain, std::size_t bytes) {
    MemoryStats& d = domains[static_cast<std::size_t>(domain)];
    d.live_bytes += bytes;
    d.peak_bytes = std::max(d.peak_bytes, d.live_bytes);
    ++d.allocations;
    total.live_bytes += bytes;
    total.peak_bytes = std::max(total.peak_bytes, total.live_bytes);
    ++total.allocations;
    total.peak_reserved_bytes = std::max(total.peak_reserved_bytes, total.live_bytes + cached_bytes);
  }
  void count_out(int domain, std::size_t bytes) {
    domains[static_cast<std::size_t>(domain)].live_bytes -= bytes;
    total.live_bytes -= bytes;
  }

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

thread_local int t_domain = 0;

}  // namespace

std::size_t size_class(std::size_t nbytes) {
  if (nbytes <= 4 * kAlign) return kAlign * ((std::max<std::size_t>(nbytes, 1) + kAlign - 1) / kAlign);
  // Four classes per power of two: [2^k, 2^(k+1)) rounds up to a multiple of 2^(k-2).
  const std::size_t step = std::bit_floor(nbytes) / 4;
  return (nbytes + step - 1) / step * step;
}

void* allocate(std::size_t nbytes) {
  const std::size_t bytes = size_class(nbytes);
  const int domain = t_domain;
  Cache& c = cache();
  {
    std::lock_guard<std::mutex> lock(c.mu);
    auto it = c.free_lists.find(bytes);
    if (it != c.free_lists.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      c.cached_bytes -= bytes;
      ++c.hits;
      c.count_in(domain, bytes);
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
  std::lock_guard<std::mutex> lock(c.mu);
  c.count_in(domain, bytes);
  return p;
}

// Called from destructors (Storage's), so it must not throw: when keeping the block in the cache
// would need memory the process does not have (a free list growing), the block is freed instead.
void deallocate(void* p, std::size_t nbytes, int domain) noexcept {
  if (p == nullptr) return;
  const std::size_t bytes = size_class(nbytes);
  Cache& c = cache();
  {
    std::lock_guard<std::mutex> lock(c.mu);
    c.count_out(domain, bytes);
    if (c.cached_bytes + bytes <= c.limit) {
      try {
        c.free_lists[bytes].push_back(p);
        c.cached_bytes += bytes;
        return;
      } catch (const std::bad_alloc&) {
        // out of memory for the list itself: fall through and give the block back
      }
    }
  }
  std::free(p);
}

void deallocate(void* p, std::size_t nbytes) noexcept { deallocate(p, nbytes, t_domain); }

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

int current_domain() { return t_domain; }

ScopedDomain::ScopedDomain(int domain) : previous_(t_domain) {
  MG_CHECK(domain >= 0 && domain < kMaxDomains, "memory::ScopedDomain: domain {} is out of range [0, {})", domain,
           kMaxDomains);
  t_domain = domain;
}

ScopedDomain::~ScopedDomain() { t_domain = previous_; }

MemoryStats domain_stats(int domain) {
  MG_CHECK(domain >= 0 && domain < kMaxDomains, "memory::domain_stats: domain {} is out of range [0, {})", domain,
           kMaxDomains);
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.domains[static_cast<std::size_t>(domain)];
}

TotalMemoryStats total_stats() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.total;
}

void reset_peaks() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  for (MemoryStats& d : c.domains) d.peak_bytes = d.live_bytes;
  c.total.peak_bytes = c.total.live_bytes;
  c.total.peak_reserved_bytes = c.total.live_bytes + c.cached_bytes;
}

void reset_peak(int domain) {
  MG_CHECK(domain >= 0 && domain < kMaxDomains, "memory::reset_peak: domain {} is out of range [0, {})", domain,
           kMaxDomains);
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  MemoryStats& d = c.domains[static_cast<std::size_t>(domain)];
  d.peak_bytes = d.live_bytes;
}

}  // namespace meshgrad::memory
