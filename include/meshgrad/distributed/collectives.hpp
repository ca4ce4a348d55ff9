// Tensor-level collectives over a ProcessGroup, along a tensor dimension, with uneven shards by
// the shard rule (tensor/shard.hpp). Not differentiable: mappings.hpp builds the differentiable
// ones from these. Every call is recorded in the active CommCounter (comm_counter.hpp).
//
// `sizes` are the extents along `dim` of every rank's shard, in rank order (sum = the full extent);
// shard_sizes(full, group.size()) gives them for the shard rule.
// A group of size 1 is a fast path: the input tensor itself is returned (no copy, not recorded),
// so single-rank runs are bit-identical to serial code.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/tensor/shard.hpp"
#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::dist {

// The result of an async collective: wait() blocks (with the communicator's deadline) and returns
// the tensor, finishing any layout step (e.g. moving the gathered dim back into place).
class PendingTensor {
 public:
  PendingTensor() = default;
  PendingTensor(comm::WorkPtr work, std::function<Tensor()> finish);
  ~PendingTensor();   // waits for an operation still in flight before its buffers go (errors swallowed)
  PendingTensor(PendingTensor&&) = default;
  PendingTensor& operator=(PendingTensor&&);
  PendingTensor(const PendingTensor&) = delete;
  PendingTensor& operator=(const PendingTensor&) = delete;
  static PendingTensor ready(Tensor t);
  Tensor wait();
  bool valid() const { return static_cast<bool>(finish_); }

 private:
  void settle() noexcept;   // waits for work_ if it is still running; drops it
  // finish_ holds the buffers the operation reads and writes; settle() runs before they go.
  std::function<Tensor()> finish_;
  comm::WorkPtr work_;
};

// x summed (or op-reduced) over the group; same shape. x: any shape, float32/float64.
Tensor all_reduce(const Tensor& x, const ProcessGroup& group, comm::ReduceOp op = comm::ReduceOp::Sum);
PendingTensor all_reduce_async(const Tensor& x, const ProcessGroup& group, comm::ReduceOp op = comm::ReduceOp::Sum);
// The same, reducing x's own buffer in place (no allocation). x must be contiguous and must not be
// read or written by anyone else until the result is waited for (e.g. a gradient just computed).
PendingTensor all_reduce_in_place_async(const Tensor& x, const ProcessGroup& group,
                                        comm::ReduceOp op = comm::ReduceOp::Sum);

// local: this rank's shard along dim (extent sizes[rank]) -> the full tensor (extent sum(sizes)).
Tensor all_gather(const Tensor& local, const ProcessGroup& group, std::int64_t dim,
                  const std::vector<std::int64_t>& sizes);
// out: optional buffer for the result (used when dim is 0 and its shape and dtype fit, so layers
// can reuse one buffer across steps).
PendingTensor all_gather_async(const Tensor& local, const ProcessGroup& group, std::int64_t dim,
                               const std::vector<std::int64_t>& sizes, const Tensor& out = Tensor());

// full: extent sum(sizes) along dim on every rank -> this rank's shard of the sum over ranks.
Tensor reduce_scatter(const Tensor& full, const ProcessGroup& group, std::int64_t dim,
                      const std::vector<std::int64_t>& sizes);
PendingTensor reduce_scatter_async(const Tensor& full, const ProcessGroup& group, std::int64_t dim,
                                   const std::vector<std::int64_t>& sizes);

// x is full along split_dim and this rank's shard along cat_dim. Returns the tensor that is this
// rank's shard along split_dim (by the shard rule) and full along cat_dim, where cat_sizes are
// every rank's extents along cat_dim.
Tensor all_to_all(const Tensor& x, const ProcessGroup& group, std::int64_t split_dim, std::int64_t cat_dim,
                  const std::vector<std::int64_t>& cat_sizes);

// Uneven all-to-all of rows (expert parallelism's token exchange; differentiable: mappings.hpp's
// all_to_all_rows): x [sum(send_rows), ...] holds, in
// rank order, send_rows[d] rows for every rank d; returns [sum(recv_rows), ...] with recv_rows[s]
// rows from every rank s, in rank order. send_rows[d] on this rank must equal recv_rows[this] on
// rank d (the caller learns them by all_gather_counts). Recorded as "all_to_all" with this rank's
// send bytes; a group of one returns x.
Tensor exchange_rows(const Tensor& x, const ProcessGroup& group, const std::vector<std::int64_t>& send_rows,
                       const std::vector<std::int64_t>& recv_rows);

// Every rank's `local` vector (all of the same length n), in rank order: [size() * n] (a small int64
// all-gather; recorded as "all_gather(sizes)").
std::vector<std::int64_t> all_gather_counts(const std::vector<std::int64_t>& local, const ProcessGroup& group);

// This rank's slice of full along dim by the shard rule (a view; no communication).
Tensor local_shard(const Tensor& full, const ProcessGroup& group, std::int64_t dim);

// Every rank's value of `local`, in rank order (a small int64 all-gather; recorded as
// "all_gather(sizes)"). Used when shard extents are not known in advance.
std::vector<std::int64_t> exchange_sizes(std::int64_t local, const ProcessGroup& group);

}  // namespace meshgrad::dist
