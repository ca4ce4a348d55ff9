// What a training run writes while it runs (internal to the train layer): the metrics file's lines
// and rank 0's progress display.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "meshgrad/data/dataset.hpp"
#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/train/options.hpp"

namespace meshgrad::train {

// The metrics file's first line: {"type": "header", the provenance, "mesh", "data", "config": every
// option of the run by its command-line name, "peak_gflops" (MFU's denominator)}. Step lines
// (step_metrics_json) and sample lines ({"type": "sample", "step", "text"}) follow, one object each.
nlohmann::json metrics_header(const TrainOptions& o, const nn::ModelConfig& m, const dist::DeviceMesh& mesh,
                              const data::TokenDataset& dataset, double peak_gflops);


// Appends JSON lines to a file. Each line goes out in one write(2) on an O_APPEND descriptor, so a
// reader (tail -f, a dashboard) never sees a partial line, and nothing is buffered in the process.
// The file is written in place (not through a temporary) so that it can be followed during the run;
// check_output_paths has made sure it is absent or a regular file that is not an input, and
// O_NOFOLLOW + the type check hold that even if it changed since.
class MetricsWriter {
 public:
  // append: keep what the file holds (a resumed run continues its metrics); else start it empty.
  // Holds an exclusive lock on the file (io::lock_output): a second run on the same file is refused
  // naming the process that holds it.
  MetricsWriter(const std::string& path, bool append);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  void write_line(const nlohmann::json& object);

 private:
  std::string path_;
  int fd_ = -1;
};

// The mesh's peak GFLOP/s for MFU: one rank's peak from blas::product_peak_gflops (the probe `meshgrad
// bench peak` prints: the best of 4 square products of 1024 in the run's precision, bf16 operands
// under --precision bf16, else the model's dtype; float32 on the better of OpenBLAS and oneDNN), on
// the calling rank with its BLAS threads, times `ranks` (every rank is taken to have the caller's
// peak: MFU is per device, as Megatron and nanoGPT count it).
// The per-rank figure is cached per machine (peak_cache_path(): a JSON object keyed by the CPU
// model, the cores, the kernel table, the product libraries, the precision and the BLAS threads), so
// runs divide by the same peak instead of one re-measured each run (150-212 GFLOP/s apart here); a
// missing or unreadable cache, or another key, measures (about 0.1 s) and writes the cache
// (atomically: a temporary file renamed). source says which: "measured" or "cached in PATH".
struct PeakGflops {
  double gflops = 0;
  std::string source;
};
PeakGflops measure_peak_gflops(DType dtype, const std::string& precision, int ranks);
// $MESHGRAD_CACHE_DIR, else $XDG_CACHE_HOME/meshgrad, else $HOME/.cache/meshgrad, + /peak-gflops.json;
// "" (no cache) when none is set or MESHGRAD_CACHE_DIR is "off".
std::string peak_cache_path();

// The time left: the median of the last (up to 8) step times in ms, times the steps left, in
// seconds. A run's first step is left out once a later one is known: it pays for the start (the
// first products pack their operands, buffers grow), which made the mean of all steps 4x off at
// step 1. Negative when no step time is known.
double eta_seconds(const std::vector<double>& recent_ms, int steps_left);
// "42s", "12m05s", "3h07m"; "--" for a negative (unknown) time.
std::string format_duration(double seconds);

// One field of the progress line and when it is dropped to fit a narrow terminal: drop_order 0 is
// always kept; among the others the highest goes first.
struct ProgressField {
  std::string text;
  int drop_order = 0;
};
// The fields joined with " | ", dropping fields (highest drop_order first) until the line fits in
// `width` columns (0: any width); a line whose kept fields alone are wider is cut at `width`.
std::string fit_to_width(const std::vector<ProgressField>& fields, int width);
// The terminal's columns on stderr (TIOCGWINSZ, else $COLUMNS); 0 when unknown or not a terminal.
int terminal_width();

// Rank 0's progress display on stderr: a bar redrawn in place on a terminal; on a pipe or file one
// line every ~5% of the steps (plus the first and the last), so logs stay readable. The rate, ms/step
// and MFU are those of the last steps (a window); an evaluation prints its own line at its step,
// so a validation loss is never shown as if it were the current one.
class Progress {
 public:
  // first: the 0-based step the run starts at (a resumed run's checkpoint step).
  Progress(int steps, int first);
  // The ETA is eta_seconds over the recent steps. m.mfu < 0: no peak known. On a terminal the line
  // fits its width (fit_to_width; the bar, the elapsed time, lr and the rates go first, then MFU).
  void update(const StepMetrics& m, double shown_tokens_per_s, double shown_ms_per_step, double shown_mfu);
  // A line of its own (a sample, an evaluation): on a terminal the bar is redrawn after it.
  void print_line(const std::string& line);

 private:
  int steps_;
  int first_;
  bool tty_;
  std::vector<double> recent_ms_;   // the last steps' times, oldest first (the run's first step dropped later)
};

}  // namespace meshgrad::train
