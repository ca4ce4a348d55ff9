// The mpi backend: one process per rank (mpirun), nonblocking MPI collectives behind every op.
//
// Determinism: MPI does not promise an order for its reductions (MPI_Allreduce may add in any tree
// order), so reductions never use MPI_Op. all_reduce, P = 3, chunks c0 | c1 | c2 (shard_range):
//   MPI_Ialltoallv: rank r receives chunk c_r of every rank's input into scratch rows 0..P-1
//   local:          out[c_r] = (row0 + row1) + row2   (the same kernel as the threads backend)
//   MPI_Iallgatherv: every rank receives every reduced chunk (in place)
// Each rank sends and receives (P-1)/P of the buffer twice: the traffic of a ring all_reduce.
// reduce_scatter is the first two steps. Small all_reduce (each rank sends at most 2 MiB in all) is
// one round instead: every rank MPI_Isends its whole input to every peer and reduces all P inputs
// in rank order itself (the same per-element order, so the same bits). all_gather is point to point
// too: every rank MPI_Isends its block to every peer, which MPI_Irecvs it straight into its output.
// These internal messages use their own duplicate communicator (internal_), never the one of the
// user's send/recv (p2p_); the executor runs collectives in order on every rank and MPI does not
// let messages between two ranks overtake each other, so one tag suffices.
//
// Deadlines: each step is a nonblocking call (or a set of Isend/Irecv) polled with MPI_Test(all) (busy
// for 1 ms, then yielding, then sleeping up to 1 ms) until the op's deadline, then CommTimeout. MPI
// cannot tell which ranks have not arrived, and cannot cancel a collective: after a timeout the
// communicator is unusable and the process should abort (mpi_abort()), which is what `meshgrad`
// does. A rank that dies under mpirun shows up as such a timeout on the survivors (OpenMPI 4 has no
// failure notification).
//
// Errors: the communicators use MPI_ERRORS_RETURN; every MPI return code is wrapped once, in
// check_mpi, into CommError naming the MPI call and the MPI error string.
#include "meshgrad/comm/mpi.hpp"

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "comm/detail.hpp"
#include "meshgrad/comm/errors.hpp"
#include "meshgrad/tensor/shard.hpp"
#include "meshgrad/tensor/trace.hpp"

#if MESHGRAD_HAVE_MPI
#define OMPI_SKIP_MPICXX 1  // the C API only (the deprecated C++ bindings need an extra library)
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace meshgrad::comm {

#if !MESHGRAD_HAVE_MPI

bool mpi_backend_available() { return false; }

MpiSession::MpiSession(int*, char***) {
  throw CommError("the mpi backend is not in this build: configure with -DMESHGRAD_WITH_MPI=ON (needs the Debian "
                  "packages libopenmpi-dev and openmpi-bin) and rebuild, or use --backend threads",
                  "mpi", "init", 0, -1);
}
MpiSession::~MpiSession() = default;
CommunicatorPtr MpiSession::world(const MpiOptions&) { return nullptr; }
void mpi_abort(int code, const std::string& message) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::_Exit(code);
}
int mpi_world_rank() { return 0; }
int mpi_world_size() { return 1; }

#else

namespace {

using detail::CallDesc;
using detail::Clock;
using detail::OpKind;
using detail::OpState;

// MPI initialised by us; finalised when the last holder (session or communicator) lets go.
struct Runtime {
  bool serialize = false;  // MPI_THREAD_SERIALIZED: every MPI call under call_m
  std::mutex call_m;
  bool we_initialised = false;
  ~Runtime() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (we_initialised && !finalized) MPI_Finalize();
  }
};

std::mutex g_runtime_m;
std::weak_ptr<Runtime> g_runtime;

// Runs one MPI call, serialised when the library is not thread-multiple.
template <class F>
int mpi_call(Runtime& rt, F&& f) {
  if (rt.serialize) {
    std::lock_guard lock(rt.call_m);
    return f();
  }
  return f();
}

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", code);
  return std::string(text, static_cast<std::size_t>(len));
}

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::Float32: return MPI_FLOAT;
    case DType::Float64: return MPI_DOUBLE;
    case DType::Int64: return MPI_INT64_T;
    case DType::BFloat16: return MPI_UINT16_T;   // moved as bits (reductions are meshgrad's own, never MPI_Op)
  }
  return MPI_BYTE;
}

int as_int(std::size_t n, std::string_view op) {
  MG_CHECK(n <= static_cast<std::size_t>(INT32_MAX), "{}: {} elements exceed the MPI count limit (2^31-1)", op, n);
  return static_cast<int>(n);
}

std::vector<int> as_ints(const std::vector<std::size_t>& v, std::string_view op) {
  std::vector<int> out;
  out.reserve(v.size());
  for (std::size_t x : v) out.push_back(as_int(x, op));
  return out;
}

class MpiComm final : public detail::CommBase {
 public:
  MpiComm(std::shared_ptr<Runtime> rt, MPI_Comm coll, int rank, int size, Milliseconds timeout, bool debug)
      : CommBase(rank, size, timeout, debug), rt_(std::move(rt)), coll_(coll) {
    MPI_Comm_set_errhandler(coll_, MPI_ERRORS_RETURN);
    check_mpi(mpi_call(*rt_, [&] { return MPI_Comm_dup(coll_, &p2p_); }), "MPI_Comm_dup", OpKind::Split, 0);
    MPI_Comm_set_errhandler(p2p_, MPI_ERRORS_RETURN);
    check_mpi(mpi_call(*rt_, [&] { return MPI_Comm_dup(coll_, &internal_); }), "MPI_Comm_dup", OpKind::Split, 0);
    MPI_Comm_set_errhandler(internal_, MPI_ERRORS_RETURN);
  }
  ~MpiComm() override {
    shutdown_executor();
    mpi_call(*rt_, [&] { return MPI_Comm_free(&internal_); });
    mpi_call(*rt_, [&] { return MPI_Comm_free(&p2p_); });
    mpi_call(*rt_, [&] { return MPI_Comm_free(&coll_); });
  }

  std::string_view backend() const override { return "mpi"; }

  WorkPtr all_reduce_async(ConstBuffer in, MutableBuffer out, ReduceOp op, const CollectiveOptions& opt) override {
    detail::check_all_reduce_args(in, out, rank_);
    as_int(in.count, "all_reduce");
    return submit(OpKind::AllReduce, opt, detail::bytes_of(in), [this, in, out, op](OpState& st) {
      debug_check(st, detail::make_desc(OpKind::AllReduce, st.seq, in.dtype, in.count, out.count, -1, int(op)));
      if (size_ > 1 && in.count * dtype_size(in.dtype) * std::size_t(size_ - 1) <= kExchangeReduceBytes) {
        exchange_reduce(st, in, out, op);
        return;
      }
      std::vector<std::size_t> chunks(static_cast<std::size_t>(size_));
      for (int q = 0; q < size_; ++q) chunks[q] = static_cast<std::size_t>(shard_range(std::int64_t(in.count), size_, q).size);
      scatter_reduce(st, in, chunks, op, static_cast<char*>(out.data) + detail::offsets_of(chunks)[rank_] *
                                                                             dtype_size(in.dtype));
      if (size_ > 1) {
        const auto counts = as_ints(chunks, "all_reduce"), displs = as_ints(detail::offsets_of(chunks), "all_reduce");
        MPI_Request req;
        check_mpi(mpi_call(*rt_, [&] {
                    return MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, out.data, counts.data(), displs.data(),
                                           mpi_type(in.dtype), coll_, &req);
                  }), "MPI_Iallgatherv", st.kind, st.seq);
        wait_request(req, st, "MPI_Iallgatherv");
      }
    });
  }

  WorkPtr all_gather_async(ConstBuffer in, MutableBuffer out, Counts counts, const CollectiveOptions& opt) override {
    constexpr std::string_view name = "all_gather";
    auto resolved = detail::check_all_gather_args(in, out, counts, size_, rank_);
    auto icounts = as_ints(resolved, name), displs = as_ints(detail::offsets_of(resolved), name);
    return submit(OpKind::AllGather, opt, detail::bytes_of(out),
                             [this, in, out, resolved, icounts, displs, given = !counts.empty()](OpState& st) {
      debug_check(st, detail::make_desc(OpKind::AllGather, st.seq, in.dtype, in.count, out.count, -1, -1,
                                        given ? Counts(resolved) : Counts{}));
      exchange_gather(st, in, out, icounts, displs);
    });
  }

  WorkPtr reduce_scatter_async(ConstBuffer in, MutableBuffer out, ReduceOp op, Counts counts,
                               const CollectiveOptions& opt) override {
    auto resolved = detail::check_reduce_scatter_args(in, out, counts, size_, rank_);
    as_int(in.count, "reduce_scatter");
    return submit(OpKind::ReduceScatter, opt, detail::bytes_of(in), [this, in, out, op, resolved,
                                                          given = !counts.empty()](OpState& st) {
      debug_check(st, detail::make_desc(OpKind::ReduceScatter, st.seq, in.dtype, in.count, out.count, -1, int(op),
                                        given ? Counts(resolved) : Counts{}));
      scatter_reduce(st, in, resolved, op, out.data);
    });
  }

  WorkPtr broadcast_async(MutableBuffer buf, int root, const CollectiveOptions& opt) override {
    detail::check_broadcast_args(buf, root, size_);
    as_int(buf.count, "broadcast");
    return submit(OpKind::Broadcast, opt, detail::bytes_of(buf), [this, buf, root](OpState& st) {
      debug_check(st, detail::make_desc(OpKind::Broadcast, st.seq, buf.dtype, buf.count, buf.count, root));
      MPI_Request req;
      check_mpi(mpi_call(*rt_, [&] {
                  return MPI_Ibcast(buf.data, int(buf.count), mpi_type(buf.dtype), root, coll_, &req);
                }), "MPI_Ibcast", st.kind, st.seq);
      wait_request(req, st, "MPI_Ibcast");
    });
  }

  WorkPtr all_to_all_async(ConstBuffer in, Counts send_counts, MutableBuffer out, Counts recv_counts,
                           const CollectiveOptions& opt) override {
    constexpr std::string_view name = "all_to_all";
    const auto [sends, recvs] = detail::check_all_to_all_args(in, out, send_counts, recv_counts, size_);
    auto sc = as_ints(sends, name), sd = as_ints(detail::offsets_of(sends), name);
    auto rc = as_ints(recvs, name), rd = as_ints(detail::offsets_of(recvs), name);
    return submit(OpKind::AllToAll, opt, detail::bytes_of(in),
                             [this, in, out, sc, sd, rc, rd](OpState& st) {
      if (debug_checks_) {
        debug_check(st, detail::make_desc(OpKind::AllToAll, st.seq, in.dtype, in.count, out.count));
        // Pairwise: what rank s sends to d must be what d expects from s. Every rank gathers all
        // counts and checks every pair, so all reach the same verdict (none is left in the exchange).
        std::vector<int> mine(sc);
        mine.insert(mine.end(), rc.begin(), rc.end());
        std::vector<int> all(static_cast<std::size_t>(2 * size_ * size_));
        MPI_Request req;
        check_mpi(mpi_call(*rt_, [&] {
                    return MPI_Iallgather(mine.data(), 2 * size_, MPI_INT, all.data(), 2 * size_, MPI_INT, coll_, &req);
                  }), "MPI_Iallgather", st.kind, st.seq);
        wait_request(req, st, "MPI_Iallgather (debug check of all_to_all counts)");
        for (int s = 0; s < size_; ++s) {
          for (int d = 0; d < size_; ++d) {
            const int sent = all[std::size_t(2 * size_ * s + d)], expected = all[std::size_t(2 * size_ * d + size_ + s)];
            MG_CHECK(sent == expected, "mpi: all_to_all seq {}: rank {} sends {} elements to rank {} but rank {} "
                     "expects {} from rank {} (debug check, seen on rank {})", st.seq, s, sent, d, d, expected, s,
                     rank_);
          }
        }
      }
      MPI_Request req;
      check_mpi(mpi_call(*rt_, [&] {
                  return MPI_Ialltoallv(in.data, sc.data(), sd.data(), mpi_type(in.dtype), out.data, rc.data(),
                                        rd.data(), mpi_type(in.dtype), coll_, &req);
                }), "MPI_Ialltoallv", st.kind, st.seq);
      wait_request(req, st, "MPI_Ialltoallv");
    });
  }

  WorkPtr barrier_async(const CollectiveOptions& opt) override {
    return submit(OpKind::Barrier, opt, 0, [this](OpState& st) {
      debug_check(st, detail::make_desc(OpKind::Barrier, st.seq, DType::Float32, 0, 0));
      MPI_Request req;
      check_mpi(mpi_call(*rt_, [&] { return MPI_Ibarrier(coll_, &req); }), "MPI_Ibarrier", st.kind, st.seq);
      wait_request(req, st, "MPI_Ibarrier");
    });
  }

  std::shared_ptr<Communicator> split(int color, int key) override {
    std::shared_ptr<Communicator> result;
    CollectiveOptions opt;
    opt.caller_waits = true;
    submit(OpKind::Split, opt, 0, [this, color, key, &result](OpState& st) {
      debug_check(st, detail::make_desc(OpKind::Split, st.seq, DType::Float32, 0, 0, color));
      // First an allgather under our deadline: once it completes every rank is in the split, so the
      // blocking MPI_Comm_split below cannot wait for a rank that never comes.
      int mine[2] = {color, key};
      std::vector<int> all(static_cast<std::size_t>(2 * size_));
      MPI_Request req;
      check_mpi(mpi_call(*rt_, [&] { return MPI_Iallgather(mine, 2, MPI_INT, all.data(), 2, MPI_INT, coll_, &req); }),
                "MPI_Iallgather", st.kind, st.seq);
      wait_request(req, st, "MPI_Iallgather (split colors)");
      MPI_Comm sub = MPI_COMM_NULL;
      check_mpi(mpi_call(*rt_, [&] { return MPI_Comm_split(coll_, color < 0 ? MPI_UNDEFINED : color, key, &sub); }),
                "MPI_Comm_split", st.kind, st.seq);
      if (sub == MPI_COMM_NULL) return;
      int r = 0, n = 0;
      MPI_Comm_rank(sub, &r);
      MPI_Comm_size(sub, &n);
      result = std::make_shared<MpiComm>(rt_, sub, r, n, default_timeout_, debug_checks_);
    })->wait();
    return result;
  }

  WorkPtr send_async(ConstBuffer in, int peer, int tag, const CollectiveOptions& opt) override {
    detail::check_point_to_point_args(OpKind::Send, in.data, in.count, peer, tag, rank_, size_);
    auto op = new_op(OpKind::Send, p2p_count_[peer]++, opt);
    MPI_Request req;
    check_mpi(mpi_call(*rt_, [&] {
                return MPI_Isend(in.data, as_int(in.count, "send"), mpi_type(in.dtype), peer, tag, p2p_, &req);
              }), "MPI_Isend", OpKind::Send, op->seq);
    return p2p_work(op, req, peer);
  }

  WorkPtr recv_async(MutableBuffer out, int peer, int tag, const CollectiveOptions& opt) override {
    detail::check_point_to_point_args(OpKind::Recv, out.data, out.count, peer, tag, rank_, size_);
    auto op = new_op(OpKind::Recv, p2p_count_[peer]++, opt);
    MPI_Request req;
    check_mpi(mpi_call(*rt_, [&] {
                return MPI_Irecv(out.data, as_int(out.count, "recv"), mpi_type(out.dtype), peer, tag, p2p_, &req);
              }), "MPI_Irecv", OpKind::Recv, op->seq);
    // A message of another size than posted is an error, not a partial fill (MPI truncates a longer
    // one with an error code, and takes a shorter one silently): the receive checks its count.
    return std::make_shared<P2PWork>(this, op, req, peer, RecvCheck{out.count, out.dtype, tag});
  }

 private:
  void check_mpi(int code, std::string_view call, OpKind op, std::uint64_t seq) const {
    if (code == MPI_SUCCESS) return;
    throw CommError(fmt::format("{}: {} failed: {}", where(op, seq), call, mpi_error_text(code)), "mpi",
                    std::string(detail::op_name(op)), seq, rank_);
  }

  // Polls req until it completes or the op's deadline passes (or its caller gave up).
  void wait_request(MPI_Request& req, OpState& st, std::string_view step) { wait_requests(&req, 1, st, step); }

  // Polls the n requests until all complete or the op's deadline passes (or its caller gave up).
  void wait_requests(MPI_Request* reqs, int n, OpState& st, std::string_view step) {
    const auto start = Clock::now();
    auto sleep = std::chrono::microseconds(20);
    for (;;) {
      int done = 0;
      if (n == 1) {
        check_mpi(mpi_call(*rt_, [&] { return MPI_Test(reqs, &done, MPI_STATUS_IGNORE); }), "MPI_Test", st.kind,
                  st.seq);
      } else {
        check_mpi(mpi_call(*rt_, [&] { return MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE); }), "MPI_Testall",
                  st.kind, st.seq);
      }
      if (done) return;
      const auto now = Clock::now();
      if (now >= st.deadline || st.cancelled()) {
        throw CommTimeout(fmt::format("{}: deadline passed{} in {}; MPI cannot tell which ranks did not arrive "
                                      "(missing ranks: unknown, best effort) and cannot cancel a collective: this "
                                      "communicator is unusable, abort the job (MPI_Abort)",
                                      where(st.kind, st.seq), st.cancelled() ? " (the caller's wait gave up)" : "",
                                      step),
                          "mpi", std::string(detail::op_name(st.kind)), st.seq, rank_, {});
      }
      const auto waited = now - start;
      if (waited < std::chrono::milliseconds(1)) continue;  // busy: like MPI's own blocking calls
      if (waited < std::chrono::milliseconds(20)) {
        std::this_thread::yield();
        continue;
      }
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, std::chrono::microseconds(1000));
    }
  }

  // all_reduce in one round (exchange_reduce) while each rank sends at most this much: measured on
  // the 2-core VM (docs/BENCHMARKS.md, collectives): better than alltoallv + allgatherv at 64K-1M (2
  // ranks) and 64K-256K (4 ranks), not consistently at 4M (2 ranks) / 1M (4 ranks), where each rank
  // sends (P-1) full buffers and reduces P of them instead of 2 (P-1)/P and one chunk.
  static constexpr std::size_t kExchangeReduceBytes = std::size_t(2) << 20;

  // Posts, on internal_, a receive of recv_counts[q] elements into recv_at(q) from every peer q and a
  // send of the own send_count elements at send to every peer, then waits for all of them. Peers are
  // visited from rank + 1 round, so not every rank sends to rank 0 first. Zero-element messages are
  // skipped on both sides (the counts agree on every rank).
  template <class RecvAt>
  void exchange(OpState& st, MPI_Datatype type, const void* send, int send_count, const std::vector<int>& recv_counts,
                RecvAt recv_at, std::string_view step, void (*local)(void*) = nullptr, void* local_arg = nullptr) {
    reqs_.clear();
    for (int i = 1; i < size_; ++i) {
      const int q = (rank_ + size_ - i) % size_;
      if (recv_counts[q] == 0) continue;
      reqs_.emplace_back();
      check_mpi(mpi_call(*rt_, [&] {
                  return MPI_Irecv(recv_at(q), recv_counts[q], type, q, kInternalTag, internal_, &reqs_.back());
                }), "MPI_Irecv", st.kind, st.seq);
    }
    for (int i = 1; i < size_ && send_count > 0; ++i) {
      const int q = (rank_ + i) % size_;
      reqs_.emplace_back();
      check_mpi(mpi_call(*rt_, [&] {
                  return MPI_Isend(send, send_count, type, q, kInternalTag, internal_, &reqs_.back());
                }), "MPI_Isend", st.kind, st.seq);
    }
    if (local) local(local_arg);  // overlaps with the transfers
    if (!reqs_.empty()) wait_requests(reqs_.data(), int(reqs_.size()), st, step);
  }

  // all_gather as point to point: every rank sends its block to every peer, which receives it straight
  // into its output (for 2 ranks one exchange, like MPI_Allgather's sendrecv; shared memory moves large
  // messages single-copy). Faster here than libnbc's MPI_Iallgather(v).
  void exchange_gather(OpState& st, ConstBuffer in, MutableBuffer out, const std::vector<int>& counts,
                       const std::vector<int>& displs) {
    const std::size_t es = dtype_size(in.dtype);
    char* const base = static_cast<char*>(out.data);
    struct Local {
      const void* src;
      void* dst;
      std::size_t bytes;
    } local{in.data, base + std::size_t(displs[rank_]) * es, std::size_t(counts[rank_]) * es};
    exchange(st, mpi_type(in.dtype), in.data, counts[rank_], counts,
             [&](int q) { return static_cast<void*>(base + std::size_t(displs[q]) * es); }, "MPI_Isend/MPI_Irecv",
             [](void* a) {
               auto* l = static_cast<Local*>(a);
               if (l->bytes) std::memcpy(l->dst, l->src, l->bytes);
             }, &local);
  }

  // Small all_reduce in one round: every rank sends its whole input to every peer (scratch row per
  // peer) and reduces all P buffers in rank order itself: the same element-wise order as the
  // alltoallv path, so the same bits, with one message latency instead of two collectives.
  void exchange_reduce(OpState& st, ConstBuffer in, MutableBuffer out, ReduceOp op) {
    const std::size_t es = dtype_size(in.dtype), bytes = in.count * es;
    if (scratch_.size() < bytes * size_) scratch_.resize(bytes * size_);
    const int n = as_int(in.count, "all_reduce");
    std::vector<int> counts(static_cast<std::size_t>(size_), n);
    exchange(st, mpi_type(in.dtype), in.data, n, counts,
             [&](int q) { return static_cast<void*>(scratch_.data() + bytes * std::size_t(q)); },
             "MPI_Isend/MPI_Irecv");
    std::vector<const void*> rows(static_cast<std::size_t>(size_));
    for (int q = 0; q < size_; ++q) rows[q] = q == rank_ ? in.data : scratch_.data() + bytes * std::size_t(q);
    void* outs[1] = {out.data};
    detail::reduce_rank_order(in.dtype, op, size_, rows.data(), size_, outs, 1, in.count);
  }

  // Steps 1 and 2 of the rank-order reduction: every rank receives chunk counts[rank] of every rank's
  // input (MPI_Ialltoallv), then reduces the P rows in rank order into dst (counts[rank] elements).
  void scatter_reduce(OpState& st, ConstBuffer in, const std::vector<std::size_t>& counts, ReduceOp op, void* dst) {
    const std::size_t es = dtype_size(in.dtype), mine = counts[rank_];
    if (size_ == 1) {
      const void* ins[1] = {in.data};
      void* outs[1] = {dst};
      detail::reduce_rank_order(in.dtype, op, 1, ins, 1, outs, 1, mine);
      return;
    }
    if (scratch_.size() < mine * es * size_) scratch_.resize(mine * es * size_);
    const auto sc = as_ints(counts, "scatter"), sd = as_ints(detail::offsets_of(counts), "scatter");
    std::vector<int> rc(static_cast<std::size_t>(size_), int(mine)), rd(static_cast<std::size_t>(size_));
    for (int q = 0; q < size_; ++q) rd[q] = as_int(mine * q, "scatter");
    MPI_Request req;
    check_mpi(mpi_call(*rt_, [&] {
                return MPI_Ialltoallv(in.data, sc.data(), sd.data(), mpi_type(in.dtype), scratch_.data(), rc.data(),
                                      rd.data(), mpi_type(in.dtype), coll_, &req);
              }), "MPI_Ialltoallv", st.kind, st.seq);
    wait_request(req, st, "MPI_Ialltoallv");
    std::vector<const void*> rows(static_cast<std::size_t>(size_));
    for (int q = 0; q < size_; ++q) rows[q] = scratch_.data() + mine * es * q;
    void* outs[1] = {dst};
    detail::reduce_rank_order(in.dtype, op, size_, rows.data(), size_, outs, 1, mine);
  }

  // Debug mode: one small allgather of every rank's call descriptor before the op's data moves.
  void debug_check(OpState& st, const CallDesc& desc) {
    if (!debug_checks_ || size_ == 1) return;
    std::vector<CallDesc> all(static_cast<std::size_t>(size_));
    MPI_Request req;
    check_mpi(mpi_call(*rt_, [&] {
                return MPI_Iallgather(&desc, sizeof(CallDesc), MPI_BYTE, all.data(), sizeof(CallDesc), MPI_BYTE, coll_,
                                      &req);
              }), "MPI_Iallgather", st.kind, st.seq);
    wait_request(req, st, "MPI_Iallgather (debug check)");
    detail::check_same_calls(all, "mpi", rank_);
  }

  // A point-to-point Work: polls its request on wait(); on the deadline cancels it (MPI_Cancel).
  // What a receive expects: its element count and dtype (count 0 with `check` false: a send).
  struct RecvCheck {
    std::size_t count = 0;
    DType dtype = DType::Float32;
    int tag = 0;
    bool check = true;
  };

  class P2PWork final : public Work {
   public:
    P2PWork(MpiComm* comm, std::shared_ptr<OpState> op, MPI_Request req, int peer,
            RecvCheck recv = {0, DType::Float32, 0, false})
        : rank_(comm->rank()), rt_(comm->rt_), op_(std::move(op)), req_(req), peer_(peer),
          where_(comm->where(op_->kind, op_->seq)), recv_(recv) {}
    ~P2PWork() override {
      if (!done_) {
        try {
          wait(Milliseconds{0});
        } catch (...) {
        }
      }
    }
    bool is_completed() override {
      if (!done_) {
        int flag = 0;
        MPI_Status status;
        const int code = mpi_call(*rt_, [&] { return MPI_Test(&req_, &flag, &status); });
        done_ = flag != 0 || code != MPI_SUCCESS;
        if (recv_.check && done_) {
          int got = -1;
          if (code == MPI_SUCCESS) MPI_Get_count(&status, mpi_type(recv_.dtype), &got);
          if (code != MPI_SUCCESS || got != static_cast<int>(recv_.count)) {
            error_ = fmt::format("{}: the message from rank {} (tag {}) does not match the recv of {} {} posted for it"
                                 "{}", where_, peer_, recv_.tag, recv_.count, dtype_name(recv_.dtype),
                                 code != MPI_SUCCESS ? fmt::format(" ({}: it is longer)", mpi_error_text(code))
                                                     : fmt::format(" (it holds {} elements)", got));
          }
        }
      }
      return done_;
    }
    void wait(Milliseconds timeout) override {
      MG_CHECK(timeout.count() >= 0, "Work::wait: timeout must be >= 0 ms, got {}", timeout.count());
      if (done_) {
        throw_if_failed();
        return;
      }
      const auto until = timeout.count() == 0 ? op_->deadline : detail::add_saturated(Clock::now(), timeout);
      auto sleep = std::chrono::microseconds(20);
      const auto start = Clock::now();
      while (!is_completed()) {
        if (Clock::now() >= until) {
          mpi_call(*rt_, [&] { return MPI_Cancel(&req_); });
          int flag = 0;
          const auto grace = Clock::now() + std::chrono::seconds(1);
          while (!flag && Clock::now() < grace) mpi_call(*rt_, [&] { return MPI_Test(&req_, &flag, MPI_STATUS_IGNORE); });
          done_ = flag != 0;
          throw CommTimeout(fmt::format("{}: deadline passed waiting for the matching call of rank {}; missing rank: {}"
                                        "{}", where_, peer_, peer_, done_ ? " (request cancelled)" :
                                        " (request could not be cancelled: the communicator is unusable)"),
                            "mpi", std::string(detail::op_name(op_->kind)), op_->seq, rank_, {peer_});
        }
        if (Clock::now() - start > std::chrono::milliseconds(1)) {
          std::this_thread::sleep_for(sleep);
          sleep = std::min(sleep * 2, std::chrono::microseconds(1000));
        }
      }
      throw_if_failed();
    }

   private:
    void throw_if_failed() const {
      if (!error_.empty()) throw CommError(error_, "mpi", std::string(detail::op_name(op_->kind)), op_->seq, rank_);
    }

    int rank_;
    std::shared_ptr<Runtime> rt_;
    std::shared_ptr<OpState> op_;
    MPI_Request req_;
    int peer_;
    std::string where_;
    RecvCheck recv_;
    std::string error_;   // a receive whose message did not match it
    bool done_ = false;
  };

  WorkPtr p2p_work(const std::shared_ptr<OpState>& op, MPI_Request req, int peer) {
    return std::make_shared<P2PWork>(this, op, req, peer);
  }

  std::shared_ptr<Runtime> rt_;
  MPI_Comm coll_;                   // collectives, run in order by the executor
  MPI_Comm p2p_ = MPI_COMM_NULL;    // point to point, posted on the calling thread
  MPI_Comm internal_ = MPI_COMM_NULL;  // the collectives' own point to point (never matches user send/recv)
  static constexpr int kInternalTag = 0;
  std::vector<MPI_Request> reqs_;   // exchange(): the requests of one op (executor thread only)
  std::vector<char> scratch_;       // all_reduce / reduce_scatter rows; reused (no page faults per call)
  std::vector<std::uint64_t> p2p_count_ = std::vector<std::uint64_t>(static_cast<std::size_t>(size_), 0);
};

}  // namespace

bool mpi_backend_available() { return true; }

MpiSession::MpiSession(int* argc, char*** argv) {
  std::lock_guard lock(g_runtime_m);
  auto rt = g_runtime.lock();
  if (!rt) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) {
      throw CommError("mpi: MPI was finalised already in this process and cannot be initialised again", "mpi", "init", 0,
                      -1);
    }
    rt = std::make_shared<Runtime>();
    int initialised = 0, provided = 0;
    MPI_Initialized(&initialised);
    if (!initialised) {
      const int code = MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
      if (code != MPI_SUCCESS) {
        throw CommError(fmt::format("mpi: MPI_Init_thread failed: {}", mpi_error_text(code)), "mpi", "init", 0, -1);
      }
      rt->we_initialised = true;
    } else {
      MPI_Query_thread(&provided);
    }
    if (provided < MPI_THREAD_SERIALIZED) {
      throw CommError(fmt::format("mpi: the MPI library provides thread level {} but meshgrad needs at least "
                                  "MPI_THREAD_SERIALIZED (its progress thread calls MPI)", provided),
                      "mpi", "init", 0, -1);
    }
    rt->serialize = provided < MPI_THREAD_MULTIPLE;
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    g_runtime = rt;
  }
  runtime_ = rt;
}

MpiSession::~MpiSession() = default;

CommunicatorPtr MpiSession::world(const MpiOptions& options) {
  auto rt = std::static_pointer_cast<Runtime>(runtime_);
  MG_CHECK(options.timeout.count() >= 0, "mpi: timeout must be >= 0 ms, got {}", options.timeout.count());
  MPI_Comm comm;
  const int code = mpi_call(*rt, [&] { return MPI_Comm_dup(MPI_COMM_WORLD, &comm); });
  if (code != MPI_SUCCESS) {
    throw CommError(fmt::format("mpi: MPI_Comm_dup(MPI_COMM_WORLD) failed: {}", mpi_error_text(code)), "mpi", "init",
                    0, -1);
  }
  int r = 0, n = 0;
  MPI_Comm_rank(comm, &r);
  MPI_Comm_size(comm, &n);
  const Milliseconds timeout = options.timeout.count() > 0 ? options.timeout : default_timeout_from_env();
  // One rank per process: the thread that takes the world communicator is the rank's lane in a trace.
  trace::name_this_thread(fmt::format("rank {}", r), r * trace::kRankLaneStride);
  auto world = std::make_shared<MpiComm>(rt, comm, r, n, timeout, false);
  // The cross-rank call checks are an exchange before every collective, so every process must run
  // them or none: a MESHGRAD_COMM_DEBUG that reached some processes only (mpirun -x on one side of an
  // MPMD line) hung the first collective until the deadline. The ranks agree (any asks: all check).
  double debug = options.debug_checks ? 1.0 : 0.0;
  world->all_reduce(MutableBuffer{&debug, 1, DType::Float64}, ReduceOp::Max);
  world->set_debug_checks(debug > 0);
  return world;
}

void mpi_abort(int code, const std::string& message) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  int initialised = 0, finalized = 0;
  MPI_Initialized(&initialised);
  MPI_Finalized(&finalized);
  if (initialised && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

int mpi_world_rank() {
  int initialised = 0, r = 0;
  MPI_Initialized(&initialised);
  if (initialised) MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int mpi_world_size() {
  int initialised = 0, n = 1;
  MPI_Initialized(&initialised);
  if (initialised) MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

#endif

}  // namespace meshgrad::comm
