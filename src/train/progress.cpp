// The metrics file and the progress display of a run (contracts in progress.hpp).
#include "progress.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>
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

std::string peak_cache_path() {
  const auto env = [](const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr ? std::string(v) : std::string();
  };
  std::string dir = env("MESHGRAD_CACHE_DIR");
  if (dir == "off") return "";
  if (dir.empty() && !env("XDG_CACHE_HOME").empty()) dir = env("XDG_CACHE_HOME") + "/meshgrad";
  if (dir.empty() && !env("HOME").empty()) dir = env("HOME") + "/.cache/meshgrad";
  return dir.empty() ? "" : dir + "/peak-gflops.json";
}

namespace {

// What one rank's peak depends on: the machine (CPU model, cores), the kernels and libraries, the
// precision and the BLAS threads the probe runs with.
std::string peak_key(DType operands) {
  std::string cpu;
  std::ifstream info("/proc/cpuinfo");
  for (std::string line; std::getline(info, line);) {
    if (line.rfind("model name", 0) == 0) {
      cpu = line.substr(line.find(':') + 1);
      break;
    }
  }
  return fmt::format("{} | {} cores | {} | {} | {} | {} threads", cpu, std::thread::hardware_concurrency(),
                     blas::kernel_core(), blas::gemm_core(), dtype_name(operands), blas::num_threads());
}

nlohmann::json read_cache(const std::string& path) {
  std::ifstream in(path);
  if (!in) return nlohmann::json::object();
  try {
    nlohmann::json j = nlohmann::json::parse(in);
    return j.is_object() ? j : nlohmann::json::object();
  } catch (const nlohmann::json::exception&) {
    return nlohmann::json::object();   // unreadable: measured again and written anew
  }
}

// Best effort: a cache that cannot be written costs the next run a measurement, nothing else.
void write_cache(const std::string& path, const nlohmann::json& cache) {
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  const std::string tmp = fmt::format("{}.{}.tmp", path, ::getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) return;
    out << cache.dump(2) << "\n";
    if (!out) return;
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) std::filesystem::remove(tmp, ec);
}

}  // namespace

PeakGflops measure_peak_gflops(DType dtype, const std::string& precision, int ranks) {
  // The run's own products: bf16 operands under --precision bf16, else the model's dtype.
  const DType operands = precision == "bf16" ? DType::BFloat16 : dtype;
  const std::string path = peak_cache_path();
  const std::string key = peak_key(operands);
  nlohmann::json cache = path.empty() ? nlohmann::json::object() : read_cache(path);
  if (cache.contains(key) && cache[key].is_number() && cache[key].get<double>() > 0) {
    return {cache[key].get<double>() * ranks, "cached in " + path};
  }
  double peak = blas::product_peak_gflops(operands, 1024, 4, blas::GemmLibrary::OpenBlas);
  // float32: the better of the two libraries (the run itself may be pinned to one of them).
  if (operands == DType::Float32 && blas::onednn_built())
    peak = std::max(peak, blas::product_peak_gflops(operands, 1024, 4, blas::GemmLibrary::OneDnn));
  if (!path.empty()) {
    cache[key] = peak;
    write_cache(path, cache);
  }
  return {peak * ranks, "measured"};
}

double eta_seconds(const std::vector<double>& recent_ms, int steps_left) {
  if (recent_ms.empty()) return -1;
  std::vector<double> sorted = recent_ms;
  std::sort(sorted.begin(), sorted.end());
  const std::size_t n = sorted.size();
  const double median = n % 2 == 1 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
  return median / 1000.0 * std::max(0, steps_left);
}

std::string format_duration(double seconds) {
  if (seconds < 0) return "--";
  const auto s = static_cast<long long>(seconds + 0.5);
  if (s < 60) return fmt::format("{}s", s);
  if (s < 3600) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}h{:02}m", s / 3600, (s % 3600) / 60);
}

std::string fit_to_width(const std::vector<ProgressField>& fields, int width) {
  std::vector<bool> kept(fields.size(), true);
  const auto join = [&] {
    std::string line;
    for (std::size_t i = 0; i < fields.size(); ++i) {
      if (!kept[i] || fields[i].text.empty()) continue;
      if (!line.empty()) line += " | ";
      line += fields[i].text;
    }
    return line;
  };
  std::string line = join();
  while (width > 0 && static_cast<int>(line.size()) > width) {
    int worst = 0;
    std::size_t drop = fields.size();
    for (std::size_t i = 0; i < fields.size(); ++i) {
      if (kept[i] && fields[i].drop_order > worst) {
        worst = fields[i].drop_order;
        drop = i;
      }
    }
    if (drop == fields.size()) return line.substr(0, static_cast<std::size_t>(width));   // only the essentials left
    kept[drop] = false;
    line = join();
  }
  return line;
}

int terminal_width() {
  if (::isatty(::fileno(stderr)) == 0) return 0;
  struct winsize ws {};
  if (::ioctl(::fileno(stderr), TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  const char* columns = std::getenv("COLUMNS");
  return columns != nullptr ? std::max(0, std::atoi(columns)) : 0;
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
  constexpr std::size_t kRecentSteps = 8;
  const int done = m.step;
  // The run's first step is dropped once a later one is known (eta_seconds).
  if (recent_ms_.size() == 1 && done == first_ + 2) recent_ms_.clear();
  recent_ms_.push_back(m.ms_per_step);
  if (recent_ms_.size() > kRecentSteps) recent_ms_.erase(recent_ms_.begin());
  const double eta = eta_seconds(recent_ms_, steps_ - done);
  std::vector<ProgressField> fields{
      {fmt::format("step {:>{}}/{}", done, std::to_string(steps_).size(), steps_), 0},
      {fmt::format("loss {:.4f}", m.loss), 0},
      {fmt::format("{:7.1f} ms/step", shown_ms_per_step), 3},
      {fmt::format("{:>7.0f} tok/s", shown_tokens_per_s), 4},
      {shown_mfu >= 0 ? fmt::format("MFU {:4.1f}%", 100 * shown_mfu) : std::string(), 2}};
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
    fields.push_back({fmt::format("load max/mean {:.2f}", worst), 2});
    if (m.aux_loss > 0) fields.push_back({fmt::format("aux {:.3f}", m.aux_loss), 5});
  }
  fields.push_back({fmt::format("lr {:.2e}", m.lr), 5});
  fields.push_back({m.elapsed_s < 60 ? fmt::format("{:.1f}s", m.elapsed_s) : format_duration(m.elapsed_s), 6});
  fields.push_back({"eta " + format_duration(eta), 1});
  if (tty_) {
    constexpr int bar_width = 24;
    const int filled = static_cast<int>(static_cast<double>(bar_width) * done / steps_);
    std::string bar(static_cast<std::size_t>(filled), '=');
    if (filled < bar_width) bar += '>';
    bar.resize(bar_width, ' ');
    fields.insert(fields.begin(), {"[" + bar + "]", 7});
    // The width is read at every update: a resized terminal is followed. One column is left free
    // (a line of exactly the width wraps on some terminals).
    const int width = terminal_width();
    fmt::print(stderr, "\r{}\033[K", fit_to_width(fields, width > 1 ? width - 1 : 0));
    if (done == steps_) fmt::print(stderr, "\n");
  } else {
    const int every = std::max(1, steps_ / 20);
    if (done - 1 == first_ || done % every == 0 || done == steps_) fmt::print(stderr, "{}\n", fit_to_width(fields, 0));
  }
  std::fflush(stderr);
}

void Progress::print_line(const std::string& line) {
  // On a terminal: clear the bar's line, print, and let the next update redraw the bar below.
  fmt::print(stderr, "{}{}\n", tty_ ? "\r\033[K" : "", line);
  std::fflush(stderr);
}

}  // namespace meshgrad::train
