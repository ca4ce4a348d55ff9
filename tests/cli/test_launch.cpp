// Unit tests of tools/launch.cpp: the --mesh grammar, the BLAS thread policy of launched ranks and
// the start-up agreement of ranks on their options.
#include <gtest/gtest.h>

#include <stdlib.h>

#include <chrono>
#include <functional>

#include <atomic>
#include <mutex>
#include <vector>
#include <string>

#include "launch.hpp"
#include "meshgrad/comm/threads.hpp"
#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/error.hpp"

using namespace meshgrad;
using meshgrad::tools::mesh_axes_from_spec;
using meshgrad::tools::mesh_world_size;

namespace {

// The error message of mesh_axes_from_spec(spec), or "" when it is accepted.
std::string mesh_error(const std::string& spec) {
  try {
    mesh_axes_from_spec(spec);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(MeshSpec, OneDimensionalGivesDpAndTp) {
  EXPECT_EQ(dist::mesh_spec_str(mesh_axes_from_spec("tp=2")), "dp=1,tp=2");
  EXPECT_EQ(dist::mesh_spec_str(mesh_axes_from_spec("dp=3")), "dp=3,tp=1");
  EXPECT_EQ(dist::mesh_spec_str(mesh_axes_from_spec("tp=2,dp=3")), "dp=3,tp=2");
  EXPECT_EQ(mesh_world_size("dp=3,tp=2"), 6);
}

TEST(MeshSpec, TwoDimensionalGivesDpRowCol) {
  EXPECT_EQ(dist::mesh_spec_str(mesh_axes_from_spec("tp=2x3")), "dp=1,tp_row=2,tp_col=3");
  EXPECT_EQ(dist::mesh_spec_str(mesh_axes_from_spec("tp=2x3,dp=2")), "dp=2,tp_row=2,tp_col=3");
  EXPECT_EQ(mesh_world_size("dp=2,tp=2x3"), 12);
  EXPECT_NE(mesh_error("tp=2x"), "");
  EXPECT_NE(mesh_error("tp=x2"), "");
  EXPECT_NE(mesh_error("tp=2x2x2").find("'2x2'"), std::string::npos) << mesh_error("tp=2x2x2");
  EXPECT_NE(mesh_error("tp=0x2").find("positive integer"), std::string::npos);
  EXPECT_NE(mesh_error("dp=2x2").find("'2x2'"), std::string::npos) << "only tp is 2-D";
}

TEST(MeshSpec, OnlyDpAndTpCaseSensitive) {
  for (const std::string spec : {"pp=2", "TP=2", "Dp=2", "dp=2,tq=2", "rows=2"}) {
    const std::string msg = mesh_error(spec);
    EXPECT_NE(msg.find("valid axes are dp and tp"), std::string::npos) << spec << ": " << msg;
    EXPECT_NE(msg.find(spec), std::string::npos) << "names the spec: " << msg;
  }
  EXPECT_NE(mesh_error("TP=2").find("did you mean 'tp'"), std::string::npos);
  EXPECT_NE(mesh_error("tp=2,tp=2").find("appears twice"), std::string::npos);
  EXPECT_NE(mesh_error("tp=2x2,tp=2").find("appears twice"), std::string::npos);
}

TEST(MeshSpec, MalformedSizes) {
  for (const std::string spec : {"", "tp", "tp=", "=2", "tp=0", "tp=-1", "tp=1e3", "tp= 2", "tp=2,", "tp=+2"}) {
    EXPECT_NE(mesh_error(spec), "") << "'" << spec << "' was accepted";
  }
}

TEST(MeshSpec, RankCountBoundedWithoutOverflow) {
  // The int product of 4 x 1073741825 wraps to 4: it must be refused, not run on 4 ranks.
  EXPECT_NE(mesh_error("dp=4,tp=1073741825").find("at most 4096"), std::string::npos);
  EXPECT_NE(mesh_error("dp=65536,tp=65536").find("at most 4096"), std::string::npos);
  EXPECT_NE(mesh_error("tp=99999999999999999999999").find("at most 4096"), std::string::npos);
  EXPECT_NE(mesh_error("dp=64,tp=8x16").find("needs 8192 ranks"), std::string::npos) << mesh_error("dp=64,tp=8x16");
  EXPECT_EQ(mesh_world_size("dp=64,tp=8x8"), tools::kMaxMeshRanks);
}

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
  tools::run_on_backend("threads", 2, [&](const comm::CommunicatorPtr& world) {
    if (world->rank() == 0) seen = blas::num_threads();
  });
  EXPECT_EQ(seen.load(), std::max(1, blas::available_cores() / 2));
  EXPECT_EQ(blas::num_threads(), 1) << "restored after the ranks finished";
}

TEST(Launch, RanksOnThisNodeFromTheMpiLauncher) {
  unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  unsetenv("MPI_LOCALNRANKS");
  EXPECT_EQ(tools::mpi_ranks_on_this_node(8), 8) << "unknown: assume all on this node";
  EnvGuard local("OMPI_COMM_WORLD_LOCAL_SIZE", "2");
  EXPECT_EQ(tools::mpi_ranks_on_this_node(8), 2);
}

TEST(Launch, ThreadsBackendUnderMpirunIsRefused) {
  unsetenv("PMI_SIZE");
  {
    EnvGuard one("OMPI_COMM_WORLD_SIZE", "1");   // mpirun -np 1: one process, nothing duplicated
    EXPECT_EQ(tools::run_on_backend("threads", 1, [](const comm::CommunicatorPtr&) {}), 0);
  }
  EnvGuard two("OMPI_COMM_WORLD_SIZE", "2");
  EXPECT_EQ(tools::mpi_launcher_world_size(), 2);
  bool ran = false;
  try {
    tools::run_on_backend("threads", 2, [&](const comm::CommunicatorPtr&) { ran = true; });
    FAIL() << "ran the threads backend under mpirun";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("add `--backend mpi`"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(ran);
}

namespace {

// Runs agree_on_options on P rank threads, rank r with options_of(r); returns each rank's error
// message ("" when it passed).
std::vector<std::string> agreement_errors(int P, const std::function<std::vector<tools::OptionValue>(int)>& options_of) {
  std::vector<std::string> errors(static_cast<std::size_t>(P));
  std::mutex m;
  comm::ThreadsOptions o;
  o.timeout = std::chrono::milliseconds(20000);
  comm::run_ranks(P, [&](const comm::CommunicatorPtr& world) {
    try {
      tools::agree_on_options(*world, options_of(world->rank()));
    } catch (const InvalidArgument& e) {
      std::lock_guard lock(m);
      errors[static_cast<std::size_t>(world->rank())] = e.what();
    }
  }, o);
  return errors;
}

}  // namespace

TEST(OptionAgreement, SameOptionsPass) {
  const std::vector<tools::OptionValue> same{{"command", "train"}, {"--hidden", "32"}, {"--data", ""}};
  for (const auto& e : agreement_errors(3, [&](int) { return same; })) EXPECT_EQ(e, "");
}

TEST(OptionAgreement, DifferentValueNamesOptionAndBothValues) {
  auto options_of = [](int rank) {
    return std::vector<tools::OptionValue>{{"command", "train"}, {"--seed", "1"}, {"--hidden", rank == 2 ? "64" : "32"}};
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
    std::vector<tools::OptionValue> o{{"command", rank == 0 ? "train" : "check"}, {"--steps", "5"}};
    if (rank == 0) o.push_back({"--metrics", "m.jsonl"});
    return o;
  });
  EXPECT_NE(errors[1].find("command is 'train' on rank 0 but 'check' on rank 1"), std::string::npos) << errors[1];
  const auto missing = agreement_errors(2, [](int rank) {
    std::vector<tools::OptionValue> o{{"command", "train"}};
    if (rank == 1) o.push_back({"--sequence-parallel", "true"});
    return o;
  });
  EXPECT_NE(missing[0].find("--sequence-parallel is absent on rank 0 but 'true' on rank 1"), std::string::npos)
      << missing[0];
}
