#include "meshgrad/diag/plot.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "meshgrad/io/file_io.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad::diag {

MetricsSeries read_metrics(const std::string& path) {
  // A regular file only: a directory read as no lines, /dev/zero read until memory ran out and a FIFO
  // blocked (reliability-2 L3). The check opens without blocking; the lines are then read as a stream.
  try {
    io::open_regular_file(path, nullptr);
  } catch (const io::FileIoError& e) {
    throw InvalidArgument(fmt::format("plot: metrics file {}", e.what()));
  }
  std::ifstream in(path);
  MG_CHECK(in.good(), "plot: metrics file '{}' cannot be opened for reading", path);
  MetricsSeries s;
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      throw InvalidArgument(fmt::format("plot: '{}' line {} is not JSON (at byte {} of the line)", path, number, e.byte));
    }
    MG_CHECK(j.is_object(), "plot: '{}' line {} is not a JSON object", path, number);
    if (j.value("type", "") == "header") {
      // A resumed run appends from its checkpoint's step on: the steps the killed run had taken
      // after that checkpoint are superseded by the resumed run's.
      if (j.contains("first_step") && j["first_step"].is_number()) {
        const double first = j["first_step"].get<double>();
        while (!s.step.empty() && s.step.back() >= first) {
          s.step.pop_back();
          s.loss.pop_back();
          s.lr.pop_back();
        }
        while (!s.val_step.empty() && s.val_step.back() >= first) {
          s.val_step.pop_back();
          s.val_loss.pop_back();
        }
      }
      continue;
    }
    auto number_at = [&](const char* key) {
      MG_CHECK(j.contains(key) && j[key].is_number(), "plot: '{}' line {} has no number \"{}\" (is it a metrics file "
               "written by meshgrad train?)", path, number, key);
      return j[key].get<double>();
    };
    s.step.push_back(number_at("step"));
    s.loss.push_back(number_at("loss"));
    s.lr.push_back(number_at("lr"));
    if (j.contains("val_loss")) {
      s.val_step.push_back(s.step.back());
      s.val_loss.push_back(number_at("val_loss"));
    }
  }
  MG_CHECK(!s.step.empty(), "plot: '{}' has no step lines to plot", path);
  return s;
}

namespace {

struct Range {
  double lo, hi;
  double at(double v, double a, double b) const { return hi > lo ? a + (v - lo) / (hi - lo) * (b - a) : (a + b) / 2; }
};

Range range_of(std::initializer_list<const std::vector<double>*> series) {
  double lo = INFINITY, hi = -INFINITY;
  for (const auto* v : series) {
    for (double x : *v) {
      if (!std::isfinite(x)) continue;
      lo = std::min(lo, x);
      hi = std::max(hi, x);
    }
  }
  if (!(lo <= hi)) return {0, 1};
  const double pad = hi > lo ? 0.05 * (hi - lo) : 0.5;
  return {lo - pad, hi + pad};
}

std::string points(const std::vector<double>& x, const std::vector<double>& y, const Range& rx, const Range& ry,
                   double left, double right, double top, double bottom) {
  std::string out;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(y[i])) continue;
    out += fmt::format("{:.1f},{:.1f} ", rx.at(x[i], left, right), ry.at(y[i], bottom, top));
  }
  return out;
}

std::string escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

}  // namespace

std::string metrics_svg(const MetricsSeries& s, const std::string& title, int width, int height) {
  const double left = 70, right = width - 80.0, top = 40, bottom = height - 50.0;
  Range rx = range_of({&s.step});
  if (s.step.back() > s.step.front()) rx = {s.step.front(), s.step.back()};   // steps: no padding
  const Range rloss = range_of({&s.loss, &s.val_loss});
  const Range rlr = range_of({&s.lr});
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" viewBox=\"0 0 {} {}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{}\" y=\"22\" font-size=\"15\">{}</text>\n",
      width, height, width, height, left, escape(title));
  // Axes with five ticks each: step (bottom), loss (left), learning rate (right).
  svg += fmt::format("<path d=\"M{0},{1} L{0},{2} L{3},{2} L{3},{1}\" fill=\"none\" stroke=\"black\"/>\n", left, top,
                     bottom, right);
  for (int k = 0; k <= 4; ++k) {
    const double f = k / 4.0;
    const double xs = rx.lo + f * (rx.hi - rx.lo), yl = rloss.lo + f * (rloss.hi - rloss.lo),
                 yr = rlr.lo + f * (rlr.hi - rlr.lo);
    const double px = left + f * (right - left), py = bottom - f * (bottom - top);
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{:.0f}</text>\n", px, bottom + 18, xs);
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\">{:.3g}</text>\n", left - 6, py + 4, yl);
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" fill=\"#777\">{:.2e}</text>\n", right + 6, py + 4, yr);
    svg += fmt::format("<line x1=\"{0}\" y1=\"{1:.1f}\" x2=\"{2}\" y2=\"{1:.1f}\" stroke=\"#eee\"/>\n", left, py, right);
  }
  svg += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">step</text>\n", (left + right) / 2, height - 10);
  svg += fmt::format("<text x=\"16\" y=\"{:.1f}\" transform=\"rotate(-90 16 {:.1f})\" text-anchor=\"middle\">loss</text>\n",
                     (top + bottom) / 2, (top + bottom) / 2);
  svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" transform=\"rotate(90 {:.1f} {:.1f})\" text-anchor=\"middle\" "
                     "fill=\"#777\">learning rate</text>\n",
                     width - 12.0, (top + bottom) / 2, width - 12.0, (top + bottom) / 2);
  svg += fmt::format("<polyline id=\"lr\" fill=\"none\" stroke=\"#999\" stroke-dasharray=\"5,4\" points=\"{}\"/>\n",
                     points(s.step, s.lr, rx, rlr, left, right, top, bottom));
  svg += fmt::format("<polyline id=\"train_loss\" fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" points=\"{}\"/>\n",
                     points(s.step, s.loss, rx, rloss, left, right, top, bottom));
  if (!s.val_step.empty()) {
    svg += fmt::format("<polyline id=\"val_loss\" fill=\"none\" stroke=\"#ff7f0e\" stroke-width=\"2\" points=\"{}\"/>\n",
                       points(s.val_step, s.val_loss, rx, rloss, left, right, top, bottom));
    for (std::size_t i = 0; i < s.val_step.size(); ++i) {
      if (!std::isfinite(s.val_loss[i])) continue;
      svg += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\" fill=\"#ff7f0e\"/>\n",
                         rx.at(s.val_step[i], left, right), rloss.at(s.val_loss[i], bottom, top));
    }
  }
  // Legend.
  svg += fmt::format("<g transform=\"translate({:.1f},{:.1f})\">"
                     "<line x1=\"0\" y1=\"0\" x2=\"20\" y2=\"0\" stroke=\"#1f77b4\" stroke-width=\"2\"/>"
                     "<text x=\"26\" y=\"4\">train loss</text>"
                     "<line x1=\"0\" y1=\"16\" x2=\"20\" y2=\"16\" stroke=\"#ff7f0e\" stroke-width=\"2\"/>"
                     "<text x=\"26\" y=\"20\">val loss</text>"
                     "<line x1=\"0\" y1=\"32\" x2=\"20\" y2=\"32\" stroke=\"#999\" stroke-dasharray=\"5,4\"/>"
                     "<text x=\"26\" y=\"36\">learning rate</text></g>\n",
                     right - 130, top + 14);
  return svg + "</svg>\n";
}

}  // namespace meshgrad::diag
