// File descriptors, read and write loops, fsync (contract in include/meshgrad/io/file_io.hpp).
#include "meshgrad/io/file_io.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

namespace meshgrad::io {

namespace {
// Bytes per read() or write() call: large enough that the calls cost nothing, small enough that one
// call never stalls the disk queue (measured on the checkpoint writer).
constexpr std::uint64_t kTransferChunk = 8u << 20;
}  // namespace

FileIoError::FileIoError(Op op, std::string path, std::string reason, const std::string& message)
    : InvalidArgument(message), op_(op), path_(std::move(path)), reason_(std::move(reason)) {}

std::string errno_text(int e) { return std::strerror(e); }

void UniqueFd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

namespace {

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a regular file";
}

}  // namespace

UniqueFd open_regular_file(const std::string& path, std::uint64_t* size) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (fd.get() < 0) {
    const std::string why = errno_text(errno);
    throw FileIoError(FileIoError::Op::open, path, why, fmt::format("cannot open '{}' for reading: {}", path, why));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    const std::string why = errno_text(errno);
    throw FileIoError(FileIoError::Op::open, path, why, fmt::format("cannot stat '{}': {}", path, why));
  }
  if (!S_ISREG(st.st_mode)) {
    throw FileIoError(FileIoError::Op::open, path, file_kind(st.st_mode),
                      fmt::format("'{}' is not a regular file ({})", path, file_kind(st.st_mode)));
  }
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags >= 0) (void)::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
  if (size != nullptr) *size = static_cast<std::uint64_t>(st.st_size);
  return fd;
}

void write_all(int fd, const void* data, std::uint64_t n, const std::string& path) {
  const auto* at = static_cast<const std::byte*>(data);
  while (n > 0) {
    const std::size_t chunk = static_cast<std::size_t>(std::min(n, kTransferChunk));
    const ssize_t w = ::write(fd, at, chunk);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const std::string why = w < 0 ? errno_text(errno) : "no progress";
      throw FileIoError(FileIoError::Op::write, path, why, fmt::format("writing '{}' failed: {}", path, why));
    }
    at += w;
    n -= static_cast<std::uint64_t>(w);
  }
}

void read_exact(int fd, void* data, std::uint64_t n, std::uint64_t offset, const std::string& path) {
  auto* at = static_cast<std::byte*>(data);
  while (n > 0) {
    const std::size_t chunk = static_cast<std::size_t>(std::min(n, kTransferChunk));
    const ssize_t r = ::pread(fd, at, chunk, static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const std::string why = errno_text(errno);
      throw FileIoError(FileIoError::Op::read, path, why, fmt::format("reading '{}' at offset {} failed: {}", path, offset, why));
    }
    if (r == 0)
      throw FileIoError(FileIoError::Op::read, path, "truncated", fmt::format("'{}' ends before offset {} (truncated)", path, offset));
    at += r;
    n -= static_cast<std::uint64_t>(r);
    offset += static_cast<std::uint64_t>(r);
  }
}

std::string read_small_file(const std::string& path, std::uint64_t max_bytes, const std::string& what) {
  std::uint64_t size = 0;
  UniqueFd fd;
  try {
    fd = open_regular_file(path, &size);
  } catch (const FileIoError& e) {
    throw FileIoError(e.op(), path, e.reason(), fmt::format("{}: {}", what, e.what()));
  }
  if (size > max_bytes) {
    throw FileIoError(FileIoError::Op::read, path, "too large",
                      fmt::format("{} '{}' is {} bytes, more than the {} MiB such a file may have", what, path, size,
                                  max_bytes >> 20));
  }
  std::string text(static_cast<std::size_t>(size), '\0');
  read_exact(fd.get(), text.data(), size, 0, path);
  return text;
}

void fsync_file(int fd, const std::string& path) {
  if (::fsync(fd) == 0) return;
  const std::string why = errno_text(errno);
  throw FileIoError(FileIoError::Op::fsync, path, why, fmt::format("fsync of '{}' failed: {}", path, why));
}

void fsync_directory(const std::string& path) {
  const UniqueFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) {
    const std::string why = errno_text(errno);
    throw FileIoError(FileIoError::Op::open, path, why, fmt::format("cannot open '{}' to flush it: {}", path, why));
  }
  if (::fsync(fd.get()) != 0 && errno != EINVAL) {
    const std::string why = errno_text(errno);
    throw FileIoError(FileIoError::Op::fsync, path, why, fmt::format("fsync of '{}' failed: {}", path, why));
  }
}

void fsync_directory_if_possible(const std::string& path) noexcept {
  const UniqueFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() >= 0) (void)::fsync(fd.get());
}

void remove_tree_quietly(const std::string& path) noexcept {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

std::filesystem::path directory_path(const std::string& path) {
  std::filesystem::path p = std::filesystem::path(path).lexically_normal();
  if (!p.has_filename() && p.has_parent_path()) p = p.parent_path();
  return p;
}

}  // namespace meshgrad::io
