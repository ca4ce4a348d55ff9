// The caching allocator behind Storage: freed blocks are reused, size classes bound the waste,
// the cache limit holds, and concurrent use from many threads is safe (this file runs under
// ThreadSanitizer in `make test-tsan`).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <thread>
#include <vector>

#include "meshgrad/tensor/allocator.hpp"
#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::test_allocator {
namespace {

TEST(Allocator, SizeClassesAreAlignedAndWasteAtMostAQuarter) {
  EXPECT_EQ(memory::size_class(0), 64u);
  EXPECT_EQ(memory::size_class(1), 64u);
  EXPECT_EQ(memory::size_class(65), 128u);
  EXPECT_EQ(memory::size_class(1000), 1024u);
  EXPECT_EQ(memory::size_class(1025), 1280u);
  for (std::size_t n = 1; n < (std::size_t{1} << 26); n = n * 3 + 7) {
    const std::size_t c = memory::size_class(n);
    EXPECT_GE(c, n);
    EXPECT_EQ(c % 64, 0u) << n;
    if (n > 256) {
      EXPECT_LE(c, n + n / 4) << n;
    }
  }
}

TEST(Allocator, FreedTensorStorageIsReusedForTheSameSize) {
  void* first = nullptr;
  {
    Tensor a = Tensor::empty({1000, 37}, DType::Float32);
    first = a.data<float>();
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(first) % 64, 0u);
  }
  const memory::CacheStats before = memory::cache_stats();
  Tensor b = Tensor::empty({37, 1000}, DType::Float32);   // same bytes, other shape
  EXPECT_EQ(static_cast<void*>(b.data<float>()), first);
  EXPECT_EQ(memory::cache_stats().hits, before.hits + 1);
}

TEST(Allocator, CacheLimitReturnsBlocksToTheSystem) {
  const std::size_t old_limit = memory::cache_limit();
  memory::release_cached();
  memory::set_cache_limit(1 << 20);
  {
    std::vector<Tensor> held;
    for (int i = 0; i < 8; ++i) held.push_back(Tensor::empty({256 * 1024}, DType::Float32));   // 1 MiB each
  }
  EXPECT_LE(memory::cache_stats().cached_bytes, std::size_t{1} << 20);
  memory::set_cache_limit(0);
  EXPECT_EQ(memory::cache_stats().cached_bytes, 0u);
  memory::set_cache_limit(old_limit);
}

// Threads allocate, write, check and free blocks of a few sizes at once; a block handed to two
// threads at the same time would show as a wrong value (and as a race under TSan).
TEST(Allocator, ConcurrentUseIsSafe) {
  constexpr int kThreads = 4, kRounds = 300;
  std::vector<int> bad(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t, &bad] {
      for (int r = 0; r < kRounds; ++r) {
        const std::size_t bytes = 64 * static_cast<std::size_t>(1 + (r + t) % 5) * 1024;
        auto* p = static_cast<unsigned char*>(memory::allocate(bytes));
        std::memset(p, t + 1, bytes);
        std::this_thread::yield();
        for (std::size_t i = 0; i < bytes; i += 4096) bad[t] += p[i] != t + 1;
        memory::deallocate(p, bytes);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(bad[t], 0) << "thread " << t;
}

// Accounting: a block counts in the domain of the thread that allocated it until it is given back,
// whichever thread frees it; the peak is the most held at once.
TEST(Allocator, DomainsCountLiveBytesAndPeaksPerThreadDomain) {
  constexpr int kA = 201, kB = 202;   // domains no other test uses
  const std::size_t a0 = memory::domain_stats(kA).live_bytes, b0 = memory::domain_stats(kB).live_bytes;
  const std::size_t bytes = memory::size_class(3 * 1000 * 4);
  std::optional<Tensor> held;
  {
    memory::ScopedDomain domain(kA);
    EXPECT_EQ(memory::current_domain(), kA);
    Tensor t1 = Tensor::empty({3, 1000}, DType::Float32);
    Tensor t2 = Tensor::empty({3, 1000}, DType::Float32);
    EXPECT_EQ(memory::domain_stats(kA).live_bytes, a0 + 2 * bytes);
    held = t1;
  }   // t2 freed: back to one block
  EXPECT_EQ(memory::current_domain(), 0);
  EXPECT_EQ(memory::domain_stats(kA).live_bytes, a0 + bytes);
  EXPECT_GE(memory::domain_stats(kA).peak_bytes, a0 + 2 * bytes);
  // Freed on another thread, in another domain: still uncounted from kA, never from kB.
  std::thread([&] {
    memory::ScopedDomain domain(kB);
    held.reset();
  }).join();
  EXPECT_EQ(memory::domain_stats(kA).live_bytes, a0);
  EXPECT_EQ(memory::domain_stats(kB).live_bytes, b0);
  {
    memory::ScopedDomain domain(kB);
    Tensor t = Tensor::empty({3, 1000}, DType::Float32);
  }
  EXPECT_GE(memory::domain_stats(kB).peak_bytes, b0 + bytes);
  memory::reset_peak(kB);   // only kB's
  EXPECT_EQ(memory::domain_stats(kB).peak_bytes, b0);
  EXPECT_GE(memory::domain_stats(kA).peak_bytes, a0 + 2 * bytes);
  memory::reset_peaks();
  EXPECT_EQ(memory::domain_stats(kA).peak_bytes, a0);
  const memory::TotalMemoryStats total = memory::total_stats();
  EXPECT_EQ(total.peak_bytes, total.live_bytes);
  EXPECT_GE(total.peak_reserved_bytes, total.live_bytes);
  EXPECT_THROW(memory::ScopedDomain(memory::kMaxDomains), InvalidArgument);
  EXPECT_THROW(memory::domain_stats(-1), InvalidArgument);
}

}  // namespace
}  // namespace meshgrad::test_allocator
