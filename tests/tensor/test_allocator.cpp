// The caching allocator behind Storage: freed blocks are reused, size classes bound the waste,
// the cache limit holds, and concurrent use from many threads is safe (this file runs under
// ThreadSanitizer in `make test-tsan`).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "meshgrad/tensor/allocator.hpp"
#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad {
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

}  // namespace
}  // namespace meshgrad
