// Checkpoint directories: names, finding, the manifest (contract in
// include/meshgrad/checkpoint/directory.hpp).
#include "meshgrad/checkpoint/directory.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <tuple>
#include <filesystem>
#include <utility>

namespace meshgrad::checkpoint {

namespace fs = std::filesystem;

namespace {

// "step_" and 8 digits; *step gets the number.
bool is_step_name(const std::string& name, std::int64_t* step) {
  if (name.size() != 13 || name.rfind("step_", 0) != 0) return false;
  std::int64_t s = 0;
  for (std::size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return false;
    s = s * 10 + (name[i] - '0');
  }
  if (step) *step = s;
  return true;
}

}  // namespace

std::string checkpoint_dir_name(std::int64_t step) {
  MG_CHECK(step >= 0 && step <= 99999999, "checkpoint: step {} does not fit step_XXXXXXXX", step);
  return fmt::format("step_{:08d}", step);
}

bool is_checkpoint_root_name(const std::string& name) {
  return is_step_name(name, nullptr) || name.rfind(".step_", 0) == 0 || name == ".lock";
}

void check_outputs_outside_checkpoint_names(const io::NamedPath& root, const std::vector<io::NamedPath>& outputs) {
  std::error_code ec;
  const fs::path dir = fs::weakly_canonical(fs::absolute(root.path), ec);
  if (ec || root.path.empty()) return;   // check_output_directory reports a root that cannot be used
  for (const io::NamedPath& out : outputs) {
    std::error_code file_ec;
    const fs::path file = fs::weakly_canonical(fs::absolute(out.path), file_ec);
    if (file_ec || out.path.empty()) continue;
    const fs::path inside = file.lexically_relative(dir);
    if (inside.empty() || *inside.begin() == ".." || *inside.begin() == ".") continue;
    const std::string first = inside.begin()->string();
    if (!is_checkpoint_root_name(first)) continue;
    throw InvalidArgument(fmt::format("{} '{}' lies in {} '{}' under the name '{}', which its checkpoints use "
                                      "(step_XXXXXXXX, .step_*, .lock): a save would replace or delete it; give {} "
                                      "another name or put it outside {}", out.option, out.path, root.option, root.path,
                                      first, out.option, root.option));
  }
}

std::optional<std::int64_t> commit_number(const std::string& dir) {
  try {
    return read_manifest(dir).commit;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

std::vector<std::string> list_checkpoints(const std::string& root) {
  struct Found {
    std::int64_t commit, step;
    std::string path;
  };
  std::vector<Found> found;
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    std::int64_t step = 0;
    const std::string name = it->path().filename().string();
    if (!is_step_name(name, &step)) continue;
    std::error_code e2;
    if (it->is_directory(e2) && fs::is_regular_file(it->path() / kManifestFileName, e2)) {
      // A manifest that cannot be read sorts newest: resume and verify then stop on it, naming it,
      // instead of silently taking an older checkpoint.
      const std::optional<std::int64_t> commit = commit_number(it->path().string());
      found.push_back({commit.value_or(std::numeric_limits<std::int64_t>::max()), step, it->path().string()});
    }
  }
  std::sort(found.begin(), found.end(),
            [](const Found& a, const Found& b) { return std::tie(a.commit, a.step) < std::tie(b.commit, b.step); });
  std::vector<std::string> out;
  for (Found& f : found) out.push_back(std::move(f.path));
  return out;
}

bool is_checkpoint_path(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return false;
  return fs::is_regular_file(fs::path(path) / kManifestFileName, ec) || !list_checkpoints(path).empty();
}

std::string resolve_checkpoint(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec))
    throw CheckpointError(fmt::format("checkpoint '{}' is not a directory (a checkpoint directory step_XXXXXXXX, or the "
                                      "--checkpoint-dir holding them)", path));
  if (fs::exists(fs::path(path) / kManifestFileName, ec)) return path;
  const std::vector<std::string> all = list_checkpoints(path);
  if (all.empty())
    throw CheckpointError(fmt::format("checkpoint '{}' holds no complete checkpoint (no step_XXXXXXXX/manifest.json)", path));
  try {
    (void)read_manifest(all.back());
  } catch (const std::exception& e) {
    throw CheckpointError(fmt::format("the newest checkpoint under '{}' cannot be read, so it was not passed over for "
                                      "an older one: {} (name an older step_XXXXXXXX to use it, or remove this one)",
                                      path, e.what()));
  }
  return all.back();
}

Manifest read_manifest(const std::string& dir) {
  return read_manifest_file((fs::path(dir) / kManifestFileName).string());
}

}  // namespace meshgrad::checkpoint
