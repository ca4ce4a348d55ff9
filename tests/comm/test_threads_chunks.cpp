// The threads backend's chunked data phase (all_reduce, all_gather, reduce_scatter): chunks are
// claimed by whichever ranks run, a rank leaves when every chunk is done, and each rank's published
// call lives in one of two slots by sequence parity. These tests run many collectives back to back
// with ranks that arrive late at random (so the ranks that run take over the late ones' chunks and
// leave before them), mixed with the ops that keep an exit rendezvous, and check every result; and
// one collective large enough to use streaming stores; small collectives back to back on the eager
// path (inputs staged in the slots, one rendezvous, no exit wait), whose staging is reused two
// collectives later, and its bits against the chunked path's. Under ThreadSanitizer (make test-tsan) they
// also check that no buffer or slot is touched after its owner moved on.
#include <gtest/gtest.h>

#include <bit>
#include <chrono>
#include <cstdint>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "meshgrad/comm/threads.hpp"
#include "meshgrad/tensor/shard.hpp"

namespace meshgrad::comm::test_threads_chunks {
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

// Eager sizes (whole buffer <= 4 KiB, all_reduce 2 KiB) back to back with no pause: a rank leaves as soon as its own
// output is written, so a fast rank is often one collective ahead of a slow one and rewrites its
// staging of two collectives back. Every value depends on the round, so a stale or overwritten
// staged input shows as a wrong result. In place, uneven counts, empty shards and chunked sizes mixed in.
TEST(ThreadsChunks, EagerSizesBackToBackKeepEveryResult) {
  for (int P : {2, 3, 4}) {
    const int rounds = P == 2 ? 4000 : 1500;
    std::vector<int> wrong(static_cast<std::size_t>(P), 0);
    run_ranks(P, [&](const CommunicatorPtr& c) {
      const int r = c->rank();
      for (int round = 0; round < rounds; ++round) {
        const std::size_t n = round % 50 == 49 ? std::size_t(P) * 3000 : std::size_t(P) * (1 + round % 97) * 5;
        std::vector<float> in(n), out(n, -1.0f);
        for (std::size_t i = 0; i < n; ++i) in[i] = v(r, i, round);
        switch (round % 4) {
          case 0: {  // in place
            c->all_reduce(buffer(std::span<const float>(in)), buffer(std::span<float>(in)), ReduceOp::Sum);
            for (std::size_t i = 0; i < n; ++i) {
              wrong[r] += in[i] != float(P * (P + 1) / 2) + float(P) * float((i + std::size_t(round)) % 7);
            }
            break;
          }
          case 1: {  // uneven counts, rank 0's empty every other time
            std::vector<std::size_t> counts(static_cast<std::size_t>(P), n / std::size_t(P));
            if (round % 8 == 1) { counts[1] += counts[0]; counts[0] = 0; }
            std::vector<float> mine(counts[r]);
            for (std::size_t i = 0; i < mine.size(); ++i) mine[i] = v(r, i, round);
            c->all_gather(buffer(std::span<const float>(mine)), buffer(std::span<float>(out)), counts);
            std::size_t i = 0;
            for (int q = 0; q < P; ++q) {
              for (std::size_t k = 0; k < counts[q]; ++k, ++i) wrong[r] += out[i] != v(q, k, round);
            }
            break;
          }
          case 2: {
            std::vector<std::size_t> counts(static_cast<std::size_t>(P), n / std::size_t(P));
            if (round % 8 == 2) { counts[P - 1] += counts[0]; counts[0] = 0; }
            std::vector<float> mine(counts[r], -1.0f);
            c->reduce_scatter(buffer(std::span<const float>(in)), buffer(std::span<float>(mine)), ReduceOp::Sum,
                              counts);
            const std::size_t first = std::accumulate(counts.begin(), counts.begin() + r, std::size_t{0});
            for (std::size_t i = 0; i < counts[r]; ++i) {
              wrong[r] += mine[i] != float(P * (P + 1) / 2) + float(P) * float((first + i + std::size_t(round)) % 7);
            }
            break;
          }
          default: {
            c->all_reduce(buffer(std::span<const float>(in)), buffer(std::span<float>(out)), ReduceOp::Max);
            for (std::size_t i = 0; i < n; ++i) wrong[r] += out[i] != v(P - 1, i, round);
          }
        }
      }
    }, short_deadline());
    for (int r = 0; r < P; ++r) EXPECT_EQ(wrong[r], 0) << "P=" << P << " rank " << r;
  }
}

// The eager path and the chunked path sum in the same (rank) order: the same bits. Random floats
// (sums that round): an all_reduce of 512 elements (2 KiB: eager) and a reduce_scatter of 1023
// (4 KiB: eager) against the same values in 40,000-element buffers (chunked).
TEST(ThreadsChunks, EagerAndChunkedSumsAreBitwiseEqual) {
  const int P = 3;
  const std::size_t small = 512, large = 40000;
  std::vector<std::vector<float>> inputs(P), eager(P), chunked(P), scattered(P), scattered_large(P);
  run_ranks(P, [&](const CommunicatorPtr& c) {
    const int r = c->rank();
    std::mt19937 rng(77u + unsigned(r));
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<float>& in = inputs[r];
    in.resize(large);
    for (float& x : in) x = dist(rng);
    eager[r].assign(small, 0.0f);
    chunked[r].assign(large, 0.0f);
    c->all_reduce(buffer(std::span<const float>(in.data(), small)), buffer(std::span<float>(eager[r])), ReduceOp::Sum);
    c->all_reduce(buffer(std::span<const float>(in)), buffer(std::span<float>(chunked[r])), ReduceOp::Sum);
    const std::size_t small_shard = 341, large_shard = large / P;  // 1023 = 3 x 341 elements
    scattered[r].assign(small_shard, 0.0f);
    scattered_large[r].assign(large_shard, 0.0f);
    std::vector<float> rs_small(in.begin(), in.begin() + std::ptrdiff_t(small_shard * P));
    c->reduce_scatter(buffer(std::span<const float>(rs_small)), buffer(std::span<float>(scattered[r])), ReduceOp::Sum);
    // The large input: rank q's shard starts with the same values as in the small one.
    std::vector<float> rs_large(large_shard * P);
    for (int q = 0; q < P; ++q) {
      std::copy(in.begin() + std::ptrdiff_t(q * small_shard), in.begin() + std::ptrdiff_t((q + 1) * small_shard),
                rs_large.begin() + std::ptrdiff_t(q * large_shard));
    }
    c->reduce_scatter(buffer(std::span<const float>(rs_large)), buffer(std::span<float>(scattered_large[r])),
                      ReduceOp::Sum);
  }, short_deadline());
  std::size_t order_matters = 0;  // elements whose sum in another order has other bits
  for (std::size_t i = 0; i < small; ++i) {
    const float in_rank_order = (inputs[0][i] + inputs[1][i]) + inputs[2][i];
    order_matters += in_rank_order != (inputs[2][i] + inputs[1][i]) + inputs[0][i];
    ASSERT_EQ(std::bit_cast<std::uint32_t>(eager[0][i]), std::bit_cast<std::uint32_t>(in_rank_order)) << i;
  }
  EXPECT_GT(order_matters, 20u);
  for (int r = 0; r < P; ++r) {
    for (std::size_t i = 0; i < small; ++i) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(eager[r][i]), std::bit_cast<std::uint32_t>(chunked[r][i]))
          << "rank " << r << " element " << i;
    }
    for (std::size_t i = 0; i < scattered[r].size(); ++i) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(scattered[r][i]), std::bit_cast<std::uint32_t>(scattered_large[r][i]))
          << "rank " << r << " shard element " << i;
    }
  }
}

}  // namespace
}  // namespace meshgrad::comm::test_threads_chunks
