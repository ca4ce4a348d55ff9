// Rank pinning of the threads backend (ThreadsOptions::pin, MESHGRAD_PIN_RANKS): which core each rank
// gets, and that a pinned rank (and the progress thread it starts) really runs on that core only.
#include <gtest/gtest.h>
#include <sched.h>

#include <cstdlib>
#include <mutex>
#include <vector>

#include "meshgrad/comm/threads.hpp"

namespace meshgrad::comm::test_threads_pinning {
namespace {

TEST(ThreadsPinning, AutoPinsOnlyWhenRanksFillTheCores) {
  const std::vector<int> cores{0, 2, 5};
  EXPECT_TRUE(rank_cores(PinRanks::Auto, 2, 0, cores).empty());    // 2 ranks, 3 cores: float
  EXPECT_EQ(rank_cores(PinRanks::Auto, 3, 1, cores), std::vector<int>{2});
  EXPECT_EQ(rank_cores(PinRanks::Auto, 4, 3, cores), std::vector<int>{0});   // wraps round the cores
  EXPECT_EQ(rank_cores(PinRanks::On, 2, 1, cores), std::vector<int>{2});
  EXPECT_TRUE(rank_cores(PinRanks::Off, 8, 1, cores).empty());
  EXPECT_TRUE(rank_cores(PinRanks::On, 2, 1, {}).empty());
}

TEST(ThreadsPinning, EnvironmentChoosesThePolicyAndRefusesNonsense) {
  ::setenv("MESHGRAD_PIN_RANKS", "off", 1);
  EXPECT_EQ(pin_ranks_from_env(), PinRanks::Off);
  ::setenv("MESHGRAD_PIN_RANKS", "on", 1);
  EXPECT_EQ(pin_ranks_from_env(), PinRanks::On);
  ::setenv("MESHGRAD_PIN_RANKS", "sometimes", 1);
  EXPECT_THROW(pin_ranks_from_env(), InvalidArgument);
  ::unsetenv("MESHGRAD_PIN_RANKS");
  EXPECT_EQ(pin_ranks_from_env(), PinRanks::Auto);
}

// The affinity each rank thread sees is exactly its core under On, and the whole process's under Off.
TEST(ThreadsPinning, PinnedRanksRunOnTheirCore) {
  cpu_set_t process;
  CPU_ZERO(&process);
  ASSERT_EQ(sched_getaffinity(0, sizeof(process), &process), 0);
  std::vector<int> cores;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &process)) cores.push_back(c);
  }
  for (const PinRanks pin : {PinRanks::On, PinRanks::Off}) {
    ThreadsOptions options;
    options.pin = pin;
    std::mutex m;
    std::vector<std::vector<int>> seen(3);
    run_ranks(3, [&](const CommunicatorPtr& comm) {
      cpu_set_t set;
      CPU_ZERO(&set);
      ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
      std::lock_guard lock(m);
      for (int c = 0; c < CPU_SETSIZE; ++c) {
        if (CPU_ISSET(c, &set)) seen[static_cast<std::size_t>(comm->rank())].push_back(c);
      }
    }, options);
    for (int r = 0; r < 3; ++r) {
      const std::vector<int> want = pin == PinRanks::On ? std::vector<int>{cores[static_cast<std::size_t>(r) % cores.size()]}
                                                        : cores;
      EXPECT_EQ(seen[static_cast<std::size_t>(r)], want) << "rank " << r << (pin == PinRanks::On ? " pinned" : " free");
    }
  }
}

}  // namespace
}  // namespace meshgrad::comm::test_threads_pinning
