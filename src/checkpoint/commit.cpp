// The directories of the commit protocol under a root (contract in commit.hpp).
#include "checkpoint/commit.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string_view>
#include <thread>
#include <vector>

#include "checkpoint/file_errors.hpp"
#include "meshgrad/checkpoint/directory.hpp"
#include "meshgrad/io/file_io.hpp"
#include "meshgrad/io/output_path.hpp"

namespace meshgrad::checkpoint {

namespace fs = std::filesystem;

namespace {

// What a killed save or prune leaves: .step_XXXXXXXX.tmp (a stage, or an old checkpoint exchanged
// out of its name), .step_XXXXXXXX.tmp-deleting (a pruned one) and .step_XXXXXXXX.tmp-<pid>-...
// (an old checkpoint moved aside by a commit without rename flags, io::rename_into_place).
bool is_leftover(const std::string& name) { return name.rfind(".step_", 0) == 0 && name.find(".tmp") != std::string::npos; }

// Creates root unless it is a directory already; refuses a symbolic link and anything else.
void create_root(const std::string& root) {
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(root, ec);
  if (fs::is_symlink(st))
    throw CheckpointError(fmt::format("--checkpoint-dir '{}' is a symbolic link: give the directory it points to", root));
  if (fs::exists(st) && !fs::is_directory(st))
    throw CheckpointError(fmt::format("--checkpoint-dir '{}' exists and is not a directory", root));
  if (!fs::exists(st) && (::mkdir(root.c_str(), 0755) != 0 && errno != EEXIST))
    throw CheckpointError(fmt::format("--checkpoint-dir '{}' cannot be created: {}", root, io::errno_text(errno)));
}

// Takes ROOT/.lock exclusively, without waiting; returns its descriptor.
int lock_root(const std::string& root) {
  const std::string lock = (fs::path(root) / ".lock").string();
  io::UniqueFd fd(::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644));
  if (fd.get() < 0) throw CheckpointError(fmt::format("--checkpoint-dir '{}': cannot open '{}': {}", root, lock, io::errno_text(errno)));
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0)
    throw CheckpointError(fmt::format("--checkpoint-dir '{}' is in use by another run ({} holds '{}'); give each run its "
                                      "own directory", root, io::lock_holder(fd.get()), lock));
  return fd.release();
}

void write_manifest(const std::string& dir, const Manifest& manifest) {
  const std::string path = (fs::path(dir) / kManifestFileName).string();
  const std::string text = manifest_to_json(manifest);
  const io::UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644));
  if (fd.get() < 0) throw CheckpointError(fmt::format("checkpoint: cannot create '{}': {}", path, io::errno_text(errno)));
  as_checkpoint_error([&] {
    io::write_all(fd.get(), text.data(), text.size(), path);
    io::fsync_file(fd.get(), path);
  });
}

void exit_here_if_asked(const char* point) {
  const char* fault = std::getenv("MESHGRAD_CHECKPOINT_FAULT");
  if (fault == nullptr || std::string_view(fault) != point) return;
  std::fprintf(stderr, "meshgrad: MESHGRAD_CHECKPOINT_FAULT=%s: exiting as if killed\n", point);
  std::_Exit(137);
}

// MESHGRAD_CHECKPOINT_TEST_DELAY_MS as read once: the point and milliseconds, or what is wrong with it.
struct TestDelay {
  std::string point;
  int ms = 0;
  std::string error;
};

TestDelay read_test_delay() {
  TestDelay d;
  const char* value = std::getenv("MESHGRAD_CHECKPOINT_TEST_DELAY_MS");
  if (value == nullptr) return d;
  const std::string_view text(value);
  const std::size_t colon = text.find(':');
  int ms = -1;
  if (colon != std::string_view::npos) {
    const char* end = text.data() + text.size();
    const auto [at, ec] = std::from_chars(text.data() + colon + 1, end, ms);
    if (ec != std::errc() || at != end) ms = -1;
  }
  const std::string_view point = text.substr(0, colon);
  const bool known = point == "write" || point == "written" || point == "commit";
  if (colon == std::string_view::npos || !known || ms < 0 || ms > 600000) {
    d.error = fmt::format("MESHGRAD_CHECKPOINT_TEST_DELAY_MS (a test hook) must be write:MS, written:MS or commit:MS "
                          "with MS from 0 to 600000, got '{}'", text);
  } else {
    d.point = point;
    d.ms = ms;
  }
  return d;
}

}  // namespace

void delay_here_if_asked(std::string_view point) {
  static const TestDelay delay = read_test_delay();
  if (!delay.error.empty()) throw CheckpointError(delay.error);
  if (delay.point == point) std::this_thread::sleep_for(std::chrono::milliseconds(delay.ms));
}

std::string stage_path(const std::string& root, std::int64_t step) {
  return (fs::path(root) / ("." + checkpoint_dir_name(step) + ".tmp")).string();
}

int lock_root_and_remove_leftovers(const std::string& root) {
  create_root(root);
  const int lock_fd = lock_root(root);
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    if (is_leftover(it->path().filename().string())) io::remove_tree_quietly(it->path().string());
  }
  return lock_fd;
}

void create_stage(const std::string& stage) {
  if (::mkdir(stage.c_str(), 0755) != 0 && errno != EEXIST)
    throw CheckpointError(fmt::format("checkpoint: cannot create '{}': {}", stage, io::errno_text(errno)));
}

void commit_stage(io::StagedDirectory& stage, const Manifest& manifest) {
  write_manifest(stage.path(), manifest);
  delay_here_if_asked("commit");
  exit_here_if_asked("before-rename");
  as_checkpoint_error([&] { stage.commit(io::ExistingTarget::kExchangeAndRemoveOld, io::ParentFlush::kRequired); });
}

void prune_checkpoints(const std::string& root, int keep, const std::string& newest) {
  if (keep <= 0) return;
  const std::vector<std::string> all = list_checkpoints(root);
  for (std::size_t i = 0; i + static_cast<std::size_t>(keep) < all.size(); ++i) {
    if (all[i] == newest) continue;
    const std::string doomed = (fs::path(root) / ("." + fs::path(all[i]).filename().string() + ".tmp-deleting")).string();
    if (::rename(all[i].c_str(), doomed.c_str()) == 0) io::remove_tree_quietly(doomed);
  }
}

}  // namespace meshgrad::checkpoint

