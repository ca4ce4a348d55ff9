// `meshgrad train`: the main job. Trains a GPT on prepared GPT-2 BPE tokens, an llm.c token file or
// the bytes of a text file (or the built-in corpus) on a dp x tp mesh with AdamW, showing progress
// on stderr and writing metrics as JSON lines.
//   meshgrad train                                   tp=2 rank threads, about a minute on 2 cores
//   meshgrad train --mesh dp=2,tp=2 --steps 100 --data book.txt --metrics run.jsonl
//   mpirun -np 2 meshgrad train --backend mpi --mesh tp=2
// The job lives in the library (launch/jobs.hpp, train/trainer.hpp); this file parses options.
#include <fmt/core.h>

#include <memory>
#include <string>

#include "command.hpp"
#include "json_config.hpp"
#include "meshgrad/checkpoint/directory.hpp"
#include "meshgrad/launch/jobs.hpp"
#include "meshgrad/launch/launch.hpp"
#include "meshgrad/tensor/blas.hpp"
#include "options.hpp"

#ifndef MESHGRAD_VERSION   // set by CMake for this file (the metrics header records them)
#define MESHGRAD_VERSION "unknown"
#endif
#ifndef MESHGRAD_GIT_COMMIT
#define MESHGRAD_GIT_COMMIT "unknown"
#endif

namespace meshgrad::tools {
namespace {

struct TrainArgs {
  std::string mesh = "tp=2";
  std::string backend = "threads";
  std::string dtype = "float32";
  std::string config;   // --config: expanded by main before parsing; never set here
  train::TrainOptions options;
  TrainArgs() {
    // Defaults sized to finish in about a minute on a 2-core machine with the loss clearly falling.
    options.model.kind = "gpt";
    options.model.vocab = 0;     // from the data: 256 for bytes, meta.json or the token range for tokens
    options.model.layers = 4;
    options.model.hidden = 128;
    options.model.heads = 4;
    options.model.seq = 64;
    options.model.batch = 16;
    options.steps = 1000;
    options.lr = 3e-3;
    options.metrics_path = "meshgrad-metrics.jsonl";
  }
};

// The checks and the loop are the library's (launch::run_train_job), shared with the Python module.
int run(TrainArgs& a, const CLI::App& app) {
  a.options.model.dtype = parse_dtype(a.dtype);
  a.options.provenance = {{"meshgrad_version", MESHGRAD_VERSION}, {"git_commit", MESHGRAD_GIT_COMMIT},
                          {"backend", a.backend}};
  // Options the user gave (on the command line or in --config): on --resume they override the
  // checkpoint's configuration, the others come from it.
  for (const CLI::Option* opt : app.get_options()) {
    if (opt->count() > 0) {
      for (const std::string& name : opt->get_lnames()) a.options.given_options.insert(name);
    }
  }
  a.options.handle_signals = true;   // SIGTERM / Ctrl-C: checkpoint and exit 0 (with --checkpoint-dir)
  std::string mesh = a.mesh;
  if (!a.options.resume.empty() && a.options.given_options.count("mesh") == 0) {
    // The checkpoint's mesh, unless another one is asked for (any mesh loads it).
    const checkpoint::Manifest manifest = checkpoint::read_manifest(checkpoint::resolve_checkpoint(a.options.resume));
    mesh = manifest.state.value("mesh", a.mesh);
  }
  launch::run_train_job(a.options, launch::mesh_runner(a.backend, mesh));
  return 0;
}

// The "Checkpoints" group: where and how often sharded checkpoints are written, and resuming.
void add_checkpoint_options(CLI::App& app, train::TrainOptions& o) {
  app.add_option("--checkpoint-dir", o.checkpoint_dir,
                 "Write sharded checkpoints (parameters, optimizer, data position, RNG) into DIR/step_XXXXXXXX "
                 "every --save-every steps and at the end; SIGTERM / Ctrl-C then checkpoint and stop")
      ->group("Checkpoints");
  app.add_option("--save-every", o.save_every, "Steps between checkpoints (0: only at the end)")
      ->check(at_least(0))
      ->group("Checkpoints");
  app.add_option("--keep", o.keep, "Keep only the newest K checkpoints (0: all)")
      ->check(at_least(0))
      ->group("Checkpoints");
  app.add_flag("--sync-checkpoints", o.checkpoint_sync,
               "Write checkpoints before training goes on (default: in the background after an in-memory "
               "snapshot)")
      ->group("Checkpoints");
  app.add_option("--resume", o.resume,
                 "Resume from a checkpoint directory, or the newest one under a --checkpoint-dir; options "
                 "come from it unless given again (the model's shape cannot change); new checkpoints go into the "
                 "folder resumed from unless --checkpoint-dir is given")
      ->group("Checkpoints");
  app.add_flag("--data-changed-ok", o.data_changed_ok,
               "With --resume: go on although the data's content differs from the checkpoint's (it is "
               "refused otherwise, naming both content hashes)")
      ->group("Checkpoints");
}

// The "Optimizer and schedule" group: AdamW's settings and the learning-rate schedule
// (train/options.hpp states the formulas; the ranges are checked by train::check_optimizer_options).
void add_optimizer_options(CLI::App& app, train::TrainOptions& o) {
  const auto add = [&app](const char* name, auto& field, const char* help) {
    return app.add_option(name, field, help)->capture_default_str()->group("Optimizer and schedule");
  };
  add("--lr", o.lr, "Peak learning rate");
  add("--warmup", o.warmup_steps, "Steps of linear warmup from lr / warmup to lr")->check(at_least(0));
  add("--lr-schedule", o.lr_schedule, "After warmup: cosine or linear decay to --min-lr over --decay-steps, constant, "
      "or wsd (warmup-stable-decay: constant, then linear to --min-lr over the last --decay-fraction)")
      ->check(CLI::IsMember({"cosine", "linear", "constant", "wsd"}));
  add("--min-lr", o.min_lr, "Learning rate at the end of the decay, in [0, --lr] (-1: lr / 10)");
  add("--decay-steps", o.decay_steps, "Steps of the decay after warmup, independent of --steps (-1: to the last "
      "step); min-lr after them")
      ->check(at_least_or_minus_one(1, "to the last step"));
  add("--decay-fraction", o.decay_fraction, "wsd: the fraction of --decay-steps that decays (the rest is stable)");
  add("--beta1", o.beta1, "AdamW: decay rate of the first moment");
  add("--beta2", o.beta2, "AdamW: decay rate of the second moment");
  add("--eps", o.eps, "AdamW: epsilon added to the second moment's square root");
  add("--weight-decay", o.weight_decay, "AdamW: decoupled weight decay of the 2-D weights (matrices and embeddings; not biases or norms)");
  add("--peak-gflops", o.peak_gflops, "The mesh's peak GFLOP/s for the MFU shown, 0.001 to 1e12 (0: measured at start with a GEMM)");
}

// The model's sizes. All of them, so that every key a run records (the metrics header's "config", a
// checkpoint's) is an option: a run's own configuration is a --config file.
void add_model_options(CLI::App& app, nn::ModelConfig& m) {
  app.add_option("--layers", m.layers, "Transformer blocks (n_layer)")
      ->check(at_least(1))
      ->capture_default_str();
  app.add_option("--hidden", m.hidden, "Model width (n_embd)")
      ->check(at_least(1))
      ->capture_default_str();
  app.add_option("--heads", m.heads, "Attention heads (n_head)")
      ->check(at_least(1))
      ->capture_default_str();
  app.add_option("--seq", m.seq, "Sequence length T")->check(at_least(1))->capture_default_str();
  app.add_option("--ffn", m.ffn, "Feed-forward width (0: 4 x hidden)")->check(at_least(0))->capture_default_str();
  app.add_option("--vocab", m.vocab, "Vocabulary size (0: the data's)")->check(at_least(0))->capture_default_str();
  app.add_option("--positions", m.positions, "Position table rows, n_positions (0: --seq)")
      ->check(at_least(0))
      ->capture_default_str();
  app.add_option("--layer-norm-epsilon", m.layer_norm_epsilon, "LayerNorm's epsilon")->capture_default_str();
  app.add_option("--batch", m.batch, "Global batch B (rows split over dp)")
      ->check(at_least(1))
      ->capture_default_str();
}

// --grad-accum, its pipeline name --micro-batches, and the pipeline's own options.
void add_micro_batch_options(CLI::App& app, train::TrainOptions& o) {
  CLI::Option* grad_accum =
      app.add_option("--grad-accum", o.grad_accum,
                     "Micro-batches per step: each replica's rows of --batch in K parts, one reduction per step (on a "
                     "pipeline: what flows through the stages)")
          ->check(at_least(1))
          ->capture_default_str();
  app.add_option("--micro-batches", o.grad_accum,
                 "The same as --grad-accum, the pipeline's name for it: with pp=P, M micro-batches flow through the "
                 "stages; the bubble is (P-1)/(M+P-1)")
      ->check(at_least(1))
      ->excludes(grad_accum);
  app.add_option("--pp-layers", o.parallel.pp_layers,
                 "With pp=P: transformer blocks per stage, e.g. 3,3 (P counts summing to --layers; default an even "
                 "split)")
      ->delimiter(',')
      ->check(each_count("3,3"));
  app.add_option("--pp-schedule", o.pp_schedule,
                 "With pp=P: 1f1b (activations of at most P micro-batches per stage) or gpipe (all forwards, then all "
                 "backwards)")
      ->check(CLI::IsMember({"1f1b", "gpipe"}))
      ->capture_default_str();
}

}  // namespace

MESHGRAD_REGISTER_COMMAND(
    train, {"", "train", "Train a GPT (GPT-2 BPE tokens from `meshgrad prepare`, or bytes) on a dp x tp mesh (AdamW, progress bar, JSON-lines metrics)",
            [](CLI::App& app) -> std::function<int()> {
              auto a = std::make_shared<TrainArgs>();
              auto& o = a->options;
              // Expanded before parsing (json_config.hpp); declared here for --help and the check.
              app.add_option("--config", a->config, "JSON file of options, e.g. {\"steps\": 100, \"mesh\": "
                             "\"tp=2\", \"sequence-parallel\": true}; the command line overrides it")
                  ->group(kJsonConfigGroup);
              app.add_option("--mesh", a->mesh, "Mesh axes pp, dp, fsdp and tp, e.g. tp=2, dp=2,tp=2, fsdp=2,tp=2, pp=2,tp=2 or tp=2x2 (2-D)")
                  ->capture_default_str();
              app.add_option("--backend", a->backend, "threads (rank threads) or mpi (under mpirun)")
                  ->check(CLI::IsMember({"threads", "mpi"}))
                  ->capture_default_str();
              app.add_option("--steps", o.steps, "Optimizer steps")->check(at_least(1))->capture_default_str();
              app.add_option("--data", o.data_path, "A directory from `meshgrad prepare` (train.bin, or train_*.bin "
                             "shards read in order), a glob of shards ('DIR/train_*.bin'), an llm.c .bin token file, "
                             "or a text file (bytes are tokens); default: built-in corpus")
                  ->check(CLI::Validator(
                      [](const std::string& v) {
                        // An unset $DATA must not silently train on the built-in corpus.
                        return v.empty() ? std::string("the path is empty (omit --data for the built-in corpus)")
                                         : std::string();
                      },
                      "PATH"));
              app.add_option("--val-data", o.val_data_path,
                             "Validate on this instead of the data's own split: a prepared directory (its val.bin or "
                             "val_*.bin), a token file, or a glob of shards");
              app.add_option("--eval-every", o.eval_every,
                             "Evaluate the validation loss every N steps and after the last (0 = never; needs a "
                             "prepared --data directory)")
                  ->check(at_least(0))
                  ->capture_default_str();
              app.add_option("--grad-clip", o.grad_clip,
                             "Clip the global L2 norm of the gradient to this (0 = off); grad_norm is in the metrics "
                             "either way")
                  ->capture_default_str();
              add_micro_batch_options(app, o);
              app.add_option("--sample-every", o.sample_every,
                             "Print (and write to the metrics) a sample of the model every N steps (0 = never); on "
                             "any mesh")
                  ->check(at_least(0))
                  ->capture_default_str();
              app.add_option("--sample-tokens", o.sample_tokens, "Tokens per sample")->check(at_least(1))->capture_default_str();
              app.add_option("--sample-prompt", o.sample_prompt, "The text samples continue (cut to the model's "
                             "positions: --positions, default --seq tokens)");
              app.add_option("--eval-steps", o.eval_steps, "Validation batches per evaluation")
                  ->check(at_least(1))
                  ->capture_default_str();
              add_model_options(app, o.model);
              add_optimizer_options(app, o);
              app.add_option("--seed", o.seed, "Seed of initialisation, data order and dropout")
                  ->check(at_least(0, UINT64_MAX))
                  ->capture_default_str();
              CLI::Option* metrics =
                  app.add_option("--metrics", o.metrics_path, "JSON-lines metrics file (one object per step)")
                      ->capture_default_str();
              app.add_flag_callback("--no-metrics", [&o] { o.metrics_path.clear(); }, "Write no metrics file")
                  ->excludes(metrics);
              app.add_flag("--sequence-parallel", o.parallel.sequence_parallel,
                           "Sequence parallelism (reduce-scatter / all-gather along the sequence)");
              app.add_flag("--overlap", o.parallel.overlap, "Overlap backward communication with compute");
              app.add_flag("--regather", o.parallel.recompute_allgather,
                           "With --sequence-parallel: keep only the local input shard of each column layer and "
                           "re-gather it in backward into one buffer shared by the layers (less memory, one more "
                           "all-gather per layer)");
              app.add_flag("--checkpoint-blocks", o.parallel.checkpoint_blocks,
                           "Activation checkpointing per transformer block");
              app.add_flag("--reshard-after-forward,!--no-reshard-after-forward", o.parallel.reshard_after_forward,
                           "With an fsdp axis: free each block's gathered parameters after its forward (the default); "
                           "--no-reshard-after-forward keeps them to its backward (one all-gather fewer per block and "
                           "step, more memory: ZeRO-2)")
                  ->default_str("true");   // --config's false must turn it off (json_config.hpp)
              app.add_flag("--shard-optimizer", o.parallel.shard_optimizer,
                           "Shard the gradients and AdamW moments over dp (ZeRO): reduce-scatter instead of "
                           "all-reduce, each rank steps its shard, parameters all-gathered once per step; needs dp > 1");
              add_tp_invariant_flag(app, o.parallel,
                           "Bitwise the same model at every tensor-parallel degree that keeps the fixed reduction "
                           "tree (docs/mesh-invariance.md); one BLAS thread per rank");
              app.add_option("--invariant-blocks", o.parallel.invariant_blocks,
                             "With --tp-invariant: fixed blocks per split dimension (a power of two; tp must divide it)")
                  ->check(at_least(1))
                  ->capture_default_str();
              add_mesh_invariant_options(app, o.parallel);
              app.add_option("--blas-threads", o.blas_threads,
                             "OpenBLAS threads per rank (0: max(1, cores / ranks on the node)). Runs meant to be "
                             "bitwise alike on meshes of different sizes (pp=2 against --grad-accum on one rank) "
                             "need the same count: give both --blas-threads 1. The invariant modes run 1")
                  ->check(at_least(0, blas::kMaxThreadsPerRank))
                  ->capture_default_str();
              app.add_option("--dtype", a->dtype, "float32 or float64")
                  ->check(CLI::IsMember({"float32", "float64"}))
                  ->capture_default_str();
              app.add_option("--dropout", o.model.dropout, "Dropout probability")->capture_default_str();
              app.add_option("--save", o.save_path, "Write the trained parameters (full tensors) to this safetensors file");
              add_checkpoint_options(app, o);
              app.add_option("--init-from", o.init_from, "Start from a Hugging Face GPT-2 directory (config.json + "
                             "model.safetensors) instead of random weights; the sizes come from its config.json");
              app.add_option("--trace", o.trace_path, "Write a Chrome trace (Perfetto / chrome://tracing) of the run to "
                             "this JSON file: per rank and communicator, each layer's forward and backward, each "
                             "collective, each wait; see docs/tracing.md");
              return [a, sub = &app] {
                // --init-from: sizes not on the command line come from its config.json (0 = the file's).
                if (!a->options.init_from.empty()) {
                  for (auto [option, field] : {std::pair{"--layers", &a->options.model.layers},
                                               std::pair{"--hidden", &a->options.model.hidden},
                                               std::pair{"--heads", &a->options.model.heads}}) {
                    if (sub->count(option) == 0) *field = 0;
                  }
                }
                return run(*a, *sub);
              };
            }});

}  // namespace meshgrad::tools
