// meshgrad bench invariant: training throughput of the normal mode against --mesh-invariant (or
// --tp-invariant alone) on the same meshes and model, measured in one run with the runs interleaved
// (normal, invariant, normal, ...) so that both see the same machine. Prints tokens/s per repeat,
// the median of each mode and the cost of the invariant mode in percent, per mesh, then one table.
#include <fmt/core.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "command.hpp"
#include "meshgrad/launch/launch.hpp"
#include "options.hpp"
#include "meshgrad/train/trainer.hpp"

namespace meshgrad::tools::cmd_bench_invariant {
namespace {

struct BenchInvariantOptions {
  std::vector<std::string> meshes = {"dp=2", "fsdp=2", "tp=2", "pp=2"};
  std::string mode = "mesh";
  std::string shape = "default";
  int steps = 0, repeats = 3;   // steps 0: the shape's
  bool sequence_parallel = false;
  int blocks = 0, batch_blocks = 4;   // blocks 0: the shape's
  std::string dtype = "float32";
};

// The shapes the cost is stated for: `train`'s default and nanoGPT's (docs/BENCHMARKS.md).
// nanoGPT's 6 heads cut into 2 feature blocks that nest at tp=2 (4 blocks of 2, 2, 1, 1 heads do not).
struct Shape {
  int layers, hidden, heads, seq, batch, steps, invariant_blocks;
};
Shape shape_named(const std::string& name) {
  if (name == "nanogpt") return {6, 384, 6, 256, 8, 6, 2};
  return {4, 128, 4, 64, 16, 30, 4};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double tokens_per_s(const train::TrainOptions& run, const std::string& mesh) {
  double tps = 0;
  launch::mesh_runner("threads", mesh)([&](const dist::DeviceMeshPtr& m) {
    const train::TrainResult result = train::train(run, m);
    if (m->rank() == 0) tps = result.tokens_per_s;
  });
  return tps;
}

// The micro-batches a pipeline's normal-mode run uses: the invariant mode's (one per row block of a
// replica), as a pipeline runs with micro-batches anyway; 1 without a pipeline.
int normal_micro_batches(const BenchInvariantOptions& o, const std::string& mesh) {
  int pp = 1, split = 1;
  for (const dist::MeshAxis& a : dist::parse_mesh(mesh)) {
    if (a.name == "pp") pp = a.size;
    if (a.name == "dp" || a.name == "fsdp") split *= a.size;
  }
  return pp > 1 && o.mode == "mesh" ? std::max(1, o.batch_blocks / split) : 1;
}

int run_bench_invariant(const BenchInvariantOptions& o) {
  const Shape s = shape_named(o.shape);
  const int blocks = o.blocks > 0 ? o.blocks : s.invariant_blocks;
  train::TrainOptions t;
  t.model.layers = s.layers;
  t.model.hidden = s.hidden;
  t.model.heads = s.heads;
  t.model.seq = s.seq;
  t.model.batch = s.batch;
  t.model.vocab = 0;   // the built-in corpus' bytes
  t.model.dtype = parse_dtype(o.dtype);
  t.parallel.sequence_parallel = o.sequence_parallel;
  t.steps = o.steps > 0 ? o.steps : s.steps;
  t.warmup_steps = 1;
  t.progress = false;
  fmt::print("meshgrad bench invariant: {}-invariant against the normal mode; gpt layers={} hidden={} heads={} seq={} "
             "batch={} ({} shape) {}{}, {} steps per run, {} invariant blocks{}, threads backend\n", o.mode, s.layers,
             s.hidden, s.heads, s.seq, s.batch, o.shape, o.dtype, o.sequence_parallel ? ", sequence-parallel" : "",
             t.steps, blocks, o.mode == "mesh" ? fmt::format(", {} batch blocks", o.batch_blocks) : "");
  struct Row {
    std::string mesh;
    double normal, invariant;
  };
  std::vector<Row> rows;
  for (const std::string& mesh : o.meshes) {
    fmt::print("\n{} (normal mode: {} micro-batches)\n{:<8} {:>16} {:>16}\n", mesh, normal_micro_batches(o, mesh),
               "repeat", "normal tok/s", "invariant tok/s");
    std::vector<double> normal, invariant;
    for (int r = 0; r < o.repeats; ++r) {
      for (const bool inv : {false, true}) {
        train::TrainOptions run = t;
        run.parallel.invariance = !inv              ? nn::Invariance::None
                                  : o.mode == "mesh" ? nn::Invariance::Mesh
                                                     : nn::Invariance::Tp;   // --mode is tp or mesh
        run.parallel.invariant_blocks = blocks;
        run.parallel.batch_blocks = o.batch_blocks;
        run.grad_accum = inv ? 1 : normal_micro_batches(o, mesh);
        (inv ? invariant : normal).push_back(tokens_per_s(run, mesh));
      }
      fmt::print("{:<8} {:>16.0f} {:>16.0f}\n", r + 1, normal.back(), invariant.back());
    }
    rows.push_back({mesh, median(normal), median(invariant)});
    fmt::print("{:<8} {:>16.0f} {:>16.0f}\n", "median", rows.back().normal, rows.back().invariant);
  }
  fmt::print("\n| mesh | normal tok/s | {}-invariant tok/s | cost |\n|---|---:|---:|---:|\n", o.mode);
  for (const Row& r : rows) {
    fmt::print("| {} | {:.0f} | {:.0f} | {:.1f}% |\n", r.mesh, r.normal, r.invariant, 100.0 * (1.0 - r.invariant / r.normal));
  }
  return 0;
}

CommandSetup setup = [](CLI::App& app) {
  auto o = std::make_shared<BenchInvariantOptions>();
  app.add_option("--mesh", o->meshes, "meshes to measure, one per --mesh (e.g. --mesh dp=2 --mesh tp=2)")
      ->capture_default_str();
  app.add_option("--mode", o->mode, "mesh: --mesh-invariant; tp: --tp-invariant alone")
      ->check(CLI::IsMember({"mesh", "tp"}))->capture_default_str();
  app.add_option("--shape", o->shape, "default (train's: 4 x 128, seq 64, batch 16) or nanogpt (6 x 384, 6 heads, "
                 "seq 256, batch 8)")->check(CLI::IsMember({"default", "nanogpt"}))->capture_default_str();
  app.add_option("--steps", o->steps, "training steps per run (0: the shape's, 30 or 6)")->check(at_least(0))
      ->capture_default_str();
  app.add_option("--repeats", o->repeats, "runs of each mode, interleaved")->check(at_least(1))->capture_default_str();
  app.add_flag("--sequence-parallel", o->sequence_parallel, "sequence parallelism in both modes");
  app.add_option("--invariant-blocks", o->blocks, "fixed blocks per split feature dimension of the invariant mode "
                 "(0: the shape's, 4 or 2)")
      ->check(at_least(0))->capture_default_str();
  app.add_option("--batch-blocks", o->batch_blocks, "row blocks of the batch (--mode mesh)")->check(at_least(1))
      ->capture_default_str();
  app.add_option("--dtype", o->dtype, "float32 or float64")->check(CLI::IsMember({"float32", "float64"}))
      ->capture_default_str();
  return [o] { return run_bench_invariant(*o); };
};

MESHGRAD_REGISTER_COMMAND(bench_invariant, {"bench", "invariant",
                                            "training tokens/s of the normal mode against --mesh-invariant or "
                                            "--tp-invariant", setup});

}  // namespace
}  // namespace meshgrad::tools::cmd_bench_invariant
