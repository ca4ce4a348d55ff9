// The numbers behind `meshgrad plot`'s axes (diag/plot.hpp): nice tick values, their labels, and the
// smoothing of the train loss.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>

#include "meshgrad/diag/plot.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad::diag {

std::vector<double> smooth_ema(const std::vector<double>& values, double weight) {
  MG_CHECK(weight >= 0 && weight < 1, "plot: the smoothing weight {} is outside [0, 1)", weight);
  std::vector<double> out;
  out.reserve(values.size());
  double last = 0;
  int finite = 0;
  for (double x : values) {
    if (!std::isfinite(x)) {   // as TensorBoard: shown as it is, kept out of the average
      out.push_back(x);
      continue;
    }
    last = weight * last + (1 - weight) * x;
    ++finite;
    out.push_back(last / (1 - std::pow(weight, finite)));
  }
  return out;
}

namespace {

// Tolerance of "a tick at lo/hi is inside": the bounds are often themselves tick values computed
// another way (a step of 10 as 10.000000000000002).
constexpr double kInside = 1e-9;

// m * 10^e as the double nearest that decimal (3 * 0.1 is 0.30000000000000004; 3 / 10 is 0.3).
double decimal(double m, int e) { return e >= 0 ? m * std::pow(10.0, e) : m / std::pow(10.0, -e); }

// The multiples of step (1, 2 or 5 times a power of ten) within [lo, hi].
std::vector<double> multiples(double lo, double hi, double step) {
  const int e = static_cast<int>(std::floor(std::log10(step) + kInside));
  const double m = std::round(step / std::pow(10.0, e));
  const double first = std::ceil(lo / step - kInside), last = std::floor(hi / step + kInside);
  std::vector<double> out;
  for (double k = first; k <= last; ++k) out.push_back(decimal(k * m, e));
  return out;
}

// The next step of the 1-2-5 sequence: 1 -> 2 -> 5 -> 10 (times the same power of ten).
double next_nice(double step) {
  const double power = std::pow(10, std::floor(std::log10(step) + kInside));
  const double mantissa = std::round(step / power);
  return mantissa < 2 ? 2 * power : mantissa < 5 ? 5 * power : 10 * power;
}

// The values m * 10^e within [lo, hi] for the mantissas given (0 < lo <= hi).
std::vector<double> decade_multiples(double lo, double hi, const std::vector<int>& mantissas) {
  std::vector<double> out;
  const int e_lo = static_cast<int>(std::floor(std::log10(lo))), e_hi = static_cast<int>(std::ceil(std::log10(hi)));
  for (int e = e_lo; e <= e_hi; ++e) {
    for (int m : mantissas) {
      const double v = decimal(m, e);
      if (v >= lo * (1 - kInside) && v <= hi * (1 + kInside)) out.push_back(v);
    }
  }
  return out;
}

}  // namespace

std::vector<double> linear_ticks(double lo, double hi, int max_ticks, bool integers_only) {
  if (!std::isfinite(lo) || !std::isfinite(hi) || hi < lo) return {};
  max_ticks = std::max(max_ticks, 1);
  if (hi == lo) return integers_only && lo != std::round(lo) ? std::vector<double>{} : std::vector<double>{lo};
  // Start a decade below the step that would give max_ticks, climb the 1-2-5 sequence until few enough.
  double step = std::pow(10, std::floor(std::log10((hi - lo) / max_ticks)) - 1);
  if (integers_only) step = std::max(step, 1.0);
  while (std::floor(hi / step + kInside) - std::ceil(lo / step - kInside) + 1 > max_ticks) step = next_nice(step);
  return multiples(lo, hi, step);
}

std::vector<double> log_ticks(double lo, double hi, int max_ticks) {
  if (!(lo > 0) || !std::isfinite(hi) || hi < lo) return {};
  max_ticks = std::max(max_ticks, 2);
  const std::vector<double> one_two_five = decade_multiples(lo, hi, {1, 2, 5});
  if (one_two_five.size() >= 3 && one_two_five.size() <= static_cast<std::size_t>(max_ticks)) return one_two_five;
  if (one_two_five.size() > static_cast<std::size_t>(max_ticks)) {
    // Many decades: powers of ten, every k-th one when even they are too many.
    std::vector<double> powers = decade_multiples(lo, hi, {1});
    const std::size_t every = (powers.size() + max_ticks - 1) / max_ticks;
    std::vector<double> kept;
    for (double p : powers) {
      if (static_cast<long>(std::lround(std::log10(p))) % static_cast<long>(every) == 0) kept.push_back(p);
    }
    return kept.size() >= 2 ? kept : powers;
  }
  // Under a decade or so: every integer multiple if that gives 3 and fits, else whichever of the two
  // gives 2, else linear ticks (a range such as 3.2 .. 3.9 holds no two integer multiples).
  const std::vector<double> all = decade_multiples(lo, hi, {1, 2, 3, 4, 5, 6, 7, 8, 9});
  const bool all_fit = all.size() <= static_cast<std::size_t>(max_ticks);
  if (all.size() >= 3 && all_fit) return all;
  if (one_two_five.size() >= 2) return one_two_five;
  if (all.size() >= 2 && all_fit) return all;
  return linear_ticks(lo, hi, max_ticks, false);
}

namespace {

// The labels of ticks with `digits` digits in the given style, or none when two are equal or one
// does not read back as its tick (within tolerance).
std::vector<std::string> try_labels(const std::vector<double>& ticks, char style, int digits, double tolerance) {
  std::vector<std::string> out;
  std::set<std::string> seen;
  for (double t : ticks) {
    std::string s = style == 'e' ? fmt::format("{:.{}e}", t, digits)
                    : style == 'f' ? fmt::format("{:.{}f}", t, digits) : fmt::format("{:.{}g}", t, digits);
    const double back = std::strtod(s.c_str(), nullptr);
    if (std::abs(back - t) > tolerance) return {};
    if (back == 0 && s.front() == '-') s.erase(0, 1);   // "-0.0": a zero computed as -1e-17
    if (!seen.insert(s).second) return {};
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace

std::vector<std::string> tick_labels(const std::vector<double>& ticks, bool log_axis) {
  if (ticks.empty()) return {};
  if (log_axis) {
    // Shortest per tick: "0.5", "1", "20", "1e-05" (a log axis mixes magnitudes; shared decimals would
    // not fit). Fixed from 1e-4 to 1e6, scientific beyond.
    std::vector<std::string> out;
    for (double t : ticks) {
      const char style = std::abs(t) >= 1e-4 && std::abs(t) < 1e6 ? 'f' : 'e';
      for (int digits = 0; digits <= 17; ++digits) {
        auto one = try_labels({t}, style, digits, 1e-9 * std::abs(t));
        if (!one.empty()) {
          out.push_back(one.front());
          break;
        }
      }
    }
    return out;
  }
  double gap = INFINITY, largest = 0;
  for (std::size_t i = 0; i < ticks.size(); ++i) {
    largest = std::max(largest, std::abs(ticks[i]));
    if (i > 0) gap = std::min(gap, ticks[i] - ticks[i - 1]);
  }
  if (!std::isfinite(gap)) gap = largest > 0 ? largest : 1;
  const bool scientific = (largest > 0 && largest < 1e-3) || largest >= 1e6;
  // A label may differ from its tick by a thousandth of the gap between ticks: invisible on the axis.
  const double tolerance = 1e-3 * gap;
  for (int digits = 0; digits <= 17; ++digits) {
    auto labels = try_labels(ticks, scientific ? 'e' : 'f', digits, tolerance);
    if (!labels.empty()) return labels;
  }
  return try_labels(ticks, 'g', 17, INFINITY);
}

}  // namespace meshgrad::diag
