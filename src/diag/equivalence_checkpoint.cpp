// A training checkpoint as the model `meshgrad check` compares (contract in diag/equivalence.hpp).
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>

#include "meshgrad/checkpoint/directory.hpp"
#include "meshgrad/diag/equivalence.hpp"
#include "meshgrad/interop/checkpoint_model.hpp"

namespace meshgrad::diag {

namespace {

bool was_given(const std::vector<std::string>& given, const std::string& name) {
  return std::find(given.begin(), given.end(), name) != given.end();
}

// Refuses every given shape size (and dtype) that differs from the checkpoint's, naming them all.
void refuse_differing_sizes(const CheckpointModel& c, const nn::ModelConfig& requested,
                            const std::vector<std::string>& given) {
  std::string differing;
  for (const interop::ModelConfigField& f : interop::model_config_fields()) {
    if (!f.fixed_by_checkpoint || !was_given(given, f.name)) continue;
    const nlohmann::json mine = f.get(requested), theirs = f.get(c.model);
    if (mine != theirs) differing += fmt::format(" --{} {} (it has {});", f.name, mine.dump(), theirs.dump());
  }
  if (!differing.empty()) {
    differing.pop_back();
    throw InvalidArgument(fmt::format("check: --checkpoint '{}' fixes the model's sizes, and these options differ:{}. "
                                      "Leave them out: the checkpoint's saved configuration gives them", c.dir,
                                      differing));
  }
}

}  // namespace

CheckpointModel checkpoint_check_config(const std::string& path, const nn::ModelConfig& requested,
                                        const std::vector<std::string>& given) {
  namespace fs = std::filesystem;
  MG_CHECK(!path.empty(), "check: --checkpoint is empty");
  std::error_code ec;
  MG_CHECK(fs::exists(path, ec), "check: --checkpoint '{}' does not exist", path);
  MG_CHECK(fs::is_directory(path, ec) && checkpoint::is_checkpoint_path(path),
           "check: --checkpoint '{}' is not a training checkpoint: expected a directory written by `meshgrad train "
           "--checkpoint-dir D` (D/step_XXXXXXXX holding manifest.json, or D itself for its newest)", path);
  CheckpointModel c;
  c.dir = checkpoint::resolve_checkpoint(path);
  c.model = interop::checkpoint_model_config(checkpoint::read_manifest(c.dir), c.dir);
  c.model.dropout = 0.0;   // the check runs without dropout anyway
  refuse_differing_sizes(c, requested, given);
  // seq and batch are the check's to choose; the positions (a shape) stay the checkpoint's.
  c.model.positions = c.model.n_positions();
  if (was_given(given, "seq")) c.model.seq = requested.seq;
  if (was_given(given, "batch")) c.model.batch = requested.batch;
  MG_CHECK(c.model.seq <= c.model.positions, "check: --seq {} is longer than checkpoint '{}' has positions ({})",
           c.model.seq, c.dir, c.model.positions);
  return c;
}

}  // namespace meshgrad::diag
