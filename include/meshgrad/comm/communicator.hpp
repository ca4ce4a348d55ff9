// comm/: the Communicator interface every backend implements (threads, mpi, later nccl).
//
// Contract (all backends):
//  - Collective calls are made by every rank of the communicator in the same order; each call gets
//    the next sequence number (0, 1, 2, ...) of this communicator, the same on every rank.
//  - Every collective has an async form returning Work and a blocking form (= async + wait()).
//  - Buffers are contiguous, typed (float32 / float64 for reductions; any dtype for data movement).
//    Input and output may be the same buffer for all_reduce and broadcast, never for the others.
//  - Reductions add in rank order ((x0 + x1) + x2) + ..., element by element in the buffer's own
//    dtype, so every rank gets the same bits and the same inputs give the same bits on every run and
//    on every backend. Avg is that sum divided by size().
//  - Misuse (sizes that differ where they must match, a counts vector of the wrong length, a rank
//    out of range, a dtype a reduction does not take) throws InvalidArgument before data moves.
//  - Every wait has a deadline: the per-call timeout, else the communicator's default (the
//    environment variable MESHGRAD_COMM_TIMEOUT_MS, else 5 minutes). When it passes the waiting rank
//    throws CommTimeout naming backend, op, sequence number, this rank and the ranks that did not
//    arrive. A rank that fails makes the others fail (PeerFailed) within the deadline, never hang.
//  - With MESHGRAD_COMM_DEBUG=1 each collective first checks that all ranks call the same op with
//    the same dtype and sizes at the same sequence number; a mismatch throws CollectiveMismatch
//    naming both ranks' calls.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "meshgrad/tensor/dtype.hpp"

namespace meshgrad::comm {

enum class ReduceOp : std::uint8_t { Sum, Avg, Max, Min };
std::string_view reduce_op_name(ReduceOp op);

using Milliseconds = std::chrono::milliseconds;

// Options every collective takes. timeout 0 means the communicator's default.
struct CollectiveOptions {
  Milliseconds timeout{0};
  // Set by the blocking forms below: the caller waits at once, so a backend may run the operation
  // on the calling thread instead of handing it to its progress thread (saves two thread hand-offs
  // per call). Async callers leave it false; the result is the same either way.
  bool caller_waits = false;
  // What issued the operation, for a trace (tensor/trace.hpp): the caller's layer label, e.g.
  // "h.0.mlp.c_fc". Read during the call only; "" = none.
  std::string_view trace_label;
};

// A typed view of contiguous memory handed to a collective. count is in elements.
struct ConstBuffer {
  const void* data = nullptr;
  std::size_t count = 0;
  DType dtype = DType::Float32;
};
struct MutableBuffer {
  void* data = nullptr;
  std::size_t count = 0;
  DType dtype = DType::Float32;
  operator ConstBuffer() const { return {data, count, dtype}; }
};

template <class T>
ConstBuffer buffer(std::span<const T> s) { return {s.data(), s.size(), dtype_of<T>()}; }
template <class T>
MutableBuffer buffer(std::span<T> s) { return {s.data(), s.size(), dtype_of<T>()}; }

// The handle of an operation in flight. Operations of one communicator run in the order they were
// issued. Destroying a Work whose operation is still running waits for it (bounded by its deadline),
// so buffers a caller frees after dropping the handle are never touched afterwards.
class Work {
 public:
  virtual ~Work() = default;
  // True once the operation finished, successfully or not. Never blocks.
  virtual bool is_completed() = 0;
  // Blocks until the operation finished or the deadline passed (timeout 0 = the one the op was
  // started with, counted from when it was issued). Rethrows the operation's stored error; throws
  // CommTimeout on the deadline. After a timeout the communicator is unusable (its later calls throw
  // CommError): ranks no longer agree on which collective comes next.
  // Calling wait() again after success returns at once.
  virtual void wait(Milliseconds timeout = Milliseconds{0}) = 0;
};
using WorkPtr = std::shared_ptr<Work>;

// Per-rank counts: counts[r] elements belong to rank r. An empty span means "equal shards":
// the buffer's count must then be divisible by size() (use shard_sizes() for uneven splits).
using Counts = std::span<const std::size_t>;

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view backend() const = 0;   // "threads", "mpi", ...
  // The default deadline of this communicator's waits.
  virtual Milliseconds default_timeout() const = 0;
  // Names this communicator in error messages ("... on rank 1 of 2 of group tp"), e.g. the mesh axis a
  // split made it for; "" (the default) names none. Call it before the communicator's first
  // operation (the messages are built on its progress thread too).
  virtual void set_label(std::string label) {}

  // ---- async forms ------------------------------------------------------------------------------
  // out[i] = reduce over ranks of in[i]. in.count == out.count, same on every rank. in may == out.
  virtual WorkPtr all_reduce_async(ConstBuffer in, MutableBuffer out, ReduceOp op,
                                   const CollectiveOptions& opt = {}) = 0;
  // out = concat over ranks r of in(r). in.count == counts[rank()] (or out.count / size()),
  // out.count == sum(counts).
  virtual WorkPtr all_gather_async(ConstBuffer in, MutableBuffer out, Counts counts = {},
                                   const CollectiveOptions& opt = {}) = 0;
  // out = rank()'s part of (reduce over ranks of in): in.count == sum(counts) on every rank,
  // out.count == counts[rank()] (or in.count / size()).
  virtual WorkPtr reduce_scatter_async(ConstBuffer in, MutableBuffer out, ReduceOp op, Counts counts = {},
                                       const CollectiveOptions& opt = {}) = 0;
  // buf on every rank = buf on root.
  virtual WorkPtr broadcast_async(MutableBuffer buf, int root, const CollectiveOptions& opt = {}) = 0;
  // Rank r sends in[send_offset(d) .. + send_counts[d]] to every rank d and receives
  // recv_counts[s] elements from every rank s into out, in rank order. send_counts[d] on rank r
  // must equal recv_counts[r] on rank d. Empty counts = equal shards of in / out.
  virtual WorkPtr all_to_all_async(ConstBuffer in, Counts send_counts, MutableBuffer out, Counts recv_counts,
                                   const CollectiveOptions& opt = {}) = 0;
  // Point to point. A send matches the recv on `peer` with the same tag, in posting order.
  virtual WorkPtr send_async(ConstBuffer in, int peer, int tag = 0, const CollectiveOptions& opt = {}) = 0;
  virtual WorkPtr recv_async(MutableBuffer out, int peer, int tag = 0, const CollectiveOptions& opt = {}) = 0;
  virtual WorkPtr barrier_async(const CollectiveOptions& opt = {}) = 0;

  // ---- blocking forms: the async form, then wait() ----------------------------------------------
  static CollectiveOptions blocking(CollectiveOptions opt) {
    opt.caller_waits = true;
    return opt;
  }
  void all_reduce(ConstBuffer in, MutableBuffer out, ReduceOp op, const CollectiveOptions& opt = {}) {
    all_reduce_async(in, out, op, blocking(opt))->wait();
  }
  void all_reduce(MutableBuffer inout, ReduceOp op, const CollectiveOptions& opt = {}) {
    all_reduce_async(inout, inout, op, blocking(opt))->wait();
  }
  void all_gather(ConstBuffer in, MutableBuffer out, Counts counts = {}, const CollectiveOptions& opt = {}) {
    all_gather_async(in, out, counts, blocking(opt))->wait();
  }
  void reduce_scatter(ConstBuffer in, MutableBuffer out, ReduceOp op, Counts counts = {},
                      const CollectiveOptions& opt = {}) {
    reduce_scatter_async(in, out, op, counts, blocking(opt))->wait();
  }
  void broadcast(MutableBuffer buf, int root, const CollectiveOptions& opt = {}) {
    broadcast_async(buf, root, blocking(opt))->wait();
  }
  void all_to_all(ConstBuffer in, Counts send_counts, MutableBuffer out, Counts recv_counts,
                  const CollectiveOptions& opt = {}) {
    all_to_all_async(in, send_counts, out, recv_counts, blocking(opt))->wait();
  }
  void send(ConstBuffer in, int peer, int tag = 0, const CollectiveOptions& opt = {}) {
    send_async(in, peer, tag, blocking(opt))->wait();
  }
  void recv(MutableBuffer out, int peer, int tag = 0, const CollectiveOptions& opt = {}) {
    recv_async(out, peer, tag, blocking(opt))->wait();
  }
  void barrier(const CollectiveOptions& opt = {}) { barrier_async(blocking(opt))->wait(); }

  // Collective over this communicator: ranks with the same color form a new communicator, ordered
  // by (key, old rank). color < 0 means "not in any" and returns nullptr.
  virtual std::shared_ptr<Communicator> split(int color, int key) = 0;
};
using CommunicatorPtr = std::shared_ptr<Communicator>;

// The default deadline: MESHGRAD_COMM_TIMEOUT_MS if set (throws InvalidArgument naming the variable
// if it is not a positive integer), else 5 minutes.
Milliseconds default_timeout_from_env();
// MESHGRAD_COMM_DEBUG=1 enables the cross-rank call check.
bool debug_checks_from_env();

}  // namespace meshgrad::comm
