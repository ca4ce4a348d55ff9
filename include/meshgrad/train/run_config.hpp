// The run configuration as a checkpoint records it: the JSON a `--config` file holds (command-line
// option names as keys), and the rules for resuming: which options a resumed run may change (steps,
// lr, the checkpointing options, ...) and which it may not (the model's shape, whose keys are
// interop::model_config_fields).
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "meshgrad/train/options.hpp"

namespace meshgrad::train {

// The options of a run as {"layers": 4, "hidden": 128, ..., "lr": 0.003, "sequence-parallel": false,
// "checkpoint-dir": "ck", ...}: every option that shapes the run, by its command-line name. The
// model's vocabulary is the resolved one (the data's when options.model.vocab is 0).
nlohmann::json run_config_json(const TrainOptions& options, int resolved_vocab);

// Every text option the run records (the paths --data, --val-data, --metrics, --save,
// --checkpoint-dir, absolute, and --sample-prompt, --lr-schedule, --pp-schedule) must be valid UTF-8:
// the records are JSON text (checkpoint manifests and --save's safetensors metadata are written
// strictly), so a byte that is not would fail the run at its first save, after the training.
// Throws InvalidArgument naming the option, its text (bad bytes as \xHH) and the offset of the first
// bad byte in it; for a relative path that is UTF-8 but whose absolute form is not, the working
// directory. Paths are refused rather than escaped: a resume reads them back from the record as the
// paths to open, and a lossless escape would need its own decoding on every reader of the record.
void check_recorded_text(const TrainOptions& options);

// The backstop of check_recorded_text for everything else a run records (a checkpoint's state, the
// --save metadata): throws InvalidArgument naming `what`, the place in `record` (a JSON pointer, e.g.
// "/data/identity/files/3") and the offset when one of its strings (keys included) is not valid UTF-8.
void check_record_text(const nlohmann::json& record, const std::string& what);

// The options of a run resumed from `checkpoint` (a path for messages) whose saved configuration is
// `saved`: the saved value of every option, except those named in options.given_options (under the
// option's name or another name of it: --micro-batches is --grad-accum), which keep the caller's
// value (and are listed in *changed, with both values, when they differ). The options taken from
// the checkpoint with another value than the caller's go to from_checkpoint. Throws
// checkpoint::CheckpointError naming each model-shape option given with another value than the
// checkpoint's.
// An option the checkpoint does not record (it was written by a meshgrad that did not have it) keeps
// the caller's value. Keeps the caller's run-time fields (progress, provenance, on_step, resume, ...).
//
// Where the resumed run writes, unless the caller gives the option: a resume never writes outside
// the folder it resumed from (resumed_from_folder(checkpoint)) on its own.
// - Its checkpoints go into that folder. On a resume in place (that folder is the checkpoint's
//   recorded --checkpoint-dir, compared as files, so any spelling or link counts) this is the
//   recorded path, as before; from a copy or a moved folder it is the copy, so --keep prunes the
//   copy's checkpoints, never the original's.
// - The recorded output files (--metrics, --save) are the run's that wrote into the recorded
//   folder: a resume in place takes them; a resume from any other folder writes none of them (nor
//   the caller's default) unless given again, and lists them in *left_out ("" when none).
TrainOptions resume_options(const TrainOptions& options, const nlohmann::json& saved, const std::string& checkpoint,
                            std::string* changed = nullptr, std::string* left_out = nullptr);

// The command-line names of the option `name` of the run configuration: its own, then the others
// that set it ("grad-accum": also "micro-batches").
std::vector<std::string> option_names(const std::string& name);

// The folder a checkpoint directory was resumed from: the directory holding it ("ck" for
// "ck/step_00000006", "." for a checkpoint in the working directory), where a resumed run writes its
// checkpoints unless --checkpoint-dir is given.
std::string resumed_from_folder(const std::string& checkpoint);

}  // namespace meshgrad::train
