// `meshgrad plot`: the loss curves of one or more runs as an SVG a browser opens, or as a PNG.
//
// Input: metrics files written by `train --metrics` (a header object, then one object per step with
// step, loss, lr and, on evaluation steps, val_loss; lines of another "type", such as the samples
// {"type":"sample",...}, are skipped).
//
// What is drawn, against the step:
// - one run: train loss (blue), validation loss (orange points joined; only when the run evaluated)
//   on the left axis, and the learning rate (grey, dashed) on a right axis of its own;
// - several runs (overlay): each run's train loss in a colour of its own and its validation loss as
//   points of that colour joined by a dashed line. The learning rate is NOT drawn for several runs:
//   a second axis shared by several schedules makes the loss curves harder to read, and the runs
//   compared usually share the schedule; a note above the plot says that it was left out.
// - with smoothing (PlotOptions::smooth > 0) the train loss is drawn as TensorBoard's debiased
//   exponential moving average, the raw curve faint behind it;
// - with PlotOptions::log_y the loss axis is logarithmic (every loss drawn must be positive).
// Tick values are "nice" (1, 2 or 5 times a power of ten; on a log axis powers of ten, with 2x and
// 5x where there is room), each drawn exactly at its value; the step axis shows integers only. The
// legend lists only what is drawn and sits above the plot, never over the curves.
//
// Long runs: each curve is drawn through at most 4 of its points per pixel column (of the points
// in a column, the first, the lowest, the highest and the last: the line covers the same pixels,
// only a dashed line's dashes may fall elsewhere), and the evaluation dots at most one per pixel,
// so the SVG's size and the PNG's rendering time grow with the width, not the number of steps.
#pragma once

#include <string>
#include <vector>

namespace meshgrad::diag {

struct MetricsSeries {
  std::vector<double> step, loss, lr;       // one per step line
  std::vector<double> val_step, val_loss;   // one per evaluation
  std::vector<std::string> notes;           // what reading changed, for the user ("line 6: a resumed run ...")
};

// Parses a metrics file. Throws InvalidArgument naming the file and the 1-based line for a line
// that is not a JSON object (or holds a number beyond a double's range), a step line without
// numeric step/loss/lr, a step that is not an integer in [1, 2^53] or not above the step before it,
// an lr that is negative or not finite, a header whose "first_step" is not a step number, or a file
// with no step lines. A line with a "type" other than "step" is skipped, except the header, whose
// "first_step" (written by a resumed run) drops the steps read so far from that step on: the resumed
// run supersedes them, and a note in `notes` says so (steps after it may then go back).
MetricsSeries read_metrics(const std::string& path);

// One run to draw: its series, the name the legend shows and the file it came from (for messages).
struct PlotRun {
  std::string name;
  std::string source;
  MetricsSeries series;
};

struct PlotOptions {
  std::string title;     // above the plot
  double smooth = 0;     // EMA weight in [0, 1) of the train loss; 0 draws the raw curve only
  bool log_y = false;    // logarithmic loss axis
  int width = 900;       // pixels
  int height = 500;
};

// The SVG document of the runs (at least one). Throws InvalidArgument for a smooth outside [0, 1),
// a size under 200 x 150 or over 20000 x 20000 pixels, and, with log_y, for a loss (train or
// validation) that is not positive, naming the run's source file and the step.
std::string plot_svg(const std::vector<PlotRun>& runs, const PlotOptions& options);

// TensorBoard's smoothing: s_t = w*s_{t-1} + (1-w)*x_t, s_0 = 0, reported as s_t / (1 - w^t) where t
// counts the finite values so far (the division removes the bias towards the zero start).
// Non-finite values are passed through and do not enter the average. Requires 0 <= w < 1.
std::vector<double> smooth_ema(const std::vector<double>& values, double weight);

// Tick values within [lo, hi], sorted: multiples of the smallest step of the 1-2-5 sequence
// (1, 2, 5, 10, 20, ...) that gives at most max_ticks of them. integers_only: the step is at least 1.
std::vector<double> linear_ticks(double lo, double hi, int max_ticks, bool integers_only);

// Tick values within [lo, hi] (0 < lo <= hi) for a logarithmic axis, sorted: the richest of powers
// of ten; 1, 2 and 5 times them; 1..9 times them, that gives 2 to max_ticks ticks (powers of ten,
// thinned to every k-th, when even those are too many). Falls back to linear_ticks over a range
// narrower than that allows.
std::vector<double> log_ticks(double lo, double hi, int max_ticks);

// The labels of sorted tick values, with as few digits as make them all differ and each read back
// as its value: fixed decimals shared by the whole axis ("0.5", "1.0", "1.5"), scientific
// ("5.0e-05") when the ticks are all under 1e-3 or reach 1e6; shortest per tick ("0.5", "1", "20")
// on a log axis.
std::vector<std::string> tick_labels(const std::vector<double>& ticks, bool log_axis);

// The output format named by a path's extension (case-insensitive): ".svg" or ".png". Throws
// InvalidArgument naming the extension (and the option, e.g. "-o") otherwise.
enum class PlotFormat { svg, png };
PlotFormat plot_format_for(const std::string& path, const std::string& option);

// The SVG document rendered to PNG bytes (librsvg into a cairo image surface) of width x height
// pixels. Throws InvalidArgument when librsvg cannot parse or render it.
std::string svg_to_png(const std::string& svg, int width, int height);

}  // namespace meshgrad::diag
