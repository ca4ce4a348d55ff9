// Output paths and atomic file writes (contract in include/meshgrad/io/output_path.hpp).
#include "meshgrad/io/output_path.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <utility>

namespace meshgrad::io {

namespace fs = std::filesystem;

OutputFileError::OutputFileError(std::string path, std::string detail)
    : InvalidArgument(fmt::format("output file '{}': {}", path, detail)), path_(std::move(path)), detail_(std::move(detail)) {}

namespace {

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
  const fs::path normal = directory_path(out.path);
  std::error_code ec;
  const fs::path dir_path = fs::weakly_canonical(normal, ec);
  for (const NamedPath& file : output_files) {
    if (file.path.empty() || ec) continue;
    std::error_code file_ec;
    const fs::path file_path = fs::weakly_canonical(directory_path(file.path), file_ec);
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

void check_free_space(const std::vector<OutputSize>& outputs) {
  struct Group {
    std::uint64_t needed = 0, free = 0;
    std::string where;
    std::vector<const OutputSize*> outputs;
  };
  std::map<dev_t, Group> groups;
  for (const OutputSize& o : outputs) {
    if (o.output.path.empty()) continue;
    // The nearest directory that exists: the file's, or the output directory itself or its parent.
    std::string dir = directory_of(o.output.path);
    struct stat st {};
    if (::stat(o.output.path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) dir = o.output.path;
    struct statvfs vfs {};
    if (::stat(dir.c_str(), &st) != 0 || ::statvfs(dir.c_str(), &vfs) != 0) continue;
    Group& g = groups[st.st_dev];
    if (g.where.empty()) {
      g.where = dir;
      g.free = static_cast<std::uint64_t>(vfs.f_bavail) * static_cast<std::uint64_t>(vfs.f_frsize);
    }
    g.needed += o.bytes;
    g.outputs.push_back(&o);
  }
  for (const auto& [dev, g] : groups) {
    if (g.needed <= g.free) continue;
    std::string names;   // each output's share when several share the file system
    for (const OutputSize* o : g.outputs) {
      names += fmt::format("{}{} '{}'", names.empty() ? "" : " and ", o->output.option, o->output.path);
      if (g.outputs.size() > 1) names += fmt::format(" ({} bytes)", o->bytes);
    }
    throw InvalidArgument(fmt::format("not enough free space for {}: at least {} bytes ({:.1f} MiB) are needed on the "
                                      "file system of '{}', which has {} bytes ({:.1f} MiB) free; free some space or "
                                      "write elsewhere", names, g.needed, static_cast<double>(g.needed) / (1 << 20),
                                      g.where, g.free, static_cast<double>(g.free) / (1 << 20)));
  }
}

std::string lock_holder(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return "another process";
  // /proc/locks: "1: FLOCK  ADVISORY  WRITE 1234 fe:00:10953134 0 EOF" (a waiter's line has "->").
  const std::string file = fmt::format("{:02x}:{:02x}:{}", major(st.st_dev), minor(st.st_dev), st.st_ino);
  std::ifstream locks("/proc/locks");
  for (std::string line; std::getline(locks, line);) {
    std::istringstream fields(line);
    std::string number, kind, advisory, mode, where;
    long pid = 0;
    if (!(fields >> number >> kind >> advisory >> mode >> pid >> where) || kind != "FLOCK" || where != file) continue;
    return pid == static_cast<long>(::getpid()) ? "this process" : fmt::format("process {}", pid);
  }
  return "another process";
}

void lock_output(int fd, const NamedPath& output) {
  if (::flock(fd, LOCK_EX | LOCK_NB) == 0) return;
  if (errno != EWOULDBLOCK) return;   // no flock on this file system: nothing to hold
  throw InvalidArgument(fmt::format("{} '{}' is in use by another run ({} holds its lock): give each run its own file",
                                    output.option, output.path, lock_holder(fd)));
}

AtomicFileWriter::AtomicFileWriter(std::string path) : path_(std::move(path)) {
  if (path_.empty()) throw OutputFileError(path_, "the path is empty");
  if (fs::path(path_).filename().empty()) throw OutputFileError(path_, "path names a directory, not a file");
  if (const std::string problem = replace_problem(path_); !problem.empty()) throw OutputFileError(path_, problem);
  remove_stale_temporaries(path_);
  temp_ = unique_temporary_path(path_);
  fd_ = UniqueFd(::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666));
  if (fd_.get() < 0) throw OutputFileError(path_, fmt::format("cannot create temporary file '{}': {}", temp_, errno_text(errno)));
}

AtomicFileWriter::~AtomicFileWriter() {
  fd_.reset();
  if (!committed_ && !temp_.empty()) ::unlink(temp_.c_str());
}

void AtomicFileWriter::write(const void* data, std::uint64_t n, std::string_view what) {
  if (fd_.get() < 0) throw OutputFileError(path_, fmt::format("write of {} after commit", what));
  try {
    write_all(fd_.get(), data, n, temp_);
  } catch (const FileIoError& e) {
    throw OutputFileError(path_, fmt::format("write error while writing {}: {}", what, e.reason()));
  }
}

void AtomicFileWriter::commit() {
  if (fd_.get() < 0) throw OutputFileError(path_, "commit of a file already committed");
  try {
    fsync_file(fd_.get(), temp_);
  } catch (const FileIoError& e) {
    throw OutputFileError(path_, fmt::format("fsync of temporary file '{}' failed: {}", temp_, e.reason()));
  }
  if (::close(fd_.release()) != 0)
    throw OutputFileError(path_, fmt::format("closing temporary file '{}' failed: {}", temp_, errno_text(errno)));
  // Again, just before replacing: the target may have changed since the writer was made.
  if (const std::string problem = replace_problem(path_); !problem.empty()) throw OutputFileError(path_, problem);
  try {
    rename_into_place(temp_, path_, ExistingTarget::kReplaceFileOrEmptyDirectory);
  } catch (const FileIoError& e) {
    throw OutputFileError(path_, fmt::format("cannot rename temporary file '{}' over it: {}", temp_, e.reason()));
  }
  committed_ = true;
  // Best effort: the new file is already in place, and some file systems do not support fsync on a
  // directory (or the directory cannot be opened to flush it).
  flush_directory_of(path_, ParentFlush::kIfPossible);
}

}  // namespace meshgrad::io
