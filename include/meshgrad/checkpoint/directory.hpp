// Checkpoint directories under a root (store.hpp describes what one holds): their names, finding the
// committed ones, and reading their manifest.
//
//   ROOT/step_00000100/manifest.json    a committed checkpoint (it has a manifest)
//   ROOT/.step_00000100.tmp/             a save in progress, or what a killed one left (saver.hpp)
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "meshgrad/checkpoint/manifest.hpp"
#include "meshgrad/io/output_path.hpp"

namespace meshgrad::checkpoint {

// The file in a checkpoint directory that makes it one: written last, by the commit.
inline constexpr const char* kManifestFileName = "manifest.json";

// "step_00000100": the directory name of the checkpoint taken after `step` optimizer steps.
std::string checkpoint_dir_name(std::int64_t step);

// True for a name that saves write, rename or remove directly under a root: a checkpoint
// (step_XXXXXXXX), a temporary (.step_*: a save in progress, an old checkpoint exchanged out of its
// name, a pruned one) and the lock (.lock). Anything else under the root is left alone.
bool is_checkpoint_root_name(const std::string& name);

// Throws InvalidArgument naming both options when one of `outputs` (files: --metrics, --save,
// --trace) lies in the checkpoint root under one of those names, directly (--metrics ck/step_00000002)
// or inside one (ck/step_00000002/m.jsonl): a save or a prune would replace or delete it. Paths are
// compared after resolving what exists of them (weakly_canonical), so other spellings count.
void check_outputs_outside_checkpoint_names(const io::NamedPath& root, const std::vector<io::NamedPath>& outputs);

// The committed checkpoints under root (directories step_XXXXXXXX with a manifest.json), in the order
// they were committed (Manifest::commit; among checkpoints of older meshgrads, which have none, by
// step), oldest first, as full paths; one whose manifest cannot be read sorts as the newest, so
// that what resolves the newest reports it rather than passing over it. Temporaries and other
// entries are ignored.
std::vector<std::string> list_checkpoints(const std::string& root);
// The commit number of checkpoint dir (Manifest::commit, 0 in older meshgrads' manifests), or
// nullopt when its manifest cannot be read (its errors are reported where it is used).
std::optional<std::int64_t> commit_number(const std::string& dir);
// True when path is a checkpoint directory (holds manifest.json) or a root holding at least one.
bool is_checkpoint_path(const std::string& path);
// `path` itself when it holds manifest.json, else the checkpoint under it committed last (not the
// highest step: see Manifest::commit). Throws CheckpointError naming path when there is none.
std::string resolve_checkpoint(const std::string& path);
// Reads and parses dir/manifest.json (size-bounded).
Manifest read_manifest(const std::string& dir);

}  // namespace meshgrad::checkpoint
