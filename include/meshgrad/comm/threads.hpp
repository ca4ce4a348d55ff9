// The threads backend, meshgrad's embedded default: P ranks as threads of one process, each with its
// own Communicator over shared memory. No launcher needed.
#pragma once

#include <functional>
#include <vector>

#include "meshgrad/comm/communicator.hpp"

namespace meshgrad::comm {

// Whether rank threads are pinned to cores (rank r on the r % C-th core of the process's affinity
// mask, C cores; a rank's progress thread and its one-thread BLAS calls run where it runs):
//   Auto   pin when there are at least as many ranks as cores (every core then has ranks that do
//          the same work in lock step, and a rank that stays on its core keeps its caches and
//          never queues behind a migrated peer); fewer ranks float, so BLAS threads can use the rest
//   On     always pin; failing to set the affinity is an error (CommError naming the rank)
//   Off    never pin
enum class PinRanks { Auto, On, Off };
// MESHGRAD_PIN_RANKS = auto | on | off (default auto); anything else throws InvalidArgument.
PinRanks pin_ranks_from_env();

struct ThreadsOptions {
  // Default deadline of every wait; 0 = default_timeout_from_env().
  Milliseconds timeout{0};
  // Cross-rank call checks before each collective; defaults to debug_checks_from_env().
  bool debug_checks = debug_checks_from_env();
  PinRanks pin = pin_ranks_from_env();
};

// The cores rank `rank` of `world_size` is pinned to under `pin`, given the process's cores (CPU ids
// in its affinity mask, ascending): one core, or empty for no pinning. Pure (for tests and banners).
std::vector<int> rank_cores(PinRanks pin, int world_size, int rank, const std::vector<int>& process_cores);

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
