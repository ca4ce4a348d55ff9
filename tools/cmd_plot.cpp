// `meshgrad plot METRICS.jsonl... -o loss.svg|loss.png [--smooth A] [--log-y] [--names a,b]`: the loss
// curves of one run (train, validation, learning rate on a second axis), or of several runs overlaid,
// each in its colour and named in the legend (diag/plot.hpp says what is drawn). Several runs: the
// learning rate is not drawn (one axis for several schedules hides more than it shows); the command
// says so. The output format is the extension of -o: .svg, or .png rendered from that SVG by librsvg.
#include <fmt/core.h>

#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "command.hpp"
#include "meshgrad/diag/plot.hpp"
#include "meshgrad/io/output_path.hpp"
#include "meshgrad/tensor/error.hpp"
#include "options.hpp"

namespace meshgrad::tools::cmd_plot {
namespace {

struct PlotArgs {
  std::vector<std::string> metrics;
  std::string out = "loss.svg";
  std::string names;
  double smooth = 0;
  bool log_y = false;
  int width = 900, height = 500;
};

// The legend's names: --names split at commas (one per file), else the files' names, else (two
// files of the same name in different folders) the paths as given.
std::vector<std::string> run_names(const PlotArgs& a) {
  std::vector<std::string> names;
  if (!a.names.empty()) {
    for (std::size_t from = 0;;) {
      const std::size_t comma = a.names.find(',', from);
      names.push_back(a.names.substr(from, comma - from));
      if (comma == std::string::npos) break;
      from = comma + 1;
    }
    MG_CHECK(names.size() == a.metrics.size(), "plot: --names '{}' gives {} name(s) for {} metrics file(s); give one "
             "name per file, separated by commas", a.names, names.size(), a.metrics.size());
    return names;
  }
  std::set<std::string> distinct;
  for (const auto& m : a.metrics) {
    names.push_back(std::filesystem::path(m).filename().string());
    distinct.insert(names.back());
  }
  return distinct.size() == names.size() ? names : a.metrics;
}

std::string title_of(const std::vector<diag::PlotRun>& runs) {
  if (runs.size() == 1) return runs[0].source;
  std::string title = runs[0].name;
  for (std::size_t i = 1; i < runs.size(); ++i) title += " vs " + runs[i].name;
  return title;
}

int run_plot(const PlotArgs& a) {
  // Everything the command line decides is checked before a file is read.
  const diag::PlotFormat format = diag::plot_format_for(a.out, "-o");
  const std::vector<std::string> names = run_names(a);
  MG_CHECK(a.smooth >= 0 && a.smooth < 1, "plot: --smooth {} is outside [0, 1) (0 is off; 0.9 smooths strongly)",
           a.smooth);
  std::vector<io::NamedPath> inputs;
  for (const auto& m : a.metrics) inputs.push_back({"METRICS", m});
  io::check_output_paths({{"-o", a.out}}, inputs);
  std::vector<diag::PlotRun> runs;
  for (std::size_t i = 0; i < a.metrics.size(); ++i) runs.push_back({names[i], a.metrics[i], diag::read_metrics(a.metrics[i])});
  const diag::PlotOptions options{title_of(runs), a.smooth, a.log_y, a.width, a.height};
  std::string bytes = diag::plot_svg(runs, options);
  if (format == diag::PlotFormat::png) bytes = diag::svg_to_png(bytes, a.width, a.height);
  io::AtomicFileWriter writer(a.out);
  writer.write(bytes.data(), bytes.size(), "the plot");
  writer.commit();
  for (const auto& r : runs) {
    fmt::print("{}: {} steps ({} evaluations)\n", r.name, r.series.step.size(), r.series.val_step.size());
    for (const std::string& note : r.series.notes) fmt::print("  note: '{}' {}\n", r.source, note);
  }
  if (runs.size() > 1) fmt::print("the learning rate is not drawn for several runs\n");
  fmt::print("drawn to {} ({}x{})\n", a.out, a.width, a.height);
  return 0;
}

}  // namespace

MESHGRAD_REGISTER_COMMAND(plot, {"", "plot", "Draw the loss curves of metrics files (one run, or several overlaid) as SVG or PNG",
    [](CLI::App& app) -> std::function<int()> {
      auto a = std::make_shared<PlotArgs>();
      app.add_option("METRICS", a->metrics, "metrics files written by `meshgrad train --metrics` (several: overlaid)")
          ->required();
      app.add_option("-o,--out", a->out, "the picture to write: .svg or .png")->capture_default_str();
      app.add_option("--smooth", a->smooth, "exponential moving average of the train loss, weight in [0, 1) as "
                     "TensorBoard's (0: off); the raw curve is drawn faint behind")->capture_default_str();
      app.add_flag("--log-y", a->log_y, "logarithmic loss axis (every loss must be positive)");
      app.add_option("--names", a->names, "the runs' names in the legend, comma-separated, one per file "
                     "(default: the file names)");
      app.add_option("--width", a->width, "picture width in pixels")->check(at_least(200, 20000))->capture_default_str();
      app.add_option("--height", a->height, "picture height in pixels")->check(at_least(150, 20000))->capture_default_str();
      return [a] { return run_plot(*a); };
    }});

}  // namespace meshgrad::tools::cmd_plot
