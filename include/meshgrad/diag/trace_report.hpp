// Reading a trace written by `--trace` (trace_file.hpp), and what `meshgrad trace summary` and
// `meshgrad trace svg` show of it: per rank how long it computed, how long its collectives ran, how
// long it waited for them and how much of the communication that overlap hid; and the lanes as an
// SVG timeline (the picture in docs/tracing.md).
//
// What counts (per rank, within its "step" spans, or its whole lane when it has none):
//   comm     time during which at least one collective of the rank was in flight (the union of the
//            spans on its progress lanes, "rank R progress ...": launch to completion);
//   waited   time the rank was blocked in a wait (the union of its "wait" spans);
//   off-CPU  time the rank thread was off the CPU between launching a collective and waiting for
//            it (the wait spans' off_cpu_us, placed right after the launch: the progress thread a
//            launch wakes takes the rank's core on a machine with more threads than cores);
//   exposed  comm during which the rank waited or was off the CPU: communication it paid for;
//   hidden   comm - exposed: communication that ran while the rank computed (overlap);
//   compute  window - waited - off-CPU.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace meshgrad::diag {

struct TraceSpan {
  std::string name, category;
  double begin_us = 0, end_us = 0;
  int depth = 0;               // nesting level on its lane (0 = outermost)
  std::string op, group, label;   // collectives and waits: args "op", "group", "label"
  std::int64_t bytes = 0;
  double since_launch_us = -1, off_cpu_us = -1;   // waits: args of the same names (-1: absent)
};

struct TraceLane {
  std::int64_t pid = 0;
  int tid = 0;
  std::string name;            // thread_name, e.g. "rank 0", "rank 0 progress (tp)"
  int sort_index = 0;
  std::string process;         // process_name
  int process_sort_index = 0;
  std::vector<TraceSpan> spans;   // by start time, outer before inner
  int depth = 0;               // 1 + the deepest span's depth (0 when empty)
};

struct TraceData {
  std::vector<TraceLane> lanes;   // by process sort index, pid, lane sort index, name
  double begin_us = 0, end_us = 0;
};

// Reads a Trace Event Format file ({"traceEvents": [...]} or a bare array) with "X" spans and "M"
// thread_name / process_name metadata. B/E pairs are matched per lane. Throws InvalidArgument
// naming the file on anything that is not such a trace.
TraceData read_trace(const std::string& path);
TraceData parse_trace(const std::string& text, const std::string& what);

struct RankSummary {
  std::string rank;            // its lane name ("rank 0"), with the process when ranks repeat
  int steps = 0;               // "step" spans in its window (0: the whole lane is the window)
  double window_ms = 0;
  double compute_ms = 0, comm_ms = 0, waited_ms = 0, off_cpu_ms = 0, exposed_ms = 0, hidden_ms = 0;
  double hidden_percent = 0;   // hidden / comm (0 without communication)
  int collectives = 0;         // collective spans in the window
  std::int64_t bytes = 0;      // their bytes
};

// One row per rank lane ("rank R"), in lane order; step > 0: over each rank's step-th "step" span
// only (InvalidArgument when there is none).
std::vector<RankSummary> summarize_trace(const TraceData& trace, int step = 0);
std::string format_trace_summary(const std::vector<RankSummary>& rows);

struct TraceSvgOptions {
  int width = 1200;            // pixels
  int step = 0;                // draw only step N (1-based, the "step" spans of the ranks); 0 = all
  std::string title;
};
// The lanes as an SVG timeline: a row per lane, spans as boxes stacked by nesting and coloured by
// category, a time axis in ms, a legend and the summary of the window drawn (of step N: each rank's
// step N). Throws InvalidArgument when step N does not exist.
std::string trace_svg(const TraceData& trace, const TraceSvgOptions& options);

}  // namespace meshgrad::diag
