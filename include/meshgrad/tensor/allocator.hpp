// The caching allocator behind tensor storage. Training frees and reallocates the same
// activation and gradient buffers every step; handing a freed block back from a free list
// avoids the system allocator's mmap / munmap of large blocks and the first-touch page faults
// that followed (the profile showed clear_page_erms among the top entries). It does not change
// the process's malloc policy (no mallopt): blocks come from std::aligned_alloc.
//
// Blocks are 64-byte aligned and rounded up to a size class (4 classes per power of two, so at
// most 25% is wasted); a freed block goes to its class's free list unless the cache would then
// exceed its limit, in which case it is returned to the system. One global cache under a mutex:
// thread-safe, and rank threads of the threads backend share freed blocks.
#pragma once

#include <cstddef>

namespace meshgrad::memory {

// A block of at least nbytes (>= 1 byte is allocated for nbytes == 0), 64-byte aligned, counted in
// the calling thread's accounting domain (below). Throws std::bad_alloc when the system has no
// memory even after the cache was released.
void* allocate(std::size_t nbytes);
// Gives back a block from allocate(nbytes) (the same nbytes), uncounting it from `domain`: the
// domain it was allocated in (Storage remembers it), whichever thread frees it. The form without a
// domain uses the calling thread's. p == nullptr is ignored.
// Never throws (destructors call it): a block the cache cannot keep is freed.
void deallocate(void* p, std::size_t nbytes, int domain) noexcept;
void deallocate(void* p, std::size_t nbytes) noexcept;

// The size class allocate(nbytes) rounds to.
std::size_t size_class(std::size_t nbytes);

struct CacheStats {
  std::size_t cached_bytes = 0;   // in free lists now
  std::size_t hits = 0;           // allocations served from a free list (since the start)
  std::size_t misses = 0;         // allocations that went to the system
};
CacheStats cache_stats();
// Returns every cached block to the system.
void release_cached();
// Most bytes kept in free lists (default 2 GiB); lowering it releases the excess now.
void set_cache_limit(std::size_t bytes);
std::size_t cache_limit();

// ---- accounting -----------------------------------------------------------------------------------
// The bytes of live blocks (size-class bytes handed out, not yet given back) are counted per
// accounting domain, with their peak. A thread allocates into its current domain: 0 unless set with
// ScopedDomain. The threads backend runs ranks as threads of one process; giving each rank thread
// its own domain (as `meshgrad bench memory` does) makes a domain's peak that rank's peak.
inline constexpr int kMaxDomains = 256;

int current_domain();
// Sets the calling thread's domain (0 <= domain < kMaxDomains) until the scope ends.
class ScopedDomain {
 public:
  explicit ScopedDomain(int domain);
  ~ScopedDomain();
  ScopedDomain(const ScopedDomain&) = delete;
  ScopedDomain& operator=(const ScopedDomain&) = delete;

 private:
  int previous_;
};

struct MemoryStats {
  std::size_t live_bytes = 0;      // held by blocks handed out now
  std::size_t peak_bytes = 0;      // the most held at once since the start or the last reset_peaks()
  std::size_t allocations = 0;     // blocks handed out since the start
};
MemoryStats domain_stats(int domain);
// Every domain together (the peak is of the sum, not the sum of the peaks), and the peak of live +
// cached bytes: what the allocator held from the system at most.
struct TotalMemoryStats : MemoryStats {
  std::size_t peak_reserved_bytes = 0;
};
TotalMemoryStats total_stats();
// Every peak (the domains', the total's and the reserved one) drops to the current value.
void reset_peaks();
// One domain's peak drops to its current value (the others are untouched).
void reset_peak(int domain);

}  // namespace meshgrad::memory
