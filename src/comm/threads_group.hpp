// The threads backend's shared state (src/comm/threads.cpp uses it): the group-wide table of per-rank
// slots every collective goes through, its counters, the point-to-point mailboxes, and the futex the
// waits sleep on. See threads.cpp for the protocol these serve.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/detail.hpp"

namespace meshgrad::comm::threads_detail {

using detail::CallDesc;
using detail::OpState;

// Sleeps while *word == expected, at most timeout; wakes every sleeper on word.
void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, std::chrono::nanoseconds timeout);
void futex_wake_all(std::atomic<std::uint32_t>* word);
inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

// Cores this process may run on: ranks spin briefly in waits only when each can have a core.
int available_cores();

struct Group;

// Everything one run_ranks call created: the world group and every group split from it. A rank that
// throws fails the universe: every wait in every group sees it.
struct Universe {
  std::atomic<bool> failed{false};
  std::mutex m;
  int failed_rank = -1;  // world rank
  std::string failed_what;
  std::vector<std::weak_ptr<Group>> groups;

  void add(const std::shared_ptr<Group>& g) {
    std::lock_guard lock(m);
    groups.push_back(g);
  }
  void fail(int world_rank, const std::string& what);
  std::string failure() {
    std::lock_guard lock(m);
    return fmt::format("rank {} (world) failed: {}", failed_rank, failed_what);
  }
};

// One pending point-to-point request. Completed by the peer's matching call, under Group::p2p_m.
struct P2PRequest {
  int tag;
  const void* send_data = nullptr;
  void* recv_data = nullptr;
  std::size_t count;
  DType dtype;
  std::shared_ptr<OpState> op;
};

// What a rank publishes for one collective: written by the owner before its arrival, read by every
// rank after the arrival completed. Two per slot, by sequence parity: a rank that left collective s
// (every chunk done) may publish s+1 while a slower peer still reads its entry of s, but it cannot
// publish s+2 before that peer arrived at s+1, i.e. stopped reading s. The counts are copies (the
// capacity is reused): the owner's operation, and the vectors it holds, may end before a peer reads.
struct CallData {
  CallDesc desc;
  const void* in = nullptr;
  void* out = nullptr;
  std::vector<std::size_t> counts;        // resolved per-rank counts / all_to_all send counts
  std::vector<std::size_t> recv_counts;   // all_to_all
  std::vector<std::size_t> send_offsets;  // all_to_all
  int color = 0, key = 0;
  std::shared_ptr<Group> new_group;  // split: set by each new group's first member
};

// Bytes a collective's whole buffer (all_reduce, reduce_scatter: the input; all_gather: the output)
// may have to take the eager path: each rank copies its input into its slot's staging area before it
// arrives, then every rank computes its own output from the staged copies, and leaves without
// waiting for the others (one rendezvous instead of two). It pays below these sizes, where the second
// rendezvous costs more than the extra copy and every rank reading all P staged inputs: 2 ranks,
// 1 KiB, 0.3-0.4 us against 0.4-0.6 us; at 16 KiB the chunked path is twice as fast (0.7-0.8 us
// against 1.6 us, all_reduce 3.1 us). Measured on a 2-core AMD EPYC VM, 2 and 4 ranks.
constexpr std::size_t kEagerBytes = std::size_t(4) << 10;
constexpr std::size_t kEagerAllReduceBytes = std::size_t(2) << 10;
static_assert(kEagerAllReduceBytes <= kEagerBytes, "an eager all_reduce stages its whole input");

struct alignas(128) Slot {
  std::atomic<std::uint64_t> progress{0};
  alignas(64) CallData data[2];
  // Eager staging of collective seq at staging + (seq & 1) * kEagerBytes: written by the owner before
  // its arrival at seq, read by every rank after it. The owner rewrites it at seq + 2, after arriving
  // at seq + 1, which every rank did only once it stopped reading seq (as CallData).
  struct alignas(64) Staging {
    std::byte bytes[2 * kEagerBytes];
  };
  std::unique_ptr<Staging> staging = std::make_unique<Staging>();
  std::byte* staged(std::uint64_t seq) const { return staging->bytes + (seq & 1) * kEagerBytes; }
};

// One atomic counter on its own cache line.
struct alignas(64) Counter {
  std::atomic<std::uint64_t> value{0};
};

// The work of one chunked collective: claims per block (rank q's block: its input for all_gather,
// its shard for reduce_scatter, range q of the buffers for all_reduce), and the chunks done.
struct ChunkWork {
  explicit ChunkWork(int n) : claimed(static_cast<std::size_t>(n)) {}
  std::vector<Counter> claimed;  // chunks of block q handed out (may run past the block's count)
  Counter done;
  // Stores only where a counter moved: after eager collectives (which claim nothing) the lines stay
  // shared in every core's cache instead of being pulled over by whichever rank arrived last.
  void reset() {
    for (Counter& c : claimed) clear(c);
    clear(done);
  }
  static void clear(Counter& c) {
    if (c.value.load(std::memory_order_relaxed) != 0) c.value.store(0, std::memory_order_relaxed);
  }
};

struct Group {
  Group(int n, std::shared_ptr<Universe> u, std::vector<int> world)
      : size(n), slots(static_cast<std::size_t>(n)), work{ChunkWork(n), ChunkWork(n)}, universe(std::move(u)),
        world_ranks(std::move(world)), sends(static_cast<std::size_t>(n) * n), recvs(static_cast<std::size_t>(n) * n),
        spin(n <= available_cores()) {}

  const int size;
  std::vector<Slot> slots;
  // Arrivals of all ranks at all collectives: collective seq s is complete when it reaches (s+1) x size.
  // A rank giving up (deadline, peer failure) withdraws its arrival with a CAS that only succeeds while
  // the count is short: once complete, nobody can withdraw, so no rank reads a buffer whose owner left.
  alignas(64) std::atomic<std::uint64_t> arrivals{0};
  // Per sequence parity. The counters of collective s+1 are reset by the rank whose arrival completes
  // s: then every rank has left s-1 (the last user of that parity) and none can claim for s+1 before
  // that rank arrives at s+1, after the reset.
  ChunkWork work[2];
  alignas(64) std::atomic<std::uint32_t> futex_word{0};
  alignas(64) std::atomic<int> sleepers{0};
  std::shared_ptr<Universe> universe;
  std::vector<int> world_ranks;  // group rank -> world rank
  // Point to point: pending sends / recvs of channel (src -> dst) at index src * size + dst.
  std::mutex p2p_m;
  std::vector<std::list<std::shared_ptr<P2PRequest>>> sends, recvs;
  const bool spin;  // ranks <= cores: spinning briefly beats sleeping

  void signal(int rank, std::uint64_t value) {
    slots[static_cast<std::size_t>(rank)].progress.store(value, std::memory_order_seq_cst);
    wake();
  }
  // Call after the seq_cst write that a waiter's condition reads. Touches the futex word (a line every
  // rank would otherwise write on every signal: ~0.2 us of the 0.7 us of a 1 KiB all_reduce on 2 ranks)
  // only when a rank sleeps. No wake-up is lost: a sleeper counts itself in before it reads the word
  // and checks its condition, so either we see it here or it sees our write (on x86 the count's locked
  // add orders the condition's loads after it; were one missed, the sleep's 10 ms slice re-checks).
  void wake() {
    if (sleepers.load(std::memory_order_seq_cst) > 0) {
      futex_word.fetch_add(1, std::memory_order_seq_cst);
      futex_wake_all(&futex_word);
    }
  }
  bool arrivals_reached(std::uint64_t target) const { return arrivals.load(std::memory_order_acquire) >= target; }
  bool all_reached(std::uint64_t target) const {
    for (const Slot& s : slots) {
      if (s.progress.load(std::memory_order_acquire) < target) return false;
    }
    return true;
  }
  std::vector<int> missing(std::uint64_t target) const {
    std::vector<int> out;
    for (int q = 0; q < size; ++q) {
      if (slots[static_cast<std::size_t>(q)].progress.load(std::memory_order_acquire) < target) out.push_back(q);
    }
    return out;
  }
  void fail_pending_p2p(const std::string& why);
};

}  // namespace meshgrad::comm::threads_detail
