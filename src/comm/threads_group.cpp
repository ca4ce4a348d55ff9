// The threads backend's shared state: see threads_group.hpp.
#include "comm/threads_group.hpp"

#include <fmt/format.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <ctime>
#include <thread>

#include "meshgrad/comm/errors.hpp"

namespace meshgrad::comm::threads_detail {

void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, std::chrono::nanoseconds timeout) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, &ts, nullptr, 0);
}
void futex_wake_all(std::atomic<std::uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}
int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

void Universe::fail(int world_rank, const std::string& what) {
  std::vector<std::shared_ptr<Group>> live;
  {
    std::lock_guard lock(m);
    if (!failed.load()) {
      failed_rank = world_rank;
      failed_what = what;
    }
    failed.store(true, std::memory_order_seq_cst);
    for (auto& w : groups) {
      if (auto g = w.lock()) live.push_back(std::move(g));
    }
  }
  const std::string why = failure();
  for (auto& g : live) {
    g->wake();
    g->fail_pending_p2p(why);
  }
}

void Group::fail_pending_p2p(const std::string& why) {
  std::vector<std::shared_ptr<P2PRequest>> pending;
  {
    std::lock_guard lock(p2p_m);
    for (auto* lists : {&sends, &recvs}) {
      for (auto& l : *lists) {
        for (auto& r : l) pending.push_back(r);
        l.clear();
      }
    }
  }
  for (auto& r : pending) {
    r->op->finish(std::make_exception_ptr(PeerFailed(
        fmt::format("threads: {} (message {} , tag {}) to/from rank {}: {}", detail::op_name(r->op->kind),
                    r->op->seq, r->tag, r->op->peer, why),
        "threads", std::string(detail::op_name(r->op->kind)), r->op->seq, -1)));
  }
}

}  // namespace meshgrad::comm::threads_detail
