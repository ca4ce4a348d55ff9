// Run configuration <-> JSON and the resume rules (contract in include/meshgrad/train/run_config.hpp).
#include "meshgrad/train/run_config.hpp"

#include <fmt/format.h>

#include <filesystem>
#include <functional>

#include "meshgrad/checkpoint/manifest.hpp"
#include "meshgrad/interop/checkpoint_model.hpp"

namespace meshgrad::train {

namespace {

// "" (none / the built-in corpus) is left out of the record (null), as an option not given: a recorded
// configuration fed back as --config must not give a path option an empty value, which is an error.
nlohmann::json absolute_path(const std::string& path) {
  if (path.empty()) return nullptr;
  return std::filesystem::absolute(path).lexically_normal().string();
}

// One option: its command-line name, how it goes to JSON and back, and whether a checkpoint fixes
// it (the model's shape).
struct OptionField {
  std::string name;
  std::function<nlohmann::json(const TrainOptions&, int resolved_vocab)> get;
  std::function<void(TrainOptions&, const nlohmann::json&)> set;
  bool fixed_by_checkpoint = false;
};

// A path is recorded absolute, so a resume from another working directory finds the same files.
#define MG_PATH_FIELD(NAME, EXPR)                                                            \
  OptionField {                                                                              \
    NAME, [](const TrainOptions& o, int) -> nlohmann::json { return absolute_path(o.EXPR); }, \
        [](TrainOptions& o, const nlohmann::json& v) { v.get_to(o.EXPR); }                   \
  }

#define MG_FIELD(NAME, EXPR)                                                                 \
  OptionField {                                                                              \
    NAME, [](const TrainOptions& o, int) -> nlohmann::json { return o.EXPR; },               \
        [](TrainOptions& o, const nlohmann::json& v) { v.get_to(o.EXPR); }                   \
  }

// The model's sizes (interop::model_config_fields: the one list of their keys, which is also what
// export and sample read back from a checkpoint), then the rest of the run.
const std::vector<OptionField>& option_fields() {
  static const std::vector<OptionField> fields = [] {
    std::vector<OptionField> f;
    for (const interop::ModelConfigField& m : interop::model_config_fields()) {
      f.push_back({m.name,
                   [get = m.get](const TrainOptions& o, int resolved_vocab) {
                     nn::ModelConfig c = o.model;
                     c.vocab = resolved_vocab;   // 0 means "the data's": record the one the run used
                     return get(c);
                   },
                   [set = m.set](TrainOptions& o, const nlohmann::json& v) { set(o.model, v); }, m.fixed_by_checkpoint});
    }
    const std::vector<OptionField> rest = {
        MG_FIELD("sequence-parallel", parallel.sequence_parallel),
        MG_FIELD("overlap", parallel.overlap),
        MG_FIELD("regather", parallel.recompute_allgather),
        MG_FIELD("checkpoint-blocks", parallel.checkpoint_blocks),
        MG_FIELD("reshard-after-forward", parallel.reshard_after_forward),
        MG_FIELD("shard-optimizer", parallel.shard_optimizer),
        MG_FIELD("tp-invariant", parallel.tp_invariant),
        MG_FIELD("invariant-blocks", parallel.invariant_blocks),
        MG_FIELD("mesh-invariant", parallel.mesh_invariant),
        MG_FIELD("batch-blocks", parallel.batch_blocks),
        MG_FIELD("pp-layers", parallel.pp_layers),
        MG_FIELD("pp-schedule", pp_schedule),
        MG_FIELD("blas-threads", blas_threads),
        MG_FIELD("steps", steps),
        MG_FIELD("lr", lr),
        MG_FIELD("warmup", warmup_steps),
        MG_FIELD("lr-schedule", lr_schedule),
        MG_FIELD("min-lr", min_lr),
        MG_FIELD("decay-steps", decay_steps),
        MG_FIELD("decay-fraction", decay_fraction),
        MG_FIELD("beta1", beta1),
        MG_FIELD("beta2", beta2),
        MG_FIELD("eps", eps),
        MG_FIELD("weight-decay", weight_decay),
        MG_FIELD("seed", seed),
        MG_PATH_FIELD("data", data_path),
        MG_PATH_FIELD("val-data", val_data_path),
        // Recorded even when "" (--no-metrics): left out, a resume would take the CLI's default file.
        OptionField{"metrics",
                    [](const TrainOptions& o, int) -> nlohmann::json {
                      return o.metrics_path.empty() ? nlohmann::json("") : absolute_path(o.metrics_path);
                    },
                    [](TrainOptions& o, const nlohmann::json& v) { v.get_to(o.metrics_path); }},
        MG_PATH_FIELD("save", save_path),
        MG_FIELD("eval-every", eval_every),
        MG_FIELD("eval-steps", eval_steps),
        MG_FIELD("sample-every", sample_every),
        MG_FIELD("sample-tokens", sample_tokens),
        MG_FIELD("sample-prompt", sample_prompt),
        MG_FIELD("grad-clip", grad_clip),
        MG_FIELD("grad-accum", grad_accum),
        MG_PATH_FIELD("checkpoint-dir", checkpoint_dir),
        MG_FIELD("save-every", save_every),
        MG_FIELD("keep", keep),
        MG_FIELD("sync-checkpoints", checkpoint_sync),
    };
    f.insert(f.end(), rest.begin(), rest.end());
    return f;
  }();
  return fields;
}
#undef MG_FIELD
#undef MG_PATH_FIELD

}  // namespace

nlohmann::json run_config_json(const TrainOptions& options, int resolved_vocab) {
  nlohmann::json j = nlohmann::json::object();
  for (const OptionField& f : option_fields()) {
    nlohmann::json value = f.get(options, resolved_vocab);
    if (!value.is_null()) j[f.name] = std::move(value);
  }
  return j;
}

TrainOptions resume_options(const TrainOptions& options, const nlohmann::json& saved, const std::string& checkpoint,
                            std::string* changed) {
  using checkpoint::CheckpointError;
  if (!saved.is_object()) throw checkpoint::CheckpointError(fmt::format("checkpoint '{}': the saved configuration is not an object", checkpoint));
  TrainOptions out = options;
  std::string refused, notes;
  for (const OptionField& f : option_fields()) {
    const auto it = saved.find(f.name);
    if (it == saved.end()) {
      // An option newer than the checkpoint: its default (or the caller's value) holds, as it did
      // for the run that wrote it. The model's shape is always recorded.
      if (f.fixed_by_checkpoint)
        throw checkpoint::CheckpointError(fmt::format("checkpoint '{}': the saved configuration has no \"{}\"", checkpoint, f.name));
      continue;
    }
    const bool given = options.given_options.count(f.name) > 0;
    // The stages' split belongs to the mesh it was written on: a resume on another mesh (given)
    // splits evenly unless --pp-layers is given too.
    if (!given && f.name == "pp-layers" && options.given_options.count("mesh") > 0) continue;
    if (!given) {
      try {
        f.set(out, *it);
      } catch (const std::exception& e) {
        throw checkpoint::CheckpointError(fmt::format("checkpoint '{}': the saved \"{}\" is {}: {}", checkpoint, f.name, it->dump(), e.what()));
      }
      continue;
    }
    // The model's vocabulary 0 means "the data's": compare the resolved one the checkpoint holds.
    const nlohmann::json mine = f.get(options, options.model.vocab);
    if (mine == *it) continue;
    // A model without its own "positions" has one position row per --seq (wpe is [seq, hidden]):
    // then --seq is part of its shape too.
    const bool shapes_positions = f.name == "seq" && saved.value("positions", nlohmann::json(0)) == nlohmann::json(0);
    if (f.fixed_by_checkpoint || shapes_positions) {
      refused += fmt::format("{}--{} {} (the checkpoint has {})", refused.empty() ? "" : ", ", f.name, mine.dump(), it->dump());
    } else {
      notes += fmt::format("{}--{} {} -> {}", notes.empty() ? "" : ", ", f.name, it->dump(), mine.dump());
    }
  }
  if (!refused.empty())
    throw checkpoint::CheckpointError(fmt::format("checkpoint '{}' holds a model of another shape than the options ask for: {}; a "
                                      "checkpoint only resumes into the model it was written from (leave these options out)",
                                      checkpoint, refused));
  if (changed) *changed = notes;
  return out;
}

}  // namespace meshgrad::train
