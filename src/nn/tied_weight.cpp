// A weight tied between the embedding and the output layer (contracts in nn/tied_weight.hpp).
#include "meshgrad/nn/tied_weight.hpp"

#include "meshgrad/autograd/function.hpp"
#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/p2p.hpp"
#include "meshgrad/distributed/placement.hpp"
#include "meshgrad/ops/tree_reduce.hpp"
#include "meshgrad/tensor/kernels.hpp"

namespace meshgrad::nn {

namespace {
// Tags of the two transfers between the first and last stage: p2p's reserved ones, which no
// micro-batch's tags_for reaches.
constexpr int kTagOutputGradient = dist::kFirstReservedTag;
constexpr int kTagWeightCopy = dist::kFirstReservedTag + 1;

Tensor plus(const Tensor& a, const Tensor& b) {
  Tensor sum = kernels::binary(kernels::Binary::Add, a, b);
  dist::set_partial_axes(sum, dist::partial_axes(a));
  return sum;
}
}  // namespace

struct TiedWeightState {
  std::string name;
  ParallelContextPtr ctx;
  PipelineStage stage;
  bool accumulating = false;
  // H of the micro-batches so far, left to right (tree::OrderedSum, the accumulator every
  // micro-batch sum goes through; the fixed tree sends each micro-batch's H whole instead).
  tree::OrderedSum output_sum{false};
  dist::AxisMask output_partial = 0;   // the axes the sum's terms are partial on
  dist::SendQueuePtr sends = std::make_shared<dist::SendQueue>();
  bool pipelined() const { return stage.count > 1; }
  // The tp-invariant mode adds micro-batches in its fixed tree, each micro-batch's gradient whole:
  // the output layer's gradient then goes to the first stage every micro-batch, unsummed.
  bool per_micro_batch() const { return ctx->reduce_order() == dist::ReduceOrder::FixedTree; }
  const dist::ProcessGroup& pp() const { return ctx->mesh->group(ctx->pp_axis); }
};

namespace {

class TiedOutputUseFn final : public autograd::Function {
 public:
  explicit TiedOutputUseFn(std::shared_ptr<TiedWeightState> state)
      : state_(std::move(state)), label_(dist::current_comm_label()) {}
  std::string_view name() const override { return "tied_output_use"; }
  TensorList forward(const TensorList& x) override { return {x[0]}; }
  TensorList backward(const TensorList& g) override {
    const dist::CommLabelScope label(label_);
    TiedWeightState& s = *state_;
    if (s.per_micro_batch()) {   // pipelined only (one stage uses w itself in this mode)
      s.sends->add(dist::send_async(g[0], s.pp(), 0, kTagOutputGradient));
      return {Tensor()};
    }
    if (s.output_sum.count() == 0) {
      s.output_sum.push({g[0].clone()});   // a packed copy: the engine may reuse g's buffer
      s.output_partial = dist::partial_axes(g[0]);
    } else {
      MG_CHECK(dist::partial_axes(g[0]) == s.output_partial, "{}: the output layer's gradient is partial on axes "
               "{:#x} in this micro-batch and {:#x} in earlier ones", s.name, dist::partial_axes(g[0]),
               s.output_partial);
      s.output_sum.push({g[0]});
    }
    if (s.accumulating) return {Tensor()};
    Tensor total = s.output_sum.total().front();
    s.output_sum.clear();
    dist::set_partial_axes(total, s.output_partial);
    if (!s.pipelined()) return {total};
    // The first stage adds it to the embedding's gradient (TiedEmbeddingUseFn), which carries the
    // same partial axes (the batch's).
    s.sends->add(dist::send_async(total, s.pp(), 0, kTagOutputGradient));
    return {Tensor()};
  }

 private:
  std::shared_ptr<TiedWeightState> state_;
  std::string label_;
};

class TiedEmbeddingUseFn final : public autograd::Function {
 public:
  explicit TiedEmbeddingUseFn(std::shared_ptr<TiedWeightState> state)
      : state_(std::move(state)), label_(dist::current_comm_label()) {}
  std::string_view name() const override { return "tied_embedding_use"; }
  TensorList forward(const TensorList& x) override { return {x[0]}; }
  TensorList backward(const TensorList& g) override {
    const dist::CommLabelScope label(label_);
    const TiedWeightState& s = *state_;
    if (s.accumulating && !s.per_micro_batch()) return {g[0]};
    // H of every micro-batch, from the same tp coordinate of the last stage; annotated as the
    // embedding's gradient is (both are partial over the axes that split the batch).
    Tensor output = dist::recv(g[0].shape(), g[0].dtype(), s.pp(), s.stage.count - 1, kTagOutputGradient);
    dist::set_partial_axes(output, dist::partial_axes(g[0]));
    return {plus(g[0], output)};
  }

 private:
  std::shared_ptr<TiedWeightState> state_;
  std::string label_;
};

}  // namespace

TiedWeight::TiedWeight(std::string name, ParallelContextPtr ctx, PipelineStage stage)
    : state_(std::make_shared<TiedWeightState>()) {
  state_->name = std::move(name);
  state_->ctx = std::move(ctx);
  state_->stage = stage;
}

TiedWeight::~TiedWeight() = default;

// Under the sequence blocks with cp, each use's gradient is complete over cp before it meets the
// other's (ParallelContext::reduced_over_cp_per_use): the step sits between the use and the node
// that adds the two, so H travels and is added complete.
Tensor TiedWeight::output_use(const Tensor& w) const {
  const ParallelContext& ctx = *state_->ctx;
  if (!state_->pipelined() && state_->per_micro_batch()) return ctx.reduced_over_cp_per_use(w);
  return ctx.reduced_over_cp_per_use(autograd::apply<TiedOutputUseFn>({w}, state_)[0]);
}

Tensor TiedWeight::embedding_use(const Tensor& w) const {
  const ParallelContext& ctx = *state_->ctx;
  if (!state_->pipelined()) return ctx.reduced_over_cp_per_use(w);
  return ctx.reduced_over_cp_per_use(autograd::apply<TiedEmbeddingUseFn>({w}, state_)[0]);
}

void TiedWeight::set_accumulating(bool on) { state_->accumulating = on; }

void TiedWeight::refresh_copy(const Tensor& w, const Tensor& copy) const {
  const TiedWeightState& s = *state_;
  if (!s.pipelined()) return;
  s.sends->wait_all();
  if (s.stage.is_first()) {
    s.sends->add(dist::send_async(w, s.pp(), s.stage.count - 1, kTagWeightCopy));
  } else if (s.stage.is_last()) {
    const Tensor fresh = dist::recv(copy.shape(), copy.dtype(), s.pp(), 0, kTagWeightCopy);
    autograd::NoGradGuard no_grad;
    Tensor target = copy;
    target.copy_from(fresh);
  }
}

}  // namespace meshgrad::nn
