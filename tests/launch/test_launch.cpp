// Unit tests of the launch API (launch/launch.hpp): the BLAS thread policy of launched ranks and the
// start-up agreement of ranks on their options. The --mesh grammar is tested in tests/distributed.
#include <gtest/gtest.h>

#include <stdlib.h>

#include <chrono>
#include <functional>

#include <atomic>
#include <mutex>
#include <vector>
#include <string>

#include "meshgrad/launch/launch.hpp"
#include "meshgrad/comm/threads.hpp"
#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/error.hpp"

namespace test_launch {

using namespace meshgrad;

namespace {
// setenv for one test (each test runs in its own process under ctest; restored anyway).
struct EnvGuard {
  std::string name;
  EnvGuard(std::string n, const char* value) : name(std::move(n)) { setenv(name.c_str(), value, 1); }
  ~EnvGuard() { unsetenv(name.c_str()); }
};
}  // namespace

TEST(Launch, ThreadsRanksShareTheCoresForBlas) {
  blas::set_num_threads(1);
  std::atomic<int> seen{-1};
  launch::run_on_backend("threads", 2, [&](const comm::CommunicatorPtr& world) {
    if (world->rank() == 0) seen = blas::num_threads();
  });
  EXPECT_EQ(seen.load(), std::max(1, blas::available_cores() / 2));
  EXPECT_EQ(blas::num_threads(), 1) << "restored after the ranks finished";
}

TEST(Launch, RanksOnThisNodeFromTheMpiLauncher) {
  unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  unsetenv("MPI_LOCALNRANKS");
  EXPECT_EQ(launch::mpi_ranks_on_this_node(8), 8) << "unknown: assume all on this node";
  EnvGuard local("OMPI_COMM_WORLD_LOCAL_SIZE", "2");
  EXPECT_EQ(launch::mpi_ranks_on_this_node(8), 2);
}

TEST(Launch, ThreadsBackendUnderMpirunIsRefused) {
  unsetenv("PMI_SIZE");
  {
    EnvGuard one("OMPI_COMM_WORLD_SIZE", "1");   // mpirun -np 1: one process, nothing duplicated
    EXPECT_EQ(launch::run_on_backend("threads", 1, [](const comm::CommunicatorPtr&) {}), 0);
  }
  EnvGuard two("OMPI_COMM_WORLD_SIZE", "2");
  EXPECT_EQ(launch::mpi_launcher_world_size(), 2);
  bool ran = false;
  try {
    launch::run_on_backend("threads", 2, [&](const comm::CommunicatorPtr&) { ran = true; });
    FAIL() << "ran the threads backend under mpirun";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("add `--backend mpi`"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(ran);
}

namespace {

// Runs agree_on_options on P rank threads, rank r with options_of(r); returns each rank's error
// message ("" when it passed).
std::vector<std::string> agreement_errors(int P, const std::function<std::vector<launch::OptionValue>(int)>& options_of) {
  std::vector<std::string> errors(static_cast<std::size_t>(P));
  std::mutex m;
  comm::ThreadsOptions o;
  o.timeout = std::chrono::milliseconds(20000);
  comm::run_ranks(P, [&](const comm::CommunicatorPtr& world) {
    try {
      launch::agree_on_options(*world, options_of(world->rank()));
    } catch (const InvalidArgument& e) {
      std::lock_guard lock(m);
      errors[static_cast<std::size_t>(world->rank())] = e.what();
    }
  }, o);
  return errors;
}

}  // namespace

TEST(OptionAgreement, SameOptionsPass) {
  const std::vector<launch::OptionValue> same{{"command", "train"}, {"--hidden", "32"}, {"--data", ""}};
  for (const auto& e : agreement_errors(3, [&](int) { return same; })) EXPECT_EQ(e, "");
}

TEST(OptionAgreement, DifferentValueNamesOptionAndBothValues) {
  auto options_of = [](int rank) {
    return std::vector<launch::OptionValue>{{"command", "train"}, {"--seed", "1"}, {"--hidden", rank == 2 ? "64" : "32"}};
  };
  const auto errors = agreement_errors(3, options_of);
  // Every rank fails (none may go on to build a model), each naming the option and the values.
  EXPECT_NE(errors[2].find("--hidden is '32' on rank 0 but '64' on rank 2"), std::string::npos) << errors[2];
  EXPECT_NE(errors[0].find("--hidden is '32' on rank 0 but '64' on rank 2"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("--hidden is '32' on rank 0 but '64' on rank 2"), std::string::npos) << errors[1];
  EXPECT_NE(errors[1].find("1 of 3 ranks differ"), std::string::npos) << errors[1];
}

TEST(OptionAgreement, MissingOptionAndOtherCommand) {
  const auto errors = agreement_errors(2, [](int rank) {
    std::vector<launch::OptionValue> o{{"command", rank == 0 ? "train" : "check"}, {"--steps", "5"}};
    if (rank == 0) o.push_back({"--metrics", "m.jsonl"});
    return o;
  });
  EXPECT_NE(errors[1].find("command is 'train' on rank 0 but 'check' on rank 1"), std::string::npos) << errors[1];
  const auto missing = agreement_errors(2, [](int rank) {
    std::vector<launch::OptionValue> o{{"command", "train"}};
    if (rank == 1) o.push_back({"--sequence-parallel", "true"});
    return o;
  });
  EXPECT_NE(missing[0].find("--sequence-parallel is absent on rank 0 but 'true' on rank 1"), std::string::npos)
      << missing[0];
}

}  // namespace test_launch
