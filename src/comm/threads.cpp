// The threads backend: P ranks as threads of one process over shared memory.
//
// Every collective is an arrival, then a data phase, over a group-wide table of per-rank slots:
//
//   rank r:  publish call + buffer pointers in slot r      (the "arrival" of seq s)
//            wait until every rank arrived                 (deadline, peer failure, cancel)
//            check the calls agree (sizes, dtypes, op)     (same verdict on every rank)
//            data phase: read peers' buffers directly      (no waits inside: bounded time)
//            leave when the data phase is complete         (peers may still be using my buffers)
//
// all_reduce, all_gather and reduce_scatter cut their data phase into chunks, each a piece of the
// result no other chunk touches, claimed one by one from a shared counter by whichever ranks are
// running; a rank leaves when every chunk is done. So on an oversubscribed or loaded machine (4 ranks
// on 2 cores) the ranks that have a core do all the work instead of waiting for a descheduled peer's
// share, and the last rank to arrive starts at once. Who computes a chunk never changes its bits.
//
//   all_reduce, P = 3, n elements cut into chunks c0 | c1 | c2 | ...:
//     whoever claims c_k computes (in0[c_k] + in1[c_k]) + in2[c_k] and writes it into out0, out1 and
//     out2 at c_k: each element is read from every input once and written to every output once, no
//     staging copy; only that rank touches range c_k of any buffer, so in place (in == out) is safe.
//   all_gather: chunk = a piece of rank q's input, copied into block q of every output (read once).
//   reduce_scatter: chunk = a piece of rank q's shard, reduced over every input into rank q's output.
//
// Small all_reduce, all_gather and reduce_scatter (kEagerBytes) take the eager path instead: each rank
// copies its input into its slot's staging area before it arrives, and after the arrival computes its
// own output from the staged copies alone, so it leaves at once (one rendezvous, not two; the sums
// are in rank order, the chunked path's bits). The shared state is in threads_group.hpp.
//
// Broadcast, all_to_all, barrier and split keep a second rendezvous instead: every rank signals "done
// reading" and waits for all. Progress counters only grow: collective seq s uses the values 4s+1
// (arrival), 4s+2 (split's middle step) and 4s+3 (exit). Waits spin for an adaptive 0-20 us (only
// when ranks <= cores), yield until 50 us passed, then sleep on a group futex that every signal
// bumps, in slices of at most 10 ms so cancel flags are seen.
#include "meshgrad/comm/threads.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <list>
#include <mutex>
#include <numeric>
#include <system_error>
#include <thread>

#include "comm/detail.hpp"
#include "comm/threads_group.hpp"
#include "meshgrad/comm/errors.hpp"
#include "meshgrad/tensor/shard.hpp"
#include "meshgrad/tensor/trace.hpp"

namespace meshgrad::comm {
namespace {

using detail::CallDesc;
using detail::Clock;
using detail::OpKind;
using detail::OpState;
using namespace threads_detail;

class ThreadsComm final : public detail::CommBase {
 public:
  ThreadsComm(std::shared_ptr<Group> group, int rank, Milliseconds timeout, bool debug)
      : CommBase(rank, group->size, timeout, debug), group_(std::move(group)),
        ins_(static_cast<std::size_t>(size_)), outs_(static_cast<std::size_t>(size_)) {}
  ~ThreadsComm() override { shutdown_executor(); }

  std::string_view backend() const override { return "threads"; }

  WorkPtr all_reduce_async(ConstBuffer in, MutableBuffer out, ReduceOp op, const CollectiveOptions& opt) override {
    detail::check_all_reduce_args(in, out, rank_);
    return submit(OpKind::AllReduce, opt, detail::bytes_of(in), [this, in, out, op](OpState& st) {
      CallData& me = my_call(st.seq);
      me.desc = detail::make_desc(OpKind::AllReduce, st.seq, in.dtype, in.count, out.count, -1, int(op));
      me.in = in.data;
      me.out = out.data;
      const std::size_t es = dtype_size(in.dtype);
      auto checks = [&] {
        check_equal_field(st, "elements", [](const CallData& c) { return c.desc.in_count; });
        check_equal_field(st, "dtype", [](const CallData& c) { return std::uint64_t(c.desc.dtype); });
        check_equal_field(st, "reduce op", [](const CallData& c) { return std::uint64_t(c.desc.reduce_op); },
                          /*mismatch=*/true);
      };
      if (in.count * es <= kEagerAllReduceBytes) {
        // Every rank sums the staged inputs in rank order into its own output: the bits of the chunked
        // path (the same sum, whoever computes it).
        eager_collective(st, in, checks, [&] {
          for (int q = 0; q < size_; ++q) ins_[q] = slot(q).staged(st.seq);
          void* dst = out.data;
          detail::reduce_rank_order(in.dtype, op, size_, ins_.data(), size_, &dst, 1, in.count,
                                    detail::Stores::Cached);
        });
        return;
      }
      // Blocks: shard_range's parts of the buffers; a chunk is one element range of every buffer.
      std::vector<std::size_t> shards(static_cast<std::size_t>(size_));
      for (int q = 0; q < size_; ++q) {
        shards[q] = static_cast<std::size_t>(shard_range(static_cast<std::int64_t>(in.count), size_, q).size);
      }
      const BlockChunks plan = plan_blocks(std::move(shards), in.count, es);
      // Cached stores at every size: streaming the P outputs measured slower here (5.8 vs 8.0 ms at
      // 64 MiB, 2 ranks), unlike all_gather's and reduce_scatter's (see stores_for).
      const detail::Stores stores = detail::Stores::Cached;
      chunked_collective(st, plan, stores, checks, [&](const BlockChunks::Piece& piece) {
        const std::size_t first = (plan.offset[piece.block] + piece.offset) * es;
        for (int q = 0; q < size_; ++q) {
          ins_[q] = static_cast<const char*>(call(q, st.seq).in) + first;
          outs_[q] = static_cast<char*>(call(q, st.seq).out) + first;
        }
        detail::reduce_rank_order(in.dtype, op, size_, ins_.data(), size_, outs_.data(), size_, piece.count, stores);
      });
    });
  }

  WorkPtr all_gather_async(ConstBuffer in, MutableBuffer out, Counts counts, const CollectiveOptions& opt) override {
    auto resolved = detail::check_all_gather_args(in, out, counts, size_, rank_);
    return submit(OpKind::AllGather, opt, detail::bytes_of(out), [this, in, out, resolved = std::move(resolved),
                                                      counts_given = !counts.empty()](OpState& st) {
      CallData& me = my_call(st.seq);
      me.desc = detail::make_desc(OpKind::AllGather, st.seq, in.dtype, in.count, out.count, -1, -1,
                                  counts_given ? Counts(resolved) : Counts{});
      me.in = in.data;
      me.out = out.data;
      me.counts.assign(resolved.begin(), resolved.end());
      const std::size_t es = dtype_size(in.dtype);
      auto checks = [&] {
        check_equal_field(st, "output elements", [](const CallData& c) { return c.desc.out_count; });
        check_equal_field(st, "dtype", [](const CallData& c) { return std::uint64_t(c.desc.dtype); });
        check_equal_counts(st);
      };
      if (out.count * es <= kEagerBytes) {  // the output's size agrees on every rank (checked): so does the path
        eager_collective(st, in, checks, [&] {
          std::size_t dst = 0;
          for (int q = 0; q < size_; ++q) {
            if (resolved[q] > 0) {
              std::memcpy(static_cast<char*>(out.data) + dst * es, slot(q).staged(st.seq), resolved[q] * es);
            }
            dst += resolved[q];
          }
        });
        return;
      }
      // Chunks: pieces of each rank's block (its input); a chunk is copied into every output.
      const BlockChunks plan = plan_blocks(resolved, out.count, es);
      const detail::Stores stores = stores_for(out.count * es, out.count * es * std::size_t(size_));
      chunked_collective(st, plan, stores, checks, [&](const BlockChunks::Piece& piece) {
        const char* src = static_cast<const char*>(call(piece.block, st.seq).in) + piece.offset * es;
        const std::size_t dst_off = (plan.offset[piece.block] + piece.offset) * es;
        for (int k = 0; k < size_; ++k) {
          const int d = (piece.block + k) % size_;  // stagger the outputs the ranks write first
          outs_[k] = static_cast<char*>(call(d, st.seq).out) + dst_off;
        }
        detail::copy_to_all(src, outs_.data(), size_, piece.count * es, stores);
      });
    });
  }

  WorkPtr reduce_scatter_async(ConstBuffer in, MutableBuffer out, ReduceOp op, Counts counts,
                               const CollectiveOptions& opt) override {
    auto resolved = detail::check_reduce_scatter_args(in, out, counts, size_, rank_);
    return submit(OpKind::ReduceScatter, opt, detail::bytes_of(in), [this, in, out, op, resolved = std::move(resolved),
                                                          counts_given = !counts.empty()](OpState& st) {
      CallData& me = my_call(st.seq);
      me.desc = detail::make_desc(OpKind::ReduceScatter, st.seq, in.dtype, in.count, out.count, -1, int(op),
                                  counts_given ? Counts(resolved) : Counts{});
      me.in = in.data;
      me.out = out.data;
      me.counts.assign(resolved.begin(), resolved.end());
      const std::size_t es = dtype_size(in.dtype);
      auto checks = [&] {
        check_equal_field(st, "input elements", [](const CallData& c) { return c.desc.in_count; });
        check_equal_field(st, "dtype", [](const CallData& c) { return std::uint64_t(c.desc.dtype); });
        check_equal_field(st, "reduce op", [](const CallData& c) { return std::uint64_t(c.desc.reduce_op); }, true);
        check_equal_counts(st);
      };
      if (in.count * es <= kEagerBytes) {
        eager_collective(st, in, checks, [&] {
          const std::size_t first = std::accumulate(resolved.begin(), resolved.begin() + rank_, std::size_t{0}) * es;
          for (int q = 0; q < size_; ++q) ins_[q] = slot(q).staged(st.seq) + first;
          void* dst = out.data;
          detail::reduce_rank_order(in.dtype, op, size_, ins_.data(), size_, &dst, 1, resolved[rank_],
                                    detail::Stores::Cached);
        });
        return;
      }
      // Chunks: pieces of each rank's shard, reduced over every input into that rank's output.
      const BlockChunks plan = plan_blocks(resolved, in.count, es);
      const detail::Stores stores = stores_for(in.count * es * std::size_t(size_), in.count * es);
      chunked_collective(st, plan, stores, checks, [&](const BlockChunks::Piece& piece) {
        const std::size_t src_off = (plan.offset[piece.block] + piece.offset) * es;
        for (int q = 0; q < size_; ++q) ins_[q] = static_cast<const char*>(call(q, st.seq).in) + src_off;
        void* dst = static_cast<char*>(call(piece.block, st.seq).out) + piece.offset * es;
        detail::reduce_rank_order(in.dtype, op, size_, ins_.data(), size_, &dst, 1, piece.count, stores);
      });
    });
  }

  WorkPtr broadcast_async(MutableBuffer buf, int root, const CollectiveOptions& opt) override {
    detail::check_broadcast_args(buf, root, size_);
    return submit(OpKind::Broadcast, opt, detail::bytes_of(buf), [this, buf, root](OpState& st) {
      CallData& me = my_call(st.seq);
      me.desc = detail::make_desc(OpKind::Broadcast, st.seq, buf.dtype, buf.count, buf.count, root);
      me.out = buf.data;
      collective(st, [&] {
        check_equal_field(st, "root", [](const CallData& c) { return std::uint64_t(c.desc.root); }, true);
        check_equal_field(st, "elements", [](const CallData& c) { return c.desc.in_count; });
        check_equal_field(st, "dtype", [](const CallData& c) { return std::uint64_t(c.desc.dtype); });
        if (rank_ != root && buf.count > 0) {
          std::memcpy(buf.data, call(root, st.seq).out, buf.count * dtype_size(buf.dtype));
        }
      });
    });
  }

  WorkPtr all_to_all_async(ConstBuffer in, Counts send_counts, MutableBuffer out, Counts recv_counts,
                           const CollectiveOptions& opt) override {
    auto resolved = std::make_shared<detail::AllToAllCounts>(
        detail::check_all_to_all_args(in, out, send_counts, recv_counts, size_));
    return submit(OpKind::AllToAll, opt, detail::bytes_of(in), [this, in, out, resolved](OpState& st) {
      CallData& me = my_call(st.seq);
      me.desc = detail::make_desc(OpKind::AllToAll, st.seq, in.dtype, in.count, out.count);
      me.in = in.data;
      me.counts = resolved->send;
      me.recv_counts = resolved->recv;
      me.send_offsets = detail::offsets_of(resolved->send);
      collective(st, [&] {
        check_equal_field(st, "dtype", [](const CallData& c) { return std::uint64_t(c.desc.dtype); });
        for (int s = 0; s < size_; ++s) {
          for (int d = 0; d < size_; ++d) {
            const std::size_t sent = call(s, st.seq).counts[d], expected = call(d, st.seq).recv_counts[s];
            MG_CHECK(sent == expected, "threads: all_to_all seq {}: rank {} sends {} elements to rank {} but rank {} "
                     "expects {} from rank {} (seen on rank {})", st.seq, s, sent, d, d, expected, s, rank_);
          }
        }
        const std::size_t es = dtype_size(in.dtype);
        std::size_t dst = 0;
        for (int s = 0; s < size_; ++s) {
          const std::size_t n = resolved->recv[s];
          const CallData& from = call(s, st.seq);
          if (n > 0) {
            std::memcpy(static_cast<char*>(out.data) + dst * es,
                        static_cast<const char*>(from.in) + from.send_offsets[rank_] * es, n * es);
          }
          dst += n;
        }
      });
    });
  }

  WorkPtr barrier_async(const CollectiveOptions& opt) override {
    return submit(OpKind::Barrier, opt, 0, [this](OpState& st) {
      my_call(st.seq).desc = detail::make_desc(OpKind::Barrier, st.seq, DType::Float32, 0, 0);
      collective(st, [] {});
    });
  }

  std::shared_ptr<Communicator> split(int color, int key) override {
    std::shared_ptr<Communicator> result;
    CollectiveOptions opt;
    opt.caller_waits = true;
    submit(OpKind::Split, opt, 0, [this, color, key, &result](OpState& st) {
      CallData& me = my_call(st.seq);
      me.desc = detail::make_desc(OpKind::Split, st.seq, DType::Float32, 0, 0, color);
      me.color = color;
      me.key = key;
      me.new_group.reset();
      const std::uint64_t base = st.seq * 4;
      arrive(st);
      std::exception_ptr err;
      std::vector<int> members;  // old ranks with my color, in new-rank order
      try {
        check_kinds(st);
        if (color >= 0) {
          for (int q = 0; q < size_; ++q) {
            if (call(q, st.seq).color == color) members.push_back(q);
          }
          std::stable_sort(members.begin(), members.end(),
                           [&](int a, int b) { return call(a, st.seq).key < call(b, st.seq).key; });
          if (members.front() == rank_) {
            std::vector<int> world;
            for (int q : members) world.push_back(group_->world_ranks[q]);
            auto g = std::make_shared<Group>(static_cast<int>(members.size()), group_->universe, std::move(world));
            group_->universe->add(g);
            me.new_group = g;
          }
        }
      } catch (...) {
        err = std::current_exception();
      }
      group_->signal(rank_, base + 2);
      wait_all(st, base + 2, false);
      if (!err && color >= 0) {
        const int new_rank = static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
        result = std::make_shared<ThreadsComm>(call(members.front(), st.seq).new_group, new_rank, default_timeout_,
                                               debug_checks_);
      }
      group_->signal(rank_, base + 3);
      wait_all(st, base + 3, false);
      if (err) std::rethrow_exception(err);
    })->wait();
    return result;
  }

  WorkPtr send_async(ConstBuffer in, int peer, int tag, const CollectiveOptions& opt) override {
    detail::check_point_to_point_args(OpKind::Send, in.data, in.count, peer, tag, rank_, size_);
    auto req = std::make_shared<P2PRequest>();
    req->tag = tag;
    req->send_data = in.data;
    req->count = in.count;
    req->dtype = in.dtype;
    return post_p2p(OpKind::Send, req, peer, opt);
  }

  WorkPtr recv_async(MutableBuffer out, int peer, int tag, const CollectiveOptions& opt) override {
    detail::check_point_to_point_args(OpKind::Recv, out.data, out.count, peer, tag, rank_, size_);
    auto req = std::make_shared<P2PRequest>();
    req->tag = tag;
    req->recv_data = out.data;
    req->count = out.count;
    req->dtype = out.dtype;
    return post_p2p(OpKind::Recv, req, peer, opt);
  }

 private:
  Slot& slot(int q) const { return group_->slots[static_cast<std::size_t>(q)]; }
  Slot& my_slot() const { return slot(rank_); }
  // Rank q's published call of collective seq (see CallData for why two).
  CallData& call(int q, std::uint64_t seq) const { return slot(q).data[seq & 1]; }
  CallData& my_call(std::uint64_t seq) const { return call(rank_, seq); }

  static std::size_t div_ceil(std::size_t a, std::size_t b) { return (a + b - 1) / b; }

  // Elements per chunk for a data phase over `total` elements of es bytes: about four chunks per
  // block (what a late rank's peers can take over), 16 KiB to 256 KiB of each buffer (a claim is one
  // atomic add on a shared line, ~0.1 us: small against copying 16 KiB), whole 64-byte vectors.
  std::size_t chunk_elements(std::size_t total, std::size_t es) const {
    const std::size_t per_vector = 64 / es;
    const std::size_t bytes = std::clamp<std::size_t>(div_ceil(total * es, 4 * std::size_t(size_)),
                                                      std::size_t(16) << 10, std::size_t(256) << 10);
    return div_ceil(bytes / es, per_vector) * per_vector;
  }

  // Streaming stores when the collective's working set (bytes read + written by all ranks) exceeds
  // what the last-level cache holds (32 MiB: this machine class shares that much L3 between its
  // cores): the results would not stay cached anyway, and streaming skips the read-for-ownership
  // of every line. Below it the results stay in cache for the caller (and the next iteration).
  static detail::Stores stores_for(std::size_t bytes_read, std::size_t bytes_written) {
    constexpr std::size_t kLastLevelCache = std::size_t(32) << 20;
    return bytes_read + bytes_written > kLastLevelCache ? detail::Stores::Streaming : detail::Stores::Cached;
  }

  // Chunks over per-rank blocks (all_gather: the inputs; reduce_scatter: the shards; all_reduce:
  // shard_range's parts of the buffers): block q has counts[q] elements at offset[q], cut into
  // chunks first_chunk[q] .. first_chunk[q+1]-1 of `chunk` elements (the last one shorter).
  struct BlockChunks {
    std::size_t chunk = 1;
    std::vector<std::size_t> count, offset, first_chunk;
    struct Piece {
      int block;
      std::size_t offset, count;  // offset within the block, elements
    };
    std::size_t total() const { return first_chunk.back(); }
    Piece piece(int q, std::size_t c) const {
      const std::size_t off = c * chunk;
      return {q, off, std::min(chunk, count[static_cast<std::size_t>(q)] - off)};
    }
  };
  BlockChunks plan_blocks(std::vector<std::size_t> counts, std::size_t total, std::size_t es) const {
    BlockChunks p;
    p.chunk = chunk_elements(total, es);
    p.offset = detail::offsets_of(counts);
    p.first_chunk.assign(counts.size() + 1, 0);
    for (std::size_t q = 0; q < counts.size(); ++q) p.first_chunk[q + 1] = p.first_chunk[q] + div_ceil(counts[q], p.chunk);
    p.count = std::move(counts);
    return p;
  }

  // Arrival, then the checks (check_kinds, checks()); a failed check is thrown by every rank alike
  // (they all read the same slots), after a full exit rendezvous so no slot is rewritten while read.
  template <class Checks>
  void arrive_and_check(OpState& st, Checks& checks) {
    const std::uint64_t base = st.seq * 4;
    arrive(st);
    try {
      check_kinds(st);
      checks();
    } catch (...) {
      const std::exception_ptr err = std::current_exception();
      group_->signal(rank_, base + 3);
      wait_all(st, base + 3, /*abortable=*/false);
      std::rethrow_exception(err);
    }
  }

  // The eager path (see kEagerBytes): stages `in` in this rank's slot, arrives, checks, then
  // compute(), which reads only staged copies and writes only this rank's output, so the rank leaves
  // without waiting for the others: nobody reads its buffers. The staging of seq is reused at seq + 2,
  // after every rank arrived at seq + 1 (and so finished reading seq). A failed check is thrown by
  // every rank alike, after a full exit rendezvous (arrive_and_check).
  template <class Checks, class Compute>
  void eager_collective(OpState& st, ConstBuffer in, Checks&& checks, Compute&& compute) {
    const std::uint64_t base = st.seq * 4;
    if (in.count > 0) std::memcpy(my_slot().staged(st.seq), in.data, in.count * dtype_size(in.dtype));
    arrive_and_check(st, checks);
    compute();
    my_slot().progress.store(base + 3, std::memory_order_release);  // for timeout messages only
  }

  // Arrival, checks, then the data phase as the plan's chunks (see the top). Each rank first claims
  // the chunks of its own block, in order (the same rank touches the same memory every time: its
  // caches stay warm), then takes what is left of the other blocks: a descheduled rank's share is
  // done by those that run. run_chunk(piece) must touch only that piece's part of any buffer and
  // wait for nothing. The plan comes from this rank's arguments: once checks() passed, every rank's
  // is equal. A rank leaves when every chunk is done: nobody touches its buffers after that. A failed
  // check is thrown by every rank alike, after a full exit rendezvous (as in collective()).
  template <class Checks, class RunChunk>
  void chunked_collective(OpState& st, const BlockChunks& plan, detail::Stores stores, Checks&& checks,
                          RunChunk&& run_chunk) {
    const std::uint64_t base = st.seq * 4;
    arrive_and_check(st, checks);
    Group& g = *group_;
    ChunkWork& work = g.work[st.seq & 1];
    const std::size_t n_chunks = plan.total();
    std::uint64_t mine = 0;  // chunks this rank did
    for (int k = 0; k < size_; ++k) {
      const int q = (rank_ + k) % size_;
      const std::size_t in_block = plan.first_chunk[q + 1] - plan.first_chunk[q];
      std::atomic<std::uint64_t>& claimed = work.claimed[static_cast<std::size_t>(q)].value;
      if (in_block == 0 || (k > 0 && claimed.load(std::memory_order_relaxed) >= in_block)) continue;
      for (;;) {
        const std::uint64_t c = claimed.fetch_add(1, std::memory_order_relaxed);
        if (c >= in_block) break;
        run_chunk(plan.piece(q, static_cast<std::size_t>(c)));
        ++mine;
      }
    }
    if (mine > 0) {
      if (stores == detail::Stores::Streaming) detail::stream_fence();  // our stores visible before "done" is
      if (work.done.value.fetch_add(mine, std::memory_order_seq_cst) + mine == n_chunks) g.wake();
    }
    // Chunks still running on other ranks: bounded work (no waits inside), so not abortable; the
    // deadline (with wait_all's grace) still holds.
    const auto deadline = std::max(st.deadline, Clock::now() + std::chrono::seconds(1));
    wait_for(st, [&] { return work.done.value.load(std::memory_order_acquire) == n_chunks; },
             /*abortable=*/false, base + 3, deadline);
    my_slot().progress.store(base + 3, std::memory_order_release);  // for timeout messages only
  }

  // Arrival, checks + data phase, exit rendezvous (see the top). A failed check is thrown by every
  // rank alike (they all see the same slots), after the exit so no slot is rewritten while read.
  template <class DataPhase>
  void collective(OpState& st, DataPhase&& data_phase) {
    const std::uint64_t base = st.seq * 4;
    arrive(st);
    std::exception_ptr err;
    try {
      check_kinds(st);
      data_phase();
    } catch (...) {
      err = std::current_exception();
    }
    group_->signal(rank_, base + 3);
    // Not abortable: peers between their arrival and exit are copying from / into my buffers and
    // finish without waiting on anything, so this wait is short; leaving early could free buffers
    // under their feet. It still has the deadline.
    wait_all(st, base + 3, /*abortable=*/false);
    if (err) std::rethrow_exception(err);
  }

  // Always on (the alternative is reading the wrong buffers): every rank calls the same op. With debug
  // checks, the full descriptors (dtype, sizes, counts, root, reduce op) must agree too.
  void check_kinds(const OpState& st) const {
    const CallDesc& d0 = call(0, st.seq).desc;
    if (debug_checks_) {
      std::vector<CallDesc> descs;
      for (int q = 0; q < size_; ++q) descs.push_back(call(q, st.seq).desc);
      detail::check_same_calls(descs, "threads", rank_);
    }
    for (int q = 1; q < size_; ++q) {
      const CallDesc& dq = call(q, st.seq).desc;
      if (dq.op != d0.op) {
        throw CollectiveMismatch(
            fmt::format("threads: collective mismatch at seq {} (seen on rank {}): rank 0 called {} but rank {} "
                        "called {}", st.seq, rank_, detail::describe(d0), q, detail::describe(dq)),
            "threads", std::string(detail::op_name(st.kind)), st.seq, rank_);
      }
    }
  }

  // A field that must agree across ranks: InvalidArgument (misuse) or, for the op's kind of
  // arguments (root, reduce op), CollectiveMismatch.
  template <class Field>
  void check_equal_field(const OpState& st, std::string_view what, Field field, bool mismatch = false) const {
    const CallData& c0 = call(0, st.seq);
    const std::uint64_t v0 = field(c0);
    for (int q = 1; q < size_; ++q) {
      const CallData& cq = call(q, st.seq);
      const std::uint64_t v = field(cq);
      if (v == v0) continue;
      std::string msg = fmt::format("threads: {} seq {}: ranks disagree on {}: rank 0 called {} but rank {} called {} "
                                    "(seen on rank {})", detail::op_name(st.kind), st.seq, what,
                                    detail::describe(c0.desc), q, detail::describe(cq.desc), rank_);
      if (mismatch) throw CollectiveMismatch(msg, "threads", std::string(detail::op_name(st.kind)), st.seq, rank_);
      throw InvalidArgument(msg);
    }
  }

  // Called after the output (all_gather) or input (reduce_scatter) sizes were checked equal: ranks
  // that both passed no counts (counts_hash 0) have the same equal shards, and the peer's vector
  // (two more cache lines from another core) is not read.
  void check_equal_counts(const OpState& st) const {
    const CallData& c0 = call(0, st.seq);
    for (int q = 1; q < size_; ++q) {
      const CallData& cq = call(q, st.seq);
      if (cq.desc.counts_hash == 0 && c0.desc.counts_hash == 0) continue;
      if (cq.counts != c0.counts) {
        throw InvalidArgument(fmt::format("threads: {} seq {}: ranks pass different counts: rank 0 {} but rank {} {} "
                                          "(seen on rank {})", detail::op_name(st.kind), st.seq,
                                          detail::counts_text(c0.counts), q, detail::counts_text(cq.counts), rank_));
      }
    }
  }

  // Arrival at collective st.seq: publish (progress, for naming missing ranks) and count ourselves
  // in, then wait until everyone did. Giving up (deadline, peer failure, cancel) withdraws our arrival
  // first; if the collective completed meanwhile it cannot be withdrawn and we take part after all.
  void arrive(OpState& st) {
    Group& g = *group_;
    const std::uint64_t base = st.seq * 4;
    const std::uint64_t target = (st.seq + 1) * static_cast<std::uint64_t>(size_);
    my_slot().progress.store(base + 1, std::memory_order_release);  // read only to name missing ranks
    if (g.arrivals.fetch_add(1, std::memory_order_seq_cst) + 1 == target) {
      g.work[(st.seq + 1) & 1].reset();  // see Group::work
    }
    g.wake();
    try {
      wait_for(st, [&] { return g.arrivals_reached(target); }, /*abortable=*/true, base + 1, st.deadline);
    } catch (...) {
      std::uint64_t v = g.arrivals.load(std::memory_order_seq_cst);
      while (v < target) {
        // (Our progress stays at the arrival: peers that time out name the ranks that never came.)
        if (g.arrivals.compare_exchange_weak(v, v - 1, std::memory_order_seq_cst)) throw;
      }
      // Complete: every rank is in the data phase or about to be; leaving now could free buffers
      // they read. The data phase is bounded, so go ahead.
    }
  }

  // Waits until every rank's progress reached target (the exit and split's middle step). These come
  // after a complete arrival, when every rank only has bounded work left: the deadline gets 1 s of
  // grace so a collective that arrived just in time does not fail on its way out.
  void wait_all(OpState& st, std::uint64_t target, bool abortable) {
    Group& g = *group_;
    const auto deadline = std::max(st.deadline, Clock::now() + std::chrono::seconds(1));
    wait_for(st, [&] { return g.all_reached(target); }, abortable, target, deadline);
  }

  // Waits for done(). abortable: also gives up when another rank failed (PeerFailed) or our caller
  // cancelled. Always gives up at the op's deadline (CommTimeout naming the ranks whose progress is
  // below progress_target, i.e. that had not arrived / finished).
  template <class Done>
  void wait_for(OpState& st, Done&& done, bool abortable, std::uint64_t progress_target,
                Clock::time_point deadline) {
    Group& g = *group_;
    if (done()) return;
    // 0) a short spin before reading the clock (tens of ns on a VM: a tenth of a small collective):
    // a peer on another core usually arrives within it.
    if (g.spin) {
      for (int i = 0; i < 64; ++i) {
        cpu_relax();
        if (done()) return;
      }
    }
    // 1) spin, only when every rank can have its own core, for an adaptive budget of 0-20 us; 2) yield
    // until 50 us have passed: when the rank we wait for is runnable on our core (more ranks than
    // cores, or a neighbour's load) this hands it the CPU at once, where a futex sleep costs a trip
    // through the scheduler on both sides (4 ranks on 2 cores, 64 KiB: 8 us per collective with this
    // phase, 27-36 us without); 3) sleep on the group futex.
    // The budget follows how long waits take: it grows while they end within 10 us (the peer runs on
    // another core: spinning answers fastest) and halves when they do not (the peer is descheduled,
    // e.g. it shares our core with a neighbour's build: spinning would only burn our slice; 2 ranks,
    // 64 KiB under load: 29 us per collective with a fixed 20 us spin).
    const auto start = Clock::now();
    auto adapt = [&] {
      const auto took = Clock::now() - start;
      spin_budget_ = took < kShortWait ? std::min(kMaxSpin, 2 * spin_budget_ + std::chrono::microseconds(1))
                                       : spin_budget_ / 2;
    };
    if (g.spin && spin_budget_.count() > 0) {
      for (int i = 1;; ++i) {
        cpu_relax();
        if (done()) return adapt();
        if ((i & 63) == 0 && Clock::now() - start > spin_budget_) break;
      }
    }
    while (Clock::now() - start < std::chrono::microseconds(50)) {
      sched_yield();
      if (done()) return adapt();
    }
    spin_budget_ /= 2;
    // Counted in as a sleeper before reading the word and checking done(): see Group::wake.
    struct Sleeper {
      std::atomic<int>& n;
      explicit Sleeper(std::atomic<int>& count) : n(count) { n.fetch_add(1, std::memory_order_seq_cst); }
      ~Sleeper() { n.fetch_sub(1, std::memory_order_seq_cst); }
    } sleeper(g.sleepers);
    for (;;) {
      const std::uint32_t seen = g.futex_word.load(std::memory_order_seq_cst);
      if (done()) return;
      if (abortable && g.universe->failed.load(std::memory_order_acquire)) {
        throw PeerFailed(fmt::format("{}: giving up: {}", where(st.kind, st.seq), g.universe->failure()), "threads",
                         std::string(detail::op_name(st.kind)), st.seq, rank_);
      }
      const auto now = Clock::now();
      if (now >= deadline || (abortable && st.cancelled())) {
        const std::vector<int> missing = g.missing(progress_target);
        const char* phase = progress_target % 4 == 1 ? "arrive" : "finish";
        throw CommTimeout(fmt::format("{}: deadline passed{} waiting for ranks to {}; missing ranks: {} (of this "
                                      "communicator; world ranks: {})", where(st.kind, st.seq),
                                      st.cancelled() ? " (the caller's wait gave up)" : "", phase,
                                      detail::missing_text(missing), world_of(missing)),
                          "threads", std::string(detail::op_name(st.kind)), st.seq, rank_, missing);
      }
      const auto slice = std::min<std::chrono::nanoseconds>(deadline - now, std::chrono::milliseconds(10));
      futex_wait(&g.futex_word, seen, slice);
    }
  }

  std::string world_of(const std::vector<int>& ranks) const {
    std::vector<int> w;
    for (int q : ranks) w.push_back(group_->world_ranks[static_cast<std::size_t>(q)]);
    return detail::missing_text(w);
  }

  // Point to point: a send and a recv on channel (src -> dst) match in posting order with equal tags.
  // Whoever comes second copies (under the group's p2p lock) and completes both.
  WorkPtr post_p2p(OpKind kind, const std::shared_ptr<P2PRequest>& req, int peer, const CollectiveOptions& opt) {
    const bool is_send = kind == OpKind::Send;
    const int src = is_send ? rank_ : peer, dst = is_send ? peer : rank_;
    const std::size_t channel = static_cast<std::size_t>(src) * size_ + dst;
    auto op = new_op(kind, p2p_count_[static_cast<std::size_t>(peer)]++, opt);
    op->peer = peer;
    op->status.store(1);
    req->op = op;
    Group& g = *group_;
    std::shared_ptr<P2PRequest> match;
    {
      std::lock_guard lock(g.p2p_m);
      if (g.universe->failed.load()) {
        throw PeerFailed(fmt::format("threads: {} to/from rank {} on rank {}: {}", detail::op_name(kind), peer, rank_,
                                     g.universe->failure()), "threads", std::string(detail::op_name(kind)), op->seq,
                         rank_);
      }
      auto& others = is_send ? g.recvs[channel] : g.sends[channel];
      auto it = std::find_if(others.begin(), others.end(), [&](const auto& r) { return r->tag == req->tag; });
      if (it == others.end()) {
        (is_send ? g.sends[channel] : g.recvs[channel]).push_back(req);
      } else {
        match = *it;
        others.erase(it);
        complete_pair(is_send ? *req : *match, is_send ? *match : *req, src, dst);
      }
    }
    std::weak_ptr<Group> weak_group = group_;
    std::weak_ptr<P2PRequest> weak_req = req;
    const std::string w = fmt::format("threads: {} (tag {}) from rank {} to rank {}", detail::op_name(kind), req->tag,
                                      src, dst);
    op->withdraw = [weak_group, weak_req, channel, is_send, w, peer, this_rank = rank_](const std::string& waited) {
      auto g = weak_group.lock();
      auto r = weak_req.lock();
      if (!g || !r) return;
      std::lock_guard lock(g->p2p_m);
      auto& mine = is_send ? g->sends[channel] : g->recvs[channel];
      auto it = std::find(mine.begin(), mine.end(), r);
      if (it == mine.end()) return;  // matched (or failed) already
      mine.erase(it);
      r->op->finish(std::make_exception_ptr(CommTimeout(
          fmt::format("{}: gave up {} without the matching call; missing rank: {}", w, waited, peer),
          "threads", std::string(detail::op_name(r->op->kind)), r->op->seq, this_rank, {peer})));
    };
    return make_work(std::move(op));
  }

  static void complete_pair(P2PRequest& send, P2PRequest& recv, int src, int dst) {
    if (send.count != recv.count || send.dtype != recv.dtype) {
      const std::string what = fmt::format(
          "threads: send of {} {} from rank {} to rank {} (tag {}) does not match the recv of {} {} posted for it",
          send.count, dtype_name(send.dtype), src, dst, send.tag, recv.count, dtype_name(recv.dtype));
      // One exception object per op: the two ranks rethrow and release them on their own threads,
      // and a shared one would be ordered only by the C++ runtime's (uninstrumented) reference
      // count, which ThreadSanitizer cannot see (it reported the destruction as a race).
      send.op->finish(std::make_exception_ptr(InvalidArgument(what)));
      recv.op->finish(std::make_exception_ptr(InvalidArgument(what)));
      return;
    }
    if (send.count > 0) std::memcpy(recv.recv_data, send.send_data, send.count * dtype_size(send.dtype));
    send.op->finish(nullptr);
    recv.op->finish(nullptr);
  }

  std::shared_ptr<Group> group_;
  // wait_for's spin budget (ops of one communicator run one at a time, so one thread uses it).
  static constexpr std::chrono::nanoseconds kMaxSpin = std::chrono::microseconds(20);
  static constexpr std::chrono::nanoseconds kShortWait = std::chrono::microseconds(10);
  std::chrono::nanoseconds spin_budget_ = kMaxSpin;
  // The chunk pointers of the op running (ops of one communicator run one at a time).
  std::vector<const void*> ins_;
  std::vector<void*> outs_;
  std::vector<std::uint64_t> p2p_count_ = std::vector<std::uint64_t>(static_cast<std::size_t>(size_), 0);
};

}  // namespace

PinRanks pin_ranks_from_env() {
  const char* text = std::getenv("MESHGRAD_PIN_RANKS");
  if (text == nullptr || *text == '\0') return PinRanks::Auto;
  const std::string_view v(text);
  if (v == "auto") return PinRanks::Auto;
  if (v == "on" || v == "1" || v == "yes") return PinRanks::On;
  if (v == "off" || v == "0" || v == "no") return PinRanks::Off;
  throw InvalidArgument(fmt::format("MESHGRAD_PIN_RANKS must be auto, on or off, got '{}'", v));
}

std::vector<int> rank_cores(PinRanks pin, int world_size, int rank, const std::vector<int>& process_cores) {
  if (pin == PinRanks::Off || process_cores.empty()) return {};
  if (pin == PinRanks::Auto && world_size < static_cast<int>(process_cores.size())) return {};
  return {process_cores[static_cast<std::size_t>(rank) % process_cores.size()]};
}

namespace {

// The CPU ids this process may run on, ascending.
std::vector<int> process_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cores;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cores;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cores.push_back(c);
  }
  return cores;
}

// Pins the calling thread to `cores` (nothing when empty). Returns "" or what failed.
std::string pin_this_thread(const std::vector<int>& cores) {
  if (cores.empty()) return "";
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cores) CPU_SET(c, &set);
  const int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  return rc == 0 ? "" : fmt::format("cannot pin to core {}: {}", fmt::join(cores, ","), std::strerror(rc));
}

}  // namespace

void run_ranks(int world_size, const std::function<void(const CommunicatorPtr&)>& fn, const ThreadsOptions& options) {
  MG_CHECK(world_size >= 1, "run_ranks: world_size must be >= 1, got {}", world_size);
  // Checked before the group's P x P mailboxes are allocated.
  MG_CHECK(world_size <= kMaxThreadRanks, "run_ranks: {} rank threads asked for; the threads backend runs at most {}",
           world_size, kMaxThreadRanks);
  MG_CHECK(options.timeout.count() >= 0, "run_ranks: timeout must be >= 0 ms, got {}", options.timeout.count());
  const Milliseconds timeout = options.timeout.count() > 0 ? options.timeout : default_timeout_from_env();

  std::vector<int> world(static_cast<std::size_t>(world_size));
  std::iota(world.begin(), world.end(), 0);
  auto universe = std::make_shared<Universe>();
  auto group = std::make_shared<Group>(world_size, universe, world);
  universe->add(group);

  std::mutex first_m;
  std::exception_ptr first_error;  // the first rank to fail, by time
  auto record_failure = [&](int r, std::exception_ptr error, const std::string& what) {
    {
      std::lock_guard lock(first_m);
      if (!first_error) first_error = std::move(error);
    }
    universe->fail(r, what);   // wakes every rank waiting in any group of this run
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(world_size));
  const std::vector<int> cores = process_cores();
  for (int r = 0; r < world_size; ++r) {
    try {
      threads.emplace_back([&, r] {
        trace::name_this_thread(fmt::format("rank {}", r), r * trace::kRankLaneStride);   // its lane in a trace
        try {
          // Before the communicator: its progress thread inherits the rank's core.
          const std::string pin_error = pin_this_thread(rank_cores(options.pin, world_size, r, cores));
          if (!pin_error.empty() && options.pin == PinRanks::On) {
            throw CommError(fmt::format("run_ranks: rank {}: {} (MESHGRAD_PIN_RANKS=on)", r, pin_error), "threads",
                            "run_ranks", 0, r);
          }
          {
            CommunicatorPtr comm = std::make_shared<ThreadsComm>(group, r, timeout, options.debug_checks);
            fn(comm);
          }  // the communicator (and its progress thread) ends with the rank
        } catch (...) {
          std::string what = "unknown exception";
          try {
            throw;
          } catch (const std::exception& e) {
            what = e.what();
          } catch (...) {
          }
          record_failure(r, std::current_exception(), what);
        }
      });
    } catch (const std::system_error& e) {
      // The ranks already started may wait for this one in a collective: fail the run so they stop
      // (PeerFailed), join them, and report which rank could not start (a joinable std::thread
      // destroyed unjoined would call std::terminate).
      const std::string what = fmt::format("run_ranks: cannot start the thread of rank {} of {}: {} (the system's "
                                           "thread or memory limit; use fewer ranks)", r, world_size, e.what());
      record_failure(r, std::make_exception_ptr(CommError(what, "threads", "run_ranks", 0, r)), what);
      break;
    }
  }
  for (auto& t : threads) t.join();
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace meshgrad::comm
