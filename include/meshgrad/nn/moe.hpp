// A sparse mixture-of-experts MLP (Mixtral's MixtralSparseMoeBlock, Hugging Face's semantics) and
// expert parallelism over the mesh's ep axis.
//
//   probs   = softmax(x Wg)                       x [N, C] (this rank's tokens), Wg [C, E] ("gate")
//   top     = the k largest probs of each token, w = top / sum(top)      (k = experts_per_token;
//             Qwen2-MoE's norm_topk_prob false: w = top)
//   y_t     = sum over its k experts e of  w_{t,e} * w2_e(silu(w1_e x_t) * w3_e x_t)
//
// The experts' weights are stacked: experts.w1.weight and experts.w3.weight [E, C, F],
// experts.w2.weight [E, F, C] (y = x W, as every meshgrad linear). Hugging Face names them one per
// expert (block_sparse_moe.experts.{e}.w1.weight, an nn.Linear [F, C]); interop/model_tensors.hpp
// maps the two.
//
// Expert parallelism: the ep axis's P ranks hold E / P experts each (the stacked tensors' dim 0 is
// split over ep) and split the batch like dp. One MoE block on one rank:
//
//   route its tokens -> sort the (token, expert) assignments by expert -> all-gather the counts
//   -> all-to-all the rows to the experts' ranks (uneven counts) -> per local expert one grouped
//   product per weight -> all-to-all back -> weight by w and add into the tokens
//
// The two all-to-alls are dist::all_to_all_rows, whose backward is the rule's S(i) -> S(j) row
// (the reverse exchange with the counts swapped). Expert gradients are complete on their owner
// (every token that used an expert sent its row there), so the stacked weights are never reduced
// over ep; the router and every dense parameter are replicated over ep and reduced like dp's.
//
// Under --mesh-invariant each expert's products run per source rank (one row block each, the same
// GEMM shapes at every ep) and its weight gradient adds the sources in the fixed tree
// (docs/mesh-invariance.md, "ep").
//
// Dropless by default. capacity_factor > 0: an expert takes at most ceil(f * N * k / E) of the
// assignments of this rank's N tokens in one forward, in token order (batch row, then position,
// then the token's rank of the expert among its k); the rest are dropped (the token keeps its other
// experts and its residual) and counted.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "meshgrad/nn/model.hpp"
#include "meshgrad/nn/parallel_context.hpp"
#include "meshgrad/nn/parameter.hpp"

namespace meshgrad::nn {

// The routing statistics of one model on one rank, shared by its MoE blocks (which write them) and
// the family (which turns them into the load-balancing loss and the metrics).
class RouterLog {
 public:
  RouterLog(const ModelConfig& cfg, ParallelContextPtr ctx);
  // A forward starts (`training`: the model's mode, Model::set_training): the previous forward's
  // per-layer entries are cleared. The load counts training forwards and any that records a graph
  // (grads), never a checkpointed block's recomputation.
  void begin_forward(bool training) {
    forward_.clear();
    training_ = training;
  }
  // One MoE block's routing in this forward: the sum over its tokens of the router probabilities
  // (prob_sum [E], in the graph), how many of its assignments each expert got (selected, before any
  // capacity drop), its token count, and the assignments it dropped.
  void record(const std::string& layer, const Tensor& prob_sum, std::vector<std::int64_t> selected,
              std::int64_t tokens, std::int64_t dropped);
  // Hugging Face's load_balancing_loss_func over every layer of this forward, times
  // router_aux_loss_coef, as this rank's share (partial over the batch axes, like the loss); an
  // undefined tensor when output_router_logits is false or nothing was routed. Collective over the
  // batch axes (and tp under SP) in the normal mode: the selection counts are summed over the ranks
  // that hold this forward's tokens. `forwards` is the number of forwards an optimizer step averages
  // (its micro-batch rounds), so a step's loss holds the mean over them.
  Tensor auxiliary_loss(int forwards);
  // The expert load of the training forwards since the last call (per layer, tokens per expert), the
  // assignments dropped and the aux loss (before the coefficient), summed over every rank of the
  // mesh that routes other tokens; then cleared. Collective over those ranks (every rank calls it).
  ExpertLoad take_load();

 private:
  struct Entry {
    std::string layer;
    Tensor prob_sum;
    std::vector<std::int64_t> selected;
    std::int64_t tokens;
  };
  ModelConfig cfg_;
  ParallelContextPtr ctx_;
  std::vector<Entry> forward_;
  ExpertLoad load_;
  bool training_ = true;
  bool counting() const;
};

// The MoE block of one transformer block (Mixtral's block_sparse_moe), on a context whose ep axis
// splits its experts. x: [T(_local), B, C] -> the same (the PreNormBlock Mlp interface).
class SparseMoe {
 public:
  SparseMoe(const std::string& name, const ModelConfig& cfg, const ParallelContextPtr& ctx, std::uint64_t seed,
            std::shared_ptr<RouterLog> log);
  Tensor forward(const Tensor& x, std::int64_t seq) const;
  // gate.weight, experts.w1.weight, experts.w2.weight, experts.w3.weight (the one-rank order; Qwen2-MoE:
  // gate, experts.gate_proj, experts.up_proj, experts.down_proj).
  void collect(std::vector<Parameter*>& out);

  Parameter gate;                 // [C, E], replicated
  // [E, C, F], [E, F, C], [E, C, F] (F: ModelConfig::expert_ffn_size()), S(0) on ep: Mixtral's w1,
  // w2, w3; Qwen2-MoE's gate_proj, down_proj, up_proj.
  Parameter w1, w2, w3;

 private:
  bool qwen_names_ = false;
  std::string name_;
  ModelConfig cfg_;
  ParallelContextPtr ctx_;
  std::shared_ptr<RouterLog> log_;
};

// Checks the MoE settings of a config against the mesh before any layer is built (InvalidArgument
// naming the option and the value): experts >= 1, 1 <= experts_per_token <= experts, a capacity
// factor >= 0, and an ep that divides the experts.
void check_moe(const ModelConfig& cfg, const ParallelContext& ctx);
// The same before a mesh exists: ep ranks of the mesh spelled `mesh`. A model without experts on a
// mesh with ep > 1 is refused too (its ep ranks would be plain data parallelism under another name).
void check_moe(const ModelConfig& cfg, int ep, const std::string& mesh);

}  // namespace meshgrad::nn
