// The training loop (contract in include/meshgrad/train/trainer.hpp): a Run checks its inputs and
// outputs before any work, builds the model, then steps, reports, saves and agrees on a stop.
#include "meshgrad/train/trainer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <deque>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <numbers>
#include <optional>

#include "meshgrad/checkpoint/parameter_file.hpp"
#include "meshgrad/checkpoint/directory.hpp"
#include "meshgrad/checkpoint/saver.hpp"
#include "meshgrad/comm/agreement.hpp"
#include "meshgrad/data/dataset.hpp"
#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/interop/checkpoint_model.hpp"
#include "meshgrad/interop/gpt2_config.hpp"
#include "meshgrad/interop/hf_io.hpp"
#include "meshgrad/io/output_path.hpp"
#include "meshgrad/nn/layers.hpp"
#include "meshgrad/nn/moe.hpp"
#include "meshgrad/optim/adamw.hpp"
#include "meshgrad/optim/grad_sync.hpp"
#include "meshgrad/pipeline/executor.hpp"
#include "meshgrad/pipeline/schedule.hpp"
#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/trace.hpp"
#include "meshgrad/train/run_config.hpp"
#include "meshgrad/train/stop_signal.hpp"
#include "progress.hpp"

namespace meshgrad::train {

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string signal_name(int sig) { return sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : fmt::format("signal {}", sig); }

// Steps averaged for the start / end loss: a quarter of the run, 1 to 10 steps.
std::size_t loss_window(std::size_t steps) { return std::clamp<std::size_t>(steps / 4, 1, 10); }

// One run of train(): what it holds between its steps. Every rank builds one; the members that only
// rank 0 uses (metrics, progress) exist there only.
class Run {
 public:
  // Checks every input and output (throws before any work on bad input), reads a resume manifest,
  // opens the metrics file, builds the model, optimizer and synchroniser, loads a resume's state.
  Run(const TrainOptions& options, const dist::DeviceMeshPtr& mesh);
  TrainResult execute();

 private:
  void read_inputs();
  const data::TokenDataset& dataset() const { return *dataset_; }
  std::vector<io::NamedPath> check_outputs() const;
  nlohmann::json run_record() const;
  void check_recorded_text() const;
  void check_output_space() const;
  void read_resume_manifest();
  void check_config_describes_tensors() const;
  void open_metrics();
  void build();
  void print_start() const;
  // The micro-batches this replica runs per step (--grad-accum; one per row block when mesh-invariant).
  int micro_batches() const { return micro_batches_per_replica(options_.parallel, *mesh_, options_.grad_accum); }
  struct StepFigures {
    double loss = 0;        // global, before the update
    double grad_norm = 0;   // before clipping
    nn::ExpertLoad load;    // a mixture of experts' routing in the step, over every rank
  };
  StepFigures step(int step, double lr);
  void report(int step, const StepFigures& figures, double lr, double step_seconds);
  void sample(int done);
  void save(int done, double lr, bool sync);
  // True when the ranks agreed that a signal ends the run; it has been saved then.
  bool agree_on_stop(int done, double lr);
  void finish();
  void print_summary() const;

  const TrainOptions& options_;
  dist::DeviceMeshPtr mesh_;
  bool leader_;
  nn::ModelConfig config_;
  std::optional<data::TokenDataset> dataset_;   // opened by read_inputs
  std::optional<checkpoint::Manifest> resume_;
  std::unique_ptr<MetricsWriter> metrics_;
  std::unique_ptr<nn::Model> model_;
  std::vector<nn::Parameter*> params_;
  std::unique_ptr<optim::GradientSynchronizer> sync_;
  std::unique_ptr<optim::AdamW> optimizer_;
  std::unique_ptr<checkpoint::CheckpointSaver> saver_;
  std::optional<StopSignalScope> signals_;
  TrainResult result_;
  double flops_per_token_ = 0;
  double peak_gflops_ = -1;   // the mesh's, for MFU (rank 0); < 0: unknown
  std::string peak_source_;   // "measured", "cached in PATH" or "--peak-gflops" (the metrics header's)
  std::int64_t tokens_per_step_ = 0;
  Clock::time_point start_;
  std::deque<double> recent_;   // step times of the last steps, for a steady rate on the display
  std::unique_ptr<Progress> progress_;
  int last_saved_ = -1;
  // Sequential (sharded) data: the tokens consumed so far (TokenDataset::batch_at_position), kept
  // across a resume by the checkpoint, so a resume with another --batch goes on where the data stopped.
  std::int64_t data_position_ = 0;
  std::int64_t resumed_data_position() const;
};

// A pipeline's options (a mesh with pp > 1), and pipeline options without one. What pipelines do not
// combine with yet is refused naming it (see docs/training.md, "Pipeline parallelism").
void check_pipeline_options(const TrainOptions& o, const dist::DeviceMesh& mesh, int dp) {
  const int stages = mesh.has_axis("pp") ? mesh.axis_size("pp") : 1;
  (void)pipeline::parse_schedule(o.pp_schedule);
  if (stages == 1) {
    MG_CHECK(o.parallel.pp_layers.empty(), "train: --pp-layers {} needs a pipeline: add pp=N to --mesh ({})",
             fmt::join(o.parallel.pp_layers, ","), mesh.str());
    MG_CHECK(o.pp_schedule == "1f1b" || o.given_options.count("pp-schedule") == 0,
             "train: --pp-schedule {} needs a pipeline: add pp=N to --mesh ({})", o.pp_schedule, mesh.str());
    return;
  }
  if (o.init_from.empty()) (void)nn::stage_layer_counts(o.model.layers, stages, o.parallel.pp_layers);
  const std::int64_t rows = o.model.batch / dp;
  const int micro = micro_batches_per_replica(o.parallel, mesh, o.grad_accum);
  MG_CHECK(o.model.batch % dp == 0 && rows % micro == 0,
           "train: --micro-batches {} on {}: each data-parallel replica's {} rows of --batch {} must divide into {} "
           "micro-batches of equal rows", micro, mesh.str(), o.model.batch / std::max(dp, 1), o.model.batch, micro);
}

// The options that need no file: sizes, rates and the checkpointing options' combinations. Returns
// options.
const TrainOptions& checked_options(const TrainOptions& o, const dist::DeviceMesh& mesh) {
  MG_CHECK(o.steps >= 1, "train: --steps must be >= 1, got {}", o.steps);
  MG_CHECK(o.lr > 0, "train: --lr must be > 0, got {}", o.lr);
  check_optimizer_options(o);
  // MFU's denominator: 0 measures it; else a machine's peak, from a millionth of a TFLOP/s to a
  // zettaFLOP/s (a value beyond would print a meaningless MFU, a negative or nan none at all).
  MG_CHECK(o.peak_gflops == 0 || (std::isfinite(o.peak_gflops) && o.peak_gflops >= 1e-3 && o.peak_gflops <= 1e12),
           "train: --peak-gflops must be 0 (measured at start) or the mesh's peak GFLOP/s, from 0.001 to 1e12, got {}",
           o.peak_gflops);
  check_blas_threads(o);
  MG_CHECK(o.precision == "float32" || o.precision == "bf16", "train: --precision must be float32 or bf16, got '{}'",
           o.precision);
  MG_CHECK(o.precision == "float32" || o.model.dtype == DType::Float32, "train: --precision bf16 needs --dtype float32 "
           "(its master weights and accumulation are float32), got --dtype {}", o.model.dtype);
  if (o.parallel.reduce_dtype != DType::Float32) {
    MG_CHECK(o.model.dtype == DType::Float32, "train: --reduce-dtype bf16 needs --dtype float32 (it halves float32 "
             "gradients on the wire), got --dtype {}", o.model.dtype);
    MG_CHECK(!o.parallel.tp_invariant(), "train: --reduce-dtype bf16 cannot be combined with --{}: the fixed tree's "
             "nodes would round to bf16 at other places on other meshes", nn::invariance_option(o.parallel.invariance));
  }
  if (o.init_from.empty()) nn::check_moe(o.model, mesh.has_axis("ep") ? mesh.axis_size("ep") : 1, mesh.str());
  // The ranks that split the batch: dp x fsdp x ep.
  const int dp = batch_split_size(mesh);
  MG_CHECK(o.model.batch >= dp, "train: the global batch ({} rows) must have at least one row per data-parallel rank "
           "(dp x fsdp = {} on {})", o.model.batch, dp, mesh.str());
  // Each replica splits its rows (the smallest has batch / dp) into --grad-accum micro-batches: known
  // now, not only at the first step (train_step's check).
  MG_CHECK(o.parallel.mesh_invariant() || o.grad_accum <= o.model.batch / dp, "train: --grad-accum {} needs at least that "
           "many rows per dp replica, and a replica has {} (--batch {} over dp x fsdp = {} on {})", o.grad_accum,
           o.model.batch / dp, o.model.batch, dp, mesh.str());
  if (o.parallel.mesh_invariant()) {
    check_mesh_invariant_split(o.model.batch, dp, o.grad_accum, o.parallel.batch_blocks);
  } else if (o.parallel.tp_invariant()) {
    check_invariant_batch_split(o.model.batch, dp, o.grad_accum, mesh.str());
  }
  MG_CHECK(o.grad_clip >= 0 && std::isfinite(o.grad_clip), "train: --grad-clip must be >= 0 (0 = off), got {}",
           o.grad_clip);
  MG_CHECK(o.sample_every >= 0 && o.sample_tokens >= 1, "train: --sample-every must be >= 0 and --sample-tokens >= 1, "
           "got {} and {}", o.sample_every, o.sample_tokens);
  MG_CHECK(o.sample_every == 0 || o.sampler, "train: --sample-every needs a sampler (TrainOptions::sampler; "
           "launch::run_train_job sets one)");
  MG_CHECK(o.eval_every >= 0 && o.eval_steps >= 1, "train: --eval-every must be >= 0 and --eval-steps >= 1, "
           "got {} and {}", o.eval_every, o.eval_steps);
  MG_CHECK(o.save_every >= 0 && o.keep >= 0, "train: --save-every and --keep must be >= 0, got {} and {}",
           o.save_every, o.keep);
  MG_CHECK(o.save_every == 0 || !o.checkpoint_dir.empty(), "train: --save-every needs --checkpoint-dir");
  MG_CHECK(o.keep == 0 || !o.checkpoint_dir.empty(), "train: --keep needs --checkpoint-dir");
  check_pipeline_options(o, mesh, dp);
  return o;
}

// Everything that can fail on a user's input fails before the first step: the options, the data
// (only read), then the outputs (a run must not train for hours and then find that --save cannot be
// written, or overwrite a file it reads: every file behind --data counts). What one rank may fail
// at alone (a file another host cannot read, a metrics file rank 0 cannot open) is agreed on by
// every rank before any of them goes on to a collective (comm::run_agreed), so a failure ends every
// rank at once with its message instead of leaving the others waiting for the deadline.
Run::Run(const TrainOptions& options, const dist::DeviceMeshPtr& mesh)
    : options_(options), mesh_(mesh), leader_(mesh->rank() == 0), config_(options.model) {
  comm::run_agreed(*mesh_->world(), [&] { read_inputs(); });
  // Every rank read the same path; on several hosts each read its own copy, which must hold the same bytes.
  data::agree_on_data(*mesh_->world(), dataset().identity(), dataset().source());
  build();
  // Last: a run refused above (another run holds the checkpoint directory, a checkpoint of another
  // shape) must not have truncated or appended to a metrics file that may be a live run's.
  comm::run_agreed(*mesh_->world(), [&] { open_metrics(); });
}

// Without communicating: the options, the data, --init-from's configuration, the outputs, a
// resume's manifest.
void Run::read_inputs() {
  checked_options(options_, *mesh_);
  train::check_recorded_text(options_);
  use_blas_threads(options_);   // every rank, before any GEMM (agreed on with the rest of the inputs)
  dataset_.emplace(options_.data_path, options_.model.batch, options_.model.seq, options_.seed, options_.val_data_path);
  MG_CHECK(options_.init_from.empty() || options_.resume_dir.empty(), "train: --init-from and --resume both give the "
           "starting weights: give one (a resumed run continues from its checkpoint)");
  if (!options_.init_from.empty()) {
    config_ = interop::hf_init_config(options_.init_from, config_, leader_ && options_.progress);
    nn::check_moe(config_, mesh_->has_axis("ep") ? mesh_->axis_size("ep") : 1, mesh_->str());
  }
  if (config_.vocab <= 0) config_.vocab = static_cast<int>(dataset().vocab());
  MG_CHECK(options_.eval_every == 0 || dataset().has_validation(),
           "train: --eval-every needs a validation split, and the data {} has none: give --data a directory written by "
           "`meshgrad prepare` (its val.bin or val_*.bin), or --val-data", dataset().source());
  dataset().require_tokens_below(config_.vocab, fmt::format("the model's vocabulary size {}", config_.vocab));
  // What the first sample would refuse (a vocabulary the data has no tokenizer for) is refused now.
  if (options_.sample_every > 0 && options_.check_sampler) options_.check_sampler(config_);
  check_outputs();
  check_recorded_text();
  read_resume_manifest();
}

// What every checkpoint records besides the step's own figures (Run::save adds those).
nlohmann::json Run::run_record() const {
  nlohmann::json record{{"config", run_config_json(options_, config_.vocab)},
                        {"mesh", mesh_->str()},
                        {"data", {{"source", dataset().source()}, {"tokens", dataset().size()}, {"vocab", dataset().vocab()},
                                  {"description", dataset().description()},
                                  {"identity", dataset().identity().to_json()}}}};
  // Where the tokenizer is (a prepared directory's meta.json), for `sample` and `export`.
  for (const std::string& f : dataset().input_files()) {
    if (fs::path(f).filename() == "meta.json") record["data"]["meta"] = fs::absolute(f).lexically_normal().string();
  }
  for (const auto& [key, value] : options_.provenance) record["provenance"][key] = value;
  return record;
}

// Checkpoint manifests and --save's metadata are strict UTF-8 JSON: the text options were checked
// by name (train::check_recorded_text); this catches the rest of the record (the data's source,
// description and meta.json path, the provenance, whatever a later option adds).
void Run::check_recorded_text() const {
  train::check_record_text(run_record(), "a checkpoint");
  nlohmann::json metadata = nlohmann::json::object();
  for (const auto& [key, value] : interop::hf_checkpoint_metadata(config_, dataset())) metadata[key] = value;
  train::check_record_text(metadata, "--save's metadata");
}

// Rank 0: the bytes --save and one checkpoint take at least (the tensors' data) must be free.
void Run::check_output_space() const {
  const auto parameter_bytes = static_cast<std::uint64_t>(result_.parameters) * dtype_size(config_.dtype);
  std::vector<io::OutputSize> outputs;
  if (!options_.save_path.empty()) outputs.push_back({{"--save", options_.save_path}, parameter_bytes});
  // The parameters and AdamW's two moments.
  if (!options_.checkpoint_dir.empty()) outputs.push_back({{"--checkpoint-dir", options_.checkpoint_dir}, 3 * parameter_bytes});
  io::check_free_space(outputs);
}

// --save, --metrics and --trace can be written without destroying anything and are not inputs;
// --checkpoint-dir is a usable directory whose checkpoints' names no output file takes. Returns the
// output files.
std::vector<io::NamedPath> Run::check_outputs() const {
  std::vector<io::NamedPath> outputs;
  if (!options_.save_path.empty()) outputs.push_back({"--save", options_.save_path});
  if (!options_.metrics_path.empty()) outputs.push_back({"--metrics", options_.metrics_path});
  if (!options_.trace_path.empty()) outputs.push_back({"--trace", options_.trace_path});
  std::vector<io::NamedPath> inputs;
  for (const std::string& f : dataset().input_files()) inputs.push_back({"--data", f});
  io::check_output_paths(outputs, inputs);
  if (!options_.checkpoint_dir.empty()) {
    std::vector<io::NamedPath> dirs = inputs;
    if (!options_.data_path.empty()) dirs.push_back({"--data", options_.data_path});
    io::check_output_directory({"--checkpoint-dir", options_.checkpoint_dir}, dirs, outputs);
    // A file where a save writes or a prune deletes (--metrics ck/step_00000002) would be destroyed.
    checkpoint::check_outputs_outside_checkpoint_names({"--checkpoint-dir", options_.checkpoint_dir}, outputs);
  }
  return outputs;
}

// A resumed run: the checkpoint's manifest (its tensors load after the model is built), checked
// against the data and --steps.
void Run::read_resume_manifest() {
  if (options_.resume_dir.empty()) return;
  resume_ = checkpoint::read_manifest(options_.resume_dir);
  check_config_describes_tensors();
  // The data by content: a checkpoint resumes on the bytes it was trained on, unless the user says
  // the change is meant. (Checkpoints older than the content hash recorded only the token count.)
  const nlohmann::json& saved_data = resume_->state.value("data", nlohmann::json::object());
  const data::DataIdentity saved = data::DataIdentity::from_json(saved_data.value("identity", nlohmann::json()));
  const data::DataIdentity& now = dataset().identity();
  const std::int64_t saved_tokens = saved_data.value("tokens", std::int64_t{-1});
  const bool same = saved.train_hash.empty() ? saved_tokens == now.train_tokens : saved == now;
  MG_CHECK(same || options_.data_changed_ok,
           "train: checkpoint '{}' was trained on {}: {}, but the data {} is now {}; the data changed since the "
           "checkpoint. Resume on the data it was trained on, or add --data-changed-ok to go on with this data (the "
           "batches of the remaining steps are drawn from it)", options_.resume_dir,
           saved_data.value("source", std::string("?")),
           saved.train_hash.empty() ? fmt::format("{} training tokens", saved_tokens) : saved.str(), dataset().source(),
           now.str());
  MG_CHECK(resume_->step < options_.steps, "train: checkpoint '{}' was taken after step {}, and --steps is {}: nothing "
           "left to train (give a larger --steps)", options_.resume_dir, resume_->step, options_.steps);
}

// The saved configuration (which the resume's model is built from) must describe the saved tensors
// before anything is built (interop::check_config_describes_tensors, reliability-2 C10).
// A registered model (nn::register_model) has no file layout to check against: its load asks for
// every parameter by name and full shape (checkpoint::read_pieces) and refuses a missing or
// misshapen one, before the first step.
void Run::check_config_describes_tensors() const {
  if (nn::registered_model(config_.kind)) return;
  interop::check_config_describes_tensors(config_, *resume_, options_.resume_dir);
}

void Run::open_metrics() {
  if (!leader_ || options_.metrics_path.empty()) return;
  metrics_ = std::make_unique<MetricsWriter>(options_.metrics_path, resume_.has_value());
  nlohmann::json header = metrics_header(options_, config_, *mesh_, dataset(), peak_gflops_);
  if (!peak_source_.empty()) header["peak_gflops_source"] = peak_source_;
  if (resume_) {
    header["resumed_from"] = options_.resume_dir;
    header["first_step"] = resume_->step + 1;
  }
  metrics_->write_line(header);
}

// The checkpoint saver first (it takes the checkpoint directory's lock, so a second run into the same
// directory stops before it builds anything), the model (from --init-from or the seed), the
// synchroniser and AdamW, a resume's state (read in place: the model and optimizer were built for
// it, and an error stops the run before its first step, so a half-read state is never used), the
// signal handlers.
void Run::build() {
  if (!options_.checkpoint_dir.empty()) {
    saver_ = std::make_unique<checkpoint::CheckpointSaver>(options_.checkpoint_dir, mesh_, options_.keep);
  }
  model_ = nn::make_model(config_, options_.parallel, mesh_, options_.seed);
  model_->set_training(true);
  params_ = model_->parameters();
  // The group that gathers full parameters is built on first use, by every rank of the mesh at once;
  // the saves and samples below use it on some ranks only (those that write), so it is built here.
  (void)nn::parameter_shard_group(*mesh_, params_);
  // Each rank reads its own pieces (no communication); they agree on the outcome before going on.
  comm::run_agreed(*mesh_->world(), [&] {
    if (!options_.init_from.empty()) interop::hf_load_parameters(options_.init_from, params_, nn::tensor_parallel_group(*mesh_));
  });
  sync_ = std::make_unique<optim::GradientSynchronizer>(
      params_, mesh_,
      optim::GradSyncOptions{.order = model_->reduce_order(), .reduce_dtype = options_.parallel.reduce_dtype});
  optimizer_ = std::make_unique<optim::AdamW>(params_, mesh_,
                                              optim::AdamWOptions{options_.lr, options_.beta1, options_.beta2, options_.eps,
                                                                                  options_.weight_decay});
  comm::run_agreed(*mesh_->world(), [&] {
    if (resume_) {
      result_.first_step = load_training_state(options_.resume_dir, *resume_, *model_, *optimizer_, StateLoad::in_place);
    }
  });
  last_saved_ = resume_ ? result_.first_step : -1;
  data_position_ = resumed_data_position();
  if (saver_ && options_.handle_signals) signals_.emplace();
  result_.parameters = count_parameters(params_);
  if (const dist::ProcessGroup* stages = pipeline::parameter_stages(*model_, *mesh_)) {
    // Each stage holds its own parameters: the model's are every stage's (exact in float64).
    dist::PhaseScope phase(dist::Phase::Optimizer);
    result_.parameters = static_cast<std::int64_t>(
        dist::all_reduce(Tensor::scalar(static_cast<double>(result_.parameters), DType::Float64), *stages).item());
  }
  // An output that cannot fit fails now, not after the training.
  comm::run_agreed(*mesh_->world(), [&] {
    if (leader_) check_output_space();
  });
  flops_per_token_ = model_flops_per_token(config_, result_.parameters - lookup_only_parameters(config_));
  tokens_per_step_ = static_cast<std::int64_t>(config_.batch) * config_.seq;
  if (leader_) progress_ = std::make_unique<Progress>(options_.steps, result_.first_step);
  const bool shows_figures = options_.progress || !options_.metrics_path.empty() || options_.on_step;
  if (leader_ && options_.peak_gflops == 0 && shows_figures) {
    const PeakGflops peak = measure_peak_gflops(config_.dtype, options_.precision, mesh_->size());
    peak_gflops_ = peak.gflops;
    peak_source_ = peak.source;
  } else if (options_.peak_gflops > 0) {
    peak_gflops_ = options_.peak_gflops;
    peak_source_ = "--peak-gflops";
  }
}

void Run::print_start() const {
  if (!leader_ || !options_.progress) return;
  const nn::ParallelConfig& p = options_.parallel;
  fmt::print(stderr,
             "meshgrad train: {} layers={} hidden={} heads={}{} seq={} batch={} ({} parameters, {}) on {} "
             "[{}{}{}{}{}], {} steps, lr {:g}, data: {} ({}, {} tokens, vocab {})\n",
             config_.kind, config_.layers, config_.hidden, config_.heads,
             config_.moe() ? fmt::format(" experts={} top-{}{}", config_.experts, config_.experts_per_token,
                                         config_.capacity_factor > 0
                                             ? fmt::format(" capacity-factor={:g}", config_.capacity_factor)
                                             : std::string(" dropless"))
                           : std::string(),
             config_.seq, config_.batch, result_.parameters,
             dtype_name(config_.dtype), mesh_->str(), p.sequence_parallel ? "sequence-parallel" : "all-reduce",
             p.overlap ? ", overlap" : "", p.checkpoint_blocks ? ", checkpoint-blocks" : "",
             p.mesh_invariant() ? fmt::format(", mesh-invariant: {} row blocks, {} per replica", p.batch_blocks,
                                            micro_batches())
             : p.tp_invariant() ? ", tp-invariant" : "",
             p.shard_optimizer ? ", shard-optimizer" : !p.reshard_after_forward ? ", no-reshard-after-forward" : "",
             options_.steps, options_.lr, dataset().source(),
             dataset().description(), dataset().size(), dataset().vocab());
  fmt::print(stderr, "compute: {}, {}; {}\n", blas::thread_policy(), blas::idle_wait_policy(),
             blas::gemm_description());   // policy set by whoever launched the ranks
  if (options_.precision == "bf16") {
    // Which kernels run the bf16 products, and why not the bf16 instructions when they do not.
    fmt::print(stderr, "precision: bf16 (bf16 inputs to the products and attention, float32 accumulation, float32 "
               "weights, gradients and optimizer state); bf16 products: {}\n", blas::bf16_description());
  }
  if (resume_) fmt::print(stderr, "resumed from {} (after step {})\n", options_.resume_dir, result_.first_step);
  if (options_.eval_every > 0 && options_.eval_steps > dataset().validation_batches()) {
    // evaluate() reads at most one pass over the validation split: say so rather than cap silently.
    fmt::print(stderr, "note: --eval-steps {} is more than the validation split's {} batches of --batch {} x --seq {}: "
               "each evaluation reads those {} once\n", options_.eval_steps, dataset().validation_batches(),
               config_.batch, config_.seq, dataset().validation_batches());
  }
  // Where checkpoints go and what --keep may remove, before anything is written (a resume's folder
  // comes from --resume unless --checkpoint-dir is given: run_config.hpp).
  if (saver_) {
    fmt::print(stderr, "checkpoints: into {}{} {}; {}\n", options_.checkpoint_dir,
               resume_ && options_.given_options.count("checkpoint-dir") == 0 ? " (the folder resumed from)" : "",
               options_.save_every > 0 ? fmt::format("every {} steps and at the end", options_.save_every) : "at the end",
               options_.keep > 0 ? fmt::format("--keep {} removes all but the newest {} checkpoints there, those "
                                               "already there included", options_.keep, options_.keep)
                                 : "--keep 0: none is removed");
  }
}

Run::StepFigures Run::step(int step, double lr) {
  optimizer_->set_lr(lr);
  nn::Batch global_batch;
  if (dataset().sequential()) {
    global_batch = dataset().batch_at_position(data_position_);
    data_position_ = dataset().next_position(data_position_);
  } else {
    global_batch = dataset().next_batch(step);
  }
  const StepOutcome outcome =
      train_step(*model_, global_batch, *mesh_, *sync_, *optimizer_, options_.grad_clip, micro_batches(),
                 pipeline::parse_schedule(options_.pp_schedule));
  const double global = global_loss(outcome.loss, *mesh_, *model_);
  nn::ExpertLoad load = model_->take_expert_load();   // collective: before evaluation routes again
  result_.losses.push_back(global);
  MG_CHECK(std::isfinite(global), "train: the loss became {} at step {} (lr {:g}): lower --lr", global, step + 1, lr);
  if (options_.eval_every > 0 && ((step + 1) % options_.eval_every == 0 || step + 1 == options_.steps)) {
    // In micro-batches as training splits them (the same bits on every mesh in TP-invariant mode).
    result_.val_losses.emplace_back(step + 1,
                                    evaluate(*model_, dataset(), options_.eval_steps, *mesh_, micro_batches()));
  }
  return {global, outcome.grad_norm, std::move(load)};
}

// Rank 0: the metrics line, the caller's on_step, the progress display (its rate, ms/step and MFU
// over the last 10 steps, steadier than one step's).
void Run::report(int step, const StepFigures& figures, double lr, double step_seconds) {
  const double loss = figures.loss, grad_norm = figures.grad_norm;
  if (!leader_) return;
  recent_.push_back(step_seconds);
  if (recent_.size() > 10) recent_.pop_front();
  double window = 0;
  for (double d : recent_) window += d;
  const auto mfu_of = [&](double tokens_per_s) {
    return peak_gflops_ > 0 ? tokens_per_s * flops_per_token_ * 1e-9 / peak_gflops_ : -1.0;
  };
  const double tps = static_cast<double>(tokens_per_step_) / step_seconds;
  StepMetrics m;
  m.step = step + 1;
  m.loss = loss;
  m.tokens_per_s = tps;
  m.gflops = tps * flops_per_token_ * 1e-9;
  m.elapsed_s = seconds_since(start_);
  m.lr = lr;
  m.grad_norm = grad_norm;
  m.ms_per_step = step_seconds * 1e3;
  m.mfu = mfu_of(tps);
  m.expert_load = figures.load.tokens;
  m.dropped = figures.load.dropped;
  m.aux_loss = figures.load.aux_loss;
  const bool evaluated = !result_.val_losses.empty() && result_.val_losses.back().first == step + 1;
  if (evaluated) {
    m.evaluated = true;
    m.val_loss = result_.val_losses.back().second;
  }
  if (metrics_) metrics_->write_line(step_metrics_json(m));
  if (options_.on_step) options_.on_step(m);
  if (!options_.progress) return;
  if (evaluated) progress_->print_line(fmt::format("step {}: val loss {:.4f}", step + 1, m.val_loss));
  const double shown_tps = static_cast<double>(tokens_per_step_) * static_cast<double>(recent_.size()) / window;
  progress_->update(m, shown_tps, window * 1e3 / static_cast<double>(recent_.size()), mfu_of(shown_tps));
}

// The model's full parameters to mesh rank 0 (one group of the axes that shard them gathers, the
// stages send theirs to stage 0), which samples from them, prints and logs the text.
void Run::sample(int done) {
  trace::Span span("sample", "step");
  std::vector<std::pair<std::string, Tensor>> full;
  if (nn::in_first_parameter_shard_group(*mesh_, params_)) {
    full = checkpoint::gather_full_parameters(params_, nn::parameter_shard_group(*mesh_, params_), 0,
                                              pipeline::parameter_stages(*model_, *mesh_));
  }
  if (!leader_) return;
  MG_CHECK(!full.empty() && options_.sampler, "train: --sample-every: mesh rank 0 has no full parameters or no sampler");
  const std::string text = options_.sampler(config_, full, done);
  if (metrics_) metrics_->write_line({{"type", "sample"}, {"step", done}, {"text", text}});
  if (options_.progress) progress_->print_line(fmt::format("step {} sample: {}", done, text));
}

// A fresh run starts at the data's beginning; a resume where its checkpoint's data stopped (checkpoints
// without a position, or of random-window data: the step's, as the batches follow the step there).
std::int64_t Run::resumed_data_position() const {
  if (!resume_) return 0;
  const std::int64_t by_step = static_cast<std::int64_t>(result_.first_step) * config_.batch * config_.seq;
  const nlohmann::json data = resume_->state.value("data", nlohmann::json::object());
  const nlohmann::json position = data.is_object() ? data.value("position", nlohmann::json::object()) : nlohmann::json();
  if (!dataset().sequential() || !position.is_object() || !position.contains("tokens")) return by_step;
  MG_CHECK(position["tokens"].is_number_integer() && position["tokens"].get<std::int64_t>() >= 0,
           "train: checkpoint '{}': the saved data position {} is not a token count", options_.resume_dir,
           position.dump());
  return position["tokens"].get<std::int64_t>();
}

// Saves the state after `done` steps (every rank; collective), in the background unless sync.
void Run::save(int done, double lr, bool sync) {
  nlohmann::json state = run_record();
  state["step"] = done;
  state["optimizer_steps"] = optimizer_->steps();
  state["random_state"] = model_->random_state();
  state["lr"] = lr;
  state["data"]["next_batch"] = done;
  state["data"]["position"] = dataset().position_json(data_position_);
  const Clock::time_point t0 = Clock::now();
  saver_->save(done, training_state_tensors(params_, *optimizer_), state, !sync && !options_.checkpoint_sync);
  result_.checkpoint_stall_s += seconds_since(t0);
  ++result_.checkpoints;
  last_saved_ = done;
}

// Preemption: the ranks agree on a stop request (a signal may land between two ranks' checks), then
// all of them save and leave together.
bool Run::agree_on_stop(int done, double lr) {
  if (!signals_ && !options_.stop_requested) return false;
  // A signal number (small: exact in a float reduction), or kStopRequest for the caller's request.
  constexpr int kStopRequest = 1000;
  double local = signals_ ? stop_requested() : 0, reduced = 0;
  if (leader_ && local == 0 && options_.stop_requested && options_.stop_requested()) local = kStopRequest;
  {
    dist::PhaseScope phase(dist::Phase::Optimizer);
    mesh_->world()->all_reduce(comm::ConstBuffer{&local, 1, DType::Float64},
                               comm::MutableBuffer{&reduced, 1, DType::Float64}, comm::ReduceOp::Max);
  }
  const int any = static_cast<int>(reduced);
  if (any == 0 || done >= options_.steps) return false;
  result_.stopped_by = any == kStopRequest ? "stop request" : signal_name(any);
  if (saver_ && last_saved_ != done) save(done, lr, true);
  return true;
}

TrainResult Run::execute() {
  // The run's product precision on this rank's thread, for its steps, evaluations and samples.
  const kernels::ProductPrecisionScope precision(options_.precision == "bf16" ? kernels::ProductPrecision::BFloat16
                                                                              : kernels::ProductPrecision::Float32);
  print_start();
  start_ = Clock::now();
  for (int step = result_.first_step; step < options_.steps; ++step) {
    const Clock::time_point t0 = Clock::now();
    trace::Span step_span("step", "step");
    step_span.arg("step", std::int64_t{step + 1});
    const double lr = learning_rate(options_, step);
    const StepFigures figures = this->step(step, lr);
    const int done = step + 1;
    if (options_.sample_every > 0 && done % options_.sample_every == 0) sample(done);
    report(step, figures, lr, seconds_since(t0));
    if (saver_ && options_.save_every > 0 && done % options_.save_every == 0 && done < options_.steps) save(done, lr, false);
    if (agree_on_stop(done, lr)) break;
  }
  finish();
  print_summary();
  return std::move(result_);
}

// The last checkpoint (synchronous, waited for), the figures of the run, the --save file.
void Run::finish() {
  const int done = result_.first_step + static_cast<int>(result_.losses.size());
  if (saver_) {
    if (last_saved_ != done) save(done, learning_rate(options_, options_.steps - 1), true);
    saver_->wait();   // a save in flight completes before the run returns
    result_.last_checkpoint = saver_->last_committed();
  }
  result_.seconds = seconds_since(start_);
  result_.tokens_per_s = static_cast<double>(tokens_per_step_) * static_cast<double>(result_.losses.size()) / result_.seconds;
  result_.gflops = result_.tokens_per_s * flops_per_token_ * 1e-9;
  if (!options_.save_path.empty() && nn::in_first_parameter_shard_group(*mesh_, params_)) {
    // One group of the axes that shard parameters (tp, fsdp; dp under --shard-optimizer) gathers and
    // writes the full tensors; the replicas are identical.
    interop::save_model_parameters(options_.save_path, config_, params_, nn::parameter_shard_group(*mesh_, params_),
                                   interop::hf_checkpoint_metadata(config_, dataset()),
                                   pipeline::parameter_stages(*model_, *mesh_));
  }
}

void Run::print_summary() const {
  if (!leader_ || !options_.progress) return;
  const TrainResult& r = result_;
  fmt::print(stderr,
             "loss {:.4f} -> {:.4f} (mean of the first / last {} steps; step {}: {:.4f}, step {}: {:.4f}) in {:.1f} s, "
             "{:.0f} tokens/s, {:.2f} GFLOP/s\n",
             r.start_loss(), r.end_loss(), loss_window(r.losses.size()), r.first_step + 1, r.losses.front(),
             r.first_step + static_cast<int>(r.losses.size()), r.losses.back(), r.seconds, r.tokens_per_s, r.gflops);
  if (r.checkpoints > 0) {
    fmt::print(stderr, "checkpoints: {} written, training stalled {:.3f} s for them in all; newest: {}\n", r.checkpoints,
               r.checkpoint_stall_s, r.last_checkpoint);
  }
  if (!r.stopped_by.empty() && r.last_checkpoint.empty()) {
    fmt::print(stderr, "meshgrad train: stopped by {} after step {} of {} (no checkpoint directory: nothing to resume "
               "from)\n", r.stopped_by, r.first_step + r.losses.size(), options_.steps);
  } else if (!r.stopped_by.empty()) {
    fmt::print(stderr, "meshgrad train: stopped by {} after step {} of {}; checkpoint {} (go on with: meshgrad train "
               "--resume {})\n", r.stopped_by, r.first_step + r.losses.size(), options_.steps, r.last_checkpoint,
               options_.checkpoint_dir);
  }
  if (!options_.save_path.empty()) fmt::print(stderr, "saved parameters to {}\n", options_.save_path);
  if (!options_.metrics_path.empty()) fmt::print(stderr, "metrics written to {}\n", options_.metrics_path);
}

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

namespace {

double resolved_min_lr(const TrainOptions& o) { return o.min_lr < 0 ? o.lr * 0.1 : o.min_lr; }

// Steps of the decay after warmup (the default: to the run's last step).
int decay_horizon(const TrainOptions& o) {
  return o.decay_steps >= 0 ? o.decay_steps : o.steps - 1 - std::max(0, o.warmup_steps);
}

}  // namespace

double learning_rate(const TrainOptions& o, int step) {
  const int warmup = std::max(0, o.warmup_steps);
  if (step < warmup) return o.lr * (step + 1) / warmup;
  const int horizon = decay_horizon(o);
  if (o.lr_schedule == "constant" || horizon <= 0) return o.lr;
  const double progress = std::clamp(static_cast<double>(step - warmup) / horizon, 0.0, 1.0);
  const double min_lr = resolved_min_lr(o);
  if (o.lr_schedule == "linear") return o.lr + (min_lr - o.lr) * progress;
  if (o.lr_schedule == "wsd") {
    const double stable = 1.0 - o.decay_fraction;
    return progress <= stable ? o.lr : o.lr + (min_lr - o.lr) * (progress - stable) / o.decay_fraction;
  }
  return min_lr + 0.5 * (o.lr - min_lr) * (1.0 + std::cos(std::numbers::pi * progress));
}

void check_optimizer_options(const TrainOptions& o) {
  MG_CHECK(o.lr_schedule == "cosine" || o.lr_schedule == "linear" || o.lr_schedule == "constant" ||
               o.lr_schedule == "wsd",
           "train: --lr-schedule must be cosine, linear, constant or wsd, got \"{}\"", o.lr_schedule);
  // -1 exactly is the documented "left out"; another negative (-5, -inf) is a mistake, not lr / 10.
  MG_CHECK(o.min_lr == -1 || (o.min_lr >= 0 && std::isfinite(o.min_lr) && o.min_lr <= o.lr),
           "train: --min-lr must be between 0 and --lr ({}), or -1 for lr / 10, got {}", o.lr, o.min_lr);
  MG_CHECK(o.decay_steps == -1 || o.decay_steps >= 1,
           "train: --decay-steps must be >= 1 (or left out: the rest of the run), got {}", o.decay_steps);
  MG_CHECK(o.decay_fraction > 0 && o.decay_fraction <= 1, "train: --decay-fraction must be in (0, 1], got {}",
           o.decay_fraction);
  MG_CHECK(o.beta1 >= 0 && o.beta1 < 1, "train: --beta1 must be in [0, 1), got {}", o.beta1);
  MG_CHECK(o.beta2 >= 0 && o.beta2 < 1, "train: --beta2 must be in [0, 1), got {}", o.beta2);
  MG_CHECK(o.eps > 0 && std::isfinite(o.eps), "train: --eps must be > 0, got {}", o.eps);
  MG_CHECK(o.weight_decay >= 0 && std::isfinite(o.weight_decay), "train: --weight-decay must be >= 0, got {}",
           o.weight_decay);
  // The decoupled decay multiplies the 2-D weights by 1 - lr x weight_decay each step (lr the step's,
  // at most --lr): from 1 on it zeroes them or flips their sign every step, and the loss turns nan.
  MG_CHECK(o.lr * o.weight_decay < 1, "train: --lr {:g} times --weight-decay {:g} is {:g}, which must be below 1: AdamW's "
           "decoupled decay multiplies the weights by 1 - lr x weight-decay each step, so it would zero them or flip "
           "their sign (usual: --weight-decay 0 to 0.1 with --lr up to 1e-2)", o.lr, o.weight_decay, o.lr * o.weight_decay);
}

std::int64_t count_parameters(const std::vector<nn::Parameter*>& params) {
  std::int64_t n = 0;
  for (const nn::Parameter* p : params) n += shape_numel(p->full_shape);
  return n;
}

namespace {
// The built-in kind whose counts a model follows: its own, or a registered kind's counts_like (""
// for none).
std::string counting_kind(const std::string& kind) {
  const std::shared_ptr<const nn::ModelKind> registered = nn::registered_model(kind);
  return registered ? registered->counts_like : kind;
}
}  // namespace

double model_flops_per_token(const nn::ModelConfig& config, std::int64_t n_params_without_wpe) {
  nn::ModelConfig c = config;
  c.kind = counting_kind(config.kind);
  // A registered model that counts like no family: every parameter multiplied once per token.
  if (c.kind.empty()) return 6.0 * static_cast<double>(n_params_without_wpe);
  const double attention_width = c.kind == "llama" ? static_cast<double>(c.heads) * c.head_size() : c.hidden;
  // A mixture of experts: a token multiplies by its k experts' weights only (the active parameters).
  const double active = static_cast<double>(n_params_without_wpe - inactive_expert_parameters(c));
  return 6.0 * active +
         12.0 * static_cast<double>(c.layers) * static_cast<double>(c.seq) * attention_width;
}

std::int64_t inactive_expert_parameters(const nn::ModelConfig& c) {
  std::int64_t sparse = 0;
  for (int i = 0; i < c.layers; ++i) sparse += c.sparse_layer(i) ? 1 : 0;
  return sparse * (c.experts - c.experts_per_token) * 3 * std::int64_t{c.hidden} * c.expert_ffn_size();
}

std::int64_t lookup_only_parameters(const nn::ModelConfig& config) {
  nn::ModelConfig c = config;
  c.kind = counting_kind(config.kind);
  if (c.kind == "gpt") return std::int64_t{c.n_positions()} * c.hidden;
  if (c.kind == "llama" && !c.tie_word_embeddings) return std::int64_t{c.vocab} * c.hidden;
  return 0;
}

TrainResult train(const TrainOptions& options, const dist::DeviceMeshPtr& mesh) {
  MG_CHECK(mesh != nullptr, "train: no mesh");
  return Run(options, mesh).execute();
}

}  // namespace meshgrad::train
