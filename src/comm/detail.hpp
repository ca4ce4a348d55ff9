// Internals shared by the communicator backends (threads, mpi): call descriptors, the misuse checks
// every backend runs before data moves, the rank-order reduction kernel, and CommBase, which owns a
// communicator's sequence numbers, deadlines and the executor that runs its operations in order.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "meshgrad/comm/communicator.hpp"
#include "meshgrad/comm/errors.hpp"
#include "meshgrad/tensor/trace.hpp"

namespace meshgrad::comm::detail {

using Clock = std::chrono::steady_clock;

enum class OpKind : std::uint8_t { AllReduce, AllGather, ReduceScatter, Broadcast, AllToAll, Barrier, Split, Send, Recv };
std::string_view op_name(OpKind op);

// A fixed-size, trivially copyable description of one collective call: what the debug check compares
// across ranks (the mpi backend sends it as bytes with one MPI_Allgather).
struct CallDesc {
  std::uint64_t seq = 0;
  std::uint64_t in_count = 0;
  std::uint64_t out_count = 0;
  std::uint64_t counts_hash = 0;  // hash of the counts vector (0 = equal shards / none)
  std::int32_t root = -1;         // broadcast root; split color
  std::uint8_t op = 0;            // OpKind
  std::uint8_t dtype = 0;         // DType
  std::uint8_t reduce_op = 0xff;  // ReduceOp, 0xff = not a reduction
  std::uint8_t pad = 0;
};
static_assert(sizeof(CallDesc) == 40);

CallDesc make_desc(OpKind op, std::uint64_t seq, DType dtype, std::size_t in_count, std::size_t out_count,
                   int root = -1, int reduce_op = -1, Counts counts = {});
// "all_reduce(seq 3, float32, in 10, out 10, op sum)"
std::string describe(const CallDesc& d);
// The fields that must agree across ranks for op d.op (all_to_all: everything but the counts, which
// legitimately differ per rank and are checked pairwise instead).
bool same_call(const CallDesc& a, const CallDesc& b);
// Debug check over every rank's descriptor (descs[r] = rank r's call): throws CollectiveMismatch
// naming rank 0's call and the first rank whose call differs. Same verdict on every rank.
void check_same_calls(const std::vector<CallDesc>& descs, std::string_view backend, int this_rank);

// ---- misuse checks (InvalidArgument, before data moves) -------------------------------------------
std::string counts_text(Counts counts);
void check_reduction_dtype(std::string_view op, DType dtype);
void check_same_dtype(std::string_view op, DType in, DType out);
void check_data(std::string_view op, std::string_view which, const void* data, std::size_t count);
void check_no_overlap(std::string_view op, ConstBuffer in, ConstBuffer out);
void check_rank(std::string_view op, std::string_view what, int r, int size);
// counts.empty(): equal shards of `total` (must divide by size); else counts.size() == size and
// sum(counts) == total. Returns the per-rank counts.
std::vector<std::size_t> resolve_counts(std::string_view op, std::string_view what, Counts counts,
                                        std::size_t total, int size);
std::vector<std::size_t> offsets_of(const std::vector<std::size_t>& counts);
// Bytes of a buffer, for traces.
inline std::int64_t bytes_of(ConstBuffer b) { return static_cast<std::int64_t>(b.count * dtype_size(b.dtype)); }

// ---- per-op argument validation ---------------------------------------------------------------------
// One function per op, called by every backend before it issues the op, so each misuse check is
// written once. Each throws InvalidArgument on the first check that fails, in the order listed (the
// order and the messages are part of the contract: tests assert on them). Checks that depend on the
// backend (e.g. MPI's int32 count limit) stay in the backend and run after these.

// all_reduce: reduction dtype (float32 / float64); in and out have the same dtype; neither buffer is
// null with elements; in.count == out.count. in == out (in place) is allowed.
void check_all_reduce_args(ConstBuffer in, ConstBuffer out, int rank);
// all_gather: same dtype; non-null buffers; no overlap; out.count resolved into per-rank counts
// (resolve_counts, "the output"); in.count == counts[rank]. Returns the resolved counts.
std::vector<std::size_t> check_all_gather_args(ConstBuffer in, ConstBuffer out, Counts counts, int size, int rank);
// reduce_scatter: reduction dtype; same dtype; non-null buffers; no overlap; in.count resolved into
// per-rank counts (resolve_counts, "the input"); out.count == counts[rank]. Returns the resolved counts.
std::vector<std::size_t> check_reduce_scatter_args(ConstBuffer in, ConstBuffer out, Counts counts, int size,
                                                   int rank);
// broadcast: root in [0, size); the buffer is not null with elements.
void check_broadcast_args(ConstBuffer buf, int root, int size);
// all_to_all: same dtype; non-null buffers; no overlap; in.count resolved into send counts, then
// out.count into recv counts (resolve_counts). Returns both. Whether what rank s sends to d matches
// what d expects from s needs the peers' counts: the backends check that during the op.
struct AllToAllCounts {
  std::vector<std::size_t> send, recv;
};
AllToAllCounts check_all_to_all_args(ConstBuffer in, ConstBuffer out, Counts send_counts, Counts recv_counts,
                                     int size);
// send / recv (op is OpKind::Send or OpKind::Recv; data, count: the input resp. output buffer): peer
// in [0, size) and not this rank; tag >= 0; the buffer is not null with elements.
void check_point_to_point_args(OpKind op, const void* data, std::size_t count, int peer, int tag, int rank,
                               int size);

// ---- rank-order reduction and copies ----------------------------------------------------------------
// How results are stored. Streaming (non-temporal) stores skip the caches: for results larger than
// the caches keep anyway they save the read-for-ownership of every line (a third less memory
// traffic), but a result read right after comes from memory. Auto streams from kStreamingBytes
// written in the call and fences before returning; Streaming leaves the fence to the caller
// (stream_fence() once after all its streaming calls, before another thread may read the results).
enum class Stores { Auto, Cached, Streaming };
inline constexpr std::size_t kStreamingBytes = std::size_t(8) << 20;
void stream_fence();

// For i in [0, count): r = ((in[0][i] op in[1][i]) op in[2][i]) ... op in[n_in-1][i] in the dtype of
// the buffers (Avg: the sum, then / divisor), written to every outs[k][i]. Reads every input of an
// element before writing any output of it, so an output may be an input (in-place all_reduce).
// Element by element the bits never depend on the count, the chunking or the stores: a range of a
// buffer reduced alone gives the same bits as inside the whole. This one function is used by every
// backend: the bits cannot differ between them. bfloat16 buffers are combined in float32 (their
// values widened exactly) and rounded once to bf16 at the end.
void reduce_rank_order(DType dtype, ReduceOp op, int divisor, const void* const* in, int n_in, void* const* outs,
                       int n_out, std::size_t count, Stores stores = Stores::Auto);
// memcpy with the stores chosen as above (Auto: streaming from kStreamingBytes, fenced).
void copy_bytes(void* dst, const void* src, std::size_t bytes, Stores stores = Stores::Auto);
// The same bytes into every dsts[k] (Auto: streaming from kStreamingBytes written in all), reading
// the source once where it can.
void copy_to_all(const void* src, void* const* dsts, int n_dst, std::size_t bytes, Stores stores = Stores::Auto);

// ---- deadlines --------------------------------------------------------------------------------------
Milliseconds resolve_timeout(Milliseconds per_call, Milliseconds communicator_default);
// t + d (d >= 0), saturated at time_point::max(): a huge timeout (MESHGRAD_COMM_TIMEOUT_MS=10^13 is
// 10^19 ns, past int64) means "wait very long", never a deadline that wrapped into the past.
template <class Rep, class Period>
Clock::time_point add_saturated(Clock::time_point t, std::chrono::duration<Rep, Period> d) {
  const auto headroom = std::chrono::floor<std::chrono::duration<Rep, Period>>(Clock::time_point::max() - t);
  if (d >= headroom) return Clock::time_point::max();
  return t + std::chrono::duration_cast<Clock::duration>(d);
}
std::string missing_text(const std::vector<int>& ranks);

// ---- one operation in flight ------------------------------------------------------------------------
// What a trace shows of a collective, filled at launch while a trace records (tensor/trace.hpp).
struct OpTrace {
  Clock::time_point launched;
  std::string group;          // the communicator's label ("tp"); "" = none
  std::string label;          // CollectiveOptions::trace_label
  std::int64_t bytes = 0;     // nccl-tests convention: the whole (gathered / unreduced) buffer
  int launcher_lane = 0;                // async launches: the launching thread's lane (0: not
  Clock::duration launcher_cpu{};       // measured) and its CPU time at the launch
};

struct OpState {
  OpKind kind{};
  std::uint64_t seq = 0;  // collectives: the sequence number; point to point: the peer's message no.
  Clock::time_point deadline;
  std::function<void(OpState&)> body;  // runs the op; throws on failure
  std::atomic<int> status{0};          // 0 queued, 1 running, 2 done
  std::atomic<bool> cancel{false};     // set when a caller's shorter wait() gave up
  std::exception_ptr error;            // written before status = 2 (release)
  // Passive ops (threads point to point) have no body: a peer's matching call completes them. The
  // Work calls withdraw(how long it waited) when its wait expires: if the request is still unmatched
  // it is removed (never touched afterwards) and the op finished with a CommTimeout.
  std::function<void(const std::string&)> withdraw;
  int peer = -1;
  std::unique_ptr<OpTrace> trace;      // set before the op is submitted, when traced; then read-only
  std::mutex m;
  std::condition_variable cv;

  bool cancelled() const { return cancel.load(std::memory_order_relaxed); }
  void finish(std::exception_ptr e);
  // Waits for status 2 until `until`; returns whether done. Spins briefly, then blocks.
  bool wait_done(Clock::time_point until);
};

// Runs the operations of one communicator in issue order: on the calling thread when the caller
// waits at once and nothing is queued (the blocking forms: no hand-off), else on a progress thread
// started on first use. The destructor lets queued operations finish (each is bounded by its
// deadline) and joins the thread.
// Traced operations (OpState::trace) are drawn on the executor's lane, one after the other from
// launch (or the end of the operation before, if later) to completion, whichever thread ran them;
// one run on the calling thread is also a "wait" on the caller's lane, which blocked meanwhile.
class Executor {
 public:
  Executor() = default;
  ~Executor();
  void submit(const std::shared_ptr<OpState>& op, bool caller_waits);
  // For an op the caller runs itself (CommBase::submit's inline path): true, and the executor is
  // held, when nothing is queued or running; end_inline() releases it. False: queue it instead.
  bool try_begin_inline();
  void end_inline();
  trace::Lane& lane() { return lane_; }

 private:
  void loop();
  void run(OpState& op, bool on_caller);
  void record(const OpState& op, Clock::time_point started, Clock::time_point end, bool on_caller, bool failed);
  trace::Lane lane_;
  Clock::time_point last_end_;  // of the last traced op; only the thread running an op touches it
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<OpState>> queue_;
  bool busy_ = false;  // an op runs inline on a caller thread
  bool stop_ = false;
  std::thread thread_;
};

// Whether a communicator can still be used: a timeout leaves it broken (ranks no longer agree on
// which collective comes next). Shared with the Work handles, which may outlive the communicator.
struct Health {
  mutable std::mutex m;
  std::atomic<bool> broken{false};
  std::string reason;
  void mark_broken(std::string why);
  std::string broken_reason() const;
};

// What the backends share: rank, size, defaults, sequence numbers, the executor, and the "broken"
// state a timeout leaves behind.
class CommBase : public Communicator {
 public:
  CommBase(int rank, int size, Milliseconds default_timeout, bool debug_checks);
  ~CommBase() override;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Milliseconds default_timeout() const override { return default_timeout_; }
  bool debug_checks() const { return debug_checks_; }
  // Before the first collective only (a backend whose ranks agree on the checks once they exist).
  void set_debug_checks(bool on) { debug_checks_ = on; }
  void set_label(std::string label) override { label_ = std::move(label); }

  // Throws CommError if the communicator is broken.
  void check_usable(OpKind op, std::uint64_t seq) const;
  // Builds the CommTimeout / PeerFailed / CommError messages: "<backend>: <op> seq <s> on rank <r> of
  // <n>[ of group <label>]: ..."
  std::string where(OpKind op, std::uint64_t seq) const;

 protected:
  // Issues a collective: assigns the next sequence number and runs body in order. The body gets
  // the OpState (its seq, deadline and cancel flag).
  // bytes: what a trace shows (OpTrace::bytes).
  WorkPtr submit_collective(OpKind kind, const CollectiveOptions& opt, std::int64_t bytes,
                            std::function<void(OpState&)> body);
  // submit_collective, and for the blocking forms (opt.caller_waits) with nothing queued and tracing
  // off, body runs right here on an OpState on the stack: no allocation, no Work of its own (the
  // returned one is already complete; errors are thrown from here). What that saves is most of a
  // small collective's cost: a 1 KiB all_reduce on one rank, 0.4 us through submit_collective.
  template <class Body>
  WorkPtr submit(OpKind kind, const CollectiveOptions& opt, std::int64_t bytes, Body&& body) {
    if (!opt.caller_waits || trace::enabled() || !executor_->try_begin_inline()) {
      return submit_collective(kind, opt, bytes, std::function<void(OpState&)>(std::forward<Body>(body)));
    }
    struct Release {
      Executor& e;
      ~Release() { e.end_inline(); }
    } release{*executor_};
    OpState st;
    st.kind = kind;
    st.seq = next_seq_++;
    st.deadline = deadline_of(opt);
    run_body(*this, *health_, body, st);
    return done_work_;
  }
  // Runs an op's body: refused when the communicator is broken; a timeout or a failed peer breaks it.
  template <class Body>
  static void run_body(const CommBase& comm, Health& health, Body& body, OpState& st) {
    comm.check_usable(st.kind, st.seq);
    try {
      body(st);
    } catch (const CommTimeout& e) {
      health.mark_broken(e.what());
      throw;
    } catch (const PeerFailed& e) {
      health.mark_broken(e.what());
      throw;
    }
  }
  // A new op with its deadline (now + the call's timeout); point to point ops use it directly.
  std::shared_ptr<OpState> new_op(OpKind kind, std::uint64_t seq, const CollectiveOptions& opt) const;
  // The caller's handle on op.
  WorkPtr make_work(std::shared_ptr<OpState> op) const;
  // Joins the progress thread; backends call it first in their destructor (the thread may use them).
  void shutdown_executor() { executor_.reset(); }

  int rank_, size_;
  Milliseconds default_timeout_;
  std::string label_;   // set_label's; "" = none
  bool debug_checks_;
  std::uint64_t next_seq_ = 0;  // issued by the (one) thread that calls this communicator

 private:
  Clock::time_point deadline_of(const CollectiveOptions& opt) const;

  std::shared_ptr<Health> health_ = std::make_shared<Health>();
  std::unique_ptr<Executor> executor_ = std::make_unique<Executor>();
  WorkPtr done_work_;  // what submit's inline path returns: complete, nothing to wait for
};

}  // namespace meshgrad::comm::detail
