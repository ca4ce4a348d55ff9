// What a training run writes while it runs (internal to the train layer): the metrics file's lines
// and rank 0's progress display.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "meshgrad/data/dataset.hpp"
#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/train/options.hpp"

namespace meshgrad::train {

// The metrics file's first line: {"type": "header", the provenance, "mesh", "data", "config": every
// option that shapes the run}. Step lines follow, one object each.
nlohmann::json metrics_header(const TrainOptions& o, const nn::ModelConfig& m, const dist::DeviceMesh& mesh,
                              const data::TokenDataset& dataset);

// One metrics line: {"step", "loss", "tokens_per_s", "gflops", "elapsed_s", "lr", "grad_norm"[, "val_loss"]}.
nlohmann::json metrics_line(const StepMetrics& m);

// Appends JSON lines to a file. Each line goes out in one write(2) on an O_APPEND descriptor, so a
// reader (tail -f, a dashboard) never sees a partial line, and nothing is buffered in the process.
// The file is written in place (not through a temporary) so that it can be followed during the run;
// check_output_paths has made sure it is absent or a regular file that is not an input, and
// O_NOFOLLOW + the type check hold that even if it changed since.
class MetricsWriter {
 public:
  // append: keep what the file holds (a resumed run continues its metrics); else start it empty.
  MetricsWriter(const std::string& path, bool append);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  void write_line(const nlohmann::json& object);

 private:
  std::string path_;
  int fd_ = -1;
};

// Rank 0's progress display on stderr: a bar redrawn in place on a terminal; on a pipe or file one
// line every ~5% of the steps (plus the first and the last), so logs stay readable.
class Progress {
 public:
  // first: the 0-based step the run starts at (a resumed run's checkpoint step).
  Progress(int steps, int first);
  // val_loss < 0: no evaluation yet. The ETA is the mean step time so far times the steps left.
  void update(int step, double loss, double tokens_per_s, double gflops, double lr, double elapsed, double val_loss);

 private:
  int steps_;
  int first_;
  bool tty_;
};

}  // namespace meshgrad::train
