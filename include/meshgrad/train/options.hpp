// What a training run is asked to do (TrainOptions), what it reports per step (StepMetrics) and at
// the end (TrainResult): the vocabulary the trainer (trainer.hpp), the run configuration a
// checkpoint records (run_config.hpp), the jobs (launch/jobs.hpp), the CLI and Python share. The
// options a user sets are declared once, with their names and help, in option_table.hpp; a field
// added here that a user should set needs an entry there.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "meshgrad/nn/model.hpp"

namespace meshgrad::train {

// The figures of one optimizer step: one line of the metrics file, and what TrainOptions::on_step sees.
struct StepMetrics {
  int step = 0;              // 1-based
  double loss = 0;           // global loss of the step's batch (before the update)
  double tokens_per_s = 0;   // global tokens of the step / its wall time
  double gflops = 0;         // tokens_per_s * model_flops_per_token
  double elapsed_s = 0;      // since the first step started
  double lr = 0;             // learning rate of the step
  double grad_norm = 0;      // global L2 norm of the gradient, before clipping
  bool evaluated = false;    // this step ran an evaluation (TrainOptions::eval_every)
  double val_loss = 0;       // then: the mean global loss over the validation batches
  double ms_per_step = 0;    // the step's wall time (an evaluation or sample at its end included)
  double mfu = -1;           // gflops / the mesh's peak GFLOP/s (TrainOptions::peak_gflops); < 0: unknown
  // A mixture of experts (nn/moe.hpp): the step's routing over every rank. expert_load[l][e]: the
  // assignments expert e of MoE layer l received (tokens x k, before capacity drops; the layers of
  // mesh rank 0's pipeline stage); dropped: the assignments the capacity factor dropped; aux_loss: the
  // load-balancing loss (before its coefficient; 0 without output_router_logits).
  std::vector<std::vector<std::int64_t>> expert_load;
  std::int64_t dropped = 0;
  double aux_loss = 0;
};

// One line of the metrics file, and a row of Python's train(): {"step", "loss", "tokens_per_s",
// "gflops", "elapsed_s", "lr", "grad_norm", "ms_per_step"[, "mfu"][, "val_loss" on evaluation steps]
// [, "expert_load", "dropped", "aux_loss" for a mixture of experts]}.
nlohmann::json step_metrics_json(const StepMetrics& m);

struct TrainOptions {
  // GPT sizes (kind "gpt"); batch is the *global* B, split over dp. vocab <= 0: the data's vocabulary
  // (TokenDataset::vocab(): 256 for bytes); a data token >= vocab is an error naming its position.
  nn::ModelConfig model;
  nn::ParallelConfig parallel;
  int steps = 200;
  // "float32", or "bf16": mixed precision as torch.autocast("cpu", torch.bfloat16) and every anchor's
  // bf16 training run it. The matrix products (and attention's) take bf16 operands with float32
  // accumulation (kernels::ProductPrecision); the weights (the float32 masters), gradients, AdamW
  // moments, softmax, normalisation and loss stay float32, and layers keep their products' saved
  // inputs in bf16. Needs model.dtype float32. blas::bf16_route() says which kernels run it.
  std::string precision = "float32";
  // The learning-rate schedule (learning_rate() in trainer.hpp): warmup_steps of linear warmup
  // from lr / warmup_steps to lr, then `lr_schedule` over decay_steps down to min_lr, then min_lr:
  //   "cosine"    min_lr + (lr - min_lr) (1 + cos(pi p)) / 2, p = steps since warmup / decay_steps
  //   "linear"    lr + (min_lr - lr) p
  //   "constant"  lr (min_lr and decay_steps unused)
  //   "wsd"       warmup-stable-decay: lr until the last decay_fraction of decay_steps, then linear
  //               down to min_lr over that fraction
  // decay_steps < 0: the rest of the run (steps - 1 - warmup_steps, so the last step has min_lr); a
  // given --decay-steps does not depend on --steps, so a resume that extends --steps keeps the curve.
  double lr = 3e-3;          // peak learning rate
  int warmup_steps = 10;
  std::string lr_schedule = "cosine";
  double min_lr = -1;        // -1: lr * 0.1 (other negatives are refused)
  int decay_steps = -1;
  double decay_fraction = 0.2;
  // AdamW (optim/adamw.hpp): moments' decay rates, the denominator's epsilon, decoupled weight decay
  // (2-D weights only).
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  std::uint64_t seed = 1234; // model initialisation, data order and dropout
  std::string data_path;     // "" = the built-in corpus; see TokenDataset for what a path may be
  // The validation set instead of the data's own split (a prepared directory, a token file or a glob
  // of shards: TokenDataset's val_path); "" = the data's.
  std::string val_data_path;
  std::string metrics_path;  // JSON lines, one per step (rank 0 writes); "" = none
  std::string save_path;     // safetensors of the full trained parameters; "" = none
  // A Hugging Face GPT-2 directory (config.json + model.safetensors) to start from instead of a
  // random initialisation (interop/hf_io.hpp): the model's sizes come from its config.json, and a size
  // of `model` that is set (> 0) must agree with it (0 takes the file's); checked before step 1.
  std::string init_from;
  // A Hugging Face config.json (model_type gpt2, llama, qwen2 or mistral; interop/hf_config.hpp) the
  // model's shape comes from instead of the size options (launch::run_train_job applies it): a size
  // option also given must agree with it. seq, batch, dropout and dtype stay the run's. "" = none.
  std::string model_config;
  std::string trace_path;    // Chrome trace of the run (run_train_job, trace_file.hpp); "" = none
  // Evaluation every eval_every steps (and after the last one; 0 = never): the mean global loss of
  // the model over the first eval_steps validation batches (all of them if fewer), without dropout
  // and without recording a graph. Needs data with a validation split (a prepared directory).
  int eval_every = 0;
  // Clip the global gradient norm to this (0 = off); the norm is reported every step either way.
  double grad_clip = 0;
  // Micro-batches per step (each rank's rows of --batch split in K; see train_step). On a pipeline
  // (a mesh with pp > 1) they are what flows through the stages (--micro-batches is its other name).
  int grad_accum = 1;
  // The pipeline schedule on a mesh with pp > 1: "1f1b" or "gpipe" (pipeline/schedule.hpp).
  std::string pp_schedule = "1f1b";
  int eval_steps = 20;
  // A sample every sample_every steps (0 = never): sample_tokens tokens continuing sample_prompt,
  // printed with the progress and written to the metrics file as {"type": "sample", "step", "text"}.
  // The run gathers the full parameters to mesh rank 0 (any mesh: tp, fsdp, pp, SP) and calls
  // `sampler` there with them; the other ranks wait for it at their next collective. The library's
  // jobs (launch::run_train_job) set sampler (a one-rank copy of the model and the data's tokenizer).
  int sample_every = 0;
  int sample_tokens = 64;
  std::string sample_prompt = "\n";
  using Sampler = std::function<std::string(const nn::ModelConfig& model,
                                             const std::vector<std::pair<std::string, Tensor>>& full, int step)>;
  Sampler sampler;
  // Called on every rank before step 1 with the run's model configuration (its vocabulary resolved)
  // when sample_every > 0: throws when `sampler` cannot sample from that model, so the run is refused
  // before it trains, not at its first sample. Empty: no check. launch::run_train_job sets it with
  // sampler (a vocabulary other than 256 needs the data's tokenizer).
  std::function<void(const nn::ModelConfig& model)> check_sampler;
  // Sharded checkpoints (checkpoint/saver.hpp): every save_every steps and after the last step,
  // into checkpoint_dir/step_XXXXXXXX, keeping the newest `keep` (0 = all), written in the background
  // unless checkpoint_sync. "" = no checkpoints.
  std::string checkpoint_dir;
  int save_every = 0;
  int keep = 0;
  bool checkpoint_sync = false;
  // Resume from a checkpoint directory, or the newest under a --checkpoint-dir (run_train_job turns
  // it into resume_dir and the saved configuration; see train/run_config.hpp).
  std::string resume;
  std::string resume_dir;
  // A resume whose data differs (by content hash) from the checkpoint's is refused unless this is set:
  // the user means to go on with other data. Not part of the saved configuration.
  bool data_changed_ok = false;
  // --keep-schedule: a resume with another --steps keeps the checkpoint's decay horizon (launch::
  // resolve_resume sets decay_steps to it); without it the decay follows the new --steps, and the
  // resume says so.
  bool keep_schedule = false;
  // The options the caller set explicitly, by command-line name ("steps", "mesh", "lr"): on resume
  // they override the checkpoint's configuration; the others come from it.
  std::set<std::string> given_options;
  // Set by a resume (train::resume_options; launch::resolve_resume adds "mesh"): the options the run
  // took from the checkpoint with another value than the caller's, by command-line name, each value
  // as a command line spells it ("grad-accum" -> "4"). An error naming one of them says that the
  // value came from the checkpoint and how to override it (launch::run_train_job).
  std::map<std::string, std::string> from_checkpoint;
  // With checkpoint_dir: SIGTERM or SIGINT finishes the current step, writes a checkpoint and returns
  // (TrainResult::stopped_by); a second SIGINT aborts. The CLI turns it on; library callers choose.
  bool handle_signals = false;
  // Polled on rank 0 after every step: true ends the run there as a signal would (every rank stops
  // after the same step; with checkpoint_dir a checkpoint is written first; TrainResult::stopped_by
  // is "stop request"). E.g. the Python module's Ctrl-C. Empty: never.
  std::function<bool()> stop_requested;
  // OpenBLAS threads per rank (--blas-threads; blas::set_threads_per_rank): 0 = the launch's automatic
  // max(1, cores / ranks on the node). Some OpenBLAS kernels (Haswell's) split a GEMM's sums
  // differently over 1 and 2 threads, so runs meant to agree bitwise on meshes of different sizes
  // (pp=2 against one rank's --grad-accum) need the same count, which the automatic one is not. The
  // invariant modes run 1 per rank (another count is refused; check_blas_threads).
  int blas_threads = 0;
  bool progress = true;      // rank 0 shows progress on stderr
  // The mesh's peak GFLOP/s, the denominator of MFU: given (0.001 to 1e12), or 0: measured once at
  // start (a GEMM on rank 0, times the ranks: train/progress.hpp). Anything else is refused.
  double peak_gflops = 0;
  // Written into the metrics file's header line with the configuration and the mesh (the CLI: the
  // meshgrad version, the git commit it was built from, the command line).
  std::vector<std::pair<std::string, std::string>> provenance;
  // Called on rank 0 (its thread) after every step, after the metrics line was written. A throw
  // fails the run like any other rank error.
  std::function<void(const StepMetrics&)> on_step;
};

struct TrainResult {
  std::vector<double> losses;   // global loss of every step (before its update), on every rank
  std::vector<std::pair<int, double>> val_losses;   // (1-based step, validation loss) of each evaluation
  double seconds = 0;           // wall time of the steps (rank 0's clock on rank 0)
  double tokens_per_s = 0;      // global tokens / seconds
  double gflops = 0;            // model GFLOP/s over the run (see model_flops_per_token)
  std::int64_t parameters = 0;  // of the full model
  int first_step = 0;           // 0-based step the run started at (the checkpoint's step when resumed)
  std::string stopped_by;       // "SIGTERM" / "SIGINT" / "stop request" when that ended the run early, else ""
  std::string last_checkpoint;  // the newest checkpoint this run committed (rank 0), else ""
  int checkpoints = 0;          // how many this run wrote
  double checkpoint_stall_s = 0;   // training time spent in saves (snapshots; whole saves when sync)
  // Mean of the losses of the first / last quarter of the steps (1 to 10 steps): per-step losses
  // are noisy (every step draws a different batch).
  double start_loss() const;
  double end_loss() const;
};

}  // namespace meshgrad::train
