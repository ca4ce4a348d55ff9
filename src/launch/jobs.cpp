#include "meshgrad/launch/jobs.hpp"

#include <fmt/core.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <cctype>
#include <cerrno>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "meshgrad/data/synthetic.hpp"
#include "meshgrad/interop/checkpoint_model.hpp"
#include "meshgrad/interop/gpt2_config.hpp"
#include "meshgrad/interop/hf_config.hpp"
#include "meshgrad/interop/hf_io.hpp"
#include "meshgrad/interop/model_tensors.hpp"
#include "meshgrad/train/step.hpp"
#include "meshgrad/nn/layers.hpp"
#include "meshgrad/nn/moe.hpp"
#include "meshgrad/tensor/error.hpp"
#include "meshgrad/checkpoint/parameter_file.hpp"
#include "meshgrad/checkpoint/directory.hpp"
#include "meshgrad/train/run_config.hpp"
#include "meshgrad/io/file_io.hpp"
#include "meshgrad/io/output_path.hpp"
#include "meshgrad/io/safetensors.hpp"
#include "meshgrad/train/trace_file.hpp"
#include "meshgrad/train/trainer.hpp"
#include "train_sampler.hpp"

namespace meshgrad::launch {
namespace {

void check_positive(const char* job, const char* option, int value) {
  MG_CHECK(value >= 1, "{}: --{} must be >= 1, got {}", job, option, value);
}

// The batch file's int64 [B, T] tensor `name`.
Tensor read_batch_tensor(const io::SafetensorsFile& file, const std::string& name) {
  MG_CHECK(file.contains(name), "batch '{}': no tensor \"{}\" (expected int64 \"inputs\" and \"targets\" [B, T])",
           file.path(), name);
  Tensor t = file.get(name);
  MG_CHECK(t.dtype() == DType::Int64 && t.dim() == 2, "batch '{}': \"{}\" must be int64 [B, T], got {}", file.path(),
           name, t.str());
  return t;
}

// Every token of a [B, T] batch tensor in [0, vocab) (targets may also be the ignore index), or an
// error naming the file, the tensor, the row and the position.
void check_token_range(const Tensor& t, const char* name, const std::string& file, std::int64_t vocab, bool ignore) {
  const std::vector<std::int64_t> v = t.to_int64_vector();
  const std::int64_t cols = t.size(1);
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (v[i] >= 0 && v[i] < vocab) continue;
    if (ignore && v[i] == train::kIgnoreIndex) continue;
    throw InvalidArgument(fmt::format("batch '{}': {}[{}, {}] = {} is outside the vocabulary [0, {}){}", file, name,
                                      static_cast<std::int64_t>(i) / cols, static_cast<std::int64_t>(i) % cols, v[i],
                                      vocab, ignore ? fmt::format(" (and is not the ignore index {})", train::kIgnoreIndex) : ""));
  }
}

// One line per option the user gave (o.given_options: the command line, --config, Python's keywords;
// never a value a checkpoint restored) whose value changes nothing on this run: a mode's setting
// without its mode, an fsdp setting without fsdp, --data-changed-ok without --resume, a warmup longer
// than the run. Settings at their defaults are not named (a recorded configuration fed back as
// --config gives every option), so a note means a value that was asked for and is ignored.
std::vector<std::string> ignored_option_notes(const train::TrainOptions& o, const dist::DeviceMesh& mesh) {
  const auto given = [&](const char* name) { return o.given_options.count(name) > 0; };
  const nn::ParallelConfig defaults;
  std::vector<std::string> notes;
  const bool fsdp = mesh.has_axis("fsdp") && mesh.axis_size("fsdp") > 1;
  if (given("reshard-after-forward") && o.parallel.reshard_after_forward != defaults.reshard_after_forward && !fsdp) {
    notes.push_back(fmt::format("--no-reshard-after-forward changes nothing: the mesh {} has no fsdp axis", mesh.str()));
  }
  if (given("batch-blocks") && o.parallel.batch_blocks != defaults.batch_blocks && !o.parallel.mesh_invariant()) {
    notes.push_back(fmt::format("--batch-blocks {} changes nothing without --mesh-invariant", o.parallel.batch_blocks));
  }
  if (given("sequence-blocks") && o.parallel.sequence_blocks != defaults.sequence_blocks && !o.parallel.mesh_invariant()) {
    notes.push_back(fmt::format("--sequence-blocks {} changes nothing without --mesh-invariant",
                                o.parallel.sequence_blocks));
  }
  if (given("invariant-blocks") && o.parallel.invariant_blocks != defaults.invariant_blocks &&
      !o.parallel.tp_invariant()) {
    notes.push_back(fmt::format("--invariant-blocks {} changes nothing without --tp-invariant or --mesh-invariant",
                                o.parallel.invariant_blocks));
  }
  if (given("data-changed-ok") && o.data_changed_ok && o.resume.empty()) {
    notes.push_back("--data-changed-ok changes nothing without --resume");
  }
  if (given("warmup") && o.warmup_steps != train::TrainOptions{}.warmup_steps && o.warmup_steps > o.steps) {
    notes.push_back(fmt::format("--warmup {} is longer than the run's {} steps: the learning rate stays below --lr {:g}",
                                o.warmup_steps, o.steps, o.lr));
  }
  return notes;
}

}  // namespace

namespace {

// The Llama family's options given for a GPT-2 run are refused rather than ignored. (Every path that
// reads or writes a model, checkpoints, Hugging Face files and samples, takes both families.)
void check_llama_edges(const train::TrainOptions& o) {
  if (o.model.kind != "llama") {
    // A resume's family is its checkpoint's: checked again once the checkpoint gave it.
    if (!o.resume.empty() && o.given_options.count("model") == 0) return;
    // The Llama family's sizes mean nothing to GPT-2: given, they are refused rather than ignored.
    // (Every field newer than GPT-2's, the checkpoint record's list: --kv-heads, ..., --rope-scaling,
    // --sliding-window, --model-type.)
    for (const interop::ModelConfigField& f : interop::model_config_fields()) {
      if (!f.absent_means_default || std::string_view(f.name) == "model") continue;
      MG_CHECK(f.get(o.model) == interop::absent_field_value(f), "train: --{} is an option of --model llama; the model "
               "is \"{}\"", f.name, o.model.kind);
    }
  }
}

// --model-config: the model's shape from a config.json. A size option the caller gave must agree
// with the file (it is not silently replaced); the others take the file's values.
train::TrainOptions with_model_config(const train::TrainOptions& given) {
  if (given.model_config.empty()) return given;
  MG_CHECK(given.init_from.empty(), "train: --model-config and --init-from both give the model's shape (--init-from "
           "reads its directory's config.json): give one");
  MG_CHECK(given.resume.empty(), "train: --model-config with --resume: a resumed run's shape is its checkpoint's; "
           "leave --model-config out");
  const nn::ModelConfig file = interop::read_hf_config(given.model_config);
  train::TrainOptions o = given;
  // Every option of the model's shape and function (the fields a checkpoint fixes: sizes, kv heads,
  // RoPE, the window, ...), given as well, must say what the file says. The dtype stays the run's.
  for (const interop::ModelConfigField& f : interop::model_config_fields()) {
    const std::string_view name = f.name;
    if (!f.fixed_by_checkpoint || name == "dtype" || name == "model" || given.given_options.count(f.name) == 0) continue;
    const nlohmann::json mine = f.get(o.model), theirs = f.get(file);
    MG_CHECK(mine == theirs, "train: --{} {} disagrees with --model-config '{}', which gives {}: leave the option out or "
             "change the file", f.name, mine.dump(), given.model_config, theirs.dump());
  }
  MG_CHECK(given.given_options.count("model") == 0 || given.model.kind == file.kind, "train: --model {} disagrees with "
           "--model-config '{}', a {} model", given.model.kind, given.model_config, file.kind);
  // The file's shape with the run's own sizes (seq, batch, dropout, dtype).
  nn::ModelConfig m = file;
  m.seq = o.model.seq;
  m.batch = o.model.batch;
  m.dropout = o.model.dropout;
  m.dtype = o.model.dtype;
  m.capacity_factor = o.model.capacity_factor;
  o.model = m;
  return o;
}

// --init-from: the model's family is its directory's (a Llama-family directory makes the run a
// Llama one, so the Llama-only options and refusals apply to it); its shape is read by the trainer
// (interop::hf_init_config), which checks the sizes given against the file.
train::TrainOptions with_init_from_family(const train::TrainOptions& given) {
  if (given.init_from.empty()) return given;
  const std::filesystem::path config = std::filesystem::path(given.init_from) / interop::kHfConfigFile;
  if (!std::filesystem::is_regular_file(config)) return given;   // hf_init_config says what is missing
  const nn::ModelConfig file = interop::read_model_config(config.string());
  MG_CHECK(given.given_options.count("model") == 0 || given.model.kind == file.kind, "train: --model {} disagrees with "
           "--init-from '{}', whose config.json is a {} model ({}): leave --model out", given.model.kind,
           given.init_from, file.kind, file.kind == "gpt" ? "gpt2" : file.model_type);
  train::TrainOptions o = given;
  o.model.kind = file.kind;
  return o;
}

// The language models train and grads run: gpt, llama, and the kinds a program registered
// (nn::register_model; the Python module's register_family). The MLP stack is not one.
void check_language_model(const char* job, const std::string& kind) {
  if (kind == "gpt" || kind == "llama" || nn::registered_model(kind)) return;
  std::string kinds = "\"gpt\", \"llama\"";
  for (const std::string& k : nn::model_kinds()) {
    if (nn::registered_model(k)) kinds += fmt::format(", \"{}\"", k);
  }
  throw InvalidArgument(fmt::format("{}: the model must be one of {} (a program adds its own with nn::register_model, "
                                    "Python with meshgrad.register_family), got \"{}\"", job, kinds, kind));
}

}  // namespace

void check_train_options(const train::TrainOptions& o) {
  check_language_model("train", o.model.kind);
  check_llama_edges(o);
  // 0 is dropless routing (the default, which a run's recorded configuration carries back as --config).
  MG_CHECK(o.model.capacity_factor >= 0 && std::isfinite(o.model.capacity_factor), "train: --capacity-factor {} must "
           "be > 0 (or 0: dropless routing, the default)", o.model.capacity_factor);
  MG_CHECK(o.model.capacity_factor == 0 || o.model.moe() || !o.init_from.empty() || !o.resume.empty(),
           "train: --capacity-factor caps a mixture of experts' experts, and the model has none (--experts 0)");
  check_positive("train", "steps", o.steps);
  // With init_from, 0 takes the size from its config.json (hf_io.hpp).
  for (const auto& [option, value] : {std::pair{"layers", o.model.layers}, std::pair{"hidden", o.model.hidden},
                                      std::pair{"heads", o.model.heads}}) {
    if (o.init_from.empty() || value != 0) check_positive("train", option, value);
  }
  check_positive("train", "seq", o.model.seq);
  check_positive("train", "batch", o.model.batch);
  MG_CHECK(o.model.dtype != DType::Int64, "train: --dtype must be float32 or float64");
  MG_CHECK(o.model.dropout >= 0 && o.model.dropout < 1, "train: --dropout must be in [0, 1), got {}", o.model.dropout);
  MG_CHECK(o.lr > 0, "train: --lr must be > 0, got {}", o.lr);
  MG_CHECK(o.warmup_steps >= 0, "train: --warmup must be >= 0, got {}", o.warmup_steps);
  train::check_optimizer_options(o);
  train::check_blas_threads(o);
  check_positive("train", "grad-accum", o.grad_accum);
  // A path option given with an empty value (an unset shell variable, "" in a --config file) is an
  // error, never "no such output" or "start from scratch": --resume "" would silently train anew.
  for (const auto& [option, value] :
       {std::pair<const char*, const std::string&>{"data", o.data_path}, {"val-data", o.val_data_path}, {"save", o.save_path},
        {"metrics", o.metrics_path}, {"trace", o.trace_path}, {"checkpoint-dir", o.checkpoint_dir},
        {"resume", o.resume}, {"init-from", o.init_from}}) {
    MG_CHECK(!value.empty() || o.given_options.count(option) == 0, "train: --{}: the path is empty ({})", option,
             std::string_view(option) == "metrics" ? "name a file; the command line's --no-metrics writes none"
                                                   : "name one, or leave the option out");
  }
}

namespace {

// A resumed run writes its checkpoints into the folder it resumed from unless --checkpoint-dir is
// given (train::resume_options): a folder it cannot write (a read-only mount or copy) is refused
// before any work, naming the way out. Writability as the kernel decides it for this process
// (access(2)): a read-only mount or an immutable folder fails it for root too.
void check_resumed_folder_writable(const train::TrainOptions& o) {
  if (o.checkpoint_dir.empty() || o.given_options.count("checkpoint-dir") > 0) return;
  if (::access(o.checkpoint_dir.c_str(), W_OK | X_OK) == 0) return;
  throw InvalidArgument(fmt::format(
      "train: --resume '{}': a resumed run writes its checkpoints into the folder it resumed from, '{}', and that "
      "folder is not writable: {}; name another folder for them with --checkpoint-dir OTHER (the checkpoint is only "
      "read)", o.resume, o.checkpoint_dir, io::errno_text(errno)));
}

// Whether `message` names the option --name (not a longer one: --mesh is not in --mesh-invariant).
bool names_option(std::string_view message, const std::string& name) {
  const std::string flag = "--" + name;
  const auto part_of_name = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_'; };
  for (std::size_t at = message.find(flag); at != std::string_view::npos; at = message.find(flag, at + 1)) {
    const std::size_t end = at + flag.size();
    if ((at == 0 || !part_of_name(message[at - 1])) && (end == message.size() || !part_of_name(message[end]))) return true;
  }
  return false;
}

// What an error of a resumed run that names options the run took from its checkpoint (not given, with
// another value than the caller's: train::TrainOptions::from_checkpoint) adds: where they came from
// and how to override them, since the user may never have given them. "" when it names none.
std::string checkpoint_options_note(const train::TrainOptions& o, std::string_view message) {
  std::string named, overrides;
  for (const auto& [name, value] : o.from_checkpoint) {
    std::vector<std::string> names = train::option_names(name);   // --grad-accum is also --micro-batches
    // The mesh-invariant mode includes the tp-invariant one, whose messages say --tp-invariant.
    if (name == "mesh-invariant") names.push_back("tp-invariant");
    if (std::none_of(names.begin(), names.end(), [&](const std::string& n) { return names_option(message, n); })) continue;
    named += fmt::format("{}--{} {}", named.empty() ? "" : ", ", name, value);
    overrides += fmt::format("{}--{}{}", overrides.empty() ? "" : ", ", name,
                             value == "true" ? "=false" : value == "false" ? "" : " ...");
  }
  if (named.empty()) return "";
  return fmt::format(" ({} came from the checkpoint '{}', not from the command line: a resumed run takes its options "
                     "from the checkpoint unless given; override with {})", named, o.resume_dir, overrides);
}

// A resume whose --steps differs from the checkpoint's moves the default decay's end (decay_steps -1:
// to the last step), a kink in the learning-rate curve. --keep-schedule keeps the checkpoint's
// horizon; otherwise the resume says what changes (the next step's rate, before and now) and how to
// keep it. saved_step: the step the checkpoint was taken after.
void keep_or_report_schedule(train::TrainOptions& o, const nlohmann::json& recorded, std::int64_t saved_step) {
  const int recorded_steps = recorded.value("steps", o.steps);
  const int horizon = recorded_steps - 1 - std::max(0, o.warmup_steps);
  if (o.decay_steps >= 0 || recorded_steps == o.steps || o.lr_schedule == "constant" || horizon < 1) return;
  train::TrainOptions kept = o;
  kept.decay_steps = horizon;
  if (o.keep_schedule) {
    o.decay_steps = horizon;
    if (o.progress) {
      fmt::print(stderr, "meshgrad train: --keep-schedule: the learning rate follows the checkpoint's schedule "
                 "(--decay-steps {}: --min-lr from step {} on)\n", horizon, recorded_steps);
    }
    return;
  }
  if (!o.progress) return;
  const int next = static_cast<int>(saved_step);   // learning_rate's step index is 0-based: step next + 1
  fmt::print(stderr, "meshgrad train: --steps {} instead of the checkpoint's {} moves the end of the {} learning-rate "
             "decay from step {} to step {}: step {} trains at {:.3g}, not {:.3g}; give --keep-schedule (or "
             "--decay-steps {}) to keep the checkpoint's schedule\n", o.steps, recorded_steps, o.lr_schedule,
             recorded_steps, o.steps, next + 1, train::learning_rate(o, next), train::learning_rate(kept, next), horizon);
}

}  // namespace

train::TrainOptions resolve_resume(const train::TrainOptions& given) {
  if (given.resume.empty()) return given;
  const std::string dir = checkpoint::resolve_checkpoint(given.resume);
  const checkpoint::Manifest manifest = checkpoint::read_manifest(dir);
  const auto config = manifest.state.find("config");
  if (config == manifest.state.end())
    throw checkpoint::CheckpointError(fmt::format("checkpoint '{}': its state has no \"config\"", dir));
  std::string changed, left_out;
  train::TrainOptions options = train::resume_options(given, *config, dir, &changed, &left_out);
  options.resume_dir = dir;
  // The caller (the CLI, Python) runs on the checkpoint's mesh unless one is given.
  const auto mesh = manifest.state.find("mesh");
  if (given.given_options.count("mesh") == 0 && mesh != manifest.state.end() && mesh->is_string())
    options.from_checkpoint["mesh"] = mesh->get<std::string>();
  check_resumed_folder_writable(options);
  if (options.progress && !changed.empty()) fmt::print(stderr, "meshgrad train: resuming {} with {}\n", dir, changed);
  keep_or_report_schedule(options, *config, manifest.step);
  if (options.progress && !left_out.empty()) {
    const auto recorded = config->find("checkpoint-dir");
    const std::string own = recorded != config->end() && recorded->is_string() ? recorded->get<std::string>() : "?";
    fmt::print(stderr, "meshgrad train: resuming from '{}', not from the checkpoint's own folder '{}': the output files "
               "recorded for the run there ({}) are not written; give them again to write them\n",
               train::resumed_from_folder(dir), own, left_out);
  }
  return options;
}

train::TrainResult run_train_job(const train::TrainOptions& given_options, const dist::RunOnMesh& run_on_mesh) {
  const train::TrainOptions given = with_init_from_family(with_model_config(given_options));
  check_llama_edges(given);   // before a checkpoint is read for --resume
  train::TrainOptions options = resolve_resume(given);
  // --experts on the Llama family is Mixtral's model_type unless one was given (what export writes).
  if (options.model.kind == "llama" && options.model.moe() && options.given_options.count("model-type") == 0) {
    options.model.model_type = "mixtral";
  }
  try {
    check_train_options(options);
    if (options.sample_every > 0 && !options.sampler) set_train_sampler(options);
    train::TraceRecorder trace(options.trace_path, "--trace", options.provenance, options.progress);
    std::optional<train::TrainResult> result;
    run_on_mesh([&](const dist::DeviceMeshPtr& mesh) {
      if (mesh->rank() == 0 && options.progress) {
        for (const std::string& note : ignored_option_notes(options, *mesh)) fmt::print(stderr, "meshgrad train: note: {}\n", note);
      }
      train::TrainResult r = train::train(options, mesh);
      trace.finish_rank(*mesh->world());
      // threads: rank 0's thread keeps its result; mpi: this process runs one rank and keeps its own
      // (the same losses on every rank; its own clock).
      if (mesh->rank() == 0 || mesh->world()->backend() == "mpi") result = std::move(r);
    });
    MG_CHECK(result.has_value(), "train: no rank returned a result");
    trace.finish();
    return *std::move(result);
  } catch (const io::FileIoError&) {
    throw;   // about a file, not an option (and of its own type for Python)
  } catch (const io::OutputFileError&) {
    throw;
  } catch (const checkpoint::CheckpointError& e) {
    const std::string note = checkpoint_options_note(options, e.what());
    if (note.empty()) throw;
    throw checkpoint::CheckpointError(e.what() + note);
  } catch (const InvalidArgument& e) {
    const std::string note = checkpoint_options_note(options, e.what());
    if (note.empty()) throw;
    throw InvalidArgument(e.what() + note);
  }
}

namespace {

// grads' model and batch from its files: the config (either family), the batch checked against it,
// the weights checked whole before a model of the config's size is allocated.
struct GradsInputs {
  nn::ModelConfig config;
  nn::Batch batch;
  std::optional<interop::WeightFiles> weights;
  DType weights_dtype = DType::Float32;   // the embedding's: the default compute dtype
};

GradsInputs read_grads_files(const GradsJob& job) {
  GradsInputs in;
  in.config = interop::read_model_config(job.config);
  nn::ModelConfig& config = in.config;
  const io::SafetensorsFile batch_file(job.batch);
  in.batch = {read_batch_tensor(batch_file, "inputs"), read_batch_tensor(batch_file, "targets")};
  const nn::Batch& batch = in.batch;
  MG_CHECK(batch.inputs.shape() == batch.targets.shape(), "batch '{}': inputs {} and targets {} differ in shape",
           job.batch, batch.inputs.str(), batch.targets.str());
  MG_CHECK(batch.inputs.numel() > 0, "batch '{}': inputs {} hold no token (a batch needs B >= 1 rows of T >= 1)",
           job.batch, batch.inputs.str());
  check_token_range(batch.inputs, "inputs", job.batch, config.vocab, /*ignore=*/false);
  check_token_range(batch.targets, "targets", job.batch, config.vocab, /*ignore=*/true);
  config.batch = static_cast<int>(batch.inputs.size(0));
  config.seq = static_cast<int>(batch.inputs.size(1));
  MG_CHECK(config.seq <= config.n_positions(), "batch '{}': T = {} exceeds the {} positions of config '{}'", job.batch,
           config.seq, config.n_positions(), job.config);
  in.weights.emplace(interop::WeightFiles::open_file(job.weights));
  const std::string embedding = config.kind == "gpt" ? "wte.weight" : "model.embed_tokens.weight";
  MG_CHECK(in.weights->contains(embedding), "weights '{}' hold no '{}': not the weights of the {} model config '{}' "
           "describes", job.weights, embedding, config.kind == "gpt" ? "GPT-2" : config.model_type, job.config);
  in.weights_dtype = in.weights->entry(embedding).dtype;
  MG_CHECK(in.weights_dtype != DType::Int64, "weights '{}': {} is int64, expected float32 or float64", job.weights,
           embedding);
  // Before any model of the config's size is allocated: a wrong n_positions or n_layer fails here.
  if (config.kind == "gpt") {
    interop::check_gpt2_config_against_weights(config, job.config, io::SafetensorsFile(job.weights));
  } else {
    (void)interop::check_llama_weights(*in.weights, config, job.config);
  }
  return in;
}

// The seed mode's model and batch (make_model's initialisation, make_synthetic_batch).
GradsInputs seeded_grads_inputs(const GradsJob& job) {
  GradsInputs in;
  in.config = job.model;
  nn::ModelConfig& config = in.config;
  check_language_model("grads", config.kind);
  for (const auto& [option, value] : {std::pair{"layers", config.layers}, {"hidden", config.hidden},
                                      {"heads", config.heads}, {"vocab", config.vocab}, {"seq", config.seq},
                                      {"batch", config.batch}}) {
    check_positive("grads", option, value);
  }
  config.dropout = 0.0;
  in.batch = data::make_synthetic_batch(config, 1, 0, job.seed);
  return in;
}

}  // namespace

GradsResult run_grads_job(const GradsJob& job, const dist::RunOnMesh& run_on_mesh) {
  const bool from_files = !job.config.empty() || !job.weights.empty() || !job.batch.empty();
  MG_CHECK(!from_files || (!job.config.empty() && !job.weights.empty() && !job.batch.empty()),
           "grads: --config, --weights and --batch go together (got config '{}', weights '{}', batch '{}')",
           job.config, job.weights, job.batch);
  GradsInputs in = from_files ? read_grads_files(job) : seeded_grads_inputs(job);
  nn::ModelConfig& config = in.config;
  if (!job.dtype.empty()) config.dtype = parse_dtype(job.dtype);
  else if (from_files) config.dtype = in.weights_dtype;
  MG_CHECK(config.dtype != DType::Int64, "grads: --dtype must be float32 or float64");
  config.capacity_factor = job.capacity_factor;
  const DType out_dtype = from_files ? in.weights_dtype : config.dtype;
  nn::ParallelConfig parallel;
  parallel.sequence_parallel = job.sequence_parallel;
  if (job.tp_invariant) parallel.require(nn::Invariance::Tp);
  if (job.mesh_invariant) parallel.require(nn::Invariance::Mesh);
  parallel.invariant_blocks = job.invariant_blocks;
  parallel.batch_blocks = job.batch_blocks;
  parallel.sequence_blocks = job.sequence_blocks;
  const std::vector<interop::ModelTensor> specs = interop::model_tensors(config);

  GradsResult result;
  run_on_mesh([&](const dist::DeviceMeshPtr& mesh) {
    nn::check_moe(config, mesh->has_axis("ep") ? mesh->axis_size("ep") : 1, mesh->str());
    const int split = train::batch_split_size(*mesh);
    if (parallel.mesh_invariant()) {
      train::check_mesh_invariant_split(config.batch, split, 1, parallel.batch_blocks);
    } else {
      MG_CHECK(config.batch % split == 0, "grads: the batch's {} rows do not split over the {} data-parallel replicas "
               "of mesh {}", config.batch, split, mesh->str());
    }
    auto model = nn::make_model(config, parallel, mesh, from_files ? 0 : job.seed);
    model->set_training(false);
    if (from_files) interop::load_model_parameters(*in.weights, config, model->parameters());
    train::GradientDump dump = train::compute_gradients(*model, in.batch, mesh,
                                                        train::micro_batches_per_replica(parallel, *mesh, 1));
    if (mesh->rank() != 0) return;
    result.loss = dump.loss;
    result.aux_loss = dump.aux_loss;
    for (auto& [name, grad] : dump.gradients) {
      const auto spec = std::find_if(specs.begin(), specs.end(), [&](const interop::ModelTensor& t) { return t.name == name; });
      MG_CHECK(spec != specs.end(), "grads: the model's parameter '{}' has no file layout", name);
      const DType out = in.weights && in.weights->contains(name) ? in.weights->entry(name).dtype : out_dtype;
      for (auto& [file_name, g] : interop::to_file_tensors(*spec, grad)) result.gradients.emplace_back(file_name, g.to(out));
    }
    result.dtype = out_dtype;
    result.mesh = mesh->str();
    result.backend = mesh->world()->backend();
    result.has_result = true;
  });
  return result;
}

}  // namespace meshgrad::launch
