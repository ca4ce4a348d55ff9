#include "meshgrad/diag/trace_report.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <tuple>
#include <utility>

#include "meshgrad/tensor/error.hpp"
#include "svg_text.hpp"

namespace meshgrad::diag {

namespace {

using Interval = std::pair<double, double>;

// Sorted, disjoint union of intervals.
std::vector<Interval> union_of(std::vector<Interval> v) {
  std::sort(v.begin(), v.end());
  std::vector<Interval> out;
  for (const auto& [b, e] : v) {
    if (e <= b) continue;
    if (!out.empty() && b <= out.back().second) {
      out.back().second = std::max(out.back().second, e);
    } else {
      out.emplace_back(b, e);
    }
  }
  return out;
}

double length(const std::vector<Interval>& v) {
  double s = 0;
  for (const auto& [b, e] : v) s += e - b;
  return s;
}

// Intersection of two sorted disjoint unions.
std::vector<Interval> intersect(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  std::vector<Interval> out;
  std::size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const double lo = std::max(a[i].first, b[j].first), hi = std::min(a[i].second, b[j].second);
    if (lo < hi) out.emplace_back(lo, hi);
    (a[i].second < b[j].second) ? ++i : ++j;
  }
  return out;
}

std::string string_arg(const nlohmann::json& args, const char* key) {
  if (!args.is_object() || !args.contains(key)) return {};
  const auto& v = args[key];
  return v.is_string() ? v.get<std::string>() : v.dump();
}

// Depths by nesting: spans sorted by start (longest first on ties); a span is one deeper than the
// spans still open when it starts. A span ending within a nanosecond of the next one's start has
// ended (ts + dur of microseconds with nanosecond digits may be off in the last bit).
void assign_depths(TraceLane& lane) {
  std::sort(lane.spans.begin(), lane.spans.end(), [](const TraceSpan& a, const TraceSpan& b) {
    return std::tie(a.begin_us, b.end_us) < std::tie(b.begin_us, a.end_us);
  });
  std::vector<double> open_ends;
  lane.depth = 0;
  for (TraceSpan& s : lane.spans) {
    while (!open_ends.empty() && open_ends.back() <= s.begin_us + 1e-3) open_ends.pop_back();
    s.depth = static_cast<int>(open_ends.size());
    open_ends.push_back(s.end_us);
    lane.depth = std::max(lane.depth, s.depth + 1);
  }
}

bool is_rank_lane(const TraceLane& lane) {
  if (lane.name.rfind("rank ", 0) != 0) return false;
  return lane.name.find(' ', 5) == std::string::npos;   // "rank 3", not "rank 3 progress (tp)"
}

bool is_progress_of(const TraceLane& lane, const TraceLane& rank) {
  return lane.pid == rank.pid && lane.name.rfind(rank.name + " progress", 0) == 0;
}

bool is_step(const TraceSpan& s) { return s.name == "step" && s.category == "step"; }

// The rank's window: its step spans in [from_us, to_us] (only its step-th one when step > 0), or its
// whole lane when it has none.
RankSummary summarize_rank(const TraceData& trace, const TraceLane& rank, double from_us, double to_us, int step) {
  RankSummary r;
  r.rank = rank.name;
  std::vector<Interval> window;
  int k = 0;
  for (const TraceSpan& s : rank.spans) {
    if (!is_step(s) || (step > 0 && ++k != step)) continue;
    if (s.end_us > from_us && s.begin_us < to_us) {
      window.emplace_back(std::max(s.begin_us, from_us), std::min(s.end_us, to_us));
      ++r.steps;
    }
  }
  if (window.empty()) {
    double lo = std::numeric_limits<double>::max(), hi = std::numeric_limits<double>::lowest();
    for (const TraceSpan& s : rank.spans) {
      lo = std::min(lo, s.begin_us);
      hi = std::max(hi, s.end_us);
    }
    if (lo < hi) window.emplace_back(std::max(lo, from_us), std::min(hi, to_us));
  }
  window = union_of(window);
  std::vector<Interval> comm, waits;
  for (const TraceLane& lane : trace.lanes) {
    if (!is_progress_of(lane, rank)) continue;
    for (const TraceSpan& s : lane.spans) {
      if (s.category != "comm") continue;
      comm.emplace_back(s.begin_us, s.end_us);
      for (const auto& [b, e] : window) {
        if (s.begin_us >= b && s.begin_us < e) {   // launched in the window
          ++r.collectives;
          r.bytes += s.bytes;
          break;
        }
      }
    }
  }
  std::vector<Interval> off_cpu;
  for (const TraceSpan& s : rank.spans) {
    if (s.category != "wait") continue;
    waits.emplace_back(s.begin_us, s.end_us);
    if (s.since_launch_us >= 0 && s.off_cpu_us > 0) {
      const double launched = s.begin_us - s.since_launch_us;
      off_cpu.emplace_back(launched, std::min(s.begin_us, launched + s.off_cpu_us));
    }
  }
  const std::vector<Interval> comm_in = intersect(union_of(comm), window);
  const std::vector<Interval> wait_in = intersect(union_of(waits), window);
  std::vector<Interval> blocked = waits;
  blocked.insert(blocked.end(), off_cpu.begin(), off_cpu.end());
  const std::vector<Interval> blocked_in = intersect(union_of(blocked), window);
  r.window_ms = length(window) / 1e3;
  r.comm_ms = length(comm_in) / 1e3;
  r.waited_ms = length(wait_in) / 1e3;
  r.off_cpu_ms = length(blocked_in) / 1e3 - r.waited_ms;
  r.exposed_ms = length(intersect(comm_in, blocked_in)) / 1e3;
  r.hidden_ms = r.comm_ms - r.exposed_ms;
  r.compute_ms = r.window_ms - r.waited_ms - r.off_cpu_ms;
  r.hidden_percent = r.comm_ms > 0 ? 100.0 * r.hidden_ms / r.comm_ms : 0.0;
  return r;
}

std::vector<RankSummary> summarize_window(const TraceData& trace, double from_us, double to_us, int step) {
  std::vector<RankSummary> rows;
  std::map<std::string, int> seen;
  for (const TraceLane& lane : trace.lanes) {
    if (is_rank_lane(lane)) ++seen[lane.name];
  }
  for (const TraceLane& lane : trace.lanes) {
    if (!is_rank_lane(lane)) continue;
    RankSummary r = summarize_rank(trace, lane, from_us, to_us, step);
    if (seen[lane.name] > 1) r.rank += fmt::format(" ({})", lane.process);
    rows.push_back(std::move(r));
  }
  return rows;
}

}  // namespace

TraceData parse_trace(const std::string& text, const std::string& what) {
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    throw InvalidArgument(fmt::format("trace '{}' is not JSON (at byte {}): is it a file written by --trace?", what,
                                      e.byte));
  }
  const nlohmann::json* events = nullptr;
  if (doc.is_array()) events = &doc;
  if (doc.is_object() && doc.contains("traceEvents") && doc["traceEvents"].is_array()) events = &doc["traceEvents"];
  MG_CHECK(events != nullptr, "trace '{}' has no \"traceEvents\" array (Trace Event Format)", what);

  std::map<std::pair<std::int64_t, int>, TraceLane> lanes;
  std::map<std::int64_t, std::pair<std::string, int>> processes;   // pid -> name, sort index
  std::map<std::pair<std::int64_t, int>, std::vector<TraceSpan>> open;   // B events per lane
  std::size_t index = 0;
  for (const nlohmann::json& e : *events) {
    ++index;
    try {
      MG_CHECK(e.is_object() && e.contains("ph") && e["ph"].is_string(),
               "trace '{}': event {} is not an object with a \"ph\" phase", what, index);
      const std::string ph = e["ph"].get<std::string>();
      const std::int64_t pid = e.value("pid", std::int64_t{0});
      const int tid = e.value("tid", 0);
      const nlohmann::json args = e.contains("args") ? e["args"] : nlohmann::json::object();
      const std::string name = e.value("name", std::string());
      if (ph == "M") {
        if (name == "thread_name") lanes[{pid, tid}].name = string_arg(args, "name");
        if (name == "thread_sort_index") lanes[{pid, tid}].sort_index = args.value("sort_index", 0);
        if (name == "process_name") processes[pid].first = string_arg(args, "name");
        if (name == "process_sort_index") processes[pid].second = args.value("sort_index", 0);
        continue;
      }
      if (ph != "X" && ph != "B" && ph != "E") continue;   // instants, counters, flows: not drawn
      MG_CHECK(e.contains("ts") && e["ts"].is_number(), "trace '{}': event {} ({}) has no numeric \"ts\"", what, index,
               name);
      const double ts = e["ts"].get<double>();
      if (ph == "E") {
        auto& stack = open[{pid, tid}];
        MG_CHECK(!stack.empty(), "trace '{}': event {} ends a span on pid {} tid {} that never began", what, index, pid,
                 tid);
        TraceSpan s = std::move(stack.back());
        stack.pop_back();
        s.end_us = ts;
        lanes[{pid, tid}].spans.push_back(std::move(s));
        continue;
      }
      TraceSpan s;
      s.name = name;
      s.category = e.value("cat", std::string());
      s.begin_us = ts;
      s.op = string_arg(args, "op");
      s.group = string_arg(args, "group");
      s.label = string_arg(args, "label");
      if (args.is_object() && args.contains("bytes") && args["bytes"].is_number()) {
        s.bytes = args["bytes"].get<std::int64_t>();
      }
      if (args.is_object() && args.contains("since_launch_us") && args.contains("off_cpu_us")) {
        s.since_launch_us = args["since_launch_us"].get<double>();
        s.off_cpu_us = args["off_cpu_us"].get<double>();
      }
      if (ph == "B") {
        open[{pid, tid}].push_back(std::move(s));
        continue;
      }
      MG_CHECK(e.contains("dur") && e["dur"].is_number() && e["dur"].get<double>() >= 0,
               "trace '{}': span {} ({}) has no non-negative \"dur\"", what, index, name);
      s.end_us = ts + e["dur"].get<double>();
      lanes[{pid, tid}].spans.push_back(std::move(s));
    } catch (const nlohmann::json::exception& error) {   // a field of the wrong type
      throw InvalidArgument(fmt::format("trace '{}': event {} is malformed: {}", what, index, error.what()));
    }
  }
  for (const auto& [key, stack] : open) {
    MG_CHECK(stack.empty(), "trace '{}': span '{}' on pid {} tid {} begins and never ends", what,
             stack.empty() ? "" : stack.back().name, key.first, key.second);
  }

  TraceData out;
  out.begin_us = std::numeric_limits<double>::max();
  out.end_us = std::numeric_limits<double>::lowest();
  for (auto& [key, lane] : lanes) {
    lane.pid = key.first;
    lane.tid = key.second;
    if (lane.name.empty()) lane.name = fmt::format("tid {}", key.second);
    lane.process = processes[key.first].first;
    lane.process_sort_index = processes[key.first].second;
    assign_depths(lane);
    for (const TraceSpan& s : lane.spans) {
      out.begin_us = std::min(out.begin_us, s.begin_us);
      out.end_us = std::max(out.end_us, s.end_us);
    }
    out.lanes.push_back(std::move(lane));
  }
  MG_CHECK(out.begin_us <= out.end_us, "trace '{}' has no spans", what);
  std::sort(out.lanes.begin(), out.lanes.end(), [](const TraceLane& a, const TraceLane& b) {
    return std::tie(a.process_sort_index, a.pid, a.sort_index, a.name) <
           std::tie(b.process_sort_index, b.pid, b.sort_index, b.name);
  });
  return out;
}

TraceData read_trace(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MG_CHECK(in.good(), "trace '{}' cannot be opened for reading", path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return parse_trace(buffer.str(), path);
}

namespace {
// Step N (1-based) of every rank: from the earliest start to the latest end.
Interval step_window(const TraceData& trace, int step, const char* who) {
  double lo = std::numeric_limits<double>::max(), hi = std::numeric_limits<double>::lowest();
  int max_steps = 0;
  for (const TraceLane& lane : trace.lanes) {
    int k = 0;
    for (const TraceSpan& s : lane.spans) {
      if (!is_step(s)) continue;
      if (++k == step) {
        lo = std::min(lo, s.begin_us);
        hi = std::max(hi, s.end_us);
      }
    }
    max_steps = std::max(max_steps, k);
  }
  MG_CHECK(lo < hi, "{}: --step {}: the trace has {} \"step\" spans per rank", who, step, max_steps);
  return {lo, hi};
}
}  // namespace

std::vector<RankSummary> summarize_trace(const TraceData& trace, int step) {
  if (step > 0) {
    const auto [lo, hi] = step_window(trace, step, "trace summary");
    return summarize_window(trace, lo, hi, step);
  }
  return summarize_window(trace, std::numeric_limits<double>::lowest(), std::numeric_limits<double>::max(), 0);
}

std::string format_trace_summary(const std::vector<RankSummary>& rows) {
  std::string out = fmt::format("{:<10} {:>5} {:>9} {:>10} {:>9} {:>9} {:>10} {:>10} {:>9} {:>6} {:>6} {:>9}\n", "rank",
                                "steps", "window ms", "compute ms", "comm ms", "waited ms", "off-CPU ms", "exposed ms",
                                "hidden ms", "hidden", "colls", "MB");
  for (const RankSummary& r : rows) {
    out += fmt::format("{:<10} {:>5} {:>9.2f} {:>10.2f} {:>9.2f} {:>9.2f} {:>10.2f} {:>10.2f} {:>9.2f} {:>5.0f}% "
                       "{:>6} {:>9.2f}\n",
                       r.rank, r.steps, r.window_ms, r.compute_ms, r.comm_ms, r.waited_ms, r.off_cpu_ms, r.exposed_ms,
                       r.hidden_ms, r.hidden_percent, r.collectives, static_cast<double>(r.bytes) / 1e6);
  }
  return out;
}

namespace {

const char* colour_of(const std::string& category) {
  static const std::map<std::string, const char*> colours{
      {"forward", "#4e79a7"},  {"backward", "#59a14f"}, {"comm", "#f28e2b"},     {"wait", "#e15759"},
      {"optimizer", "#b07aa1"}, {"grad_sync", "#edc948"}, {"evaluate", "#76b7b2"}, {"recompute", "#9c755f"},
      {"step", "#d7d2cc"}};
  auto it = colours.find(category);
  return it == colours.end() ? "#bab0ac" : it->second;
}

// A round tick spacing giving about `target` ticks over span.
double tick_step(double span, int target) {
  const double raw = span / target;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (m * p >= raw) return m * p;
  }
  return 10 * p;
}

}  // namespace

std::string trace_svg(const TraceData& trace, const TraceSvgOptions& options) {
  double t0 = trace.begin_us, t1 = trace.end_us;
  if (options.step > 0) std::tie(t0, t1) = step_window(trace, options.step, "trace svg");
  if (t1 <= t0) t1 = t0 + 1;
  constexpr int kLabel = 190, kRight = 36, kTop = 46, kRow = 14, kLaneGap = 8;
  const int plot_w = std::max(200, options.width - kLabel - kRight);
  auto x_of = [&](double us) { return kLabel + (us - t0) / (t1 - t0) * plot_w; };

  std::vector<const TraceLane*> lanes;
  for (const TraceLane& lane : trace.lanes) {
    bool visible = false;
    for (const TraceSpan& s : lane.spans) visible = visible || (s.end_us > t0 && s.begin_us < t1);
    if (visible) lanes.push_back(&lane);
  }
  int y = kTop;
  std::string body;
  for (std::size_t k = 0; k < lanes.size(); ++k) {
    const TraceLane* lane = lanes[k];
    const int h = std::max(1, lane->depth) * kRow;
    body += fmt::format("<rect x='0' y='{}' width='{}' height='{}' fill='{}'/>\n", y - kLaneGap / 2, options.width,
                        h + kLaneGap, k % 2 ? "#f4f4f4" : "#ffffff");
    body += fmt::format("<text x='{}' y='{}' class='lane'>{}</text>\n", kLabel - 8, y + 11, svg_escape(lane->name));
    for (const TraceSpan& s : lane->spans) {
      // Zero-length waits carry arguments only.
      if (s.end_us <= t0 || s.begin_us >= t1 || s.end_us <= s.begin_us) continue;
      const double x0 = x_of(std::max(s.begin_us, t0)), x1 = x_of(std::min(s.end_us, t1));
      const double w = std::max(0.6, x1 - x0);
      const int sy = y + s.depth * kRow;
      std::string tip = fmt::format("{} [{}] {:.3f} ms", s.name, s.category, (s.end_us - s.begin_us) / 1e3);
      if (!s.op.empty()) tip += fmt::format(" op={}", s.op);
      if (!s.group.empty()) tip += fmt::format(" group={}", s.group);
      if (!s.label.empty()) tip += fmt::format(" label={}", s.label);
      if (s.bytes > 0) tip += fmt::format(" bytes={}", s.bytes);
      body += fmt::format("<rect x='{:.2f}' y='{}' width='{:.2f}' height='{}' fill='{}'><title>{}</title></rect>\n", x0,
                          sy, w, kRow - 2, colour_of(s.category), svg_escape(tip));
      const std::string text = s.category == "comm" && !s.label.empty() ? s.op : s.name;
      if (w > 6.2 * static_cast<double>(text.size()) + 4) {
        body += fmt::format("<text x='{:.2f}' y='{}' class='span'>{}</text>\n", x0 + 2, sy + 9, svg_escape(text));
      }
    }
    y += h + kLaneGap;
  }
  // Time axis.
  const double step_ms = tick_step((t1 - t0) / 1e3, 10);
  body += fmt::format("<line x1='{}' y1='{}' x2='{}' y2='{}' stroke='#333'/>\n", kLabel, y, kLabel + plot_w, y);
  for (double ms = std::ceil((t0 / 1e3) / step_ms) * step_ms; ms <= t1 / 1e3 + 1e-9; ms += step_ms) {
    const double x = x_of(ms * 1e3);
    body += fmt::format("<line x1='{:.2f}' y1='{}' x2='{:.2f}' y2='{}' stroke='#333'/>", x, y, x, y + 4);
    body += fmt::format("<text x='{:.2f}' y='{}' class='tick'>{:g}</text>\n", x, y + 15, ms);
  }
  body += fmt::format("<text x='{}' y='{}' class='unit'>ms</text>\n", kLabel + plot_w + 16, y + 15);
  y += 30;
  // Legend.
  int lx = kLabel;
  for (const char* cat :
       {"step", "forward", "backward", "recompute", "comm", "wait", "grad_sync", "optimizer", "evaluate"}) {
    body += fmt::format("<rect x='{}' y='{}' width='12' height='10' fill='{}'/>"
                        "<text x='{}' y='{}' class='span'>{}</text>\n",
                        lx, y, colour_of(cat), lx + 16, y + 9, cat);
    lx += 16 + 7 * static_cast<int>(std::string(cat).size()) + 14;
  }
  y += 24;
  // What the window shows, per rank.
  auto ms = [](double v) { return fmt::format("{:.{}f} ms", v, v < 1 ? 3 : v < 10 ? 2 : 1); };
  for (const RankSummary& r : summarize_window(trace, t0, t1, options.step)) {
    body += fmt::format("<text x='{}' y='{}' class='sum'>{}: compute {}, collectives in flight {}, waited {}, off the "
                        "CPU after a launch {}; {} of the communication ran during compute ({:.0f}%)</text>\n",
                        kLabel, y, svg_escape(r.rank), ms(r.compute_ms), ms(r.comm_ms), ms(r.waited_ms), ms(r.off_cpu_ms),
                        ms(r.hidden_ms), r.hidden_percent);
    y += 16;
  }
  y += 6;
  const std::string title = options.title.empty()
                                ? (options.step > 0 ? fmt::format("step {}", options.step) : std::string("trace"))
                                : options.title;
  return fmt::format(
      "<svg xmlns='http://www.w3.org/2000/svg' width='{}' height='{}' viewBox='0 0 {} {}' font-family='sans-serif'>\n"
      "<style>.lane{{font-size:11px;text-anchor:end}} .span{{font-size:9px;fill:#111}} "
      ".tick{{font-size:10px;text-anchor:middle}} .unit{{font-size:10px}} .sum{{font-size:11px}} .title{{font-size:14px}}"
      "</style>\n"
      "<rect width='100%' height='100%' fill='white'/>\n"
      "<text x='{}' y='24' class='title'>{}</text>\n{}</svg>\n",
      options.width, y, options.width, y, kLabel, svg_escape(title), body);
}

}  // namespace meshgrad::diag
