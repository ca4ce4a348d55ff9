// What a checkpoint needs from the trainer and gives back to it: the run configuration as the JSON a
// `--config` file holds (command-line option names as keys), and the rules for resuming: which
// options a resumed run may change and which it may not.
#pragma once

#include <nlohmann/json.hpp>
#include <map>
#include <set>
#include <utility>
#include <vector>
#include <string>

#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/train/checkpoint_store.hpp"
#include "meshgrad/train/trainer.hpp"

namespace meshgrad::train {

// The options of a run as {"layers": 4, "hidden": 128, ..., "lr": 0.003, "sequence-parallel": false,
// "checkpoint-dir": "ck", ...}: every option that shapes the run, by its command-line name. The
// model's vocabulary is the resolved one (the data's when options.model.vocab is 0).
nlohmann::json run_config_json(const TrainOptions& options, int resolved_vocab);

// The model-shape options: a checkpoint only loads into the same shape, so a resumed run may not
// change them (the others, from --steps to --lr and the checkpointing options, it may).
const std::set<std::string>& fixed_by_checkpoint();

// The options of a run resumed from `checkpoint` (a path for messages) whose saved configuration is
// `saved`: the saved value of every option, except those named in options.given_options, which keep
// the caller's value (and are listed in *changed, with both values, when they differ). Throws
// CheckpointError naming each model-shape option given with another value than the checkpoint's.
// An option the checkpoint does not record (it was written by a meshgrad that did not have it) keeps
// the caller's value. Keeps the caller's run-time fields (progress, provenance, on_step, resume, ...).
TrainOptions resume_options(const TrainOptions& options, const nlohmann::json& saved, const std::string& checkpoint,
                            std::string* changed = nullptr);

// The model a checkpoint holds: the sizes and dropout of its saved configuration, the dtype of its
// tensors. Throws CheckpointError naming dir when the state lacks them.
nn::ModelConfig checkpoint_model_config(const Manifest& manifest, const std::string& dir);

// The full tensors `names` of checkpoint dir (each read whole from its pieces, hashes checked), in the
// given order: what `sample`, `export` and other single-file tools read from a sharded checkpoint.
std::vector<std::pair<std::string, Tensor>> read_full_tensors(const std::string& dir, const Manifest& manifest,
                                                              const std::vector<std::pair<std::string, Shape>>& names);

// The metadata a `train --save` file carries about its data, from a checkpoint's state: "data_meta"
// (the prepared directory's meta.json, which names the tokenizer) and "data_tokens" (its
// description, "bytes" for byte tokens), when the checkpoint recorded them.
std::map<std::string, std::string> checkpoint_data_metadata(const Manifest& manifest);

// The mesh as --mesh spells it: "dp=2,tp=4", "tp=2x2" (2-D: tp_row x tp_col), "dp=2,tp=2x2".
std::string cli_mesh_spec(const dist::DeviceMesh& mesh);

}  // namespace meshgrad::train
