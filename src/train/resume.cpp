// Run configuration <-> JSON and the resume rules (contract in include/meshgrad/train/resume.hpp).
#include "meshgrad/train/resume.hpp"

#include <fmt/format.h>

#include "meshgrad/train/checkpoint_store.hpp"

namespace meshgrad::train {

namespace {

// One option: its command-line name, how it goes to JSON and back.
struct OptionField {
  const char* name;
  nlohmann::json (*get)(const TrainOptions&, int resolved_vocab);
  void (*set)(TrainOptions&, const nlohmann::json&);
};

#define MG_FIELD(NAME, EXPR)                                                                 \
  OptionField {                                                                              \
    NAME, [](const TrainOptions& o, int) -> nlohmann::json { return o.EXPR; },               \
        [](TrainOptions& o, const nlohmann::json& v) { v.get_to(o.EXPR); }                   \
  }

const std::vector<OptionField>& option_fields() {
  static const std::vector<OptionField> fields = {
      MG_FIELD("layers", model.layers),
      MG_FIELD("hidden", model.hidden),
      MG_FIELD("ffn", model.ffn),
      MG_FIELD("heads", model.heads),
      OptionField{"vocab", [](const TrainOptions&, int vocab) -> nlohmann::json { return vocab; },
                  [](TrainOptions& o, const nlohmann::json& v) { v.get_to(o.model.vocab); }},
      MG_FIELD("positions", model.positions),
      MG_FIELD("layer-norm-epsilon", model.layer_norm_epsilon),
      OptionField{"dtype", [](const TrainOptions& o, int) -> nlohmann::json { return std::string(dtype_name(o.model.dtype)); },
                  [](TrainOptions& o, const nlohmann::json& v) { o.model.dtype = parse_dtype(v.get<std::string>()); }},
      MG_FIELD("seq", model.seq),
      MG_FIELD("batch", model.batch),
      MG_FIELD("dropout", model.dropout),
      MG_FIELD("sequence-parallel", parallel.sequence_parallel),
      MG_FIELD("overlap", parallel.overlap),
      MG_FIELD("regather", parallel.recompute_allgather),
      MG_FIELD("checkpoint-blocks", parallel.checkpoint_blocks),
      MG_FIELD("tp-invariant", parallel.tp_invariant),
      MG_FIELD("invariant-blocks", parallel.invariant_blocks),
      MG_FIELD("steps", steps),
      MG_FIELD("lr", lr),
      MG_FIELD("warmup", warmup_steps),
      MG_FIELD("min-lr-ratio", min_lr_ratio),
      MG_FIELD("weight-decay", weight_decay),
      MG_FIELD("seed", seed),
      MG_FIELD("data", data_path),
      MG_FIELD("metrics", metrics_path),
      MG_FIELD("save", save_path),
      MG_FIELD("eval-every", eval_every),
      MG_FIELD("eval-steps", eval_steps),
      MG_FIELD("grad-clip", grad_clip),
      MG_FIELD("grad-accum", grad_accum),
      MG_FIELD("checkpoint-dir", checkpoint_dir),
      MG_FIELD("save-every", save_every),
      MG_FIELD("keep", keep),
      MG_FIELD("sync-checkpoints", checkpoint_sync),
  };
  return fields;
}
#undef MG_FIELD

}  // namespace

nlohmann::json run_config_json(const TrainOptions& options, int resolved_vocab) {
  nlohmann::json j = nlohmann::json::object();
  for (const OptionField& f : option_fields()) j[f.name] = f.get(options, resolved_vocab);
  return j;
}

const std::set<std::string>& fixed_by_checkpoint() {
  static const std::set<std::string> fixed = {"layers", "hidden", "ffn", "heads", "vocab", "positions", "layer-norm-epsilon",
                                              "dtype"};
  return fixed;
}

TrainOptions resume_options(const TrainOptions& options, const nlohmann::json& saved, const std::string& checkpoint,
                            std::string* changed) {
  if (!saved.is_object()) throw CheckpointError(fmt::format("checkpoint '{}': the saved configuration is not an object", checkpoint));
  TrainOptions out = options;
  std::string refused, notes;
  for (const OptionField& f : option_fields()) {
    const auto it = saved.find(f.name);
    if (it == saved.end()) {
      // An option newer than the checkpoint: its default (or the caller's value) holds, as it did
      // for the run that wrote it. The model's shape is always recorded.
      if (fixed_by_checkpoint().count(f.name) > 0)
        throw CheckpointError(fmt::format("checkpoint '{}': the saved configuration has no \"{}\"", checkpoint, f.name));
      continue;
    }
    const bool given = options.given_options.count(f.name) > 0;
    if (!given) {
      try {
        f.set(out, *it);
      } catch (const std::exception& e) {
        throw CheckpointError(fmt::format("checkpoint '{}': the saved \"{}\" is {}: {}", checkpoint, f.name, it->dump(), e.what()));
      }
      continue;
    }
    // The model's vocabulary 0 means "the data's": compare the resolved one the checkpoint holds.
    const nlohmann::json mine = f.get(options, options.model.vocab);
    if (mine == *it) continue;
    if (fixed_by_checkpoint().count(f.name) > 0) {
      refused += fmt::format("{}--{} {} (the checkpoint has {})", refused.empty() ? "" : ", ", f.name, mine.dump(), it->dump());
    } else {
      notes += fmt::format("{}--{} {} -> {}", notes.empty() ? "" : ", ", f.name, it->dump(), mine.dump());
    }
  }
  if (!refused.empty())
    throw CheckpointError(fmt::format("checkpoint '{}' holds a model of another shape than the options ask for: {}; a "
                                      "checkpoint only resumes into the model it was written from (leave these options out)",
                                      checkpoint, refused));
  if (changed) *changed = notes;
  return out;
}

nn::ModelConfig checkpoint_model_config(const Manifest& manifest, const std::string& dir) {
  const auto config = manifest.state.find("config");
  if (config == manifest.state.end())
    throw CheckpointError(fmt::format("checkpoint '{}': its state has no \"config\" (not written by meshgrad train?)", dir));
  TrainOptions defaults;
  const TrainOptions saved = resume_options(defaults, *config, dir);
  nn::ModelConfig m = saved.model;
  const ManifestTensor* wte = manifest.find("wte.weight");
  if (wte == nullptr) throw CheckpointError(fmt::format("checkpoint '{}' has no tensor 'wte.weight'", dir));
  m.dtype = wte->dtype;
  return m;
}

std::vector<std::pair<std::string, Tensor>> read_full_tensors(const std::string& dir, const Manifest& manifest,
                                                              const std::vector<std::pair<std::string, Shape>>& names) {
  std::vector<PieceRequest> requests;
  for (const auto& [name, shape] : names) {
    const ManifestTensor* t = manifest.find(name);
    if (t == nullptr) throw CheckpointError(fmt::format("checkpoint '{}' has no tensor '{}'", dir, name));
    dist::PieceLayout whole;
    for (const std::int64_t n : shape) whole.ranges.push_back({ShardRange{0, n}});
    whole.local_shape = shape;
    requests.push_back({name, shape, whole, t->dtype});
  }
  std::vector<Tensor> read = read_pieces(dir, manifest, requests);
  std::vector<std::pair<std::string, Tensor>> out;
  for (std::size_t i = 0; i < names.size(); ++i) out.emplace_back(names[i].first, std::move(read[i]));
  return out;
}

std::map<std::string, std::string> checkpoint_data_metadata(const Manifest& manifest) {
  std::map<std::string, std::string> out;
  const auto data = manifest.state.find("data");
  if (data == manifest.state.end() || !data->is_object()) return out;
  if (data->contains("meta") && (*data)["meta"].is_string()) out["data_meta"] = (*data)["meta"].get<std::string>();
  if (data->contains("description") && (*data)["description"].is_string()) {
    out["data_tokens"] = (*data)["description"].get<std::string>();   // as --save records it ("bytes", ...)
  }
  return out;
}

std::string cli_mesh_spec(const dist::DeviceMesh& mesh) {
  const int dp = mesh.has_axis("dp") ? mesh.axis_size("dp") : 1;
  std::string tp;
  if (mesh.has_axis("tp_row") && mesh.has_axis("tp_col")) {
    tp = fmt::format("tp={}x{}", mesh.axis_size("tp_row"), mesh.axis_size("tp_col"));
  } else {
    tp = fmt::format("tp={}", mesh.has_axis("tp") ? mesh.axis_size("tp") : 1);
  }
  return dp > 1 ? fmt::format("dp={},{}", dp, tp) : tp;
}

}  // namespace meshgrad::train
