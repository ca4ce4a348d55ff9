// The conformance suite on the threads backend: run_ranks(P) directly.
#include "comm/conformance.hpp"
#include "meshgrad/comm/threads.hpp"

namespace meshgrad::comm::testing::test_threads_conformance {
namespace {

class ThreadsHarness final : public Harness {
 public:
  void run(int P, const std::function<void(Communicator&)>& body) override {
    ThreadsOptions options;
    options.timeout = std::chrono::seconds(20);  // a broken test fails in seconds, not minutes
    run_ranks(P, [&](const CommunicatorPtr& c) { body(*c); }, options);
  }
  int max_size() const override { return 4; }
};

ThreadsHarness& threads_harness() {
  static ThreadsHarness h;
  return h;
}

}  // namespace
}  // namespace meshgrad::comm::testing::test_threads_conformance

MESHGRAD_COMM_CONFORMANCE_TESTS(ThreadsConformance, ::meshgrad::comm::testing::test_threads_conformance::threads_harness())
