// `meshgrad trace summary FILE.json` and `meshgrad trace svg FILE.json -o trace.svg`: what a trace
// written by `--trace` shows, without a browser (diag/trace_report.hpp).
//   meshgrad train --mesh tp=2 --overlap --steps 3 --trace t.json
//   meshgrad trace summary t.json [--step 3]      per rank: compute, comm, waited, hidden %
//   meshgrad trace svg t.json --step 3 -o t.svg   the lanes of step 3 as an SVG timeline
#include <fmt/core.h>

#include <memory>
#include <string>

#include "command.hpp"
#include "meshgrad/io/output_path.hpp"
#include "meshgrad/diag/trace_report.hpp"
#include "options.hpp"

namespace meshgrad::tools::cmd_trace {
namespace {

struct TraceArgs {
  std::string trace;
  std::string out = "trace.svg";
  int step = 0;
  int width = 1200;
  std::string title;
};

int run_summary(const TraceArgs& a) {
  const diag::TraceData trace = diag::read_trace(a.trace);
  const auto rows = diag::summarize_trace(trace, a.step);
  MG_CHECK(!rows.empty(), "trace summary: '{}' has no rank lanes (\"rank N\"): was it written by --trace?", a.trace);
  fmt::print("{}", diag::format_trace_summary(rows));
  fmt::print("comm: time with a collective of the rank in flight; exposed: the part of it the rank waited or was off "
             "the CPU after launching one; hidden: the rest, overlapped with compute (docs/tracing.md)\n");
  return 0;
}

int run_svg(const TraceArgs& a) {
  io::check_output_paths({{"-o", a.out}}, {{"TRACE", a.trace}});
  const diag::TraceData trace = diag::read_trace(a.trace);
  diag::TraceSvgOptions options;
  options.step = a.step;
  options.width = a.width;
  options.title = a.title.empty() ? (a.step > 0 ? fmt::format("{}, step {}", a.trace, a.step) : a.trace) : a.title;
  const std::string svg = diag::trace_svg(trace, options);
  io::AtomicFileWriter writer(a.out);
  writer.write(svg.data(), svg.size(), "the SVG");
  writer.commit();
  fmt::print("{} lanes drawn to {}\n", trace.lanes.size(), a.out);
  return 0;
}

}  // namespace

MESHGRAD_REGISTER_COMMAND(trace_summary, {"trace", "summary",
    "Per rank of a --trace file: compute, communication, time waited and how much of the communication overlap hid",
    [](CLI::App& app) -> std::function<int()> {
      auto a = std::make_shared<TraceArgs>();
      app.add_option("TRACE", a->trace, "a trace written by --trace (Chrome Trace Event Format JSON)")->required();
      app.add_option("--step", a->step, "sum up only this step of each rank (1-based; 0 = all steps)")
          ->check(at_least(0))
          ->capture_default_str();
      return [a] { return run_summary(*a); };
    }});

MESHGRAD_REGISTER_COMMAND(trace_svg, {"trace", "svg", "Draw the lanes of a --trace file as an SVG timeline",
    [](CLI::App& app) -> std::function<int()> {
      auto a = std::make_shared<TraceArgs>();
      app.add_option("TRACE", a->trace, "a trace written by --trace (Chrome Trace Event Format JSON)")->required();
      app.add_option("-o,--out", a->out, "the SVG to write")->capture_default_str();
      app.add_option("--step", a->step, "draw only this step (1-based; 0 = the whole trace)")
          ->check(at_least(0))
          ->capture_default_str();
      app.add_option("--width", a->width, "width in pixels")->check(at_least(400))->capture_default_str();
      app.add_option("--title", a->title, "title above the timeline (default: the file, and the step)");
      return [a] { return run_svg(*a); };
    }});

}  // namespace meshgrad::tools::cmd_trace
