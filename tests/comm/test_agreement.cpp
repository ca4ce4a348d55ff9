// Ranks agree on a failure before any of them waits on the others (comm/agreement.hpp): every rank
// learns the lowest failed rank and its message; the failed rank keeps its exception's type.
#include <gtest/gtest.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "meshgrad/comm/agreement.hpp"
#include "meshgrad/comm/threads.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad::comm::test_agreement {
namespace {

void run3(const std::function<void(Communicator&)>& fn) {
  ThreadsOptions options;
  options.timeout = std::chrono::milliseconds(20000);
  run_ranks(3, [&](const CommunicatorPtr& world) { fn(*world); }, options);
}

TEST(Agreement, EveryRankLearnsTheLowestFailedRankAndItsMessage) {
  std::vector<std::optional<RankFailure>> seen(3);
  run3([&](Communicator& c) {
    const std::string error = c.rank() >= 1 ? "disk of rank " + std::to_string(c.rank()) + " is full" : "";
    seen[static_cast<std::size_t>(c.rank())] = first_failure(c, error);
  });
  for (const auto& f : seen) {
    ASSERT_TRUE(f.has_value());
    EXPECT_EQ(f->rank, 1);
    EXPECT_EQ(f->message, "disk of rank 1 is full");
  }
  run3([&](Communicator& c) { seen[static_cast<std::size_t>(c.rank())] = first_failure(c, ""); });
  for (const auto& f : seen) EXPECT_FALSE(f.has_value());
}

struct DiskFull : Error {
  using Error::Error;
};

TEST(Agreement, RunAgreedRethrowsTheOwnErrorAndGivesTheOthersItsMessage) {
  std::vector<std::string> kinds(3), messages(3);
  run3([&](Communicator& c) {
    try {
      run_agreed(c, [&] {
        if (c.rank() == 2) throw DiskFull("rank 2: no space left on device");
      });
      kinds[static_cast<std::size_t>(c.rank())] = "none";
    } catch (const DiskFull& e) {
      kinds[static_cast<std::size_t>(c.rank())] = "own";
      messages[static_cast<std::size_t>(c.rank())] = e.what();
    } catch (const InvalidArgument& e) {
      kinds[static_cast<std::size_t>(c.rank())] = "invalid";
    } catch (const Error& e) {
      kinds[static_cast<std::size_t>(c.rank())] = "error";
      messages[static_cast<std::size_t>(c.rank())] = e.what();
    }
  });
  EXPECT_EQ(kinds, (std::vector<std::string>{"error", "error", "own"}));
  for (const std::string& m : messages) EXPECT_EQ(m, "rank 2: no space left on device");
  // Bad input on one rank is bad input on every rank.
  run3([&](Communicator& c) {
    try {
      run_agreed(c, [&] {
        if (c.rank() == 0) throw InvalidArgument("--data: no such file");
      });
      kinds[static_cast<std::size_t>(c.rank())] = "none";
    } catch (const InvalidArgument& e) {
      kinds[static_cast<std::size_t>(c.rank())] = e.what();
    }
  });
  for (const std::string& k : kinds) EXPECT_EQ(k, "--data: no such file");
}

}  // namespace
}  // namespace meshgrad::comm::test_agreement
