// meshgrad bench invariant: training throughput of the normal mode against --tp-invariant on the same
// mesh and model (the default shape of `meshgrad train`), measured in one run with the runs
// interleaved (normal, invariant, normal, ...) so that both see the same machine. Prints tokens/s
// per repeat, the median of each mode and the cost of the invariant mode in percent.
#include <fmt/core.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "command.hpp"
#include "meshgrad/launch/launch.hpp"
#include "options.hpp"
#include "meshgrad/train/trainer.hpp"

namespace meshgrad::tools {
namespace {

struct BenchInvariantOptions {
  std::string mesh = "tp=2";
  int steps = 30, repeats = 3;
  int layers = 4, hidden = 128, heads = 4, seq = 64, batch = 16;
  bool sequence_parallel = false;
  int blocks = 4;
  std::string dtype = "float32";
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int run_bench_invariant(const BenchInvariantOptions& o) {
  train::TrainOptions t;
  t.model.layers = o.layers;
  t.model.hidden = o.hidden;
  t.model.heads = o.heads;
  t.model.seq = o.seq;
  t.model.batch = o.batch;
  t.model.vocab = 0;   // the built-in corpus' bytes
  t.model.dtype = parse_dtype(o.dtype);
  t.parallel.sequence_parallel = o.sequence_parallel;
  t.steps = o.steps;
  t.warmup_steps = 1;
  t.progress = false;
  fmt::print("meshgrad bench invariant: gpt layers={} hidden={} heads={} seq={} batch={} {} on {}{}, {} steps per run, "
             "{} invariant blocks, threads backend\n", o.layers, o.hidden, o.heads, o.seq, o.batch, o.dtype, o.mesh,
             o.sequence_parallel ? ", sequence-parallel" : "", o.steps, o.blocks);
  fmt::print("{:<8} {:>16} {:>16}\n", "repeat", "normal tok/s", "invariant tok/s");
  std::vector<double> normal, invariant;
  for (int r = 0; r < o.repeats; ++r) {
    for (const bool inv : {false, true}) {
      train::TrainOptions run = t;
      run.parallel.tp_invariant = inv;
      run.parallel.invariant_blocks = o.blocks;
      double tps = 0;
      launch::mesh_runner("threads", o.mesh)([&](const dist::DeviceMeshPtr& mesh) {
        const train::TrainResult result = train::train(run, mesh);
        if (mesh->rank() == 0) tps = result.tokens_per_s;
      });
      (inv ? invariant : normal).push_back(tps);
    }
    fmt::print("{:<8} {:>16.0f} {:>16.0f}\n", r + 1, normal.back(), invariant.back());
  }
  const double n = median(normal), i = median(invariant);
  fmt::print("{:<8} {:>16.0f} {:>16.0f}\n", "median", n, i);
  fmt::print("tp-invariant costs {:.1f}% of the normal mode's throughput\n", 100.0 * (1.0 - i / n));
  return 0;
}

CommandSetup setup = [](CLI::App& app) {
  auto o = std::make_shared<BenchInvariantOptions>();
  app.add_option("--mesh", o->mesh, "mesh, e.g. tp=2 or dp=2,tp=2")->capture_default_str();
  app.add_option("--steps", o->steps, "training steps per run")->check(at_least(1))->capture_default_str();
  app.add_option("--repeats", o->repeats, "runs of each mode, interleaved")->check(at_least(1))->capture_default_str();
  app.add_option("--layers", o->layers, "transformer blocks")->check(at_least(1))->capture_default_str();
  app.add_option("--hidden", o->hidden, "hidden size")->check(at_least(1))->capture_default_str();
  app.add_option("--heads", o->heads, "attention heads")->check(at_least(1))->capture_default_str();
  app.add_option("--seq", o->seq, "sequence length")->check(at_least(1))->capture_default_str();
  app.add_option("--batch", o->batch, "global batch rows")->check(at_least(1))->capture_default_str();
  app.add_flag("--sequence-parallel", o->sequence_parallel, "sequence parallelism in both modes");
  app.add_option("--invariant-blocks", o->blocks, "fixed blocks per split dimension of the invariant mode")
      ->check(at_least(1))->capture_default_str();
  app.add_option("--dtype", o->dtype, "float32 or float64")->check(CLI::IsMember({"float32", "float64"}))
      ->capture_default_str();
  return [o] { return run_bench_invariant(*o); };
};

MESHGRAD_REGISTER_COMMAND(bench_invariant, {"bench", "invariant",
                                            "training tokens/s of the normal mode against --tp-invariant", setup});

}  // namespace
}  // namespace meshgrad::tools
