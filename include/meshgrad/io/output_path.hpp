// Output files that are never lost or clobbered: checked before a run does any work, written
// atomically through a temporary in the same directory, and never replacing anything but a regular
// file. Used by `train --save` / `--metrics` and `grads --out`, and by write_safetensors.
//
// Symbolic links: an output path that is a symbolic link is refused (give the path of its target
// instead). Writing through a link would either replace the link by a regular file (what rename()
// does) or silently write somewhere the command line does not say; neither is what a user expects,
// so meshgrad asks.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "meshgrad/io/atomic_commit.hpp"
#include "meshgrad/io/file_io.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad::io {

// A path from the command line with the option that gave it, for messages ("--save").
struct NamedPath {
  std::string option;
  std::string path;
};

// Checks, before any work, that every output can be written without destroying anything, and
// throws InvalidArgument naming the option and the path otherwise:
// - the path is not empty and names a file (not "dir/");
// - its directory exists and is writable;
// - the path is absent or a regular file: a directory, a device, a FIFO, a socket or a symbolic
//   link is refused;
// - it is not the same file as any input (compared by device and inode, so another spelling, a
//   hard link or a symbolic link to the input is caught) nor the same path as another output;
//   the message names both options.
// Inputs that do not exist are skipped (their readers report them).
void check_output_paths(const std::vector<NamedPath>& outputs, const std::vector<NamedPath>& inputs);

// The same for an output directory (--checkpoint-dir): absent with a writable parent, or a writable
// directory (not a symbolic link, a file or a device), not the same directory as an input, and not
// the path of one of `output_files` (--metrics DIR beside --checkpoint-dir DIR).
void check_output_directory(const NamedPath& output, const std::vector<NamedPath>& inputs,
                            const std::vector<NamedPath>& output_files = {});

// An output and the bytes it will at least take (a file's data, a checkpoint's tensors).
struct OutputSize {
  NamedPath output;
  std::uint64_t bytes = 0;
};

// Refuses, before any work, outputs that cannot fit: the outputs are grouped by the file system
// their directory is on (an output directory not created yet: its parent's), and the bytes of each
// group must not exceed the space free there for an unprivileged user (statvfs: f_bavail x
// f_frsize). Throws InvalidArgument naming the options, the bytes needed and free. A file that is
// replaced counts whole (it is written beside the old one and renamed over it). A file system whose
// free space cannot be read is skipped (the write reports its own error).
void check_free_space(const std::vector<OutputSize>& outputs);

// Takes an exclusive advisory lock (flock) on fd, an output that one run at a time may write, without
// waiting: held until fd is closed. Throws InvalidArgument "{option} '{path}' is in use by another
// run ({who holds it})" when another open file holds it (in another process, or in this one: two
// runs of the Python module). A file system without flock support is not an error.
void lock_output(int fd, const NamedPath& output);

// Who holds a flock on the file fd is open on, for messages: "process 1234" (from /proc/locks), "this
// process" or, when it cannot be told, "another process".
std::string lock_holder(int fd);

// What went wrong writing an output file; the message names the file.
class OutputFileError : public InvalidArgument {
 public:
  OutputFileError(std::string path, std::string detail);
  const std::string& path() const { return path_; }
  const std::string& detail() const { return detail_; }   // the message without the file prefix

 private:
  std::string path_, detail_;
};

// Writes one file atomically (io/atomic_commit.hpp). The data goes to a temporary
// unique_temporary_path(target) in the target's directory (so the rename cannot cross file systems);
// commit() flushes it to disk, checks again that the target is absent or a regular file, renames it
// over the target and flushes the directory. Until commit() the target is untouched; after it the
// target is complete.
// A writer destroyed without commit() (an error, an exception between writes) removes its
// temporary. Construction first removes stale temporaries of the same target (see
// remove_stale_temporaries). Throws OutputFileError.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::string path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  // Appends n bytes; `what` names them in an error ("tensor 'w'").
  void write(const void* data, std::uint64_t n, std::string_view what);
  void commit();

  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_; }

 private:
  std::string path_, temp_;
  UniqueFd fd_;
  bool committed_ = false;
};

}  // namespace meshgrad::io
