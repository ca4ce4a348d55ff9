// Gradient accumulation in the order of the summation policy (contract in micro_batches.hpp).
#include "meshgrad/optim/micro_batches.hpp"

#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/tensor/kernels.hpp"

namespace meshgrad::optim {

MicroBatchGradients::MicroBatchGradients(std::vector<nn::Parameter*> params, GradientSynchronizer& sync,
                                         dist::ReduceOrder order, int count)
    : params_(std::move(params)), sync_(sync), order_(order), count_(count), partial_(params_.size(), 0) {
  MG_CHECK(count >= 1, "gradient accumulation: {} micro-batches", count);
  MG_CHECK(order != dist::ReduceOrder::FixedTree || tree::is_power_of_two(count), "gradient accumulation: {} "
           "micro-batches are added in a fixed binary tree, which needs a power of two", count);
}

MicroBatchGradients::MicroBatchGradients(nn::Model& model, GradientSynchronizer& sync, int count)
    : MicroBatchGradients(model.parameters(), sync, model.reduce_order(), count) {
  model_ = &model;
}

void MicroBatchGradients::before_backward(int k) {
  MG_CHECK(k == next_ && k < count_, "gradient accumulation: micro-batch {} after {} of {}", k, next_, count_);
  // Rank order: reduce during the last backward. Tree: the caller's tree holds the sum; reduce it in finish().
  sync_.set_accumulating(tree() || k + 1 < count_);
  // fsdp units and the tied weight sum the micro-batches themselves and reduce after the last.
  if (model_) model_->set_accumulating(k + 1 < count_);
}

void MicroBatchGradients::after_backward(int k) {
  MG_CHECK(k == next_, "gradient accumulation: after_backward({}) for micro-batch {}", k, next_);
  ++next_;
  if (!tree()) return;
  const dist::ProcessGroup* siblings = model_ != nullptr ? model_->micro_batch_sum_group() : nullptr;
  std::vector<Tensor> micro(params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) {
    micro[i] = params_[i]->value.grad();
    if (micro[i].defined() && siblings != nullptr && (params_[i]->replicated_axes() & siblings->axes) == siblings->axes &&
        (dist::partial_axes(micro[i]) & siblings->axes)) {
      // The sibling blocks of this micro-batch (ep, or cp's sequence blocks, under --mesh-invariant)
      // are added first: their sum is the subtree the micro-batches' tree takes as one leaf.
      dist::PhaseScope phase(dist::Phase::Optimizer);
      dist::CommLabelScope label("grad-sync:" + params_[i]->name);
      Tensor reduced = dist::sum_over(micro[i], *siblings, order_);
      dist::set_partial_axes(reduced, dist::partial_axes(micro[i]) & ~siblings->axes);
      micro[i] = reduced;
    }
    if (micro[i].defined()) partial_[i] = dist::partial_axes(micro[i]);
    params_[i]->value.set_grad(Tensor());   // the next micro-batch starts from no gradient
  }
  sum_.push(std::move(micro));
}

void MicroBatchGradients::finish() {
  MG_CHECK(next_ == count_, "gradient accumulation: finish after {} of {} micro-batches", next_, count_);
  if (model_) model_->set_accumulating(false);
  if (!tree()) return;
  const std::vector<Tensor> total = sum_.total();
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (!total[i].defined()) continue;
    dist::set_partial_axes(total[i], partial_[i]);   // the sum is partial where its terms were (dp)
    params_[i]->value.set_grad(total[i]);
  }
  sync_.reduce_gradients();
}

MicroBatchLosses::MicroBatchLosses(dist::ReduceOrder order, const dist::ProcessGroup* siblings)
    : sum_(order == dist::ReduceOrder::FixedTree), order_(order), siblings_(siblings) {}

void MicroBatchLosses::push(const Tensor& loss) {
  if (siblings_ == nullptr) {
    sum_.push({loss.detach()});
    return;
  }
  dist::PhaseScope phase(dist::Phase::Optimizer);
  sum_.push({dist::sum_over(loss.detach(), *siblings_, order_)});
}

Tensor MicroBatchLosses::total() const {
  MG_CHECK(sum_.count() > 0, "micro-batch losses: none pushed");
  return sum_.total().front();
}

}  // namespace meshgrad::optim
