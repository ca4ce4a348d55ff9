// The threads backend's chunked data phase (all_reduce, all_gather, reduce_scatter): chunks are
// claimed by whichever ranks run, a rank leaves when every chunk is done, and each rank's published
// call lives in one of two slots by sequence parity. These tests run many collectives back to back
// with ranks that arrive late at random (so the ranks that run take over the late ones' chunks and
// leave before them), mixed with the ops that keep an exit rendezvous, and check every result; and
// one collective large enough to use streaming stores. Under ThreadSanitizer (make test-tsan) they
// also check that no buffer or slot is touched after its owner moved on.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "meshgrad/comm/threads.hpp"
#include "meshgrad/tensor/shard.hpp"

namespace meshgrad::comm {
namespace {

ThreadsOptions short_deadline() {
  ThreadsOptions o;
  o.timeout = std::chrono::seconds(20);
  return o;
}

// Exact in float: small integers.
float v(int rank, std::size_t i, int round) { return float(rank + 1) + float((i + std::size_t(round)) % 7); }

TEST(ThreadsChunks, LateRanksAndMixedOpsKeepEveryResult) {
  for (int P : {2, 3, 4}) {
    constexpr int kRounds = 60;
    std::vector<int> wrong(static_cast<std::size_t>(P), 0);
    run_ranks(P, [&](const CommunicatorPtr& c) {
      const int r = c->rank();
      std::mt19937 rng(1234u + unsigned(r));
      for (int round = 0; round < kRounds; ++round) {
        // Sizes from one chunk to a few per rank (chunks are >= 16 KiB); a late rank now and then.
        const std::size_t n = std::size_t(P) * (1000 + 7919 * std::size_t(round % 5));
        if (rng() % 3 == 0) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 300));
        std::vector<float> in(n), out(n, -1.0f);
        for (std::size_t i = 0; i < n; ++i) in[i] = v(r, i, round);
        switch (round % 4) {
          case 0: {
            c->all_reduce(buffer(std::span<const float>(in)), buffer(std::span<float>(out)), ReduceOp::Sum);
            for (std::size_t i = 0; i < n; ++i) {
              wrong[r] += out[i] != float(P * (P + 1) / 2) + float(P) * float((i + std::size_t(round)) % 7);
            }
            break;
          }
          case 1: {
            const std::size_t shard = n / std::size_t(P);
            std::vector<float> mine(in.begin(), in.begin() + std::ptrdiff_t(shard));
            c->all_gather(buffer(std::span<const float>(mine)), buffer(std::span<float>(out)));
            for (std::size_t i = 0; i < n; ++i) wrong[r] += out[i] != v(int(i / shard), i % shard, round);
            break;
          }
          case 2: {
            const std::size_t shard = n / std::size_t(P);
            std::vector<float> mine(shard, -1.0f);
            c->reduce_scatter(buffer(std::span<const float>(in)), buffer(std::span<float>(mine)), ReduceOp::Sum);
            for (std::size_t i = 0; i < shard; ++i) {
              const std::size_t g = std::size_t(r) * shard + i;
              wrong[r] += mine[i] != float(P * (P + 1) / 2) + float(P) * float((g + std::size_t(round)) % 7);
            }
            break;
          }
          default: {  // an op with an exit rendezvous between chunked ones
            c->broadcast(buffer(std::span<float>(in)), round % P);
            for (std::size_t i = 0; i < n; ++i) wrong[r] += in[i] != v(round % P, i, round);
          }
        }
        // Buffers die here, right after the call: a rank still reading them would show under TSan.
      }
    }, short_deadline());
    for (int r = 0; r < P; ++r) EXPECT_EQ(wrong[r], 0) << "P=" << P << " rank " << r;
  }
}

// 2 ranks x 4.5 M floats: an all_gather's working set (18 MiB of inputs, 36 MiB of outputs) is past
// the 32 MiB from which the backend streams its stores; likewise the reduce_scatter's.
TEST(ThreadsChunks, StreamingSizesAreExact) {
  const int P = 2;
  const std::size_t n = 9 * (std::size_t(1) << 20) + 13;   // odd: the last chunk is not whole vectors
  std::vector<std::size_t> counts{n / 2 - 5, n - (n / 2 - 5)};
  std::vector<std::size_t> wrong(P, 0);
  run_ranks(P, [&](const CommunicatorPtr& c) {
    const int r = c->rank();
    std::vector<float> mine(counts[r]), out(n);
    for (std::size_t i = 0; i < mine.size(); ++i) mine[i] = v(r, i, 0);
    c->all_gather(buffer(std::span<const float>(mine)), buffer(std::span<float>(out)), counts);
    for (std::size_t i = 0; i < n; ++i) {
      const int q = i < counts[0] ? 0 : 1;
      wrong[r] += out[i] != v(q, q == 0 ? i : i - counts[0], 0);
    }
    std::vector<float> in(n), shard(counts[r]);
    for (std::size_t i = 0; i < n; ++i) in[i] = v(r, i, 1);
    c->reduce_scatter(buffer(std::span<const float>(in)), buffer(std::span<float>(shard)), ReduceOp::Sum, counts);
    const std::size_t first = r == 0 ? 0 : counts[0];
    for (std::size_t i = 0; i < counts[r]; ++i) wrong[r] += shard[i] != 3.0f + 2.0f * float((first + i + 1) % 7);
  }, short_deadline());
  EXPECT_EQ(wrong[0], 0u);
  EXPECT_EQ(wrong[1], 0u);
}

}  // namespace
}  // namespace meshgrad::comm
