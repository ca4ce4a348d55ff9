// `meshgrad train`: the main job. Trains a byte-level GPT on a text file (or the built-in corpus)
// on a dp x tp mesh with AdamW, showing progress on stderr and writing metrics as JSON lines.
//   meshgrad train                                   tp=2 rank threads, about a minute on 2 cores
//   meshgrad train --mesh dp=2,tp=2 --steps 100 --data book.txt --metrics run.jsonl
//   mpirun -np 2 meshgrad train --backend mpi --mesh tp=2
// The loop lives in the library (train/trainer.hpp); this file parses options and starts the ranks.
#include <fmt/core.h>

#include <memory>
#include <string>

#include "command.hpp"
#include "meshgrad/train/jobs.hpp"

namespace meshgrad::tools {
namespace {

struct TrainArgs {
  std::string dtype = "float32";
  train::TrainJob job;
  TrainArgs() {
    // Defaults sized to finish in about a minute on a 2-core machine with the loss clearly falling.
    train::TrainOptions& o = job.options;
    o.model.kind = "gpt";
    o.model.vocab = 256;   // byte tokens
    o.model.layers = 4;
    o.model.hidden = 128;
    o.model.heads = 4;
    o.model.seq = 64;
    o.model.batch = 16;
    o.steps = 1000;
    o.lr = 3e-3;
    o.metrics_path = "meshgrad-metrics.jsonl";
  }
};

// The job (checks, ranks, loop) is train::run_train_job, shared with the Python module.
int run(TrainArgs& a) {
  a.job.options.model.dtype = parse_dtype(a.dtype);
  train::run_train_job(a.job);
  return 0;
}

}  // namespace

MESHGRAD_REGISTER_COMMAND(
    train, {"", "train", "Train a byte-level GPT on a dp x tp mesh (AdamW, progress bar, JSON-lines metrics)",
            [](CLI::App& app) -> std::function<int()> {
              auto a = std::make_shared<TrainArgs>();
              auto& o = a->job.options;
              app.add_option("--mesh", a->job.mesh, "Mesh axes, e.g. tp=2 or dp=2,tp=2")->capture_default_str();
              app.add_option("--backend", a->job.backend, "threads (rank threads) or mpi (under mpirun)")
                  ->check(CLI::IsMember({"threads", "mpi"}))
                  ->capture_default_str();
              app.add_option("--steps", o.steps, "Optimizer steps")->check(CLI::PositiveNumber)->capture_default_str();
              app.add_option("--data", o.data_path, "Text file to train on (bytes are tokens); default: built-in corpus");
              app.add_option("--layers", o.model.layers, "Transformer blocks (n_layer)")
                  ->check(CLI::PositiveNumber)
                  ->capture_default_str();
              app.add_option("--hidden", o.model.hidden, "Model width (n_embd)")
                  ->check(CLI::PositiveNumber)
                  ->capture_default_str();
              app.add_option("--heads", o.model.heads, "Attention heads (n_head)")
                  ->check(CLI::PositiveNumber)
                  ->capture_default_str();
              app.add_option("--seq", o.model.seq, "Sequence length T")->check(CLI::PositiveNumber)->capture_default_str();
              app.add_option("--batch", o.model.batch, "Global batch B (rows split over dp)")
                  ->check(CLI::PositiveNumber)
                  ->capture_default_str();
              app.add_option("--lr", o.lr, "Peak learning rate (warmup, then cosine decay to 10%)")
                  ->capture_default_str();
              app.add_option("--warmup", o.warmup_steps, "Warmup steps")->capture_default_str();
              app.add_option("--seed", o.seed, "Seed of initialisation, data order and dropout")->capture_default_str();
              app.add_option("--metrics", o.metrics_path, "JSON-lines metrics file (one object per step)")
                  ->capture_default_str();
              app.add_flag("--sequence-parallel", o.parallel.sequence_parallel,
                           "Sequence parallelism (reduce-scatter / all-gather along the sequence)");
              app.add_flag("--overlap", o.parallel.overlap, "Overlap backward communication with compute");
              app.add_flag("--checkpoint-blocks", o.parallel.checkpoint_blocks,
                           "Activation checkpointing per transformer block");
              app.add_option("--dtype", a->dtype, "float32 or float64")
                  ->check(CLI::IsMember({"float32", "float64"}))
                  ->capture_default_str();
              app.add_option("--dropout", o.model.dropout, "Dropout probability")->capture_default_str();
              app.add_option("--save", o.save_path, "Write the trained parameters (full tensors) to this safetensors file");
              return [a] { return run(*a); };
            }});

}  // namespace meshgrad::tools
