// The training loop behind `meshgrad train`, and the gradient computation behind `meshgrad grads`.
//
// One step on every rank of a dp x tp mesh:
//   batch  = dp_shard(dataset.next_batch(step))          same global batch everywhere, rows split over dp
//   loss   = model.loss(batch, B * T)                     this rank's share of the global mean
//   backward(loss)                                        hooks launch tp / dp gradient all-reduces
//   sync.finish(); opt.step(); opt.zero_grad()           complete gradients, AdamW on local shards
//   report = all_reduce(loss) over dp                     the global loss (Phase::Optimizer)
#pragma once

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/nn/model.hpp"
#include "meshgrad/optim/adamw.hpp"
#include "meshgrad/optim/grad_sync.hpp"
#include "meshgrad/checkpoint/store.hpp"
#include "meshgrad/train/options.hpp"
#include "meshgrad/interop/gpt2_config.hpp"   // read_gpt2_config (used with compute_gradients)

namespace meshgrad::train {

// The learning rate of step s (0-based): linear warmup over warmup_steps, then cosine decay to
// lr * min_lr_ratio at step steps - 1.
double learning_rate(const TrainOptions& options, int step);

// Number of elements of the full model (sum over parameters of their full shapes).
std::int64_t count_parameters(const std::vector<nn::Parameter*>& params);

// Model FLOPs per trained token, forward + backward (PaLM appendix B / nanoGPT convention):
//   6 * N_matmul + 12 * L * T * C
// N_matmul = every parameter except the position table wpe (a lookup, no multiply; wte counts: it
// is the tied output projection, 2 * C * V per token forward). 6 = 2 (multiply-add) * 3 (forward,
// input gradient, weight gradient). 12 L T C = attention scores q k^T and the weighted sum of v,
// 2 * T * C each per token per layer forward, times 3 for backward; counted over the full T as is
// customary (the causal mask skips half). Recomputation under activation checkpointing is not
// model work and is not counted.
double model_flops_per_token(const nn::ModelConfig& config, std::int64_t n_params_without_wpe);

// Trains a GPT on the mesh (collective: every rank calls it with the same options). Rank 0 shows
// progress on stderr (one line redrawn with \r on a terminal, else a line every ~5% of the steps)
// and appends one JSON object per step to options.metrics_path:
//   {"step": 1, "loss": 5.54, "tokens_per_s": 1.2e4, "gflops": 0.8, "elapsed_s": 0.3, "lr": 3e-4}
// Each line is written by one write() call and flushed, so a reader never sees half a line.
TrainResult train(const TrainOptions& options, const dist::DeviceMeshPtr& mesh);

// Targets equal to kIgnoreIndex add no loss (PyTorch's and Hugging Face's ignore_index; the default
// of nn::vocab_parallel_cross_entropy), and the mean is over the others: the loss divisor is
// count_loss_targets(global targets), not B * T.
inline constexpr std::int64_t kIgnoreIndex = -100;

// The number of targets (int64, any shape) that are not kIgnoreIndex: the divisor of the mean
// cross-entropy of a global batch. Throws InvalidArgument when it is 0 (every target ignored: the
// mean over no tokens is undefined; PyTorch returns NaN).
std::int64_t count_loss_targets(const Tensor& targets);


// One optimizer step, the loop body every training loop shares (train, the equivalence checker):
// zero the gradients, this rank's loss on its dp share of global_batch (divided by the global count
// of non-ignored targets), backward, gradient synchronisation, the global gradient norm (clipped to
// grad_clip when > 0, grad_norm.hpp), AdamW step. loss: this rank's share of the global loss (sum
// it over dp); grad_norm: the norm before clipping, the same on every rank.
struct StepOutcome {
  Tensor loss;
  double grad_norm = 0;
};
// grad_accum K > 1: this rank's rows are split into K micro-batches (shard rule) whose losses (each
// over the global target count) are backpropagated one after the other, gradients accumulating, and
// reduced once after the last: the same loss and gradients as K = 1 up to rounding, dropout masks
// included (every micro-batch draws the seeds of one forward of the whole batch, and masks are by
// global row), with one dp reduction per step and the activations of one micro-batch at a time.
StepOutcome train_step(nn::Model& model, const nn::Batch& global_batch, const dist::DeviceMesh& mesh,
                       optim::GradientSynchronizer& sync, optim::AdamW& optimizer, double grad_clip = 0, int grad_accum = 1);
// TP-invariant mode (the model's tp_invariant()): the K micro-batches' gradients and losses are added
// in the fixed binary tree, and the synchroniser must be built with GradSyncOptions::tree_dp, so the
// step is bitwise the same on every mesh with the same dp x K (docs/tp-invariance.md, "dp").
// check_invariant_batch_split throws InvalidArgument unless dp and K are powers of two and the
// global batch of `rows` splits into dp x K micro-batches of equal rows.
void check_invariant_batch_split(std::int64_t rows, int dp_size, int grad_accum);

// The training state a checkpoint holds as tensors: every parameter's piece, then its AdamW moments
// ("optimizer.exp_avg.NAME", "optimizer.exp_avg_sq.NAME"; zeros before the first update, which is
// what AdamW's lazily created moments start from).
std::vector<checkpoint::StateTensor> training_state_tensors(const std::vector<nn::Parameter*>& params, const optim::AdamW& optimizer);
// How load_training_state treats the state it replaces.
enum class StateLoad {
  // Read into new tensors and checked, then copied in: on any error the model and the optimizer are
  // unchanged. Costs a second copy of the state in memory while loading.
  all_or_nothing,
  // Read straight into the parameters' memory and the optimizer's moments (created first, as zeros):
  // no second copy, and no memory the process has not touched already. Errors found from the
  // manifest and the files' sizes still change nothing; a hash mismatch found while reading leaves
  // the values partly overwritten. For a model and optimizer built for the resume, which the caller
  // drops when it throws (train --resume).
  in_place,
};
// Loads parameters, AdamW state and the model's random stream from checkpoint dir (written on any
// mesh: each rank reads the pieces of its own layout), every piece checked against its hash. Returns
// the number of steps the checkpoint was taken after. Not collective. Throws CheckpointError naming
// the file and the tensor.
int load_training_state(const std::string& dir, const checkpoint::Manifest& manifest, nn::Model& model, optim::AdamW& optimizer,
                        StateLoad how = StateLoad::all_or_nothing);

struct GradientDump {
  double loss = 0;                                      // global mean cross-entropy
  std::vector<std::pair<std::string, Tensor>> gradients; // full gradient of every parameter, by name
};

// loss + backward + gradient synchronisation of model on the global batch (inputs/targets int64
// [B, T], split over dp by the shard rule; loss = mean over the positions whose target is not
// kIgnoreIndex), then every
// parameter's full gradient gathered over tp (collective: every rank calls it; every rank gets the
// full result). The model's parameters must not have gradients yet.
GradientDump compute_gradients(nn::Model& model, const nn::Batch& global_batch, const dist::DeviceMeshPtr& mesh);

}  // namespace meshgrad::train
