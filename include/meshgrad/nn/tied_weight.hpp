// A weight used at both ends of a model (GPT's wte: the token embedding and the output layer),
// whose two gradients can live on different pipeline stages and still add up to one rank's bits.
//
// The output layer's gradient is accumulated on its own over a step's micro-batches and joins the
// embedding's once, in the last micro-batch's backward:
//     grad = e_0 + e_1 + ... + e_{K-2} + (H + e_{K-1}),   H = h_0 + h_1 + ... + h_{K-1}
// (e_k, h_k: micro-batch k's gradient through the embedding and through the output layer, each
// left to right). One rank and a pipeline, whose first stage holds the embedding and whose last the
// output layer, compute these same sums in the same order: H crosses from the last stage to the
// first once per step (Megatron's embedding all-reduce moves the same bytes), and the last stage
// keeps a copy of the weight that the first stage's values refresh before each step
// (refresh_copy). One micro-batch (K = 1) is the plain tied gradient e_0 + h_0.
//
// The tp-invariant mode adds micro-batches in its fixed tree instead (optim/micro_batches.hpp), each
// micro-batch's gradient whole, so its uses are not separated: on one stage output_use and
// embedding_use return w (the engine adds h_k + e_k), and in a pipeline every micro-batch's h_k goes
// to the first stage, which adds it to e_k (V x C values per micro-batch instead of per step).
//
// Shapes: w is this rank's [V_local, C] rows (vocab-parallel over tp); H travels between the same
// tp coordinates of the two stages.
#pragma once

#include <memory>
#include <string>

#include "meshgrad/nn/parallel_context.hpp"
#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::nn {

struct TiedWeightState;

class TiedWeight {
 public:
  // name: the weight's (messages); stage: this rank's place in the pipeline (PipelineStage).
  TiedWeight(std::string name, ParallelContextPtr ctx, PipelineStage stage);
  ~TiedWeight();
  TiedWeight(const TiedWeight&) = delete;
  TiedWeight& operator=(const TiedWeight&) = delete;

  // The weight as the output layer sees it (one stage, or the last of a pipeline: w is then the
  // copy): identity forward; backward adds the gradient to H and passes H on in the last
  // micro-batch (to w on one stage, sent to the first stage in a pipeline).
  Tensor output_use(const Tensor& w) const;
  // The weight as the embedding sees it: w on one stage; on the first stage of a pipeline, a node
  // whose backward in the last micro-batch receives H from the last stage and adds it.
  Tensor embedding_use(const Tensor& w) const;
  // While on (every micro-batch of a step but the last), H is kept, not passed on.
  void set_accumulating(bool on);
  // Pipeline only: the first stage sends `w` (its rows of the weight) to the last, which copies
  // them into `copy`. Collective over the pp group's first and last stage; others return at once.
  // Also waits for the previous step's transfer of H to complete.
  void refresh_copy(const Tensor& w, const Tensor& copy) const;

 private:
  std::shared_ptr<TiedWeightState> state_;
};

}  // namespace meshgrad::nn
