// meshgrad bench mlp: one Megatron MLP (column h -> f, GELU, row f -> h) forward+backward per step on
// the threads backend, the shapes of ../shared/peers/torch_tp_mlp.py, so the two can be run side by
// side. Prints ms per step, GFLOP/s, the time ranks spent blocked in communication and, with
// --overlap, how much of the communication the overlap hid (measured against the same step with
// overlap off, in the same run).
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>

#include "command.hpp"
#include "options.hpp"
#include "meshgrad/launch/launch.hpp"
#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/nn/model.hpp"
#include "meshgrad/tensor/trace.hpp"
#include "meshgrad/train/trace_file.hpp"

namespace meshgrad::tools::cmd_bench_mlp {
namespace {

struct BenchMlpOptions {
  std::string mesh = "tp=1";
  bool sequence_parallel = false;
  bool overlap = false;
  int tokens = 1024, hidden = 512, ffn = 2048, steps = 5, warmup = 2;
  std::string dtype = "float32";
  std::string trace;   // --trace: Chrome trace of every variant's steps, one after the other
};

struct StepFigures {
  double ms = 0;          // median step time over ranks' max
  double blocked_ms = 0;  // rank 0's time blocked in collectives per step (median step)
};

StepFigures time_steps(const BenchMlpOptions& o, int tp, bool overlap) {
  nn::ModelConfig cfg;
  cfg.kind = "mlp";
  cfg.layers = 1;
  cfg.hidden = o.hidden;
  cfg.ffn = o.ffn;
  cfg.seq = o.tokens;
  cfg.batch = 1;
  cfg.dtype = parse_dtype(o.dtype);
  nn::ParallelConfig parallel;
  parallel.sequence_parallel = o.sequence_parallel;
  parallel.overlap = overlap;
  StepFigures result;
  std::mutex mu;
  launch::run_on_backend("threads", tp, [&](const comm::CommunicatorPtr& world) {
    auto mesh = std::make_shared<const dist::DeviceMesh>(world, std::vector<dist::MeshAxis>{{"tp", tp}});
    auto model = nn::make_model(cfg, parallel, mesh, 1);
    const nn::Batch batch{Tensor::zeros({1, o.tokens}, DType::Int64), Tensor::zeros({1, o.tokens}, DType::Int64)};
    std::vector<double> step_ms, blocked_ms;
    for (int step = 0; step < o.warmup + o.steps; ++step) {
      for (nn::Parameter* p : model->parameters()) p->value.zero_grad();
      world->barrier();
      dist::reset_comm_blocked_seconds();
      const auto start = std::chrono::steady_clock::now();
      {
        trace::Span span(step < o.warmup ? "warmup" : "step", "step");
        span.arg("overlap", std::int64_t{overlap});
        backward(model->loss(batch, o.tokens));
      }
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      // The step takes as long as its slowest rank.
      double slowest = ms;
      world->all_reduce(comm::MutableBuffer{&slowest, 1, DType::Float64}, comm::ReduceOp::Max);
      if (step >= o.warmup) {
        step_ms.push_back(slowest);
        blocked_ms.push_back(dist::comm_blocked_seconds() * 1e3);
      }
    }
    if (world->rank() == 0) {
      std::sort(step_ms.begin(), step_ms.end());
      std::sort(blocked_ms.begin(), blocked_ms.end());
      std::lock_guard<std::mutex> lock(mu);
      result.ms = step_ms[step_ms.size() / 2];
      result.blocked_ms = blocked_ms[blocked_ms.size() / 2];
    }
  });
  return result;
}

int run_bench_mlp(const BenchMlpOptions& o) {
  const auto axes = dist::parse_mesh(o.mesh);
  MG_CHECK(axes.size() == 2 && axes[0].size == 1 && axes[1].name == "tp", "bench mlp: --mesh must be tp=N, got '{}'",
           o.mesh);
  MG_CHECK(o.steps >= 1 && o.warmup >= 0 && o.tokens >= 1 && o.hidden >= 1 && o.ffn >= 1,
           "bench mlp: steps, tokens, hidden and ffn must be positive");
  const int tp = axes[1].size;
  // Forward: two GEMMs of 2*T*H*F flops; backward: twice the forward (dX and dW of each).
  const double flops = 3.0 * 2.0 * 2.0 * o.tokens * static_cast<double>(o.hidden) * o.ffn;
  fmt::print("meshgrad bench mlp: tp={} tokens={} hidden={} ffn={} {} {}, threads backend, median of {} steps\n", tp,
             o.tokens, o.hidden, o.ffn, o.dtype, o.sequence_parallel ? "sequence-parallel" : "all-reduce mode", o.steps);
  train::TraceRecorder trace(o.trace);
  fmt::print("{:<12} {:>10} {:>10} {:>16}\n", "variant", "ms/step", "GFLOP/s", "comm blocked ms");
  const StepFigures plain = time_steps(o, tp, false);
  fmt::print("{:<12} {:>10.2f} {:>10.1f} {:>16.2f}\n", "no overlap", plain.ms, flops / plain.ms / 1e6, plain.blocked_ms);
  if (o.overlap) {
    const StepFigures over = time_steps(o, tp, true);
    fmt::print("{:<12} {:>10.2f} {:>10.1f} {:>16.2f}\n", "overlap", over.ms, flops / over.ms / 1e6, over.blocked_ms);
    const double hidden = std::max(0.0, plain.blocked_ms - over.blocked_ms);
    fmt::print("communication: {:.2f} ms per step without overlap; {:.2f} ms of it hidden by overlap ({:.0f}%)\n",
               plain.blocked_ms, hidden, plain.blocked_ms > 0 ? 100.0 * hidden / plain.blocked_ms : 0.0);
  } else {
    fmt::print("communication: {:.2f} ms per step, none hidden (run with --overlap to overlap it)\n", plain.blocked_ms);
  }
  trace.finish();
  return 0;
}

CommandSetup setup = [](CLI::App& app) {
  auto o = std::make_shared<BenchMlpOptions>();
  app.add_option("--mesh", o->mesh, "tensor-parallel mesh, tp=N")->capture_default_str();
  app.add_flag("--sequence-parallel", o->sequence_parallel, "sequence-parallel (reduce-scatter) mode");
  app.add_flag("--overlap", o->overlap, "also run with backward communication overlapped and report what it hid");
  app.add_option("--tokens", o->tokens, "tokens per step")->check(at_least(1))->capture_default_str();
  app.add_option("--hidden", o->hidden, "hidden size")->check(at_least(1))->capture_default_str();
  app.add_option("--ffn", o->ffn, "feed-forward size")->check(at_least(1))->capture_default_str();
  app.add_option("--steps", o->steps, "timed steps")->check(at_least(1))->capture_default_str();
  app.add_option("--warmup", o->warmup, "untimed steps first")->check(at_least(0))->capture_default_str();
  app.add_option("--dtype", o->dtype, "float32 or float64")->capture_default_str();
  app.add_option("--trace", o->trace, "write a Chrome trace of the steps (warm-up and timed, each variant) to this "
                 "JSON file (docs/tracing.md)");
  return [o] { return run_bench_mlp(*o); };
};

MESHGRAD_REGISTER_COMMAND(bench_mlp, {"bench", "mlp", "time a tensor-parallel MLP step (compare with peers/torch_tp_mlp.py)", setup});

}  // namespace
}  // namespace meshgrad::tools::cmd_bench_mlp
