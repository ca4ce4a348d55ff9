// A small GPT trained on meshgrad's built-in corpus on a tp=2 mesh of rank threads through the
// trainer API, with a per-step callback (TrainOptions::on_step) that prints each step.
// Exit status 0 when the callback saw every step with a finite loss and the loss fell.
#include <fmt/core.h>

#include <cmath>
#include <vector>

#include "example_check.hpp"
#include "meshgrad/comm/threads.hpp"
#include "meshgrad/train/trainer.hpp"

using namespace meshgrad;

int main() {
  try {
    train::TrainOptions options;
    options.model.kind = "gpt";
    options.model.vocab = 256;   // byte tokens
    options.model.layers = 1;
    options.model.hidden = 32;
    options.model.heads = 4;
    options.model.seq = 16;
    options.model.batch = 8;
    options.steps = 40;
    options.progress = false;   // the callback reports instead
    std::vector<train::StepMetrics> seen;   // written on rank 0's thread only
    options.on_step = [&seen](const train::StepMetrics& m) {
      seen.push_back(m);
      if (m.step % 10 == 0 || m.step == 1) fmt::print("step {:3d}  loss {:.4f}  lr {:.2e}\n", m.step, m.loss, m.lr);
    };

    train::TrainResult result;
    comm::run_ranks(2, [&](const comm::CommunicatorPtr& world) {
      const auto mesh = example::make_mesh(world, 1, 2);
      train::TrainResult r = train::train(options, mesh);
      if (mesh->rank() == 0) result = r;
    });

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
