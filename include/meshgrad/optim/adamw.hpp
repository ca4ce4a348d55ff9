// AdamW with state kept per shard: each rank holds the moments (m, v) of its own parameter shards
// only, so optimizer memory divides by tp like the parameters do. The update is elementwise, so
// updating shards independently gives exactly the slices of the unsharded update.
//
//   t += 1
//   p -= lr * weight_decay * p                 (decoupled decay; 2-D ".weight" parameters only)
//   m  = beta1 m + (1 - beta1) g
//   v  = beta2 v + (1 - beta2) g^2
//   p -= lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
//
// (PyTorch's torch.optim.AdamW, the GPT-2 / nanoGPT conventions: betas (0.9, 0.95), decay 0.1 on
// matrices and embeddings, none on biases and LayerNorm parameters.)
#pragma once

#include <cstdint>
#include <vector>

#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/nn/parameter.hpp"

namespace meshgrad::optim {

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
};

// True for the parameters weight decay applies to: names ending ".weight" whose full tensor is 2-D.
bool decays(const nn::Parameter& p);

class AdamW {
 public:
  // params: float32 or float64 leaves; the mesh tells which axes each parameter is replicated over
  // (nullptr: a single-rank run, every axis trivially complete).
  AdamW(std::vector<nn::Parameter*> params, dist::DeviceMeshPtr mesh, AdamWOptions options = {});

  // One update of every parameter with a gradient (a parameter without one is skipped, as PyTorch
  // does). Runs without recording (NoGradGuard) and in Phase::Optimizer. Refuses, naming the
  // parameter and the axis, a gradient still partial over an axis the parameter is replicated over,
  // and, when the mesh has dp > 1, a gradient never marked complete: GradientSynchronizer::finish()
  // was not run. Checks every parameter before touching any, so a refused step changes nothing.
  void step();
  // Drops every parameter's gradient (the next backward starts from nothing).
  void zero_grad();

  void set_lr(double lr) { options_.lr = lr; }
  double lr() const { return options_.lr; }
  std::int64_t steps() const { return t_; }
  const AdamWOptions& options() const { return options_; }
  // The moments of parameter i (this rank's shard; undefined before the first step).
  const Tensor& exp_avg(std::size_t i) const { return m_.at(i); }
  const Tensor& exp_avg_sq(std::size_t i) const { return v_.at(i); }
  // Replaces the state, for a resumed run: the step count and every parameter's moments (this rank's
  // shard, one per parameter in order, each of the parameter's shape and dtype; an undefined pair
  // means "no update yet", the same as zeros). Checks everything before changing anything.
  void load_state(std::int64_t steps, std::vector<Tensor> exp_avg, std::vector<Tensor> exp_avg_sq);
  // For a resume that reads saved moments straight into the optimizer's memory (no second copy):
  // creates the moments of every parameter that has none yet (zeros, what its first update starts
  // from) and returns them, every parameter's exp_avg in order, then every exp_avg_sq, as handles
  // on the optimizer's own storage: writing into them is writing the optimizer's state.
  std::vector<Tensor> materialize_moments();
  // Sets the number of updates taken (the t of the bias corrections), for a resume; >= 0.
  void set_steps(std::int64_t steps);

 private:
  void check_gradients() const;

  std::vector<nn::Parameter*> params_;
  dist::DeviceMeshPtr mesh_;
  AdamWOptions options_;
  std::vector<Tensor> m_, v_;
  std::int64_t t_ = 0;
};

}  // namespace meshgrad::optim
