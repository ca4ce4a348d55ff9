// What recording a trace costs a training step, measured in one process: two rank threads (tp=2,
// overlap) train the same GPT in blocks of STEPS steps, alternately with a trace recording and
// without (the order swapped every round), so both see the same neighbours and the same warm
// caches; the table gives the median ms per step of each. The file itself is not written (that is
// once, after the run). On a shared machine read the spread next to the difference.
// Usage: bench_trace_overhead [ROUNDS [STEPS [LAYERS HIDDEN HEADS SEQ BATCH]]]
//   default: 15 rounds of 10 steps, the `meshgrad train` defaults (4 layers, 128 wide, 4 heads, seq 64, batch 16)
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <vector>

#include "meshgrad/comm/threads.hpp"
#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/trace.hpp"
#include "meshgrad/data/synthetic.hpp"
#include "meshgrad/diag/explain.hpp"
#include "meshgrad/optim/grad_sync.hpp"
#include "meshgrad/optim/adamw.hpp"
#include "meshgrad/train/trainer.hpp"

using namespace meshgrad;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  auto arg = [&](int i, int fallback) { return argc > i ? std::atoi(argv[i]) : fallback; };
  const int rounds = arg(1, 15), steps = arg(2, 10);
  const nn::ModelConfig cfg =
      nn::ModelConfig::gpt(arg(3, 4), arg(4, 128), arg(5, 4), /*vocab=*/256, arg(6, 64), arg(7, 16));
  nn::ParallelConfig parallel;
  parallel.overlap = true;
  std::vector<double> off_ms, on_ms;   // ms per step of each block (rank 0's clock)
  std::size_t spans = 0;
  blas::ThreadsPerRank blas_policy(2);
  comm::run_ranks(2, [&](const comm::CommunicatorPtr& world) {
    auto mesh = std::make_shared<const dist::DeviceMesh>(world, std::vector<dist::MeshAxis>{{"dp", 1}, {"tp", 2}});
    auto model = nn::make_model(cfg, parallel, mesh, 1);
    const auto params = model->parameters();
    optim::GradientSynchronizer sync(params, mesh);
    optim::AdamW opt(params, mesh, optim::AdamWOptions{});
    const nn::Batch batch = data::make_synthetic_batch(cfg, 1, 0, 7);
    for (int k = 0; k < 5; ++k) train::train_step(*model, batch, *mesh, sync, opt);   // warm-up
    for (int r = 0; r < rounds; ++r) {
      for (int j = 0; j < 2; ++j) {
        const bool traced = (r + j) % 2 == 1;
        world->barrier();
        if (world->rank() == 0) traced ? trace::start() : trace::reset();
        world->barrier();
        const auto t0 = std::chrono::steady_clock::now();
        for (int k = 0; k < steps; ++k) {
          trace::Span span("step", "step");
          train::train_step(*model, batch, *mesh, sync, opt);
        }
        world->barrier();
        const double ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / steps;
        if (world->rank() == 0) {
          (traced ? on_ms : off_ms).push_back(ms);
          if (traced) {
            trace::stop();
            const std::string fragment = trace::events_fragment({});
            spans = static_cast<std::size_t>(std::count(fragment.begin(), fragment.end(), '\n')) + 1;
          }
        }
      }
    }
    world->barrier();
    if (world->rank() == 0) trace::reset();
  });
  const double off = median(off_ms), on = median(on_ms);
  fmt::print("tp=2 overlap, GPT layers={} hidden={} heads={} seq={} batch={}: {} rounds of {} steps, trace off / on "
             "alternately\n", cfg.layers, cfg.hidden, cfg.heads, cfg.seq, cfg.batch, rounds, steps);
  fmt::print("| trace | median ms/step | min .. max | vs off |\n|---|---|---|---|\n");
  fmt::print("| off | {:.3f} | {:.3f} .. {:.3f} | |\n", off, *std::min_element(off_ms.begin(), off_ms.end()),
             *std::max_element(off_ms.begin(), off_ms.end()));
  fmt::print("| on | {:.3f} | {:.3f} .. {:.3f} | {:+.1f}% |\n", on, *std::min_element(on_ms.begin(), on_ms.end()),
             *std::max_element(on_ms.begin(), on_ms.end()), 100.0 * (on / off - 1.0));
  fmt::print("events recorded per step (both ranks, with lane names): {}\n", spans / static_cast<std::size_t>(steps));
  return 0;
}
