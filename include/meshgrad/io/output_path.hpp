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
