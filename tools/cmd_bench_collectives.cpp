// `meshgrad bench collectives`: the nccl-tests table for the threads or mpi backend. The logic lives
// in the library (comm/collective_bench.hpp); this file parses options and starts the ranks.
//   meshgrad bench collectives --backend threads --ranks 2 --min-bytes 64K --max-bytes 64M
//   mpirun -np 4 meshgrad bench collectives --backend mpi          (rank 0 prints)
#include <fmt/core.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <sstream>

#include "command.hpp"
#include "options.hpp"
#include "meshgrad/launch/launch.hpp"
#include "meshgrad/comm/collective_bench.hpp"
#include "meshgrad/train/trace_file.hpp"

namespace meshgrad::tools::cmd_bench_collectives {
namespace {

struct BenchCollectivesArgs {
  std::string backend = "threads";
  int ranks = 0;  // threads: default 2; mpi: the world size
  std::string ops = "all_reduce,all_gather,reduce_scatter,broadcast,all_to_all";
  std::string min_bytes = "1K", max_bytes = "64M", dtype = "float32";
  int iters = 0, warmup = 0, step = 2;
  std::string trace;   // --trace: Chrome trace of every collective the bench ran
};

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

int run(const BenchCollectivesArgs& a) {
  comm::CollectiveBenchOptions o;
  o.ops = split_list(a.ops);
  o.min_bytes = comm::parse_byte_size(a.min_bytes);
  o.max_bytes = comm::parse_byte_size(a.max_bytes);
  o.dtype = parse_dtype(a.dtype);
  o.iters = a.iters;
  o.warmup = a.warmup;
  o.step_factor = a.step;
  MG_CHECK(!o.ops.empty(), "bench collectives: --ops is empty");
  // threads: --ranks rank threads (default 2); mpi: the world mpirun started (--ranks, if given,
  // must match it). run_on_backend refuses unknown backends and sets the BLAS policy.
  const bool threads = a.backend == "threads";
  const int world_size = a.ranks > 0 ? a.ranks : threads ? 2 : 0;
  // threads: measured before the ranks start, so they do not compete with it.
  double memcpy_gbps = threads ? comm::measure_memcpy_gbps(std::size_t(64) << 20) : 0;
  std::vector<comm::CollectiveBenchRow> rows;   // rank 0's, written by the rank 0 of this process
  int printed_world = 0;
  std::atomic<bool> wrong{false};
  train::TraceRecorder trace(a.trace);
  launch::run_on_backend(a.backend, world_size, [&](const comm::CommunicatorPtr& world) {
    if (!threads) {
      if (world->rank() == 0) memcpy_gbps = comm::measure_memcpy_gbps(std::size_t(64) << 20);
      world->barrier();
    }
    auto mine = comm::run_collective_bench(*world, o);
    for (const auto& row : mine) {
      if (row.wrong != 0) wrong = true;
    }
    if (world->rank() == 0) {
      rows = std::move(mine);
      printed_world = world->size();
    }
    trace.finish_rank(*world);
  });
  trace.finish();
  if (printed_world > 0) fmt::print("{}", comm::format_collective_table(rows, a.backend, printed_world, memcpy_gbps));
  return wrong ? 1 : 0;
}

MESHGRAD_REGISTER_COMMAND(bench_collectives, {"bench", "collectives",
    "Collective bandwidth table (nccl-tests columns) for the threads or mpi backend",
    [](CLI::App& app) -> std::function<int()> {
      auto a = std::make_shared<BenchCollectivesArgs>();
      app.add_option("--backend", a->backend, "threads or mpi (mpi: start under mpirun)")->capture_default_str();
      app.add_option("--ranks", a->ranks, "ranks (threads: default 2; mpi: must equal the world size)")->check(at_least(1));
      app.add_option("--ops", a->ops, "comma-separated ops")->capture_default_str();
      app.add_option("--min-bytes", a->min_bytes, "smallest size, e.g. 1K")->capture_default_str();
      app.add_option("--max-bytes", a->max_bytes, "largest size, e.g. 64M")->capture_default_str();
      app.add_option("--step-factor", a->step, "size multiplier between rows (2 or 4)")->capture_default_str();
      app.add_option("--dtype", a->dtype, "float32 or float64")->capture_default_str();
      app.add_option("--iters", a->iters, "timed iterations per size (0 = auto)")->check(at_least(0));
      app.add_option("--warmup", a->warmup, "warm-up iterations per size (0 = auto)")->check(at_least(0));
      app.add_option("--trace", a->trace, "write a Chrome trace of every collective to this JSON file (two spans per "
                     "iteration and rank: keep --iters small; docs/tracing.md)");
      return [a] { return run(*a); };
    }});

}  // namespace
}  // namespace meshgrad::tools::cmd_bench_collectives
