// Output paths and atomic file writes (contract in include/meshgrad/io/output_path.hpp).
#include "meshgrad/io/output_path.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits.h>
#include <optional>
#include <random>
#include <utility>

namespace meshgrad::io {

namespace fs = std::filesystem;

OutputFileError::OutputFileError(std::string path, std::string detail)
    : InvalidArgument(fmt::format("output file '{}': {}", path, detail)), path_(std::move(path)), detail_(std::move(detail)) {}

namespace {

std::string errno_text(int err) { return std::strerror(err); }

// "a directory", "a character device", ... for a file that is not a regular file.
std::string type_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISREG(mode)) return "a regular file";
  return "of an unknown file type";
}

std::string directory_of(const std::string& path) {
  const fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

// "" when path may be replaced (absent or a regular file), else why not.
std::string replace_problem(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return {};
    return fmt::format("cannot check it: {}", errno_text(errno));
  }
  if (S_ISREG(st.st_mode)) return {};
  if (S_ISLNK(st.st_mode))
    return "is a symbolic link; meshgrad does not write through links (give the path of its target)";
  return fmt::format("is {}; meshgrad only replaces regular files", type_of(st.st_mode));
}

std::string host_name() {
  char buf[HOST_NAME_MAX + 1] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "unknown";
  return buf;
}

// ".NAME.tmp-": the prefix of every temporary of target.
std::string temp_prefix(const std::string& path) { return "." + fs::path(path).filename().string() + ".tmp-"; }

std::string make_temp_path(const std::string& path) {
  static std::atomic<std::uint64_t> counter{0};
  static const std::uint32_t salt = std::random_device{}();
  const std::string leaf = fmt::format("{}{}-{:08x}-{}@{}", temp_prefix(path), ::getpid(), salt,
                                       counter.fetch_add(1), host_name());
  return (fs::path(directory_of(path)) / leaf).string();
}

struct FileId {
  dev_t dev = 0;
  ino_t ino = 0;
  bool operator==(const FileId&) const = default;
};

std::optional<FileId> id_of(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  return FileId{st.st_dev, st.st_ino};
}

}  // namespace

void check_output_directory(const NamedPath& out, const std::vector<NamedPath>& inputs, const std::vector<NamedPath>& output_files) {
  const auto bad = [&](const std::string& what) { throw InvalidArgument(fmt::format("{} '{}': {}", out.option, out.path, what)); };
  if (out.path.empty()) throw InvalidArgument(fmt::format("{}: the path is empty", out.option));
  // Compared as paths (neither needs to exist yet): the file would be created first and the
  // directory then refused, or the directory created and the file's write fail at the end.
  // "ck/" is the directory ck: without the trailing separator, its parent is what holds it.
  const auto without_trailing_separator = [](const std::string& path) {
    fs::path p = fs::path(path).lexically_normal();
    if (!p.has_filename() && p.has_parent_path()) p = p.parent_path();
    return p;
  };
  const fs::path normal = without_trailing_separator(out.path);
  std::error_code ec;
  const fs::path dir_path = fs::weakly_canonical(normal, ec);
  for (const NamedPath& file : output_files) {
    if (file.path.empty() || ec) continue;
    std::error_code file_ec;
    const fs::path file_path = fs::weakly_canonical(without_trailing_separator(file.path), file_ec);
    if (!file_ec && file_path == dir_path)
      bad(fmt::format("is also the path of {} '{}': give the file and the directory different paths", file.option, file.path));
  }
  struct stat st {};
  if (::lstat(out.path.c_str(), &st) == 0) {
    if (S_ISLNK(st.st_mode)) bad("is a symbolic link; meshgrad does not write through links (give the directory it points to)");
    if (!S_ISDIR(st.st_mode)) bad(fmt::format("is {}, not a directory", type_of(st.st_mode)));
    if (::access(out.path.c_str(), W_OK | X_OK) != 0) bad(fmt::format("is not writable: {}", errno_text(errno)));
  } else if (errno == ENOENT) {
    const std::string parent = directory_of(normal.string());
    struct stat pst {};
    if (::stat(parent.c_str(), &pst) != 0 || !S_ISDIR(pst.st_mode))
      bad(fmt::format("does not exist and its parent '{}' is not a directory", parent));
    if (::access(parent.c_str(), W_OK | X_OK) != 0)
      bad(fmt::format("cannot be created: its parent '{}' is not writable: {}", parent, errno_text(errno)));
    return;   // a new directory holds no input
  } else {
    bad(fmt::format("cannot be checked: {}", errno_text(errno)));
  }
  const std::optional<FileId> dir = id_of(out.path);
  for (const NamedPath& in : inputs) {
    if (in.path.empty()) continue;
    if (id_of(in.path) == dir)
      throw InvalidArgument(fmt::format("{} '{}' is the same directory as {} '{}': give the checkpoints their own directory",
                                        out.option, out.path, in.option, in.path));
  }
}

void check_output_paths(const std::vector<NamedPath>& outputs, const std::vector<NamedPath>& inputs) {
  struct Checked {
    const NamedPath* named;
    FileId dir;                     // the directory it is in
    std::string leaf;               // its name there
    std::optional<FileId> file;     // the file, when it exists
  };
  std::vector<Checked> checked;
  for (const NamedPath& out : outputs) {
    const auto bad = [&](const std::string& what) {
      throw InvalidArgument(fmt::format("{} '{}': {}", out.option, out.path, what));
    };
    if (out.path.empty()) throw InvalidArgument(fmt::format("{}: the path is empty", out.option));
    const std::string leaf = fs::path(out.path).filename().string();
    if (leaf.empty() || leaf == "." || leaf == "..") bad("names a directory, not a file");
    const std::string dir = directory_of(out.path);
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0) bad(fmt::format("its directory '{}' cannot be used: {}", dir, errno_text(errno)));
    if (!S_ISDIR(st.st_mode)) bad(fmt::format("'{}' is not a directory", dir));
    if (::access(dir.c_str(), W_OK | X_OK) != 0)
      bad(fmt::format("its directory '{}' is not writable: {}", dir, errno_text(errno)));
    if (const std::string problem = replace_problem(out.path); !problem.empty()) bad(problem);
    checked.push_back({&out, FileId{st.st_dev, st.st_ino}, leaf, id_of(out.path)});
  }
  for (std::size_t i = 0; i < checked.size(); ++i) {
    const Checked& a = checked[i];
    for (const NamedPath& in : inputs) {
      if (in.path.empty() || !a.file) continue;
      if (id_of(in.path) == a.file)
        throw InvalidArgument(fmt::format("{} '{}' is the same file as {} '{}': refusing to overwrite an input",
                                          a.named->option, a.named->path, in.option, in.path));
    }
    for (std::size_t j = 0; j < i; ++j) {
      const Checked& b = checked[j];
      if ((a.dir == b.dir && a.leaf == b.leaf) || (a.file && a.file == b.file))
        throw InvalidArgument(fmt::format("{} '{}' and {} '{}' name the same file: give them different paths",
                                          b.named->option, b.named->path, a.named->option, a.named->path));
    }
  }
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

AtomicFileWriter::AtomicFileWriter(std::string path) : path_(std::move(path)) {
  if (path_.empty()) throw OutputFileError(path_, "the path is empty");
  if (fs::path(path_).filename().empty()) throw OutputFileError(path_, "path names a directory, not a file");
  if (const std::string problem = replace_problem(path_); !problem.empty()) throw OutputFileError(path_, problem);
  remove_stale_temporaries(path_);
  temp_ = make_temp_path(path_);
  fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd_ < 0) throw OutputFileError(path_, fmt::format("cannot create temporary file '{}': {}", temp_, errno_text(errno)));
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !temp_.empty()) ::unlink(temp_.c_str());
}

void AtomicFileWriter::write(const void* data, std::uint64_t n, std::string_view what) {
  if (fd_ < 0) throw OutputFileError(path_, fmt::format("write of {} after commit", what));
  const auto* src = static_cast<const std::byte*>(data);
  std::uint64_t done = 0;
  while (done < n) {
    const std::size_t chunk = static_cast<std::size_t>(std::min<std::uint64_t>(n - done, std::uint64_t{1} << 30));
    const ssize_t put = ::write(fd_, src + done, chunk);
    if (put < 0) {
      if (errno == EINTR) continue;
      throw OutputFileError(path_, fmt::format("write error while writing {}: {}", what, errno_text(errno)));
    }
    done += static_cast<std::uint64_t>(put);
  }
}

void AtomicFileWriter::commit() {
  if (fd_ < 0) throw OutputFileError(path_, "commit of a file already committed");
  if (::fsync(fd_) != 0)
    throw OutputFileError(path_, fmt::format("fsync of temporary file '{}' failed: {}", temp_, errno_text(errno)));
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0)
    throw OutputFileError(path_, fmt::format("closing temporary file '{}' failed: {}", temp_, errno_text(errno)));
  // Again, just before replacing: the target may have changed since the writer was made.
  if (const std::string problem = replace_problem(path_); !problem.empty()) throw OutputFileError(path_, problem);
  if (::rename(temp_.c_str(), path_.c_str()) != 0)
    throw OutputFileError(path_, fmt::format("cannot rename temporary file '{}' over it: {}", temp_, errno_text(errno)));
  committed_ = true;
  // Make the rename itself durable. Best effort: the new file is already in place, and some file
  // systems do not support fsync on a directory.
  const int dir_fd = ::open(directory_of(path_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    (void)::fsync(dir_fd);
    ::close(dir_fd);
  }
}

}  // namespace meshgrad::io
