// `meshgrad plot`: the loss curves of a run as an SVG a browser opens. Reads a metrics file written
// by `train` (a header object, then one object per step with step, loss, lr and, on evaluation
// steps, val_loss) and draws train loss (blue line) and validation loss (orange points joined) against
// the step on the left axis, and the learning rate (grey, dashed) on a right axis.
#pragma once

#include <string>
#include <vector>

namespace meshgrad::diag {

struct MetricsSeries {
  std::vector<double> step, loss, lr;       // one per step line
  std::vector<double> val_step, val_loss;   // one per evaluation
};

// Parses a metrics file. Throws InvalidArgument naming the file and the 1-based line for a line
// that is not a JSON object, a step line without numeric step/loss/lr, or a file with no step lines.
MetricsSeries read_metrics(const std::string& path);

// The SVG document (width x height pixels) of the series; title goes above the plot.
std::string metrics_svg(const MetricsSeries& series, const std::string& title, int width = 900, int height = 500);

}  // namespace meshgrad::diag
