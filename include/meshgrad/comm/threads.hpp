// The threads backend, meshgrad's embedded default: P ranks as threads of one process, each with its
// own Communicator over shared memory. No launcher needed.
#pragma once

#include <functional>

#include "meshgrad/comm/communicator.hpp"

namespace meshgrad::comm {

struct ThreadsOptions {
  // Default deadline of every wait; 0 = default_timeout_from_env().
  Milliseconds timeout{0};
  // Cross-rank call checks before each collective; defaults to debug_checks_from_env().
  bool debug_checks = debug_checks_from_env();
  // BLAS threads each rank may use; 0 = max(1, hardware cores / world_size), so that
  // ranks x BLAS threads never exceeds the cores (waits block, they do not spin for long).
  int blas_threads_per_rank = 0;
};

// Runs fn(comm) on world_size rank threads and returns when all finished. If any rank throws, the
// others are woken (their pending and later collectives fail with PeerFailed) and the first
// exception (by time) is rethrown here after every thread joined: never a hang.
void run_ranks(int world_size, const std::function<void(const CommunicatorPtr&)>& fn,
               const ThreadsOptions& options = {});

}  // namespace meshgrad::comm
