// The SVG of `meshgrad plot` (diag/plot.hpp): the curves of one or more runs, the axes with nice
// ticks, and the legend above the plot area.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <unordered_set>

#include "meshgrad/diag/plot.hpp"
#include "meshgrad/tensor/error.hpp"
#include "svg_text.hpp"

namespace meshgrad::diag {
namespace {

// Estimated advance of a character at 12 px sans-serif (DejaVu Sans digits are 7.6 px): the margins
// and the spacing of labels are laid out with it, on the wide side so that labels never touch.
constexpr double kCharWidth = 7.6;
constexpr const char* kPalette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

double text_width(const std::string& text) {
  std::size_t chars = 0;
  for (unsigned char c : text) chars += (c & 0xC0) != 0x80;   // UTF-8: count the first byte of each character
  return static_cast<double>(chars) * kCharWidth;
}

// One axis: data values (log10 of them on a log axis) from lo to hi drawn from px_lo to px_hi.
struct Scale {
  double lo = 0, hi = 1;
  bool log = false;
  double px_lo = 0, px_hi = 1;
  double at(double v) const {
    const double x = log ? std::log10(v) : v;
    return hi > lo ? px_lo + (x - lo) / (hi - lo) * (px_hi - px_lo) : (px_lo + px_hi) / 2;
  }
  double value_lo() const { return log ? std::pow(10, lo) : lo; }
  double value_hi() const { return log ? std::pow(10, hi) : hi; }
};

enum class Stroke { solid, faint, dashed };

struct Curve {
  std::string id;
  std::vector<double> x, y;
  std::string colour;
  Stroke stroke = Stroke::solid;
  bool dots = false;         // a point per value (evaluations)
  bool right_axis = false;   // the learning rate
};

struct LegendEntry {
  std::string label, colour;
  Stroke stroke;
  bool dot;
};

struct Drawing {
  std::vector<Curve> curves;
  std::vector<LegendEntry> legend;
  std::vector<std::string> notes;   // said above the plot (what an overlay leaves out)
};

void add_curve(Drawing& d, Curve c, const std::string& label) {
  if (!label.empty()) d.legend.push_back({label, c.colour, c.stroke, c.dots});
  d.curves.push_back(std::move(c));
}

// The curves and legend of the runs: what plot.hpp's header comment describes.
Drawing drawing_of(const std::vector<PlotRun>& runs, const PlotOptions& o) {
  Drawing d;
  const bool overlay = runs.size() > 1;
  const std::string smoothed = o.smooth > 0 ? fmt::format(" (smoothed {:g})", o.smooth) : "";
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const MetricsSeries& s = runs[i].series;
    const std::string suffix = overlay ? fmt::format("_{}", i) : "";
    const std::string train_colour = kPalette[overlay ? i % 10 : 0], val_colour = kPalette[overlay ? i % 10 : 1];
    if (o.smooth > 0) {
      add_curve(d, {"train_loss_raw" + suffix, s.step, s.loss, train_colour, Stroke::faint},
                overlay ? "" : "train loss (raw)");
    }
    add_curve(d, {"train_loss" + suffix, s.step, o.smooth > 0 ? smooth_ema(s.loss, o.smooth) : s.loss, train_colour},
              overlay ? runs[i].name : "train loss" + smoothed);
    if (!s.val_step.empty()) {
      add_curve(d, {"val_loss" + suffix, s.val_step, s.val_loss, val_colour, overlay ? Stroke::dashed : Stroke::solid, true},
                overlay ? runs[i].name + " val" : "val loss");
    }
  }
  if (overlay) {
    if (o.smooth > 0) d.notes.push_back(fmt::format("train loss smoothed (EMA {:g}), raw faint behind", o.smooth));
    d.notes.push_back("learning rate not drawn for several runs");
  } else {
    add_curve(d, {"lr", runs[0].series.step, runs[0].series.lr, "#999", Stroke::dashed, false, true}, "learning rate");
  }
  return d;
}

void check_positive(const std::vector<double>& steps, const std::vector<double>& values, const PlotRun& run,
                    const char* what) {
  for (std::size_t i = 0; i < values.size(); ++i) {
    MG_CHECK(!(values[i] <= 0), "plot: --log-y needs positive losses, but '{}' has {} {} at step {:g}", run.source, what,
             values[i], steps[i]);
  }
}

// The range of the finite values of the curves on one side, padded by 5% (in decades on a log axis).
Scale value_scale(const std::vector<Curve>& curves, bool right_axis, bool log) {
  double lo = INFINITY, hi = -INFINITY;
  for (const Curve& c : curves) {
    if (c.right_axis != right_axis) continue;
    for (double v : c.y) {
      if (!std::isfinite(v)) continue;
      lo = std::min(lo, log ? std::log10(v) : v);
      hi = std::max(hi, log ? std::log10(v) : v);
    }
  }
  if (!(lo <= hi)) return {0, 1, log};
  const double pad = hi > lo ? 0.05 * (hi - lo) : log ? 0.1 : lo != 0 ? 0.1 * std::abs(lo) : 0.5;
  return {lo - pad, hi + pad, log};
}

// The step axis: first to last step of all runs, without padding; one step gets half a step each side.
Scale step_scale(const std::vector<PlotRun>& runs) {
  double lo = INFINITY, hi = -INFINITY;
  for (const PlotRun& r : runs) {
    for (double s : r.series.step) {
      lo = std::min(lo, s);
      hi = std::max(hi, s);
    }
  }
  return hi > lo ? Scale{lo, hi} : Scale{lo - 0.5, lo + 0.5};
}

struct Ticks {
  std::vector<double> values;
  std::vector<std::string> labels;
  double widest() const {
    double w = 0;
    for (const auto& l : labels) w = std::max(w, text_width(l));
    return w;
  }
};

// Ticks of a vertical axis: one per 40 px at most, labels at least 14 px apart on a log axis.
Ticks vertical_ticks(const Scale& s, double length_px) {
  const int most = std::max(2, static_cast<int>(length_px / 40));
  Ticks t;
  t.values = s.log ? log_ticks(s.value_lo(), s.value_hi(), most) : linear_ticks(s.lo, s.hi, most, false);
  t.labels = tick_labels(t.values, s.log);
  return t;
}

// Ticks of the step axis: integers, as many as fit with a label's width and 16 px between labels.
Ticks step_ticks(const Scale& s) {
  const double length = std::abs(s.px_hi - s.px_lo);
  for (int most = std::max(1, static_cast<int>(length / 40)); most >= 1; --most) {
    Ticks t;
    t.values = linear_ticks(s.lo, s.hi, most, true);
    t.labels = tick_labels(t.values, false);
    if (t.values.size() < 2 || std::abs(s.at(t.values[1]) - s.at(t.values[0])) >= t.widest() + 16) return t;
  }
  return {};
}

struct Pixel {
  double x, y;
};

// The vertices of a line through `points` that a picture of one-pixel columns can show (the M4
// reduction plotting libraries use): of each run of consecutive points within one pixel column,
// the first, the lowest, the highest and the last, in their order. The line drawn through them
// covers the same pixels as the line through all points (inside a column it spans the run's
// lowest to highest value, and it enters and leaves the column where the full line does), and a
// curve keeps at most 4 vertices per column however many steps it has (reliability-3 N108: every
// point went to librsvg and a 200,000-step run never rendered to PNG).
std::vector<Pixel> column_extremes(const std::vector<Pixel>& points) {
  std::vector<Pixel> out;
  for (std::size_t from = 0; from < points.size();) {
    const double column = std::floor(points[from].x);
    std::size_t to = from, low = from, high = from;
    for (; to < points.size() && std::floor(points[to].x) == column; ++to) {
      if (points[to].y < points[low].y) low = to;
      if (points[to].y > points[high].y) high = to;
    }
    std::size_t keep[] = {from, std::min(low, high), std::max(low, high), to - 1};
    for (std::size_t k = 0; k < 4; ++k) {
      if (k == 0 || keep[k] != keep[k - 1]) out.push_back(points[keep[k]]);
    }
    from = to;
  }
  return out;
}

std::string polyline(const Curve& c, const Scale& x, const Scale& y) {
  static const char* const kStroke[] = {"stroke-width=\"1.5\"", "stroke-width=\"1\" stroke-opacity=\"0.3\"",
                                        "stroke-width=\"1.5\" stroke-dasharray=\"5,4\""};
  std::vector<Pixel> finite;
  for (std::size_t i = 0; i < c.x.size(); ++i) {
    // At the 1/100 px the SVG writes, so that a vertex lies in the column it was kept for.
    if (std::isfinite(c.y[i])) finite.push_back({std::round(100 * x.at(c.x[i])) / 100, std::round(100 * y.at(c.y[i])) / 100});
  }
  std::string points;
  for (const Pixel& p : column_extremes(finite)) points += fmt::format("{:.2f},{:.2f} ", p.x, p.y);
  std::string out = fmt::format("<polyline id=\"{}\" fill=\"none\" stroke=\"{}\" {} points=\"{}\"/>\n", c.id, c.colour,
                                kStroke[static_cast<int>(c.stroke)], points);
  // A curve of one point is a point: drawn as a dot so that a 1-step run shows something.
  if (!(c.dots || (finite.size() == 1 && c.stroke != Stroke::faint))) return out;
  // One dot per pixel the points fall on: a dot drawn again on the same pixel adds nothing.
  std::string dots;
  std::unordered_set<std::int64_t> drawn;
  for (const Pixel& p : finite) {
    const std::int64_t pixel = (static_cast<std::int64_t>(std::lround(p.x)) << 32) + std::lround(p.y);
    if (!drawn.insert(pixel).second) continue;
    dots += fmt::format("<circle cx=\"{:.2f}\" cy=\"{:.2f}\" r=\"3\" fill=\"{}\"/>", p.x, p.y, c.colour);
  }
  return out + fmt::format("<g id=\"{}_points\">{}</g>\n", c.id, dots);
}

// The legend's entries in rows of at most `width` px; returns the SVG and the height it takes.
std::pair<std::string, double> legend_svg(const std::vector<LegendEntry>& entries, double left, double top,
                                          double width) {
  static const char* const kStroke[] = {"stroke-width=\"2\"", "stroke-width=\"1.5\" stroke-opacity=\"0.3\"",
                                        "stroke-width=\"2\" stroke-dasharray=\"5,4\""};
  std::string out = "<g id=\"legend\">";
  double x = 0, y = 0;
  for (const LegendEntry& e : entries) {
    const double w = 26 + text_width(e.label) + 18;
    if (x > 0 && x + w > width) {
      x = 0;
      y += 18;
    }
    const double sx = left + x, sy = top + y;
    out += fmt::format("<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"{}\" {}/>", sx, sy, sx + 20,
                       sy, e.colour, kStroke[static_cast<int>(e.stroke)]);
    if (e.dot) out += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\" fill=\"{}\"/>", sx + 10, sy, e.colour);
    out += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" dy=\"4\">{}</text>", sx + 26, sy, svg_escape(e.label));
    x += w;
  }
  return {out + "</g>\n", entries.empty() ? 0 : y + 18};
}

// Tick labels (and grid lines for the loss axis) of one axis; each label sits exactly at its value:
// x ticks at their x, vertical ticks at their y (the dy moves the text, not the position).
// group: the opening tag of the labels' group, with its id and text attributes.
std::string ticks_svg(const std::string& group, const Ticks& t, const Scale& s, bool horizontal, double at,
                      const std::string& grid_from_to) {
  std::string out = group;
  for (std::size_t i = 0; i < t.values.size(); ++i) {
    const double p = s.at(t.values[i]);
    out += horizontal ? fmt::format("<text x=\"{:.2f}\" y=\"{:.1f}\" dy=\"16\">{}</text>", p, at, t.labels[i])
                      : fmt::format("<text x=\"{:.1f}\" y=\"{:.2f}\" dy=\"4\">{}</text>", at, p, t.labels[i]);
  }
  out += "</g>\n";
  if (grid_from_to.empty()) return out;
  for (double v : t.values) {
    const double p = s.at(v);
    out += horizontal ? fmt::format("<line x1=\"{0:.2f}\" x2=\"{0:.2f}\" {1} stroke=\"#eee\"/>\n", p, grid_from_to)
                      : fmt::format("<line y1=\"{0:.2f}\" y2=\"{0:.2f}\" {1} stroke=\"#eee\"/>\n", p, grid_from_to);
  }
  return out;
}

void check_options(const std::vector<PlotRun>& runs, const PlotOptions& o) {
  MG_CHECK(!runs.empty(), "plot: no metrics to draw");
  MG_CHECK(o.smooth >= 0 && o.smooth < 1, "plot: --smooth {} is outside [0, 1) (0 is off, 0.9 smooths strongly)",
           o.smooth);
  MG_CHECK(o.width >= 200 && o.height >= 150 && o.width <= 20000 && o.height <= 20000,
           "plot: the size {}x{} is outside 200x150 .. 20000x20000 pixels", o.width, o.height);
  for (const PlotRun& r : runs) {
    MG_CHECK(!r.series.step.empty(), "plot: '{}' has no step lines to plot", r.source);
    if (!o.log_y) continue;
    check_positive(r.series.step, r.series.loss, r, "loss");
    check_positive(r.series.val_step, r.series.val_loss, r, "val_loss");
  }
}

}  // namespace

std::string plot_svg(const std::vector<PlotRun>& runs, const PlotOptions& o) {
  check_options(runs, o);
  const Drawing d = drawing_of(runs, o);
  const bool with_lr = runs.size() == 1;
  const double width = o.width, height = o.height;
  // Top to bottom: title, notes, legend (wrapped to the width), the plot, the step labels and title.
  std::string head = fmt::format("<text x=\"12\" y=\"22\" font-size=\"15\">{}</text>\n", svg_escape(o.title));
  double y = 22;
  for (const std::string& note : d.notes) {
    y += 16;
    head += fmt::format("<text x=\"12\" y=\"{:.0f}\" font-size=\"11\" fill=\"#666\">{}</text>\n", y, svg_escape(note));
  }
  auto [legend, legend_height] = legend_svg(d.legend, 12, y + 20, width - 24);
  const double top = y + 20 + legend_height + 4, bottom = height - 42;
  Scale loss = value_scale(d.curves, false, o.log_y), lr = value_scale(d.curves, true, false);
  loss.px_lo = lr.px_lo = bottom;
  loss.px_hi = lr.px_hi = top;
  const Ticks loss_ticks = vertical_ticks(loss, bottom - top), lr_ticks = with_lr ? vertical_ticks(lr, bottom - top) : Ticks{};
  const double left = 34 + loss_ticks.widest() + 8;
  const double right = width - (with_lr ? 30 + lr_ticks.widest() + 8 : 12 + kCharWidth * 4);
  Scale step = step_scale(runs);
  step.px_lo = left;
  step.px_hi = right;
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"DejaVu Sans, sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n",
      o.width, o.height);
  svg += head + legend;
  svg += ticks_svg("<g id=\"y_ticks\" text-anchor=\"end\">", loss_ticks, loss, false, left - 6,
                   fmt::format("x1=\"{:.1f}\" x2=\"{:.1f}\"", left, right));
  svg += ticks_svg("<g id=\"x_ticks\" text-anchor=\"middle\">", step_ticks(step), step, true, bottom,
                   fmt::format("y1=\"{:.1f}\" y2=\"{:.1f}\"", top, bottom));
  if (with_lr) svg += ticks_svg("<g id=\"lr_ticks\" fill=\"#777\">", lr_ticks, lr, false, right + 6, "");
  svg += fmt::format("<path d=\"M{0:.1f},{1:.1f} L{0:.1f},{2:.1f} L{3:.1f},{2:.1f} L{3:.1f},{1:.1f}\" fill=\"none\" "
                     "stroke=\"black\"/>\n", left, top, bottom, right);
  svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">step</text>\n", (left + right) / 2, height - 8);
  svg += fmt::format("<text transform=\"translate(16 {:.1f}) rotate(-90)\" text-anchor=\"middle\">{}</text>\n",
                     (top + bottom) / 2, o.log_y ? "loss (log scale)" : "loss");
  if (with_lr) {
    svg += fmt::format("<text transform=\"translate({:.1f} {:.1f}) rotate(90)\" text-anchor=\"middle\" fill=\"#777\">"
                       "learning rate</text>\n", width - 14, (top + bottom) / 2);
  }
  // The learning rate first: the losses are drawn over it.
  for (const Curve& c : d.curves) {
    if (c.right_axis) svg += polyline(c, step, lr);
  }
  for (const Curve& c : d.curves) {
    if (!c.right_axis) svg += polyline(c, step, loss);
  }
  return svg + "</svg>\n";
}

}  // namespace meshgrad::diag
