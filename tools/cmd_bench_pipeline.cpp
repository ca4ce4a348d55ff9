// meshgrad bench pipeline: the bubble and the activation memory of the pipeline schedules, measured.
// For each schedule, stage count p and micro-batch count m it trains a few steps on the mesh pp=p
// (rank threads) and prints, per stage, the fraction of the step it spent waiting (blocked in a
// receive from a neighbour or in the step's few collectives) next to the ideal bubble
// (p - 1) / (m + p - 1), and the memory a step needs above what the stage keeps between steps
// (activations of the micro-batches in flight, gradients, temporaries), with the micro-batches the
// schedule keeps in flight. The machine's cores bound what it shows: with more ranks than cores the
// stages also wait for a core, and that counts as computing here.
//   meshgrad bench pipeline --stages 2,4 --micro 1,4,8
#include <fmt/core.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <vector>

#include "command.hpp"
#include "meshgrad/data/synthetic.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/launch/launch.hpp"
#include "meshgrad/pipeline/schedule.hpp"
#include "meshgrad/tensor/allocator.hpp"
#include "meshgrad/train/step.hpp"
#include "options.hpp"

namespace meshgrad::tools::cmd_bench_pipeline {
namespace {

struct BenchPipelineOptions {
  std::vector<int> stages{2, 4};
  std::vector<int> micro{1, 4, 8};
  std::vector<std::string> schedules{"gpipe", "1f1b"};
  int steps = 3;
  int layers = 8, hidden = 128, heads = 4, seq = 64, batch = 16;
};

struct StageFigures {
  double idle = 0;       // fraction of the step's wall time spent blocked
  double step_s = 0;     // mean wall time of a step
  double peak_mb = 0;    // the step's peak above the bytes held before it
};

std::vector<StageFigures> measure(const BenchPipelineOptions& o, pipeline::ScheduleKind kind, int p, int m) {
  const nn::ModelConfig cfg = nn::ModelConfig::gpt(o.layers, o.hidden, o.heads, 256, o.seq, o.batch);
  std::vector<StageFigures> out(static_cast<std::size_t>(p));
  std::mutex mu;
  memory::release_cached();
  launch::run_on_backend("threads", p, [&](const comm::CommunicatorPtr& world) {
    const int r = world->rank();
    const memory::ScopedDomain domain(r + 1);   // this rank's allocations only
    auto mesh = std::make_shared<const dist::DeviceMesh>(world, dist::parse_mesh(fmt::format("pp={}", p)));
    auto model = nn::make_model(cfg, {}, mesh, 1);
    const std::vector<nn::Parameter*> params = model->parameters();
    optim::GradientSynchronizer sync(params, mesh);
    optim::AdamW optimizer(params, mesh);
    const nn::Batch batch = data::make_synthetic_batch(cfg, 1, 0, 5);
    train::train_step(*model, batch, *mesh, sync, optimizer, 0, m, kind);   // warm-up: buffers, caches
    StageFigures mine;
    double blocked = 0, wall = 0;
    for (int s = 0; s < o.steps; ++s) {
      optimizer.zero_grad();
      const std::size_t before = memory::domain_stats(r + 1).live_bytes;
      memory::reset_peak(r + 1);
      dist::reset_comm_blocked_seconds();
      const auto t0 = std::chrono::steady_clock::now();
      train::train_step(*model, batch, *mesh, sync, optimizer, 0, m, kind);
      wall += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      blocked += dist::comm_blocked_seconds();
      const std::size_t peak = memory::domain_stats(r + 1).peak_bytes;
      mine.peak_mb = std::max(mine.peak_mb, static_cast<double>(peak - std::min(peak, before)) / 1e6);
    }
    mine.idle = blocked / wall;
    mine.step_s = wall / o.steps;
    const std::lock_guard<std::mutex> lock(mu);
    out[static_cast<std::size_t>(r)] = mine;
  });
  return out;
}

std::string per_stage(const std::vector<double>& v, const char* format) {
  std::string s;
  for (const double x : v) s += (s.empty() ? "" : " ") + fmt::format(fmt::runtime(format), x);
  return s;
}

// What each row needs, checked for every row before the first is measured (the items' ranges are the
// options' validators'): a pipeline of p stages needs p blocks, and m micro-batches of equal rows.
void check_rows(const BenchPipelineOptions& o) {
  for (const int p : o.stages) {
    MG_CHECK(p <= o.layers, "bench pipeline: --stages {}: a pipeline of {} stages needs at least {} transformer "
             "blocks, and --layers is {}", p, p, p, o.layers);
  }
  for (const int m : o.micro) {
    MG_CHECK(o.batch % m == 0, "bench pipeline: --micro {}: --batch {} does not divide into {} micro-batches of equal "
             "rows", m, o.batch, m);
  }
}

int run_bench_pipeline(const BenchPipelineOptions& o) {
  check_rows(o);
  fmt::print("pipeline bubble and memory: gpt layers={} hidden={} heads={} seq={} batch={}, {} steps per row, rank "
             "threads on this machine\n", o.layers, o.hidden, o.heads, o.seq, o.batch, o.steps);
  fmt::print("{:<7} {:>2} {:>2} {:>6} {:>8}  {:<26} {:>8}  {:<12} {:<28}\n", "sched", "p", "m", "ideal", "idle max",
             "idle per stage", "step ms", "in flight", "step peak MB per stage");
  for (const std::string& name : o.schedules) {
    const pipeline::ScheduleKind kind = pipeline::parse_schedule(name);
    for (const int p : o.stages) {
      for (const int m : o.micro) {
        const std::vector<StageFigures> f = measure(o, kind, p, m);
        std::vector<double> idle, peak, in_flight;
        double step_s = 0, idle_max = 0;
        for (int s = 0; s < p; ++s) {
          const StageFigures& x = f[static_cast<std::size_t>(s)];
          idle.push_back(x.idle);
          idle_max = std::max(idle_max, x.idle);
          peak.push_back(x.peak_mb);
          step_s = std::max(step_s, x.step_s);
          in_flight.push_back(pipeline::peak_in_flight(pipeline::stage_actions(kind, p, s, m)));
        }
        fmt::print("{:<7} {:>2} {:>2} {:>6.3f} {:>8.3f}  {:<26} {:>8.1f}  {:<12} {:<28}\n", name, p, m,
                   pipeline::ideal_bubble(p, m), idle_max, per_stage(idle, "{:.2f}"), 1e3 * step_s,
                   per_stage(in_flight, "{:.0f}"), per_stage(peak, "{:.1f}"));
      }
    }
  }
  return 0;
}

CommandSetup setup = [](CLI::App& app) {
  auto o = std::make_shared<BenchPipelineOptions>();
  app.add_option("--stages", o->stages, "pipeline stage counts p, e.g. 2,4 (each at most --layers)")
      ->delimiter(',')
      ->check(each_count("2,4", 1, dist::kMaxMeshRanks))
      ->capture_default_str();
  app.add_option("--micro", o->micro, "micro-batch counts m, e.g. 1,4,8 (each must divide --batch)")
      ->delimiter(',')
      ->check(each_count("1,4,8"))
      ->capture_default_str();
  app.add_option("--schedules", o->schedules, "gpipe, 1f1b or both")
      ->delimiter(',')
      ->check(CLI::IsMember({"gpipe", "1f1b"}))
      ->capture_default_str();
  app.add_option("--steps", o->steps, "measured steps per row (after one warm-up step)")
      ->check(at_least(1))
      ->capture_default_str();
  app.add_option("--layers", o->layers, "transformer blocks (at least the largest p)")->check(at_least(1))
      ->capture_default_str();
  app.add_option("--hidden", o->hidden, "hidden size")->check(at_least(1))->capture_default_str();
  app.add_option("--heads", o->heads, "attention heads")->check(at_least(1))->capture_default_str();
  app.add_option("--seq", o->seq, "sequence length")->check(at_least(1))->capture_default_str();
  app.add_option("--batch", o->batch, "global batch rows")->check(at_least(1))->capture_default_str();
  return [o] { return run_bench_pipeline(*o); };
};

MESHGRAD_REGISTER_COMMAND(bench_pipeline, {"bench", "pipeline",
                                           "the pipeline schedules' bubble (idle fraction per stage against (p-1)/(m+p-1)) "
                                           "and step memory per stage, measured",
                                           setup});

}  // namespace
}  // namespace meshgrad::tools::cmd_bench_pipeline
