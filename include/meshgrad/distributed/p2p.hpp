// Point to point between ranks of a group (the stages of a pipeline), as autograd nodes whose
// backward is the transfer in the other direction (written here, not taken from rule.hpp's table,
// which is about placements on a mesh axis):
//
//   forward                 backward
//   send(x) to peer         receive x's gradient from peer
//   recv() from peer        send the gradient of what was received back to peer
//
// So a pipeline stage's backward is the ordinary backward of its graph: it starts at the token
// that send() returned (or at the loss on the last stage) and ends in the recv() that fed it,
// which sends the gradient on to the previous stage. No schedule writes a gradient transfer.
//
// Matching: a send matches the receive on `peer` with the same tag, in posting order (comm
// contract). Forward and backward transfers of micro-batch m use different tags (tags_for), so an
// activation is never taken for a gradient. Every wait has the communicator's deadline; a receive
// whose element count differs from the send is an error on the receiving rank (on both with rank
// threads) naming the tag and the counts, never a partial fill.
#pragma once

#include <memory>
#include <vector>

#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::dist {

// The tags of one transfer: the forward one (the activation) and the backward one (its gradient).
struct P2PTags {
  int forward = 0;
  int backward = 1;
};
// Tags are below 32768 (the least MPI_TAG_UB the MPI standard allows). Micro-batches take
// [0, kFirstReservedTag); the tags from kFirstReservedTag up are reserved for transfers that are not
// a micro-batch's (nn/tied_weight.cpp), so no micro-batch can ever match them.
inline constexpr int kMicroBatchTagWindow = 16000;
inline constexpr int kFirstReservedTag = 2 * kMicroBatchTagWindow;
// In use: +0, +1 (nn/tied_weight.cpp), +2, +3 (nn/context_parallel.cpp, the cp ring).
static_assert(kFirstReservedTag + 4 <= 32768, "reserved p2p tags must stay below MPI's least MPI_TAG_UB");
// The tags of micro-batch `micro` (>= 0): distinct per micro-batch (modulo kMicroBatchTagWindow) and
// direction, below kFirstReservedTag.
P2PTags tags_for(int micro);

// Sends still in flight. A send is waited before its buffer may go: at wait_all() (the end of a
// step), or at destruction (errors swallowed there: the path that abandoned it reports its own).
class SendQueue {
 public:
  SendQueue() = default;
  SendQueue(const SendQueue&) = delete;
  SendQueue& operator=(const SendQueue&) = delete;
  ~SendQueue();
  void add(PendingTensor send);
  // Waits for every send (each with the communicator's deadline); rethrows the first error.
  void wait_all();
  std::size_t in_flight() const { return sends_.size(); }

 private:
  std::vector<PendingTensor> sends_;
};
using SendQueuePtr = std::shared_ptr<SendQueue>;

// ---- not differentiable ----------------------------------------------------------------------------
// x (any dtype, any layout) to `peer` (a rank of group, not this one), asynchronously; recorded as
// "send" with its bytes. The PendingTensor keeps x's packed copy alive until the send completes.
PendingTensor send_async(const Tensor& x, const ProcessGroup& group, int peer, int tag);
// A tensor of this shape and dtype from `peer`; blocks with the communicator's deadline.
Tensor recv(const Shape& shape, DType dtype, const ProcessGroup& group, int peer, int tag);

// ---- differentiable --------------------------------------------------------------------------------
// Sends x to `peer` (tag tags.forward; async, queued on `queue`) and returns a token: a scalar 0 of
// x's dtype that requires grad when x does. backward from the token receives x's gradient from peer
// (tag tags.backward, blocking with the deadline) and passes it to x, with the partial axes it
// had on peer (dp: the two ranks share every coordinate but this group's, so it is the same sum).
Tensor send(const Tensor& x, const ProcessGroup& group, int peer, P2PTags tags, const SendQueuePtr& queue);
// Receives a tensor of `shape` and `dtype` from peer (tag tags.forward, blocking). When
// requires_grad, the result is recorded: its backward sends the gradient to peer (tag
// tags.backward, async on `queue`: first its partial axes as one int64, then the gradient).
Tensor recv(const Shape& shape, DType dtype, const ProcessGroup& group, int peer, P2PTags tags,
            const SendQueuePtr& queue, bool requires_grad);

}  // namespace meshgrad::dist
