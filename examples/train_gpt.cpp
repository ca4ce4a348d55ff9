// A small GPT trained on meshgrad's built-in corpus on a tp=2 mesh of rank threads through the
// library's train job (launch/jobs.hpp, as `meshgrad train` runs it), with a per-step callback
// (TrainOptions::on_step) that prints each step.
// Exit status 0 when the callback saw every step with a finite loss and the loss fell.
#include <fmt/core.h>

#include <cmath>
#include <vector>

#include "meshgrad/launch/jobs.hpp"
#include "meshgrad/launch/launch.hpp"

using namespace meshgrad;

int main() {
  try {
    train::TrainOptions options;
    // 1 block of 32 features and 4 heads over byte tokens, 8 sequences of 16 per step.
    options.model = nn::ModelConfig::gpt(/*layers=*/1, /*hidden=*/32, /*heads=*/4, /*vocab=*/256, /*seq=*/16,
                                         /*batch=*/8);
    options.steps = 40;
    options.progress = false;   // the callback reports instead
    std::vector<train::StepMetrics> seen;   // written on rank 0's thread only
    options.on_step = [&seen](const train::StepMetrics& m) {
      seen.push_back(m);
      if (m.step % 10 == 0 || m.step == 1) fmt::print("step {:3d}  loss {:.4f}  lr {:.2e}\n", m.step, m.loss, m.lr);
    };

    // The job the CLI runs (checks, ranks, the trainer), on 2 rank threads: rank 0's result.
    const train::TrainResult result = launch::run_train_job(options, launch::mesh_runner("threads", "tp=2"));

    bool ok = static_cast<int>(seen.size()) == options.steps;
    for (std::size_t i = 0; ok && i < seen.size(); ++i) {
      ok = seen[i].step == static_cast<int>(i) + 1 && std::isfinite(seen[i].loss) && seen[i].loss == result.losses[i];
    }
    const bool fell = result.end_loss() < result.start_loss() - 0.1;
    fmt::print("callback saw {} of {} steps; loss {:.4f} -> {:.4f} (mean of first / last steps)\n", seen.size(),
               options.steps, result.start_loss(), result.end_loss());
    fmt::print("{}\n", ok && fell ? "PASS" : "FAIL");
    return ok && fell ? 0 : 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "train_gpt: error: {}\n", e.what());
    return 1;
  }
}
