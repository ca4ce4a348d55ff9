// The metrics file and the progress display of a run (contracts in progress.hpp).
#include "progress.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <vector>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "meshgrad/io/output_path.hpp"
#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/error.hpp"
#include "meshgrad/train/run_config.hpp"

namespace meshgrad::train {

nlohmann::json metrics_header(const TrainOptions& o, const nn::ModelConfig& m, const dist::DeviceMesh& mesh,
                              const data::TokenDataset& dataset, double peak_gflops) {
  nlohmann::json h{{"type", "header"}, {"mesh", mesh.str()}, {"data", dataset.source()}};
  for (const auto& [key, value] : o.provenance) h[key] = value;
  h["blas_kernels"] = blas::kernel_core();   // the bits of a run depend on the GEMM kernels
  h["gemm"] = blas::gemm_core();               // and on the product library
  if (o.precision == "bf16") h["bf16_products"] = blas::bf16_description();
  h["blas_threads"] = blas::num_threads();   // and, for some kernels, on their threads per rank
  // The run's options by their command-line names (the list a checkpoint records: run_config.hpp),
  // with the model's vocabulary as resolved from the data.
  h["config"] = run_config_json(o, m.vocab);
  h["peak_gflops"] = peak_gflops;
  return h;
}

nlohmann::json step_metrics_json(const StepMetrics& m) {
  nlohmann::json line{{"step", m.step},         {"loss", m.loss},           {"tokens_per_s", m.tokens_per_s},
                      {"gflops", m.gflops},     {"elapsed_s", m.elapsed_s}, {"lr", m.lr},
                      {"grad_norm", m.grad_norm}, {"ms_per_step", m.ms_per_step}};
  if (m.mfu >= 0) line["mfu"] = m.mfu;
  if (m.evaluated) line["val_loss"] = m.val_loss;
  if (!m.expert_load.empty()) {
    line["expert_load"] = m.expert_load;
    line["dropped"] = m.dropped;
    line["aux_loss"] = m.aux_loss;
  }
  return line;
}

double measure_peak_gflops(DType dtype, const std::string& precision, int ranks) {
  // The run's own products: bf16 operands under --precision bf16, else the model's dtype.
  const DType operands = precision == "bf16" ? DType::BFloat16 : dtype;
  double peak = blas::product_peak_gflops(operands, 1024, 4, blas::GemmLibrary::OpenBlas);
  // float32: the better of the two libraries (the run itself may be pinned to one of them).
  if (operands == DType::Float32 && blas::onednn_built())
    peak = std::max(peak, blas::product_peak_gflops(operands, 1024, 4, blas::GemmLibrary::OneDnn));
  return peak * ranks;
}

MetricsWriter::MetricsWriter(const std::string& path, bool append) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
  MG_CHECK(fd_ >= 0, "metrics file '{}' cannot be opened for writing: {}", path, std::strerror(errno));
  try {
    struct stat st {};
    if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode))
      throw InvalidArgument(fmt::format("metrics file '{}' is not a regular file", path));
    // One run per metrics file: two would interleave their lines, and the second's truncation would
    // drop the first's. Taken before the truncation; held until the writer closes the file.
    io::lock_output(fd_, {"--metrics", path});
    if (!append && ::ftruncate(fd_, 0) != 0)
      throw InvalidArgument(fmt::format("metrics file '{}' cannot be truncated: {}", path, std::strerror(errno)));
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

MetricsWriter::~MetricsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsWriter::write_line(const nlohmann::json& object) {
  // Text from a model (a sample) may hold bytes that are not UTF-8: replaced (U+FFFD), never a throw.
  const std::string line = object.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  const ssize_t n = ::write(fd_, line.data(), line.size());
  MG_CHECK(n == static_cast<ssize_t>(line.size()), "metrics file '{}': write failed: {}", path_,
           n < 0 ? std::strerror(errno) : "short write");
}

Progress::Progress(int steps, int first) : steps_(steps), first_(first), tty_(::isatty(::fileno(stderr)) != 0) {}

void Progress::update(const StepMetrics& m, double shown_tokens_per_s, double shown_ms_per_step, double shown_mfu) {
  const int done = m.step;
  const double eta = m.elapsed_s / std::max(1, done - first_) * (steps_ - done);
  std::string mfu = shown_mfu >= 0 ? fmt::format(" | MFU {:4.1f}%", 100 * shown_mfu) : std::string();
  if (!m.expert_load.empty()) {
    // The busiest expert's share over the mean (1.00: balanced), the worst layer's.
    double worst = 0;
    for (const auto& layer : m.expert_load) {
      double total = 0, top = 0;
      for (const std::int64_t n : layer) {
        total += static_cast<double>(n);
        top = std::max(top, static_cast<double>(n));
      }
      if (total > 0) worst = std::max(worst, top * static_cast<double>(layer.size()) / total);
    }
    mfu += fmt::format(" | load max/mean {:.2f}", worst);
    if (m.aux_loss > 0) mfu += fmt::format(" | aux {:.3f}", m.aux_loss);
  }
  const std::string stats = fmt::format(
      "step {:>{}}/{} | loss {:.4f} | {:7.1f} ms/step | {:>7.0f} tok/s{} | lr {:.2e} | {:.1f}s | eta {:.0f}s", done,
      std::to_string(steps_).size(), steps_, m.loss, shown_ms_per_step, shown_tokens_per_s, mfu, m.lr, m.elapsed_s, eta);
  if (tty_) {
    constexpr int width = 24;
    const int filled = static_cast<int>(static_cast<double>(width) * done / steps_);
    std::string bar(static_cast<std::size_t>(filled), '=');
    if (filled < width) bar += '>';
    bar.resize(width, ' ');
    fmt::print(stderr, "\r[{}] {}\033[K", bar, stats);
    if (done == steps_) fmt::print(stderr, "\n");
  } else {
    const int every = std::max(1, steps_ / 20);
    if (done - 1 == first_ || done % every == 0 || done == steps_) fmt::print(stderr, "{}\n", stats);
  }
  std::fflush(stderr);
}

void Progress::print_line(const std::string& line) {
  // On a terminal: clear the bar's line, print, and let the next update redraw the bar below.
  fmt::print(stderr, "{}{}\n", tty_ ? "\r\033[K" : "", line);
  std::fflush(stderr);
}

}  // namespace meshgrad::train
