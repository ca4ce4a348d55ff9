// File descriptors and the loops and flushes every writer and reader of meshgrad's files needs:
// an owning descriptor, write and read loops that survive EINTR and short transfers, and fsync of a
// file and of a directory. Errors name the operation, the path and (for reads) the offset.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>

#include "meshgrad/tensor/error.hpp"

namespace meshgrad::io {

// A file system call that failed. what() is one sentence naming the operation, the path (and the
// offset of a read) and why: "fsync of 'ck/rank_00000.bin' failed: Input/output error". reason() is
// the why alone ("Input/output error", "no progress"), for a caller that words its own message around
// it; op() says which step failed.
class FileIoError : public InvalidArgument {
 public:
  enum class Op { create, open, read, write, fsync, rename };
  FileIoError(Op op, std::string path, std::string reason, const std::string& message);
  Op op() const { return op_; }
  const std::string& path() const { return path_; }
  const std::string& reason() const { return reason_; }

 private:
  Op op_;
  std::string path_, reason_;
};

// strerror(e) as a string.
std::string errno_text(int e);

// Owns a POSIX file descriptor: closes it when destroyed or reset. -1 is "none".
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.release();
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  void reset();

 private:
  int fd_ = -1;
};

// Opens path for reading, refusing anything but a regular file without blocking on it: opened with
// O_NONBLOCK (a FIFO with no writer would block open() for ever), checked with fstat, then switched
// back to blocking reads. *size gets its size. Throws FileIoError(open) naming path: "cannot open
// 'P' for reading: <why>", or "'P' is not a regular file (a FIFO)" (a directory, a device, ...).
UniqueFd open_regular_file(const std::string& path, std::uint64_t* size);

// Writes all n bytes at fd's position, 8 MiB per write() (one huge write() is several times slower
// on the disks measured than the same bytes in pieces). Throws FileIoError(write) naming path:
// "writing 'P' failed: <why>".
void write_all(int fd, const void* data, std::uint64_t n, const std::string& path);

// Reads exactly n bytes at offset with pread, 8 MiB per call. Throws FileIoError(read) naming path
// and the offset: "reading 'P' at offset N failed: <why>", or "'P' ends before offset N (truncated)".
void read_exact(int fd, void* data, std::uint64_t n, std::uint64_t offset, const std::string& path);

// The whole of a small file a user names (a config, a metrics log, a meta.json): opened with
// open_regular_file (a directory, a FIFO or a device is refused at once, without blocking or reading
// /dev/zero until memory runs out), and refused when larger than max_bytes. `what` names the
// option or role in messages: "--config 'c.json' is 3000000000 bytes, more than the 64 MiB such a
// file may have". Throws FileIoError (open, read).
std::string read_small_file(const std::string& path, std::uint64_t max_bytes, const std::string& what);

// fsync(fd); throws FileIoError(fsync) "fsync of 'P' failed: <why>".
void fsync_file(int fd, const std::string& path);

// Flushes a directory's entries (the names created, renamed or removed in it) to disk. Throws
// FileIoError: open, "cannot open 'P' to flush it: <why>"; fsync, "fsync of 'P' failed: <why>". A
// file system that refuses fsync on a directory (EINVAL) is accepted: its files were flushed already.
void fsync_directory(const std::string& path);
// The same, best effort: a directory that cannot be opened (no read permission) or flushed is left as
// it is. For a flush after a commit that already took place, which an error can no longer undo.
void fsync_directory_if_possible(const std::string& path) noexcept;

// Removes a file or directory tree; errors are ignored (a leftover is cleaned up next time).
void remove_tree_quietly(const std::string& path) noexcept;

// A directory path without its trailing separator, lexically normalised: "ck/" and "ck/." are
// "ck", so its parent_path() is the directory that holds it ("" for a relative name: the current one).
std::filesystem::path directory_path(const std::string& path);

}  // namespace meshgrad::io
