// The micro-batches of one optimizer step (gradient accumulation), summed in the order of the
// summation policy (dist::ReduceOrder):
//   RankOrder  backward adds each micro-batch's gradient into .grad, one after the other
//              (g0 + g1, then + g2, ...); the synchroniser's hooks reduce the total during the last
//              micro-batch's backward, overlapped with it.
//   FixedTree  each micro-batch's gradient is taken out of .grad after its backward and added in the
//              fixed binary tree (tree::StreamingSum); the synchroniser reduces the root after the
//              last. A model with a sibling-block group (ep under --mesh-invariant) has each
//              micro-batch's gradients summed over that group first, where replicated there. So dp=2 with one micro-batch adds the same two halves of the batch in the same
//              order as dp=1 with two (docs/mesh-invariance.md, "dp").
// One micro-batch is the same in both: the hooks reduce during its backward.
//
//   MicroBatchGradients grads(model, sync, K);
//   for k in 0..K-1: grads.before_backward(k); backward(loss_k); grads.after_backward(k);
//   grads.finish();  then sync.finish()
//
// It is the one object that knows which backward is the last: it arms the synchroniser and tells the
// model (Model::set_accumulating: fsdp units and the tied weight hold their sums until the last
// micro-batch), so no caller keeps the two in step. The sums themselves all go through
// tree::OrderedSum, in the model's order.
#pragma once

#include <vector>

#include "meshgrad/distributed/placement.hpp"
#include "meshgrad/distributed/rule.hpp"
#include "meshgrad/nn/model.hpp"
#include "meshgrad/nn/parameter.hpp"
#include "meshgrad/ops/tree_reduce.hpp"
#include "meshgrad/optim/grad_sync.hpp"

namespace meshgrad::optim {

class MicroBatchGradients {
 public:
  // count >= 1 micro-batches of `model` (its parameters, its order); FixedTree needs a power of two
  // (throws InvalidArgument otherwise).
  MicroBatchGradients(nn::Model& model, GradientSynchronizer& sync, int count);
  // The same for parameters without a model (nothing else holds a sum of its own).
  MicroBatchGradients(std::vector<nn::Parameter*> params, GradientSynchronizer& sync, dist::ReduceOrder order,
                      int count);
  // Before the backward of micro-batch k (0-based, in order): arms the synchroniser to reduce during
  // this backward (the last one, in rank order) or to leave the gradients alone, and tells the model
  // whether more micro-batches follow.
  void before_backward(int k);
  // After the backward of micro-batch k: in the tree order, takes its gradients into the tree.
  void after_backward(int k);
  // After the last micro-batch: in the tree order, sets every gradient to the root of the tree and
  // has the synchroniser reduce it; the model accumulates no more. Then GradientSynchronizer::finish
  // completes the step.
  void finish();

 private:
  bool tree() const { return order_ == dist::ReduceOrder::FixedTree && count_ > 1; }

  nn::Model* model_ = nullptr;            // told which backward is the last (may be null)
  std::vector<nn::Parameter*> params_;
  GradientSynchronizer& sync_;
  dist::ReduceOrder order_;
  int count_;
  int next_ = 0;                          // the micro-batch expected next
  tree::OrderedSum sum_{true};            // FixedTree: the micro-batches' gradients
  std::vector<dist::AxisMask> partial_;   // the axes each gradient is partial on (dp)
};

// The sum of a step's micro-batch losses (one-element tensors) in the same order: left to right in
// rank order, the fixed tree otherwise.
// siblings (Model::sibling_block_group): each micro-batch's loss is first summed over that group, so
// the total already holds the group's ranks (the caller sums over the other batch axes only).
class MicroBatchLosses {
 public:
  explicit MicroBatchLosses(dist::ReduceOrder order, const dist::ProcessGroup* siblings = nullptr);
  void push(const Tensor& loss);
  Tensor total() const;

 private:
  tree::OrderedSum sum_;
  dist::ReduceOrder order_;
  const dist::ProcessGroup* siblings_;
};

}  // namespace meshgrad::optim
