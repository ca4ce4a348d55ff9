#include "meshgrad/train/trainer.hpp"

#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/nn/layers.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/optim/grad_norm.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <csignal>
#include <cstring>
#include <deque>
#include <filesystem>
#include <optional>
#include <nlohmann/json.hpp>
#include <numbers>

#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/tree_collectives.hpp"
#include "meshgrad/ops/tree_reduce.hpp"
#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/trace.hpp"
#include "meshgrad/checkpoint/parameter_file.hpp"
#include "meshgrad/checkpoint/store.hpp"
#include "meshgrad/train/run_config.hpp"
#include "meshgrad/train/stop_signal.hpp"
#include "meshgrad/data/dataset.hpp"
#include "meshgrad/interop/gpt2_config.hpp"
#include "meshgrad/optim/grad_sync.hpp"
#include "meshgrad/interop/hf_io.hpp"
#include "meshgrad/optim/adamw.hpp"
#include "meshgrad/io/output_path.hpp"

namespace meshgrad::train {

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// This rank's place on the data-parallel axis (a mesh without "dp" is one replica).
struct DpPlace {
  int rank = 0;
  int size = 1;
  const dist::ProcessGroup* group = nullptr;
};
DpPlace dp_place(const dist::DeviceMesh& mesh) {
  if (!mesh.has_axis("dp")) return {};
  return {mesh.coordinate("dp"), mesh.axis_size("dp"), &mesh.group("dp")};
}

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
                   {"tp_invariant", o.parallel.tp_invariant}, {"invariant_blocks", o.parallel.invariant_blocks}}},
                 {"steps", o.steps}, {"lr", o.lr}, {"warmup_steps", o.warmup_steps}, {"min_lr_ratio", o.min_lr_ratio},
                 {"weight_decay", o.weight_decay}, {"seed", o.seed}, {"grad_clip", o.grad_clip},
                 {"grad_accum", o.grad_accum}, {"eval_every", o.eval_every}, {"eval_steps", o.eval_steps}};
  return h;
}

// The global loss: the sum over dp of each replica's share (each rank's loss is replicated over tp).
// Declared as Phase::Optimizer so communication counts of forward/backward stay those of the model.
// TP-invariant mode: in the fixed tree (dist::tree_all_reduce), so the reported loss has the same
// bits at every dp x tp with the same dp x grad-accum.
double global_loss(const Tensor& local_loss, const DpPlace& dp, bool tree) {
  dist::PhaseScope phase(dist::Phase::Optimizer);
  const Tensor l = local_loss.detach();
  if (dp.size == 1) return l.item();
  if (tree) return dist::tree_all_reduce(l, *dp.group).item();
  return dist::all_reduce(l, *dp.group, comm::ReduceOp::Sum).item();
}

// Appends JSON lines to a file. Each line goes out in one write(2) on an O_APPEND descriptor, so a
// reader (tail -f, a dashboard) never sees a partial line, and nothing is buffered in the process.
// The file is written in place (not through a temporary) so that it can be followed during the run;
// check_output_paths has made sure it is absent or a regular file that is not an input, and
// O_NOFOLLOW + the type check below hold that even if it changed since.
class MetricsWriter {
 public:
  // append: keep what the file holds (a resumed run continues its metrics); else start it empty.
  MetricsWriter(const std::string& path, bool append) : path_(path) {
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
  ~MetricsWriter() {
    if (fd_ >= 0) ::close(fd_);
  }
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  void write_line(const nlohmann::json& object) {
    const std::string line = object.dump() + "\n";
    const ssize_t n = ::write(fd_, line.data(), line.size());
    MG_CHECK(n == static_cast<ssize_t>(line.size()), "metrics file '{}': write failed: {}", path_,
             n < 0 ? std::strerror(errno) : "short write");
  }

 private:
  std::string path_;
  int fd_ = -1;
};

// Rank 0's progress display on stderr: a bar redrawn in place on a terminal; on a pipe or file one
// line every ~5% of the steps (plus the first and the last), so logs stay readable.
class Progress {
 public:
  // first: the 0-based step the run starts at (a resumed run's checkpoint step).
  Progress(int steps, int first) : steps_(steps), first_(first), tty_(::isatty(::fileno(stderr)) != 0) {}

  // val_loss < 0: no evaluation yet. The ETA is the mean step time so far times the steps left.
  void update(int step, double loss, double tokens_per_s, double gflops, double lr, double elapsed, double val_loss) {
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

 private:
  int steps_;
  int first_;
  bool tty_;
};

std::string signal_name(int sig) { return sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : fmt::format("signal {}", sig); }

}  // namespace

// The training state a checkpoint holds as tensors: every parameter's piece and its AdamW moments
// (zeros before the first update: the same as AdamW's lazily created ones), by name.
std::vector<checkpoint::StateTensor> training_state_tensors(const std::vector<nn::Parameter*>& params, const optim::AdamW& opt) {
  std::vector<checkpoint::StateTensor> out;
  for (const nn::Parameter* p : params) out.push_back({p->name, p->full_shape, p->placements, p->value});
  for (const char* kind : {"exp_avg", "exp_avg_sq"}) {
    for (std::size_t i = 0; i < params.size(); ++i) {
      const nn::Parameter& p = *params[i];
      Tensor m = std::string(kind) == "exp_avg" ? opt.exp_avg(i) : opt.exp_avg_sq(i);
      if (!m.defined()) m = Tensor::zeros(p.value.shape(), p.value.dtype());
      out.push_back({fmt::format("optimizer.{}.{}", kind, p.name), p.full_shape, p.placements, m});
    }
  }
  return out;
}

int load_training_state(const std::string& dir, const checkpoint::Manifest& manifest, nn::Model& model, optim::AdamW& opt, StateLoad how) {
  const std::vector<nn::Parameter*> params = model.parameters();
  std::vector<checkpoint::PieceRequest> requests;
  for (const nn::Parameter* p : params) requests.push_back({p->name, p->full_shape, p->layout(), p->value.dtype()});
  for (const char* kind : {"exp_avg", "exp_avg_sq"}) {
    for (const nn::Parameter* p : params)
      requests.push_back({fmt::format("optimizer.{}.{}", kind, p->name), p->full_shape, p->layout(), p->value.dtype()});
  }
  // The scalars first: a checkpoint without them is refused before any tensor is read.
  const nlohmann::json& state = manifest.state;
  std::int64_t optimizer_steps = 0, step = 0;
  std::uint64_t random_state = 0;
  try {
    optimizer_steps = state.at("optimizer_steps").get<std::int64_t>();
    step = state.at("step").get<std::int64_t>();
    random_state = state.at("random_state").get<std::uint64_t>();
  } catch (const std::exception& e) {
    throw checkpoint::CheckpointError(fmt::format("checkpoint '{}': its state lacks the optimizer step, the step or the random state: {}", dir, e.what()));
  }
  MG_CHECK(step == manifest.step && step >= 0 && step <= INT32_MAX, "checkpoint '{}': state step {} differs from the manifest's {}",
           dir, step, manifest.step);
  MG_CHECK(optimizer_steps >= 0, "checkpoint '{}': optimizer step count {} is negative", dir, optimizer_steps);
  const std::size_t n = params.size();
  autograd::NoGradGuard no_grad;
  if (how == StateLoad::in_place) {
    std::vector<Tensor> targets;
    targets.reserve(3 * n);
    for (const nn::Parameter* p : params) {
      MG_CHECK(p->value.is_contiguous(), "load_training_state: parameter '{}' is not contiguous", p->name);
      targets.push_back(p->value.detach());
    }
    for (Tensor& moment : opt.materialize_moments()) targets.push_back(std::move(moment));
    checkpoint::read_pieces_into(dir, manifest, requests, targets);
    opt.set_steps(optimizer_steps);
  } else {
    const std::vector<Tensor> loaded = checkpoint::read_pieces(dir, manifest, requests);
    std::vector<Tensor> m(loaded.begin() + static_cast<std::ptrdiff_t>(n), loaded.begin() + static_cast<std::ptrdiff_t>(2 * n));
    std::vector<Tensor> v(loaded.begin() + static_cast<std::ptrdiff_t>(2 * n), loaded.end());
    opt.load_state(optimizer_steps, m, v);   // checks before it changes anything
    for (std::size_t i = 0; i < n; ++i) params[i]->value.detach().copy_from(loaded[i]);
  }
  model.set_random_state(random_state);
  return static_cast<int>(step);
}

namespace {
// Steps averaged for the start / end loss: a quarter of the run, 1 to 10 steps.
std::size_t loss_window(std::size_t steps) { return std::clamp<std::size_t>(steps / 4, 1, 10); }
}  // namespace

double TrainResult::start_loss() const {
  const std::size_t n = std::min(loss_window(losses.size()), losses.size());
  if (n == 0) return 0;
  double s = 0;
  for (std::size_t i = 0; i < n; ++i) s += losses[i];
  return s / static_cast<double>(n);
}

double TrainResult::end_loss() const {
  const std::size_t n = std::min(loss_window(losses.size()), losses.size());
  if (n == 0) return 0;
  double s = 0;
  for (std::size_t i = losses.size() - n; i < losses.size(); ++i) s += losses[i];
  return s / static_cast<double>(n);
}

double learning_rate(const TrainOptions& o, int step) {
  if (o.warmup_steps > 0 && step < o.warmup_steps) return o.lr * (step + 1) / o.warmup_steps;
  const int decay_steps = o.steps - 1 - std::max(0, o.warmup_steps);
  if (decay_steps <= 0) return o.lr;
  const double progress = std::clamp(static_cast<double>(step - std::max(0, o.warmup_steps)) / decay_steps, 0.0, 1.0);
  const double min_lr = o.lr * o.min_lr_ratio;
  return min_lr + 0.5 * (o.lr - min_lr) * (1.0 + std::cos(std::numbers::pi * progress));
}

std::int64_t count_parameters(const std::vector<nn::Parameter*>& params) {
  std::int64_t n = 0;
  for (const nn::Parameter* p : params) n += shape_numel(p->full_shape);
  return n;
}

double model_flops_per_token(const nn::ModelConfig& c, std::int64_t n_params_without_wpe) {
  return 6.0 * static_cast<double>(n_params_without_wpe) +
         12.0 * static_cast<double>(c.layers) * static_cast<double>(c.seq) * static_cast<double>(c.hidden);
}

// The mean global loss over the first `batches` validation batches: no dropout, nothing recorded,
// the same batches at every evaluation and on every rank (TokenDataset::validation_batch).
// TP-invariant mode: each replica's rows in micro_batches pieces whose losses are added in the
// fixed tree, then the tree over dp, as train_step does (the same bits for every dp x tp with the
// same dp x micro_batches).
double evaluate(nn::Model& model, const data::TokenDataset& dataset, int batches, int dp_rank, int dp_size,
                const dist::ProcessGroup* dp_group, int micro_batches) {
  trace::Span span("evaluate", "evaluate");
  autograd::NoGradGuard no_grad;
  model.set_training(false);
  const std::int64_t n = std::min<std::int64_t>(batches, dataset.validation_batches());
  double total = 0;
  for (std::int64_t k = 0; k < n; ++k) {
    const nn::Batch global_batch = dataset.validation_batch(k);
    const nn::Batch share = data::dp_shard(global_batch, dp_rank, dp_size);
    const std::int64_t targets = count_loss_targets(global_batch.targets);
    Tensor local;
    if (model.tp_invariant()) {
      tree::StreamingSum losses;
      for (int k = 0; k < micro_batches; ++k) losses.push({model.loss(data::dp_shard(share, k, micro_batches), targets)});
      local = losses.root().front();
    } else {
      local = model.loss(share, targets);
    }
    dist::PhaseScope phase(dist::Phase::Optimizer);   // not the model's training communication
    if (dp_size == 1) {
      total += local.item();
    } else {
      total += model.tp_invariant() ? dist::tree_all_reduce(local, *dp_group).item()
                                    : dist::all_reduce(local, *dp_group, comm::ReduceOp::Sum).item();
    }
  }
  model.set_training(true);
  return total / static_cast<double>(n);
}

void check_invariant_batch_split(std::int64_t rows, int dp_size, int grad_accum) {
  const std::int64_t blocks = std::int64_t{dp_size} * grad_accum;
  MG_CHECK(tree::is_power_of_two(dp_size) && tree::is_power_of_two(grad_accum),
           "--tp-invariant: dp={} and --grad-accum {} must be powers of two (the micro-batches and the dp replicas are "
           "added in a fixed binary tree)", dp_size, grad_accum);
  MG_CHECK(rows % blocks == 0,
           "--tp-invariant: the global batch of {} rows must divide into dp x grad-accum = {} x {} = {} micro-batches of "
           "equal rows, so that every mesh with the same dp x grad-accum sums the same micro-batches; use a --batch "
           "that is a multiple of {}", rows, dp_size, grad_accum, blocks, blocks);
}

namespace {

// TP-invariant mode: K micro-batches of this replica's rows, each backpropagated on its own, their
// gradients (and losses) added in the fixed binary tree rather than accumulated one after the other,
// then reduced over dp by the synchroniser in the same tree (GradSyncOptions::tree_dp). The global
// batch is thus a tree over dp x K micro-batches of equal rows whose shape does not depend on the
// mesh: dp=2 with K=1 adds the same two micro-batches in the same order as dp=1 with K=2. Returns
// the tree sum of the micro-batches' losses (this replica's share of the global loss).
Tensor accumulate_in_tree(nn::Model& model, const nn::Batch& batch, std::int64_t targets,
                          const std::vector<nn::Parameter*>& params, optim::GradientSynchronizer& sync, int grad_accum) {
  if (grad_accum == 1) {   // one micro-batch: the hooks reduce during backward, as in the normal mode
    sync.set_accumulating(false);
    const Tensor loss = model.loss(batch, targets);
    backward(loss);
    return loss.detach();
  }
  sync.set_accumulating(true);
  tree::StreamingSum grads, losses;
  std::vector<dist::AxisMask> partial(params.size(), 0);
  // Every micro-batch draws the dropout seeds of one forward of the whole batch: masks depend on the
  // seed and the global row, so its rows get the masks they get at K = 1 (and on a dp replica).
  const std::uint64_t dropout_start = model.random_state();
  for (int k = 0; k < grad_accum; ++k) {
    model.set_random_state(dropout_start);
    const Tensor loss = model.loss(data::dp_shard(batch, k, grad_accum), targets);
    backward(loss);
    std::vector<Tensor> micro(params.size());
    for (std::size_t i = 0; i < params.size(); ++i) {
      micro[i] = params[i]->value.grad();
      if (micro[i].defined()) partial[i] = dist::partial_axes(micro[i]);
      params[i]->value.set_grad(Tensor());   // the next micro-batch starts from no gradient
    }
    grads.push(std::move(micro));
    losses.push({loss.detach()});
  }
  const std::vector<Tensor>& total = grads.root();
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (!total[i].defined()) continue;
    dist::set_partial_axes(total[i], partial[i]);   // the sum is partial where its terms were (dp)
    params[i]->value.set_grad(total[i]);
  }
  sync.reduce_gradients();
  return losses.root().front();
}

}  // namespace

StepOutcome train_step(nn::Model& model, const nn::Batch& global_batch, const dist::DeviceMesh& mesh,
                       optim::GradientSynchronizer& sync, optim::AdamW& optimizer, double grad_clip, int grad_accum) {
  const int dp_rank = mesh.has_axis("dp") ? mesh.coordinate("dp") : 0;
  const int dp_size = mesh.has_axis("dp") ? mesh.axis_size("dp") : 1;
  optimizer.zero_grad();
  const nn::Batch batch = data::dp_shard(global_batch, dp_rank, dp_size);
  MG_CHECK(grad_accum >= 1 && grad_accum <= batch.inputs.size(0),
           "train: --grad-accum {} needs at least that many rows per dp replica, and this replica has {} (--batch {} "
           "over dp={})", grad_accum, batch.inputs.size(0), global_batch.inputs.size(0), dp_size);
  // The mean over the non-ignored targets of the whole global batch (byte tokens never are).
  const std::int64_t targets = count_loss_targets(global_batch.targets);
  StepOutcome out;
  const std::vector<nn::Parameter*> params = model.parameters();
  if (model.tp_invariant()) {
    check_invariant_batch_split(global_batch.inputs.size(0), dp_size, grad_accum);
    out.loss = accumulate_in_tree(model, batch, targets, params, sync, grad_accum);
  } else {
    const std::uint64_t dropout_start = model.random_state();
    for (int k = 0; k < grad_accum; ++k) {
      const nn::Batch micro = grad_accum == 1 ? batch : data::dp_shard(batch, k, grad_accum);
      model.set_random_state(dropout_start);   // the global batch's masks (see accumulate_in_tree)
      sync.set_accumulating(k + 1 < grad_accum);   // reduce once, after the last micro-batch
      const Tensor loss = model.loss(micro, targets);
      backward(loss);
      out.loss = k == 0 ? loss.detach() : add(out.loss, loss.detach());
    }
  }
  sync.finish();
  out.grad_norm = grad_clip > 0 ? optim::clip_grad_norm(params, mesh, grad_clip, model.tp_invariant())
                                : optim::global_grad_norm(params, mesh, model.tp_invariant());
  optimizer.step();
  return out;
}

TrainResult train(const TrainOptions& options, const dist::DeviceMeshPtr& mesh) {
  MG_CHECK(mesh != nullptr, "train: no mesh");
  MG_CHECK(options.steps >= 1, "train: --steps must be >= 1, got {}", options.steps);
  MG_CHECK(options.lr > 0, "train: --lr must be > 0, got {}", options.lr);
  nn::ModelConfig config = options.model;
  const DpPlace dp = dp_place(*mesh);
  const bool leader = mesh->rank() == 0;
  MG_CHECK(config.batch >= dp.size, "train: the global batch ({} rows) must have at least one row per dp replica "
           "(dp={})", config.batch, dp.size);
  if (options.parallel.tp_invariant) check_invariant_batch_split(config.batch, dp.size, options.grad_accum);

  // Everything that can fail on a user's input fails before the first step: the data (only read),
  // then the outputs (a run must not train for hours and then find that --save cannot be written,
  // or overwrite a file it reads: every file behind --data counts).
  const data::TokenDataset dataset(options.data_path, config.batch, config.seq, options.seed);
  MG_CHECK(options.init_from.empty() || options.resume_dir.empty(), "train: --init-from and --resume both give the "
           "starting weights: give one (a resumed run continues from its checkpoint)");
  if (!options.init_from.empty()) config = interop::hf_init_config(options.init_from, config, leader && options.progress);
  if (config.vocab <= 0) config.vocab = static_cast<int>(dataset.vocab());
  MG_CHECK(options.grad_clip >= 0 && std::isfinite(options.grad_clip),
           "train: --grad-clip must be >= 0 (0 = off), got {}", options.grad_clip);
  MG_CHECK(options.eval_every >= 0 && options.eval_steps >= 1, "train: --eval-every must be >= 0 and --eval-steps >= 1, "
           "got {} and {}", options.eval_every, options.eval_steps);
  MG_CHECK(options.eval_every == 0 || dataset.has_validation(),
           "train: --eval-every needs a validation split, and the data {} has none: give --data a directory written by "
           "`meshgrad prepare` (its val.bin)", dataset.source());
  dataset.require_tokens_below(config.vocab, fmt::format("the model's vocabulary size {}", config.vocab));
  std::vector<io::NamedPath> outputs;
  if (!options.save_path.empty()) outputs.push_back({"--save", options.save_path});
  if (!options.metrics_path.empty()) outputs.push_back({"--metrics", options.metrics_path});
  if (!options.trace_path.empty()) outputs.push_back({"--trace", options.trace_path});
  std::vector<io::NamedPath> inputs;
  for (const std::string& f : dataset.input_files()) inputs.push_back({"--data", f});
  io::check_output_paths(outputs, inputs);
  MG_CHECK(options.save_every >= 0 && options.keep >= 0, "train: --save-every and --keep must be >= 0, got {} and {}",
           options.save_every, options.keep);
  MG_CHECK(options.save_every == 0 || !options.checkpoint_dir.empty(), "train: --save-every needs --checkpoint-dir");
  MG_CHECK(options.keep == 0 || !options.checkpoint_dir.empty(), "train: --keep needs --checkpoint-dir");
  if (!options.checkpoint_dir.empty()) {
    std::vector<io::NamedPath> dirs = inputs;
    if (!options.data_path.empty()) dirs.push_back({"--data", options.data_path});
    io::check_output_directory({"--checkpoint-dir", options.checkpoint_dir}, dirs, outputs);
  }
  // A resumed run: the checkpoint's manifest (its tensors load after the model is built).
  std::optional<checkpoint::Manifest> resume;
  if (!options.resume_dir.empty()) {
    resume = checkpoint::read_manifest(options.resume_dir);
    const nlohmann::json& saved_data = resume->state.value("data", nlohmann::json::object());
    const std::int64_t saved_tokens = saved_data.value("tokens", std::int64_t{-1});
    MG_CHECK(options.given_options.count("data") > 0 || saved_tokens == dataset.size(),
             "train: the data {} holds {} training tokens but checkpoint '{}' was trained on {} tokens of {}: the file "
             "changed; give --data explicitly to go on with other data", dataset.source(), dataset.size(), options.resume_dir,
             saved_tokens, saved_data.value("source", std::string("?")));
    MG_CHECK(resume->step < options.steps, "train: checkpoint '{}' was taken after step {}, and --steps is {}: nothing "
             "left to train (give a larger --steps)", options.resume_dir, resume->step, options.steps);
  }
  std::unique_ptr<MetricsWriter> metrics;
  if (leader && !options.metrics_path.empty()) {
    metrics = std::make_unique<MetricsWriter>(options.metrics_path, resume.has_value());
    nlohmann::json header = metrics_header(options, config, *mesh, dataset);
    if (resume) {
      header["resumed_from"] = options.resume_dir;
      header["first_step"] = resume->step + 1;
    }
    metrics->write_line(header);
  }

  std::unique_ptr<nn::Model> model = nn::make_model(config, options.parallel, mesh, options.seed);
  model->set_training(true);
  const std::vector<nn::Parameter*> params = model->parameters();
  if (!options.init_from.empty()) interop::hf_load_parameters(options.init_from, params, nn::tensor_parallel_group(*mesh));
  optim::GradientSynchronizer sync(params, mesh, {.tree_dp = options.parallel.tp_invariant});
  optim::AdamW opt(params, mesh, optim::AdamWOptions{options.lr, 0.9, 0.95, 1e-8, options.weight_decay});

  TrainResult result;
  // In place: the model and optimizer were built for this resume, and an error stops the run before
  // its first step, so a half-read state is never used.
  if (resume) result.first_step = load_training_state(options.resume_dir, *resume, *model, opt, StateLoad::in_place);
  const int first_step = result.first_step;
  std::unique_ptr<checkpoint::CheckpointSaver> saver;
  if (!options.checkpoint_dir.empty()) saver = std::make_unique<checkpoint::CheckpointSaver>(options.checkpoint_dir, mesh, options.keep);
  std::optional<StopSignalScope> signals;
  if (saver && options.handle_signals) signals.emplace();
  result.parameters = count_parameters(params);
  std::int64_t wpe = 0;
  for (const nn::Parameter* p : params) {
    if (p->name == "wpe.weight") wpe = shape_numel(p->full_shape);
  }
  const double flops_per_token = model_flops_per_token(config, result.parameters - wpe);
  const std::int64_t tokens_per_step = static_cast<std::int64_t>(config.batch) * config.seq;

  if (leader && options.progress) {
    fmt::print(stderr,
               "meshgrad train: gpt layers={} hidden={} heads={} seq={} batch={} ({} parameters, {}) on {} "
               "[{}{}{}{}], {} steps, lr {:g}, data: {} ({}, {} tokens, vocab {})\n",
               config.layers, config.hidden, config.heads, config.seq, config.batch, result.parameters,
               dtype_name(config.dtype), mesh->str(), options.parallel.sequence_parallel ? "sequence-parallel" : "all-reduce",
               options.parallel.overlap ? ", overlap" : "", options.parallel.checkpoint_blocks ? ", checkpoint-blocks" : "",
               options.parallel.tp_invariant ? ", tp-invariant" : "",
               options.steps, options.lr, dataset.source(), dataset.description(), dataset.size(), dataset.vocab());
    fmt::print(stderr, "compute: {}, {}; {}\n", blas::thread_policy(), blas::idle_wait_policy(),
               blas::kernel_description());   // policy set by whoever launched the ranks
    if (resume) fmt::print(stderr, "resumed from {} (after step {})\n", options.resume_dir, first_step);
  }
  Progress progress(options.steps, first_step);
  // Saves the state after `done` steps (every rank; collective).
  const auto save_checkpoint = [&](int done, double lr, bool sync) {
    nlohmann::json state{{"config", run_config_json(options, config.vocab)},
                         {"step", done},
                         {"optimizer_steps", opt.steps()},
                         {"random_state", model->random_state()},
                         {"lr", lr},
                         {"mesh", mesh->str()},
                         {"data", {{"source", dataset.source()}, {"tokens", dataset.size()}, {"vocab", dataset.vocab()},
                                   {"description", dataset.description()}, {"next_batch", done}}}};
    // Where the tokenizer is (a prepared directory's meta.json), for `sample` and `export`.
    for (const std::string& f : dataset.input_files()) {
      if (fs::path(f).filename() == "meta.json") state["data"]["meta"] = fs::absolute(f).lexically_normal().string();
    }
    for (const auto& [key, value] : options.provenance) state["provenance"][key] = value;
    const Clock::time_point t0 = Clock::now();
    const checkpoint::SaveTimes times = saver->save(done, training_state_tensors(params, opt), state, !sync && !options.checkpoint_sync);
    result.checkpoint_stall_s += seconds_since(t0);
    ++result.checkpoints;
    return times;
  };
  std::deque<double> recent;   // step times of the last steps, for a steady rate on the display
  const Clock::time_point start = Clock::now();
  int last_saved = resume ? first_step : -1;
  for (int step = first_step; step < options.steps; ++step) {
    const Clock::time_point t0 = Clock::now();
    trace::Span step_span("step", "step");
    step_span.arg("step", std::int64_t{step + 1});
    const double lr = learning_rate(options, step);
    opt.set_lr(lr);
    const nn::Batch global_batch = dataset.next_batch(step);
    const StepOutcome outcome = train_step(*model, global_batch, *mesh, sync, opt, options.grad_clip, options.grad_accum);
    const double global = global_loss(outcome.loss, dp, options.parallel.tp_invariant);
    result.losses.push_back(global);
    MG_CHECK(std::isfinite(global), "train: the loss became {} at step {} (lr {:g}): lower --lr", global, step + 1, lr);
    if (options.eval_every > 0 && ((step + 1) % options.eval_every == 0 || step + 1 == options.steps)) {
      result.val_losses.emplace_back(step + 1, evaluate(*model, dataset, options.eval_steps, dp.rank, dp.size, dp.group,
                                                            options.parallel.tp_invariant ? options.grad_accum : 1));
    }

    if (leader) {
    const double dt = seconds_since(t0);
    const double elapsed = seconds_since(start);
    recent.push_back(dt);
    if (recent.size() > 10) recent.pop_front();
    double window = 0;
    for (double d : recent) window += d;
    const double shown_tps = static_cast<double>(tokens_per_step) * static_cast<double>(recent.size()) / window;
    const double tps = static_cast<double>(tokens_per_step) / dt;
    StepMetrics m{step + 1, global, tps, tps * flops_per_token * 1e-9, elapsed, lr, outcome.grad_norm};
    if (!result.val_losses.empty() && result.val_losses.back().first == step + 1) {
      m.evaluated = true;
      m.val_loss = result.val_losses.back().second;
    }
    if (metrics) {
      nlohmann::json line{{"step", m.step},           {"loss", m.loss},           {"tokens_per_s", m.tokens_per_s},
                          {"gflops", m.gflops},       {"elapsed_s", m.elapsed_s}, {"lr", m.lr},
                          {"grad_norm", m.grad_norm}};
      if (m.evaluated) line["val_loss"] = m.val_loss;
      metrics->write_line(line);
    }
    if (options.on_step) options.on_step(m);
    if (options.progress) {
      progress.update(step, global, shown_tps, shown_tps * flops_per_token * 1e-9, lr, elapsed,
                      result.val_losses.empty() ? -1.0 : result.val_losses.back().second);
    }
    }

    if (!saver) continue;
    const int done = step + 1;
    if (options.save_every > 0 && done % options.save_every == 0 && done < options.steps) {
      save_checkpoint(done, lr, false);
      last_saved = done;
    }
    // Preemption: the ranks agree on a stop request (a signal may land between two ranks' checks),
    // then all of them save and leave together.
    if (signals) {
      // A signal number is small: exact in a float reduction.
      double local = stop_requested(), reduced = 0;
      {
        dist::PhaseScope phase(dist::Phase::Optimizer);
        mesh->world()->all_reduce(comm::ConstBuffer{&local, 1, DType::Float64},
                                  comm::MutableBuffer{&reduced, 1, DType::Float64}, comm::ReduceOp::Max);
      }
      const int any = static_cast<int>(reduced);
      if (any != 0 && done < options.steps) {
        result.stopped_by = signal_name(any);
        if (last_saved != done) save_checkpoint(done, lr, true);
        last_saved = done;
        break;
      }
    }
  }
  if (saver) {
    if (last_saved != static_cast<int>(result.first_step + result.losses.size()))
      save_checkpoint(result.first_step + static_cast<int>(result.losses.size()), learning_rate(options, options.steps - 1), true);
    saver->wait();   // a save in flight completes before the run returns
    result.last_checkpoint = saver->last_committed();
  }
  result.seconds = seconds_since(start);
  result.tokens_per_s = static_cast<double>(tokens_per_step) * static_cast<double>(result.losses.size()) / result.seconds;
  result.gflops = result.tokens_per_s * flops_per_token * 1e-9;

  if (!options.save_path.empty() && dp.rank == 0) {
    // One tp group (dp coordinate 0) gathers and writes the full tensors; the replicas are identical.
    checkpoint::save_parameters(options.save_path, params, nn::tensor_parallel_group(*mesh), 0, interop::hf_checkpoint_metadata(config, dataset));
  }
  if (leader && options.progress) {
    fmt::print(stderr,
               "loss {:.4f} -> {:.4f} (mean of the first / last {} steps; step {}: {:.4f}, step {}: {:.4f}) in {:.1f} s, "
               "{:.0f} tokens/s, {:.2f} GFLOP/s\n",
               result.start_loss(), result.end_loss(), loss_window(result.losses.size()), result.first_step + 1,
               result.losses.front(),
               result.first_step + static_cast<int>(result.losses.size()), result.losses.back(), result.seconds,
               result.tokens_per_s, result.gflops);
    if (result.checkpoints > 0) {
      fmt::print(stderr, "checkpoints: {} written, training stalled {:.3f} s for them in all; newest: {}\n",
                 result.checkpoints, result.checkpoint_stall_s, result.last_checkpoint);
    }
    if (!result.stopped_by.empty()) {
      fmt::print(stderr, "meshgrad train: stopped by {} after step {} of {}; checkpoint {} (go on with: meshgrad train "
                 "--resume {})\n", result.stopped_by, result.first_step + result.losses.size(), options.steps,
                 result.last_checkpoint, options.checkpoint_dir);
    }
    if (!options.save_path.empty()) fmt::print(stderr, "saved parameters to {}\n", options.save_path);
    if (!options.metrics_path.empty()) fmt::print(stderr, "metrics written to {}\n", options.metrics_path);
  }
  return result;
}

std::int64_t count_loss_targets(const Tensor& targets) {
  MG_CHECK(targets.defined() && targets.dtype() == DType::Int64, "count_loss_targets: targets must be int64");
  const Tensor packed = targets.contiguous();
  const std::int64_t* t = packed.data<std::int64_t>();
  std::int64_t n = 0;
  for (std::int64_t i = 0; i < packed.numel(); ++i) n += t[i] != kIgnoreIndex ? 1 : 0;
  MG_CHECK(n > 0, "every one of the {} targets is {} (the ignore index): the mean loss over no tokens is undefined",
           packed.numel(), kIgnoreIndex);
  return n;
}

GradientDump compute_gradients(nn::Model& model, const nn::Batch& global_batch, const dist::DeviceMeshPtr& mesh) {
  MG_CHECK(mesh != nullptr, "compute_gradients: no mesh");
  MG_CHECK(global_batch.inputs.defined() && global_batch.inputs.dim() == 2,
           "compute_gradients: inputs must be int64 [B, T]");
  const DpPlace dp = dp_place(*mesh);
  const std::vector<nn::Parameter*> params = model.parameters();
  for (const nn::Parameter* p : params) {
    MG_CHECK(!p->value.grad().defined(), "compute_gradients: parameter '{}' already has a gradient", p->name);
  }
  optim::GradientSynchronizer sync(params, mesh, {.tree_dp = model.tp_invariant()});
  const std::int64_t global_tokens = count_loss_targets(global_batch.targets);
  const nn::Batch local = data::dp_shard(global_batch, dp.rank, dp.size);
  const Tensor loss = model.loss(local, global_tokens);
  backward(loss);
  sync.finish();
  GradientDump dump;
  dump.loss = global_loss(loss, dp, model.tp_invariant());
  dump.gradients = checkpoint::gather_gradients(params, nn::tensor_parallel_group(*mesh));
  return dump;
}

}  // namespace meshgrad::train
