// Temporaries, the rename that commits, staged directories (contract in
// include/meshgrad/io/atomic_commit.hpp).
#include "meshgrad/io/atomic_commit.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <limits.h>
#include <random>
#include <string_view>
#include <vector>

#include "meshgrad/io/file_io.hpp"

namespace meshgrad::io {

namespace fs = std::filesystem;

namespace {

std::string host_name() {
  char buf[HOST_NAME_MAX + 1] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "unknown";
  return buf;
}

// ".NAME.tmp-": the prefix of every temporary of target.
std::string temp_prefix(const std::string& path) { return "." + fs::path(path).filename().string() + ".tmp-"; }

// A failed rename that commits: what was asked, and why it failed (errno e).
[[noreturn]] void rename_failed(const std::string& target, const std::string& what, int e) {
  throw FileIoError(FileIoError::Op::rename, target, errno_text(e), fmt::format("{}: {}", what, errno_text(e)));
}

// renameat2 with flags. MESHGRAD_IO_FAULT=no-rename-flags answers as a file system without them
// does (NFS: EINVAL), so the fallback below can be tested on any machine.
int rename_with_flags(const std::string& from, const std::string& to, unsigned flags) {
  const char* fault = std::getenv("MESHGRAD_IO_FAULT");
  if (fault != nullptr && std::string_view(fault) == "no-rename-flags") {
    errno = EINVAL;
    return -1;
  }
  return ::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), flags);
}

// What renameat2 answers on a file system that has no rename flags (NFS, some FUSE file systems).
bool rename_flags_unsupported(int e) { return e == EINVAL || e == ENOSYS || e == EOPNOTSUPP; }

// kExchangeAndRemoveOld without rename flags. Safe because the writer holds its target directory's
// lock (the checkpoint saver's ROOT/.lock): nothing else creates or removes the target meanwhile, so
// looking first and then renaming is not a race. An absent target: one plain rename (atomic). An
// existing one moves aside under a temporary name, the stage takes its place, the old one goes; a
// kill between the two renames leaves no target, the old one under its temporary name and the new
// one under the stage's (the next writer removes both as leftovers: only this target is lost).
void rename_without_flags(const std::string& staged, const std::string& target) {
  struct stat st {};
  if (::lstat(target.c_str(), &st) != 0) {
    const int e = errno;
    if (e != ENOENT) rename_failed(target, fmt::format("cannot look at '{}'", target), e);
    if (::rename(staged.c_str(), target.c_str()) == 0) return;
    rename_failed(target, fmt::format("cannot rename '{}' to '{}'", staged, target), errno);
  }
  const std::string aside = unique_temporary_path(target);
  if (::rename(target.c_str(), aside.c_str()) != 0)
    rename_failed(target, fmt::format("cannot move '{}' aside to '{}'", target, aside), errno);
  if (::rename(staged.c_str(), target.c_str()) != 0) {
    const int e = errno;
    (void)::rename(aside.c_str(), target.c_str());   // the old one back where it was
    rename_failed(target, fmt::format("cannot rename '{}' to '{}'", staged, target), e);
  }
  remove_tree_quietly(aside);
}

}  // namespace

std::string directory_of(const std::string& path) {
  const fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

std::string unique_temporary_path(const std::string& target) {
  static std::atomic<std::uint64_t> counter{0};
  static const std::uint32_t salt = std::random_device{}();
  const std::string leaf = fmt::format("{}{}-{:08x}-{}@{}", temp_prefix(target), ::getpid(), salt,
                                       counter.fetch_add(1), host_name());
  return (fs::path(directory_of(target)) / leaf).string();
}

int remove_stale_temporaries(const std::string& target) {
  const std::string dir = directory_of(target);
  const std::string prefix = temp_prefix(target);
  const std::string me = host_name();
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return 0;   // the writer reports a missing directory
  std::vector<std::string> stale;
  while (const dirent* e = ::readdir(d)) {
    const std::string_view name = e->d_name;
    if (!name.starts_with(prefix)) continue;
    const std::string_view rest = name.substr(prefix.size());
    // "<pid>-<salt>-<n>@<host>" (or without "@<host>" from older writers).
    const std::size_t dash = rest.find('-');
    if (dash == 0 || dash == std::string_view::npos || dash > 9) continue;
    const std::string_view pid_text = rest.substr(0, dash);
    if (!std::all_of(pid_text.begin(), pid_text.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    const auto pid = static_cast<pid_t>(std::stol(std::string(pid_text)));
    if (const std::size_t at = rest.rfind('@'); at != std::string_view::npos && rest.substr(at + 1) != me) continue;
    if (pid == ::getpid()) continue;                              // ours: maybe another thread's write
    if (::kill(pid, 0) == 0 || errno == EPERM) continue;        // that process is alive
    stale.emplace_back(name);
  }
  ::closedir(d);
  int removed = 0;
  for (const auto& name : stale)
    if (::unlink((fs::path(dir) / name).c_str()) == 0) ++removed;
  return removed;
}

void rename_into_place(const std::string& staged, const std::string& target, ExistingTarget existing) {
  if (existing == ExistingTarget::kReplaceFileOrEmptyDirectory) {
    if (::rename(staged.c_str(), target.c_str()) == 0) return;
    const int e = errno;
    rename_failed(target, fmt::format("cannot rename '{}' to '{}'", staged, target), e);
  }
  if (rename_with_flags(staged, target, RENAME_NOREPLACE) == 0) return;
  if (const int e = errno; rename_flags_unsupported(e)) {
    rename_without_flags(staged, target);
    return;
  } else if (e != EEXIST && e != ENOTEMPTY) {
    rename_failed(target, fmt::format("cannot rename '{}' to '{}'", staged, target), e);
  }
  if (rename_with_flags(staged, target, RENAME_EXCHANGE) != 0) {
    const int e = errno;
    if (rename_flags_unsupported(e)) {   // NOREPLACE without EXCHANGE: some FUSE file systems
      rename_without_flags(staged, target);
      return;
    }
    rename_failed(target, fmt::format("cannot replace '{}'", target), e);
  }
  remove_tree_quietly(staged);   // the old target
}

void flush_directory_of(const std::string& target, ParentFlush flush) {
  const std::string dir = directory_of(target);
  if (flush == ParentFlush::kRequired) fsync_directory(dir);
  else fsync_directory_if_possible(dir);
}

StagedDirectory StagedDirectory::create_beside(std::string target) {
  target = directory_path(target).string();   // "hf/" is the directory hf: its stage is ".hf.tmp-..." beside it
  // A name taken meanwhile (a crashed process of a recycled pid with the same salt) gets another.
  for (int attempt = 0;; ++attempt) {
    std::string stage = unique_temporary_path(target);
    if (::mkdir(stage.c_str(), 0777) == 0) return StagedDirectory(std::move(stage), std::move(target));
    const int e = errno;
    if (e != EEXIST || attempt >= 7)
      throw FileIoError(FileIoError::Op::create, stage, errno_text(e),
                        fmt::format("cannot create the temporary directory '{}': {}", stage, errno_text(e)));
  }
}

StagedDirectory StagedDirectory::adopt(std::string stage, std::string target) {
  return StagedDirectory(std::move(stage), std::move(target));
}

StagedDirectory::~StagedDirectory() {
  if (!committed_) remove_tree_quietly(stage_);
}

void StagedDirectory::commit(ExistingTarget existing, ParentFlush parent) {
  fsync_directory(stage_);
  rename_into_place(stage_, target_, existing);
  committed_ = true;
  flush_directory_of(target_, parent);
}

}  // namespace meshgrad::io
