// Injected communication faults for showing that `meshgrad check` catches a wrong mesh model
// (contract in diag/equivalence.hpp). A decorator over any communicator: the faulty reductions are
// the backend's own, changed after they complete (or not run at all), on every rank alike, so the
// ranks stay in step and the run ends normally with a wrong model.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstring>
#include <mutex>

#include "meshgrad/diag/equivalence.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/mesh.hpp"

namespace meshgrad::diag {

namespace {

// out *= factor, for a float buffer.
void scale_buffer(const comm::MutableBuffer& out, double factor) {
  if (out.dtype == DType::Float64) {
    auto* p = static_cast<double*>(out.data);
    for (std::size_t i = 0; i < out.count; ++i) p[i] *= factor;
    return;
  }
  MG_CHECK(out.dtype == DType::Float32, "check --inject-fault: a reduction of {} (only float32 and float64)",
           dtype_name(out.dtype));
  auto* p = static_cast<float*>(out.data);
  for (std::size_t i = 0; i < out.count; ++i) p[i] = static_cast<float>(p[i] * factor);
}

// The inner operation's handle, with `after` run once when it has completed.
class AfterWork final : public comm::Work {
 public:
  AfterWork(comm::WorkPtr inner, std::function<void()> after) : inner_(std::move(inner)), after_(std::move(after)) {}
  bool is_completed() override {
    if (!inner_->is_completed()) return false;
    finish();
    return true;
  }
  void wait(comm::Milliseconds timeout) override {
    inner_->wait(timeout);
    finish();
  }

 private:
  void finish() { std::call_once(once_, after_); }
  comm::WorkPtr inner_;
  std::function<void()> after_;
  std::once_flag once_;
};

class DoneWork final : public comm::Work {
 public:
  bool is_completed() override { return true; }
  void wait(comm::Milliseconds) override {}
};

class FaultyCommunicator final : public comm::Communicator {
 public:
  FaultyCommunicator(comm::CommunicatorPtr inner, CommFault fault, FaultCount* fired)
      : inner_(std::move(inner)), fault_(std::move(fault)), fired_(fired) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string_view backend() const override { return inner_->backend(); }
  comm::Milliseconds default_timeout() const override { return inner_->default_timeout(); }
  void set_label(std::string label) override {
    label_ = label;
    inner_->set_label(std::move(label));
  }

  comm::WorkPtr all_reduce_async(comm::ConstBuffer in, comm::MutableBuffer out, comm::ReduceOp op,
                                 const comm::CollectiveOptions& opt) override {
    if (!faulty()) return inner_->all_reduce_async(in, out, op, opt);
    if (fault_.kind == CommFault::Kind::Drop) return keep_own(in, out, 0);
    return scaled(inner_->all_reduce_async(in, out, op, opt), out);
  }
  comm::WorkPtr reduce_scatter_async(comm::ConstBuffer in, comm::MutableBuffer out, comm::ReduceOp op,
                                     comm::Counts counts, const comm::CollectiveOptions& opt) override {
    if (!faulty()) return inner_->reduce_scatter_async(in, out, op, counts, opt);
    if (fault_.kind == CommFault::Kind::Drop) {
      std::size_t offset = 0;
      for (int r = 0; r < rank(); ++r) offset += counts.empty() ? out.count : counts[static_cast<std::size_t>(r)];
      return keep_own(in, out, offset);
    }
    return scaled(inner_->reduce_scatter_async(in, out, op, counts, opt), out);
  }
  comm::WorkPtr all_gather_async(comm::ConstBuffer in, comm::MutableBuffer out, comm::Counts counts,
                                 const comm::CollectiveOptions& opt) override {
    return inner_->all_gather_async(in, out, counts, opt);
  }
  comm::WorkPtr broadcast_async(comm::MutableBuffer buf, int root, const comm::CollectiveOptions& opt) override {
    return inner_->broadcast_async(buf, root, opt);
  }
  comm::WorkPtr all_to_all_async(comm::ConstBuffer in, comm::Counts send_counts, comm::MutableBuffer out,
                                 comm::Counts recv_counts, const comm::CollectiveOptions& opt) override {
    return inner_->all_to_all_async(in, send_counts, out, recv_counts, opt);
  }
  comm::WorkPtr send_async(comm::ConstBuffer in, int peer, int tag, const comm::CollectiveOptions& opt) override {
    return inner_->send_async(in, peer, tag, opt);
  }
  comm::WorkPtr recv_async(comm::MutableBuffer out, int peer, int tag, const comm::CollectiveOptions& opt) override {
    return inner_->recv_async(out, peer, tag, opt);
  }
  comm::WorkPtr barrier_async(const comm::CollectiveOptions& opt) override { return inner_->barrier_async(opt); }
  std::shared_ptr<comm::Communicator> split(int color, int key) override {
    auto sub = inner_->split(color, key);
    return sub ? std::make_shared<FaultyCommunicator>(std::move(sub), fault_, fired_) : nullptr;
  }

 private:
  // The phase is the calling thread's: the autograd engine's backward pass, where the rule's
  // backward reductions and the gradient synchronisation run.
  // Counts the reductions it changes (true) in *fired_.
  bool faulty() const {
    const bool hit = label_ == fault_.axis && dist::current_phase() == dist::Phase::Backward;
    if (hit && fired_ != nullptr) fired_->fetch_add(1, std::memory_order_relaxed);
    return hit;
  }

  comm::WorkPtr keep_own(comm::ConstBuffer in, comm::MutableBuffer out, std::size_t offset) {
    const std::size_t bytes = dtype_size(out.dtype);
    const auto* from = static_cast<const char*>(in.data) + offset * bytes;
    if (from != out.data) std::memmove(out.data, from, out.count * bytes);
    return std::make_shared<DoneWork>();
  }
  comm::WorkPtr scaled(comm::WorkPtr work, comm::MutableBuffer out) {
    const double factor = fault_.kind == CommFault::Kind::Double ? size() : fault_.scale;
    return std::make_shared<AfterWork>(std::move(work), [out, factor] { scale_buffer(out, factor); });
  }

  comm::CommunicatorPtr inner_;
  CommFault fault_;
  FaultCount* fired_;   // may be null
  std::string label_;
};

}  // namespace

CommFault parse_comm_fault(const std::string& spec) {
  CommFault f;
  if (spec.empty()) return f;
  const auto bad = [&] {
    return InvalidArgument(fmt::format("--inject-fault '{}': expected drop:AXIS, double:AXIS or scale:AXIS:FACTOR "
                                       "(e.g. scale:tp:1.001)", spec));
  };
  const std::size_t colon = spec.find(':');
  if (colon == std::string::npos || colon + 1 == spec.size()) throw bad();
  const std::string kind = spec.substr(0, colon);
  std::string rest = spec.substr(colon + 1);
  if (kind == "drop" || kind == "double") {
    f.kind = kind == "drop" ? CommFault::Kind::Drop : CommFault::Kind::Double;
    if (rest.find(':') != std::string::npos) throw bad();
    f.axis = rest;
    return f;
  }
  const std::size_t second = rest.find(':');
  if (kind != "scale" || second == std::string::npos || second == 0) throw bad();
  f.kind = CommFault::Kind::Scale;
  f.axis = rest.substr(0, second);
  try {
    std::size_t used = 0;
    const std::string factor = rest.substr(second + 1);
    f.scale = std::stod(factor, &used);
    if (used != factor.size()) throw bad();
  } catch (const std::logic_error&) {
    throw bad();
  }
  return f;
}

void check_fault_axis(const CommFault& fault, const std::string& mesh) {
  if (fault.kind == CommFault::Kind::None) return;
  const std::vector<dist::MeshAxis> axes = dist::parse_mesh(mesh);
  std::vector<std::string> listed;
  bool reduces = false;
  for (const dist::MeshAxis& a : axes) {
    listed.push_back(fmt::format("{}={}", a.name, a.size));
    reduces = reduces || (a.name == fault.axis && a.size > 1);
  }
  MG_CHECK(reduces, "--inject-fault: the mesh {} has no axis '{}' of more than one rank, so no reduction would run on "
           "it and the fault would change nothing (the mesh's axes: {})", mesh, fault.axis, fmt::join(listed, ", "));
}

comm::CommunicatorPtr with_comm_fault(comm::CommunicatorPtr world, const CommFault& fault, FaultCount* fired) {
  if (fault.kind == CommFault::Kind::None) return world;
  return std::make_shared<FaultyCommunicator>(std::move(world), fault, fired);
}

}  // namespace meshgrad::diag
