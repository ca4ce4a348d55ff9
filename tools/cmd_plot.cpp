// `meshgrad plot METRICS.jsonl -o loss.svg`: train and validation loss against steps, with the
// learning rate on a second axis, as an SVG (diag/plot.hpp).
#include <fmt/core.h>

#include <memory>
#include <string>

#include "command.hpp"
#include "meshgrad/io/output_path.hpp"
#include "meshgrad/diag/plot.hpp"

namespace meshgrad::tools {
namespace {

struct PlotArgs {
  std::string metrics;
  std::string out = "loss.svg";
};

int run_plot(const PlotArgs& a) {
  io::check_output_paths({{"-o", a.out}}, {{"METRICS", a.metrics}});
  const diag::MetricsSeries series = diag::read_metrics(a.metrics);
  const std::string svg = diag::metrics_svg(series, a.metrics);
  io::AtomicFileWriter writer(a.out);
  writer.write(svg.data(), svg.size(), "the plot");
  writer.commit();
  fmt::print("{} steps ({} evaluations) drawn to {}\n", series.step.size(), series.val_step.size(), a.out);
  return 0;
}

}  // namespace

MESHGRAD_REGISTER_COMMAND(plot, {"", "plot", "Draw train and validation loss (and the learning rate) of a metrics file as SVG",
    [](CLI::App& app) -> std::function<int()> {
      auto a = std::make_shared<PlotArgs>();
      app.add_option("METRICS", a->metrics, "metrics file written by `meshgrad train --metrics`")->required();
      app.add_option("-o,--out", a->out, "the SVG to write")->capture_default_str();
      return [a] { return run_plot(*a); };
    }});

}  // namespace meshgrad::tools
