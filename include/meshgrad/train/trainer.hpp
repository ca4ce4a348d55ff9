// The training loop behind `meshgrad train`, and the gradient computation behind `meshgrad grads`.
//
// One step on every rank of a dp x tp mesh (train_step, step.hpp):
//   batch  = dp_shard(dataset.next_batch(step))          same global batch everywhere, rows split over dp
//   loss   = model.loss(batch, B * T)                     this rank's share of the global mean
//   backward(loss)                                        hooks launch tp / dp gradient all-reduces
//   sync.finish(); opt.step(); opt.zero_grad()           complete gradients, AdamW on local shards
//   report = sum over dp of the loss                      the global loss (Phase::Optimizer)
// around it: the checks of the inputs, the outputs (metrics, checkpoints), resume (state.hpp),
// evaluation, saves and the agreement of the ranks on a stop signal.
#pragma once

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/nn/model.hpp"
#include "meshgrad/train/options.hpp"
#include "meshgrad/train/state.hpp"
#include "meshgrad/train/step.hpp"

namespace meshgrad::train {

// The learning rate of step s (0-based): the schedule of TrainOptions (warmup, then lr_schedule
// over decay_steps down to min_lr). The options must have passed check_schedule_options.
double learning_rate(const TrainOptions& options, int step);

// Throws InvalidArgument naming the option (--lr-schedule, --min-lr, --decay-steps,
// --decay-fraction, --beta1, --beta2, --eps, --weight-decay) when it is out of range, and both when
// --lr x --weight-decay >= 1 (the decoupled decay would zero or flip the weights).
void check_optimizer_options(const TrainOptions& options);

// Throws InvalidArgument when --blas-threads is outside [0, blas::kMaxThreadsPerRank] or above 1 under
// --tp-invariant / --mesh-invariant (which run one BLAS thread per rank), saying when the value came
// from a resumed checkpoint.
void check_blas_threads(const TrainOptions& options);
// On every rank of a run, before its first GEMM: options.blas_threads (> 0) BLAS threads per rank
// (blas::set_threads_per_rank); 0 leaves the launch's automatic count.
void use_blas_threads(const TrainOptions& options);

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
// The Llama family: N_matmul leaves out embed_tokens when it is untied (a lookup; lm_head is the
// output projection), and the attention term is 12 L T (heads x head_dim), its q/k/v width.
double model_flops_per_token(const nn::ModelConfig& config, std::int64_t n_params_without_wpe);
// A mixture of experts' expert weights a token does not multiply by ((experts - k) of every layer's
// experts): the parameters model_flops_per_token leaves out. 0 for a dense model.
std::int64_t inactive_expert_parameters(const nn::ModelConfig& config);
// The parameters of config that are only looked up, never multiplied: GPT-2's wpe, an untied
// Llama's embed_tokens; 0 for other models.
std::int64_t lookup_only_parameters(const nn::ModelConfig& config);

// Trains a GPT on the mesh (collective: every rank calls it with the same options). Rank 0 shows
// progress on stderr (one line redrawn with \r on a terminal, else a line every ~5% of the steps)
// and appends one JSON object per step to options.metrics_path:
//   {"step": 1, "loss": 5.54, "tokens_per_s": 1.2e4, "gflops": 0.8, "elapsed_s": 0.3, "lr": 3e-4}
// Each line is written by one write() call and flushed, so a reader never sees half a line.
TrainResult train(const TrainOptions& options, const dist::DeviceMeshPtr& mesh);

}  // namespace meshgrad::train
