// The metrics file and the progress display of a run (contracts in progress.hpp).
#include "progress.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad::train {

// The metrics file's first line: {"type": "header", the provenance, "mesh", "data", "config": every
// option that shapes the run}. Step lines follow, one object each.
nlohmann::json metrics_header(const TrainOptions& o, const nn::ModelConfig& m, const dist::DeviceMesh& mesh,
                              const data::TokenDataset& dataset) {
  nlohmann::json h{{"type", "header"}, {"mesh", mesh.str()}, {"data", dataset.source()}};
  for (const auto& [key, value] : o.provenance) h[key] = value;
  h["blas_kernels"] = blas::kernel_core();   // the bits of a run depend on the GEMM kernels
  h["config"] = {{"model",
                  {{"layers", m.layers}, {"hidden", m.hidden}, {"ffn", m.ffn_size()}, {"heads", m.heads},
                   {"vocab", m.vocab}, {"positions", m.n_positions()}, {"seq", m.seq}, {"batch", m.batch},
                   {"dropout", m.dropout}, {"dtype", dtype_name(m.dtype)}}},
                 {"parallel",
                  {{"sequence_parallel", o.parallel.sequence_parallel}, {"overlap", o.parallel.overlap},
                   {"regather", o.parallel.recompute_allgather}, {"checkpoint_blocks", o.parallel.checkpoint_blocks},
                   {"tp_invariant", o.parallel.tp_invariant}, {"invariant_blocks", o.parallel.invariant_blocks},
                   {"reshard_after_forward", o.parallel.reshard_after_forward},
                   {"shard_optimizer", o.parallel.shard_optimizer}, {"pp_layers", o.parallel.pp_layers},
                   {"pp_schedule", o.pp_schedule}}},
                 {"steps", o.steps}, {"lr", o.lr}, {"warmup_steps", o.warmup_steps}, {"min_lr_ratio", o.min_lr_ratio},
                 {"weight_decay", o.weight_decay}, {"seed", o.seed}, {"grad_clip", o.grad_clip},
                 {"grad_accum", o.grad_accum}, {"eval_every", o.eval_every}, {"eval_steps", o.eval_steps}};
  return h;
}

nlohmann::json metrics_line(const StepMetrics& m) {
  nlohmann::json line{{"step", m.step},     {"loss", m.loss},           {"tokens_per_s", m.tokens_per_s},
                      {"gflops", m.gflops}, {"elapsed_s", m.elapsed_s}, {"lr", m.lr},
                      {"grad_norm", m.grad_norm}};
  if (m.evaluated) line["val_loss"] = m.val_loss;
  return line;
}

MetricsWriter::MetricsWriter(const std::string& path, bool append) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
  MG_CHECK(fd_ >= 0, "metrics file '{}' cannot be opened for writing: {}", path, std::strerror(errno));
  struct stat st {};
  std::string problem;
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode))
    problem = "is not a regular file";
  else if (!append && ::ftruncate(fd_, 0) != 0)
    problem = fmt::format("cannot be truncated: {}", std::strerror(errno));
  if (!problem.empty()) {
    ::close(fd_);
    throw InvalidArgument(fmt::format("metrics file '{}' {}", path, problem));
  }
}

MetricsWriter::~MetricsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsWriter::write_line(const nlohmann::json& object) {
  const std::string line = object.dump() + "\n";
  const ssize_t n = ::write(fd_, line.data(), line.size());
  MG_CHECK(n == static_cast<ssize_t>(line.size()), "metrics file '{}': write failed: {}", path_,
           n < 0 ? std::strerror(errno) : "short write");
}

Progress::Progress(int steps, int first) : steps_(steps), first_(first), tty_(::isatty(::fileno(stderr)) != 0) {}

void Progress::update(int step, double loss, double tokens_per_s, double gflops, double lr, double elapsed, double val_loss) {
  const int done = step + 1;
  const double eta = elapsed / std::max(1, done - first_) * (steps_ - done);
  const std::string val = val_loss >= 0 ? fmt::format(" | val {:.4f}", val_loss) : std::string();
  const std::string stats =
      fmt::format("step {:>{}}/{} | loss {:.4f}{} | {:>7.0f} tok/s | {:6.2f} GFLOP/s | lr {:.2e} | {:.1f}s | eta {:.0f}s",
                  done, std::to_string(steps_).size(), steps_, loss, val, tokens_per_s, gflops, lr, elapsed, eta);
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
    if (step == first_ || done % every == 0 || done == steps_) fmt::print(stderr, "{}\n", stats);
  }
  std::fflush(stderr);
}

}  // namespace meshgrad::train
