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
};

// The most rank threads one run_ranks call starts (its group allocates world_size^2 mailboxes).
inline constexpr int kMaxThreadRanks = 4096;

// Runs fn(comm) on world_size rank threads and returns when all finished. If any rank throws, the
// others are woken (their pending and later collectives fail with PeerFailed) and the first
// exception (by time) is rethrown here after every thread joined: never a hang. A rank thread that
// cannot be created (system limits) is such an error (CommError naming the rank), after the ranks
// already started were failed and joined.
// Compute settings are the caller's: run_ranks leaves the process-wide BLAS thread count alone. Set
// it for the duration with blas::ThreadsPerRank (tensor/blas.hpp) so that ranks x BLAS threads does
// not exceed the cores, e.g.
//   blas::ThreadsPerRank blas_policy(world_size);
//   comm::run_ranks(world_size, fn);
void run_ranks(int world_size, const std::function<void(const CommunicatorPtr&)>& fn,
               const ThreadsOptions& options = {});

}  // namespace meshgrad::comm
