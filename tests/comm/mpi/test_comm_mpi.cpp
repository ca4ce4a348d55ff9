// The conformance suite on the mpi backend, run under mpirun (ctest: -np 2 and -np 4). Communicators
// of size P < world size are made with split; ranks outside sit the test out. Every rank runs the same
// tests in the same order; rank 0 prints the usual gtest output, the others only their failures.
//
// Fault mode (driven by tests/comm/mpi/check_fault.cmake, not gtest):
//   test_comm_mpi --fault=kill|skip --marker-dir=DIR
// kill: rank 1 SIGKILLs itself before a collective; skip: rank 1 never calls it (sleeps, then exits).
// Survivors must fail with CommTimeout or PeerFailed within the deadline and write DIR/rank<r>.txt
// ("ok <error kind> <elapsed ms> <message>"); the driver checks those files, so the test can fail.
#include <gtest/gtest.h>
#define OMPI_SKIP_MPICXX 1  // the C API only (the deprecated C++ bindings need an extra library)
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <string>

#include "comm/conformance.hpp"
#include "meshgrad/comm/mpi.hpp"

namespace meshgrad::comm::testing {
namespace {

MpiSession* g_session = nullptr;

class MpiHarness final : public Harness {
 public:
  explicit MpiHarness(bool debug) : debug_(debug) {}
  CommunicatorPtr world() {
    if (!world_) {
      MpiOptions o;
      o.timeout = std::chrono::seconds(20);
      o.debug_checks = debug_;
      world_ = g_session->world(o);
    }
    return world_;
  }
  void run(int P, const std::function<void(Communicator&)>& body) override {
    auto w = world();
    auto it = subs_.find(P);
    if (it == subs_.end()) it = subs_.emplace(P, w->split(w->rank() < P ? 0 : -1, w->rank())).first;
    if (it->second) body(*it->second);
    w->barrier();  // keep the ranks in step between tests
  }
  int max_size() const override { return mpi_world_size(); }

 private:
  bool debug_;
  CommunicatorPtr world_;
  std::map<int, CommunicatorPtr> subs_;
};

MpiHarness& mpi_harness() {
  static MpiHarness h(false);
  return h;
}
MpiHarness& mpi_debug_harness() {
  static MpiHarness h(true);
  return h;
}

}  // namespace
}  // namespace meshgrad::comm::testing

MESHGRAD_COMM_CONFORMANCE_TESTS(MpiConformance, ::meshgrad::comm::testing::mpi_harness())

namespace meshgrad::comm::testing {
namespace {

TEST(MpiFaults, DebugModeNamesBothMismatchedCalls) {
  mpi_debug_harness().run(2, [](Communicator& c) {
    std::vector<float> v(c.rank() == 0 ? 10 : 12, 1.0f);
    try {
      c.all_reduce(buffer(std::span<float>(v)), ReduceOp::Sum);
      ADD_FAILURE() << "no CollectiveMismatch";
    } catch (const CollectiveMismatch& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("rank 0 called all_reduce("), std::string::npos) << m;
      EXPECT_NE(m.find("in 10, out 10, op sum)"), std::string::npos) << m;
      EXPECT_NE(m.find("rank 1 called all_reduce("), std::string::npos) << m;
      EXPECT_NE(m.find("in 12, out 12, op sum)"), std::string::npos) << m;
    }
    // Every rank threw at the same point: the communicator is still in step.
    float x = 1;
    c.all_reduce(buffer(std::span<float>(&x, 1)), ReduceOp::Sum);
    EXPECT_EQ(x, 2.0f);
  });
}

TEST(MpiFaults, DebugModeChecksAllToAllPairs) {
  mpi_debug_harness().run(2, [](Communicator& c) {
    std::vector<float> in(4, 1.0f), out(4, 0.0f);
    std::vector<std::size_t> sc{2, 2}, rc = c.rank() == 0 ? std::vector<std::size_t>{1, 3} : std::vector<std::size_t>{2, 2};
    EXPECT_THROW(c.all_to_all(buffer(std::span<const float>(in)), sc, buffer(std::span<float>(out)), rc), InvalidArgument);
  });
}

TEST(MpiBackend, IsAvailableAndNamed) {
  EXPECT_TRUE(mpi_backend_available());
  EXPECT_EQ(mpi_harness().world()->backend(), "mpi");
  EXPECT_EQ(mpi_harness().world()->size(), mpi_world_size());
}

// Prints only failures (for ranks other than 0).
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed()) std::fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_, r.file_name() ? r.file_name() : "?",
                                 r.line_number(), r.summary());
  }

 private:
  int rank_;
};

int run_fault_mode(const std::string& mode, const std::string& dir) {
  MpiOptions o;
  o.timeout = std::chrono::milliseconds(300);
  auto world = g_session->world(o);
  const int r = world->rank();
  world->barrier();
  if (r == 1) {
    if (mode == "kill") raise(SIGKILL);
    std::this_thread::sleep_for(std::chrono::seconds(2));  // "skip": never calls the collective
    std::_Exit(0);
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::string line;
  int code = 1;
  try {
    std::vector<float> v(1 << 16, 1.0f);
    world->all_reduce(buffer(std::span<float>(v)), ReduceOp::Sum);
    line = "no-error: the all_reduce completed without rank 1";
  } catch (const CommTimeout& e) {
    line = fmt::format("ok CommTimeout {} {}", std::chrono::duration_cast<std::chrono::milliseconds>(
                                                   std::chrono::steady_clock::now() - t0).count(), e.what());
    code = 0;
  } catch (const PeerFailed& e) {
    line = fmt::format("ok PeerFailed {} {}", std::chrono::duration_cast<std::chrono::milliseconds>(
                                                  std::chrono::steady_clock::now() - t0).count(), e.what());
    code = 0;
  } catch (const std::exception& e) {
    line = fmt::format("wrong-error {}", e.what());
  }
  {
    std::ofstream f(fmt::format("{}/rank{}.txt", dir, r));
    f << line << "\n";
  }
  std::fprintf(stderr, "rank %d: %s\n", r, line.c_str());
  std::fflush(stderr);
  // The communicator is unusable (a collective is pending forever): leave without MPI_Finalize.
  std::_Exit(code);
}

}  // namespace
}  // namespace meshgrad::comm::testing

int main(int argc, char** argv) {
  meshgrad::comm::MpiSession session(&argc, &argv);
  meshgrad::comm::testing::g_session = &session;
  std::string fault, dir = ".";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--fault=", 0) == 0) fault = a.substr(8);
    if (a.rfind("--marker-dir=", 0) == 0) dir = a.substr(13);
  }
  if (!fault.empty()) return meshgrad::comm::testing::run_fault_mode(fault, dir);
  ::testing::InitGoogleTest(&argc, argv);
  const int rank = meshgrad::comm::mpi_world_rank();
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new meshgrad::comm::testing::FailurePrinter(rank));
  }
  const int failed = RUN_ALL_TESTS();
  // Agree on the verdict: mpirun's exit code then reflects a failure on any rank.
  int any = failed, all = 0;
  MPI_Allreduce(&any, &all, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return all;
}
