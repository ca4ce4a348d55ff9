// Internal to the checkpoint layer: the directories of the commit protocol (saver.hpp) under a root:
// the lock, the stage a save writes into, step 3's commit onto step_XXXXXXXX and the pruning after it,
// and the removal of what killed saves left. The rename and the flushes themselves are
// io::StagedDirectory's.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "meshgrad/checkpoint/manifest.hpp"
#include "meshgrad/io/atomic_commit.hpp"

namespace meshgrad::checkpoint {

// ROOT/.step_XXXXXXXX.tmp: where the ranks write the files of the save of `step`.
std::string stage_path(const std::string& root, std::int64_t step);

// Rank 0, when a saver opens root: creates root if needed (refusing a symbolic link or a file), takes
// the lock ROOT/.lock (refusing a root another run holds: one run at a time per root), and, now that
// nobody else writes there, removes what killed saves left (.step_*.tmp and .step_*.tmp-deleting).
// Returns the lock's descriptor, which holds the lock until closed. Throws CheckpointError naming root.
int lock_root_and_remove_leftovers(const std::string& root);

// Every rank, before it writes: the stage directory, made by whichever rank comes first.
void create_stage(const std::string& stage);

// Rank 0, once every rank wrote and flushed its files into the stage (adopted by an
// io::StagedDirectory whose target is ROOT/step_XXXXXXXX, so that a failure removes it and every
// rank's files in it): writes and flushes the manifest, and commits the stage: fsync of the stage, a
// rename that exchanges with a same-named older checkpoint (a run resumed from an earlier step writes
// the step again), which is then removed, and an fsync of the root, which must succeed. Throws
// CheckpointError. MESHGRAD_CHECKPOINT_FAULT=before-rename exits the process (code 137, as SIGKILL
// would) once the manifest is written, right before the commit: what the tests of a killed save use.
void commit_stage(io::StagedDirectory& stage, const Manifest& manifest);

// Test-only, for tests/cli/kill_resume_soak.py: MESHGRAD_CHECKPOINT_TEST_DELAY_MS=POINT:MS sleeps MS
// milliseconds (0 to 600000) at POINT of every save, so that a kill sent meanwhile lands there:
// "write" (every rank's save job, once the stage directory exists and before the rank writes its
// files), "written" (every rank, once its files are written and flushed, before the ranks exchange
// their hashes) or "commit" (rank 0, once the manifest is written and before the rename). The
// variable is read once per process; a malformed value fails every save with a CheckpointError naming
// it. Unset, this does nothing.
void delay_here_if_asked(std::string_view point);

// Only once a new checkpoint is committed: removes the oldest committed checkpoints under root
// beyond the newest `keep` (0 keeps all), never `newest`. Each is first renamed out of the committed
// names (atomic), then deleted: a kill in the middle of the deletion leaves a temporary the next
// saver removes, never a half-deleted checkpoint. Errors are ignored (leftovers go next time).
void prune_checkpoints(const std::string& root, int keep, const std::string& newest);

}  // namespace meshgrad::checkpoint
