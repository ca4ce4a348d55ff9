// The one way meshgrad makes a new file or directory appear at a path: built under a temporary name
// beside its target (same directory, so the same file system), flushed, renamed onto the target in one
// step, and the directory holding both flushed. A kill at any moment leaves the old target or the
// complete new one, never a mix; what is left of a killed writer is a temporary, which the next
// writer of the same target removes.
//
//   AtomicFileWriter (output_path.hpp)  a file: fsync of its data, then rename_into_place
//   StagedDirectory (below)             a directory: its files flushed by their writers, then commit()
//                                       (fsync of the directory, rename_into_place, fsync of the parent):
//                                       an export (interop/hf_io), a sharded checkpoint (checkpoint/saver)
//
// Every rename that commits goes through rename_into_place: it is the one place that knows what may
// be replaced and how.
#pragma once

#include <string>
#include <utility>

namespace meshgrad::io {

// The directory that holds path: its parent, or "." for a bare name. Temporaries of path go there.
std::string directory_of(const std::string& path);

// ".NAME.tmp-<pid>-<salt>-<n>@<host>" beside target (in its directory; NAME is its last component):
// a name no other process or thread of this process picks, which says who made it.
std::string unique_temporary_path(const std::string& target);

// Removes the temporary files ".NAME.tmp-<pid>-..." of target in its directory whose process is gone:
// written on this host (or by an older meshgrad that did not record the host) by a pid that no longer
// exists. A live process's temporaries are left alone. Returns how many were removed.
int remove_stale_temporaries(const std::string& target);

// What a commit does to a target that exists.
enum class ExistingTarget {
  // rename(2): a file replaces a file; a directory replaces only an empty directory, and a non-empty
  // one makes the commit fail with nothing changed. (Whether a file may be replaced is the caller's
  // check: AtomicFileWriter replaces only regular files.)
  kReplaceFileOrEmptyDirectory,
  // A directory takes the target's place whatever it holds: renameat2(RENAME_NOREPLACE) when the
  // target is absent, else renameat2(RENAME_EXCHANGE), which swaps the two in one step; the old
  // target, now at the staged path, is then removed (a kill in the middle leaves it there, a
  // temporary). On a file system without rename flags (NFS answers EINVAL) the caller must hold a
  // lock on the target's directory: a plain rename onto an absent target, else the old target moved
  // aside to a temporary name, the stage renamed in and the old removed (a kill between the two
  // renames loses this one target: both are then temporaries). MESHGRAD_IO_FAULT=no-rename-flags
  // makes every machine behave so (tests).
  kExchangeAndRemoveOld,
};

// Renames staged (complete and flushed) onto target as `existing` says. Throws FileIoError (op
// rename) with nothing changed: "cannot rename 'S' to 'T': <why>", or for an exchange "cannot replace
// 'T': <why>". This is the only function that renames a stage into place.
void rename_into_place(const std::string& staged, const std::string& target, ExistingTarget existing);

// Whether the flush of the target's directory after the rename must succeed. The rename has taken
// place either way: kRequired turns a failed flush into an error (a checkpoint that may not survive a
// power cut is not reported saved); kIfPossible accepts it (a directory without read permission
// cannot even be opened to flush it).
enum class ParentFlush { kRequired, kIfPossible };

// The directory holding target ("." for a bare name), flushed as `flush` says (fsync_directory).
void flush_directory_of(const std::string& target, ParentFlush flush);

// A directory built beside its target and committed onto it in one rename. Destroyed without a
// commit, it removes the stage and everything in it (errors ignored: a leftover is a temporary).
class StagedDirectory {
 public:
  // A new empty stage at unique_temporary_path(target), mode 0777 before the umask. Throws FileIoError
  // (op create): "cannot create the temporary directory 'S': <why>".
  static StagedDirectory create_beside(std::string target);
  // Takes charge of `stage`, an existing directory beside target that others filled (the ranks of a
  // checkpoint each write their files into it; the one that commits adopts it).
  static StagedDirectory adopt(std::string stage, std::string target);
  ~StagedDirectory();
  StagedDirectory(const StagedDirectory&) = delete;
  StagedDirectory& operator=(const StagedDirectory&) = delete;

  const std::string& path() const { return stage_; }
  const std::string& target() const { return target_; }

  // Every file in the stage must be complete and flushed (fsync) by its writer. Flushes the stage's
  // entries (fsync_directory), renames it into place (rename_into_place) and flushes the target's
  // directory (flush_directory_of). Throws FileIoError: before the rename, with the target untouched
  // (the stage stays until destruction); after it (ParentFlush::kRequired only), with the new
  // target in place.
  void commit(ExistingTarget existing, ParentFlush parent);

 private:
  StagedDirectory(std::string stage, std::string target) : stage_(std::move(stage)), target_(std::move(target)) {}
  std::string stage_, target_;
  bool committed_ = false;
};

}  // namespace meshgrad::io
