// Point to point as autograd nodes (contracts in include/meshgrad/distributed/p2p.hpp).
#include "meshgrad/distributed/p2p.hpp"

#include <chrono>
#include <exception>

#include "meshgrad/autograd/function.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/placement.hpp"
#include "meshgrad/tensor/trace.hpp"

namespace meshgrad::dist {

namespace {

void check_peer(const ProcessGroup& group, int peer, const char* op) {
  MG_CHECK(peer >= 0 && peer < group.size() && peer != group.rank(),
           "{} over {}: peer {} is not another rank of the group (rank {} of {})", op, group.axis, peer, group.rank(),
           group.size());
}

comm::CollectiveOptions p2p_options() {
  comm::CollectiveOptions opt;
  opt.trace_label = current_comm_label();
  return opt;
}

// Forward: x goes to peer; the token stands for it in the graph. Backward: x's gradient comes back.
class SendFn final : public autograd::Function {
 public:
  SendFn(ProcessGroup group, int peer, P2PTags tags, SendQueuePtr queue)
      : group_(std::move(group)), peer_(peer), tags_(tags), queue_(std::move(queue)), label_(current_comm_label()) {}
  std::string_view name() const override { return "send"; }
  TensorList forward(const TensorList& x) override {
    shape_ = x[0].shape();
    dtype_ = x[0].dtype();
    queue_->add(send_async(x[0], group_, peer_, tags_.forward));
    return {Tensor::scalar(0.0, dtype_)};
  }
  TensorList backward(const TensorList& /*token gradient: its value means nothing*/) override {
    const CommLabelScope label(label_);   // the forward's label, for counters and traces
    // The axes the gradient is partial on (those that split the batch: dp), then the gradient.
    const Tensor axes = recv({1}, DType::Int64, group_, peer_, tags_.backward);
    Tensor grad = recv(shape_, dtype_, group_, peer_, tags_.backward);
    set_partial_axes(grad, static_cast<AxisMask>(axes.to_int64_vector()[0]));
    return {grad};
  }

 private:
  ProcessGroup group_;
  int peer_;
  P2PTags tags_;
  SendQueuePtr queue_;
  std::string label_;
  Shape shape_;
  DType dtype_ = DType::Float32;
};

// Forward: the tensor arrives from peer (the input is an empty anchor that only puts this node in
// the graph). Backward: its gradient goes back to peer.
class RecvFn final : public autograd::Function {
 public:
  RecvFn(Shape shape, DType dtype, ProcessGroup group, int peer, P2PTags tags, SendQueuePtr queue)
      : shape_(std::move(shape)), dtype_(dtype), group_(std::move(group)), peer_(peer), tags_(tags),
        queue_(std::move(queue)), label_(current_comm_label()) {}
  std::string_view name() const override { return "recv"; }
  TensorList forward(const TensorList& /*anchor*/) override {
    return {recv(shape_, dtype_, group_, peer_, tags_.forward)};
  }
  TensorList backward(const TensorList& g) override {
    const CommLabelScope label(label_);
    // A gradient partial on an axis (dp: the loss is each replica's share) stays so on the other
    // stage: the two ranks have the same coordinates on every axis but this group's, so the sum
    // over that axis is the same sum. The group's own axis cannot be partial (nothing sums over it).
    const AxisMask partial = partial_axes(g[0]);
    MG_CHECK((partial & group_.axes) == 0, "recv from rank {} over {}: the gradient to send back is partial over {} "
             "itself", peer_, group_.axis, group_.axis);
    const std::int64_t axes[1] = {static_cast<std::int64_t>(partial)};
    queue_->add(send_async(Tensor::from_int64(axes, {1}), group_, peer_, tags_.backward));
    queue_->add(send_async(g[0], group_, peer_, tags_.backward));
    return {Tensor()};
  }

 private:
  Shape shape_;
  DType dtype_;
  ProcessGroup group_;
  int peer_;
  P2PTags tags_;
  SendQueuePtr queue_;
  std::string label_;
};

}  // namespace

P2PTags tags_for(int micro) {
  MG_CHECK(micro >= 0, "tags_for: micro-batch {} is negative", micro);
  const int base = 2 * (micro % kMicroBatchTagWindow);
  return {base, base + 1};
}

SendQueue::~SendQueue() {
  for (PendingTensor& send : sends_) {
    try {
      if (send.valid()) send.wait();
    } catch (...) {
    }
  }
}

void SendQueue::add(PendingTensor send) { sends_.push_back(std::move(send)); }

void SendQueue::wait_all() {
  std::exception_ptr first;
  for (PendingTensor& send : sends_) {
    try {
      send.wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  sends_.clear();
  if (first) std::rethrow_exception(first);
}

PendingTensor send_async(const Tensor& x, const ProcessGroup& group, int peer, int tag) {
  MG_CHECK(x.defined(), "send over {}: the tensor is undefined", group.axis);
  check_peer(group, peer, "send");
  record_collective("send", group.axis, x.nbytes());
  // A trace shows the post (the transfer itself runs while this rank goes on; the receiver's span
  // shows how long it waited for it).
  trace::Span span("send", "p2p");
  span.arg("peer", std::int64_t{peer});
  span.arg("group", group.axis);
  span.arg("bytes", x.nbytes());
  span.arg("tag", std::int64_t{tag});
  const Tensor packed = x.contiguous();
  auto work = group.comm->send_async({packed.raw_data(), static_cast<std::size_t>(packed.numel()), packed.dtype()},
                                     peer, tag, p2p_options());
  // The packed copy is captured: it lives until the send completed.
  return PendingTensor(std::move(work), [packed] { return packed; });
}

Tensor recv(const Shape& shape, DType dtype, const ProcessGroup& group, int peer, int tag) {
  check_peer(group, peer, "recv");
  Tensor out = Tensor::empty(shape, dtype);
  record_collective("recv", group.axis, out.nbytes());
  // The span is the wait for the neighbour: a pipeline's bubble, seen from this stage.
  trace::Span span("recv", "p2p");
  span.arg("peer", std::int64_t{peer});
  span.arg("group", group.axis);
  span.arg("bytes", out.nbytes());
  span.arg("tag", std::int64_t{tag});
  const auto start = std::chrono::steady_clock::now();
  group.comm->recv_async({out.raw_data(), static_cast<std::size_t>(out.numel()), dtype}, peer, tag, p2p_options())
      ->wait();
  add_comm_blocked_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return out;
}

Tensor send(const Tensor& x, const ProcessGroup& group, int peer, P2PTags tags, const SendQueuePtr& queue) {
  MG_CHECK(queue != nullptr, "send over {}: no send queue", group.axis);
  return autograd::apply<SendFn>({x}, group, peer, tags, queue)[0];
}

Tensor recv(const Shape& shape, DType dtype, const ProcessGroup& group, int peer, P2PTags tags,
            const SendQueuePtr& queue, bool requires_grad) {
  MG_CHECK(queue != nullptr, "recv over {}: no send queue", group.axis);
  if (!requires_grad) return recv(shape, dtype, group, peer, tags.forward);
  Tensor anchor = Tensor::empty({0}, dtype);
  anchor.set_requires_grad(true);
  return autograd::apply<RecvFn>({anchor}, shape, dtype, group, peer, tags, queue)[0];
}

}  // namespace meshgrad::dist
