// meshgrad gradcheck: runs the gradient-check suite (every op of ops.hpp, random small shapes drawn
// from the seed, float64) and prints one row per case and mode. Exit status 1 when any check fails
// (or an op throws), so it can gate CI and the README's main job.
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "command.hpp"
#include "options.hpp"
#include "meshgrad/ops/gradcheck.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad::tools::cmd_gradcheck {
namespace {

struct GradcheckArgs {
  std::uint64_t seed = 0;
  std::vector<std::string> ops;
  std::string mode = "both";
  int repeats = 1;
};

struct Row {
  std::uint64_t seed;
  GradcheckResult result;
};

int run_gradcheck(const GradcheckArgs& args) {
  MG_CHECK(args.repeats >= 1, "gradcheck: --repeats must be >= 1, got {}", args.repeats);
  std::vector<GradcheckMode> modes;
  if (args.mode == "both") {
    modes = {GradcheckMode::Full, GradcheckMode::Projection};
  } else {
    modes = {parse_gradcheck_mode(args.mode)};   // throws naming an unknown mode
  }
  const GradcheckOptions defaults;
  // Validate the selection before printing anything: an unknown op is an error naming it.
  const std::size_t n_cases = select_gradcheck_cases(args.seed, args.ops).size();
  fmt::print("meshgrad gradcheck: {} cases x {} mode(s) x {} seed(s) from {}; float64, central differences h={:g}, "
             "pass when |analytic - numeric| <= {:g} + {:g} |numeric|\n\n",
             n_cases, modes.size(), args.repeats, args.seed, defaults.eps, defaults.atol, defaults.rtol);

  const auto start = std::chrono::steady_clock::now();
  std::vector<Row> failures;
  int total = 0;
  bool header_printed = false;
  for (int r = 0; r < args.repeats; ++r) {
    const std::uint64_t seed = args.seed + static_cast<std::uint64_t>(r);
    const std::vector<GradcheckCase> cases = select_gradcheck_cases(seed, args.ops);
    std::size_t name_width = 4;
    for (const GradcheckCase& c : cases) {
      name_width = std::max(name_width, c.name.size());
    }
    if (!header_printed) {
      fmt::print("{:<6} {:<{}} {:<10} {:>11} {:>11} {:<6} {}\n", "seed", "op", name_width, "mode", "max abs err",
                 "max rel err", "result", "shapes");
      header_printed = true;
    }
    for (const GradcheckCase& c : cases) {
      for (GradcheckMode mode : modes) {
        GradcheckResult result;
        try {
          result = run_case(c, mode);
        } catch (const std::exception& e) {
          // One broken op must not hide the others: report it as a failure and go on.
          result.op = c.name;
          result.mode = mode;
          result.shapes = describe_inputs(c.inputs, c.input_names);
          result.passed = false;
          result.message = fmt::format("gradcheck error: case '{}' threw: {}", c.name, e.what());
        }
        ++total;
        fmt::print("{:<6} {:<{}} {:<10} {:>11.2e} {:>11.2e} {:<6} {}\n", seed, c.name, name_width,
                   gradcheck_mode_name(mode), result.max_abs_error, result.max_rel_error,
                   result.passed ? "PASS" : "FAIL", result.shapes);
        std::fflush(stdout);
        if (!result.passed) failures.push_back({seed, std::move(result)});
      }
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  if (!failures.empty()) {
    fmt::print("\nfailures:\n");
    for (const Row& f : failures) {
      fmt::print("  [seed {}, {}] {}\n", f.seed, gradcheck_mode_name(f.result.mode), f.result.message);
    }
  }
  fmt::print("\n{} of {} checks passed, {} failed ({:.2f} s)\n", total - static_cast<int>(failures.size()), total,
             failures.size(), seconds);
  return failures.empty() ? 0 : 1;
}

CLI::App* add_options(CLI::App& app, const std::shared_ptr<GradcheckArgs>& args) {
  app.add_option("--seed", args->seed, "Seed of the random shapes and values (repeat r uses seed + r)")
      ->check(at_least(0, UINT64_MAX))
      ->capture_default_str();
  app.add_option("--ops", args->ops, "Comma-separated ops or case names to check (default: all)")->delimiter(',');
  app.add_option("--mode", args->mode, "full (whole Jacobian), projection (random v^T J u) or both")
      ->check(CLI::IsMember({"full", "projection", "both"}))
      ->capture_default_str();
  app.add_option("--repeats", args->repeats, "Number of seeds to run (seed, seed+1, ...)")
      ->check(at_least(1))
      ->capture_default_str();
  return &app;
}

}  // namespace

MESHGRAD_REGISTER_COMMAND(gradcheck, {"", "gradcheck",
                                      "Check every op's gradient against central differences (float64)",
                                      [](CLI::App& app) -> std::function<int()> {
                                        auto args = std::make_shared<GradcheckArgs>();
                                        add_options(app, args);
                                        return [args] { return run_gradcheck(*args); };
                                      }});

}  // namespace meshgrad::tools::cmd_gradcheck
