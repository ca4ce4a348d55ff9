// Saving sharded checkpoints (store.hpp describes what one holds on disk): every rank writes its own
// pieces of the training state in parallel, and rank 0 commits the directory atomically.
//
// Commit protocol (a kill at any moment leaves the earlier checkpoints, and either the complete new
// one or nothing, under step_XXXXXXXX):
//   1. every rank writes and fsyncs its files in ROOT/.step_XXXXXXXX.tmp/, hashing as it writes;
//   2. the ranks exchange sizes and hashes (a communicator of the saver's own, so a background save
//      never interleaves with training's collectives);
//   3. rank 0 writes manifest.json, fsyncs the directory, renames it to step_XXXXXXXX (atomically
//      exchanging with a same-named older directory, which is then removed), fsyncs ROOT, and only
//      then removes checkpoints beyond the newest `keep`;
//   4. the ranks agree on the outcome: committed, or the error of the lowest rank that failed (its
//      writing, or rank 0's commit), which every rank then throws, so that all of them fail or go on
//      together and each says why.
// The rename and the flushes of step 3 are io::StagedDirectory's (io/atomic_commit.hpp). Leftover
// .tmp directories of a killed save are removed when the next saver opens ROOT. One run at a time per
// ROOT: the saver holds an exclusive lock (ROOT/.lock) for its lifetime.
//
// The file system must be shared by all ranks (one process with rank threads; under MPI on several
// machines, one file system every machine sees): rank 0 commits the directory the others wrote into.
// The commit renames with RENAME_NOREPLACE / RENAME_EXCHANGE, which local file systems (ext4, xfs,
// btrfs, tmpfs) support and NFS does not yet (io::rename_into_place is where a fallback goes).
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "meshgrad/checkpoint/manifest.hpp"
#include "meshgrad/checkpoint/state_tensor.hpp"
#include "meshgrad/comm/agreement.hpp"
#include "meshgrad/comm/communicator.hpp"
#include "meshgrad/distributed/mesh.hpp"

namespace meshgrad::checkpoint {

// What a save cost this rank, in seconds: the snapshot is the time training stood still (the copy of
// the state into memory); write covers files, hashes and the exchange (in the background when async);
// commit is rank 0's manifest, renames and fsyncs.
struct SaveTimes {
  double snapshot_s = 0;
  double write_s = 0;
  double commit_s = 0;
  std::uint64_t bytes_written = 0;   // by this rank
};

class CheckpointSaver {
 public:
  // Collective over the mesh (every rank constructs it, in the same order relative to other
  // collectives): creates root if needed, takes its lock (rank 0; refuses a root another run holds),
  // removes leftover temporaries, and splits a communicator for the saves. keep >= 1 keeps the newest
  // `keep` checkpoints after each commit; 0 keeps all. files_per_rank: how many files (each written
  // and hashed by its own thread) every rank spreads its pieces over, 1 to 64; 0 lets rank 0 choose
  // the cores each rank has to itself (hardware threads / ranks), 1 to 8.
  CheckpointSaver(std::string root, dist::DeviceMeshPtr mesh, int keep, int files_per_rank = 0);
  // Waits for a save in flight; its error, if any, is printed on stderr (call wait() to get it).
  ~CheckpointSaver();
  CheckpointSaver(const CheckpointSaver&) = delete;
  CheckpointSaver& operator=(const CheckpointSaver&) = delete;

  // Saves `tensors` and `state` as ROOT/step_XXXXXXXX (collective: every rank calls it with the same
  // step; state matters on rank 0). Ranks may hold different tensors (a pipeline stage holds its own
  // blocks): the checkpoint is their union, each tensor's boxes written by ranks that hold them; a
  // tensor several ranks hold must have the same full shape, placements and dtype on all of them. Waits for the previous save first. Copies this rank's pieces into memory, then writes them
  // on a background thread (async) or before returning. Throws CheckpointError for inconsistent
  // tensors; errors of the writing itself surface from this call (sync) or from the next save()/wait().
  SaveTimes save(std::int64_t step, const std::vector<StateTensor>& tensors, const nlohmann::json& state, bool async);
  // Waits for the save in flight (if any) and rethrows its error. Returns its times.
  SaveTimes wait();
  // The path of the last checkpoint this saver committed (rank 0; "" elsewhere or before any).
  const std::string& last_committed() const { return last_committed_; }
  const std::string& root() const { return root_; }

 private:
  struct Job;
  // The saved bytes of this rank's pieces: copied into snapshot_ (async) or pointing into the tensors.
  void collect_pieces(Job& job, const std::vector<StateTensor>& tensors, bool async);
  // Steps 1 to 4 of the commit protocol, on the saver's thread (async) or the caller's; the outcome
  // goes to job.error.
  void run_job(Job& job) noexcept;
  void write_files(Job& job) const;      // 1
  void share_reports(Job& job) const;    // 2 (collective)
  // 3 (rank 0): true when committed; false when a rank could not write its files (its own error
  // says why) or the commit failed (job.commit_error says why).
  bool commit(Job& job);
  Manifest manifest_of(const Job& job) const;   // 3: from every rank's report
  // 4 (collective): the failure of the lowest rank that failed (writing, or rank 0's commit), with its
  // message, the same on every rank; nothing when the checkpoint was committed.
  std::optional<comm::RankFailure> share_verdict(const Job& job) const;

  std::string root_;
  dist::DeviceMeshPtr mesh_;
  int keep_;
  int files_per_rank_ = 1;       // given, or decided by rank 0 at construction (cores per rank, 1 to 8)
  comm::CommunicatorPtr comm_;   // the saves' own communicator (a split of the mesh's world)
  int lock_fd_ = -1;
  std::unique_ptr<Job> job_;
  std::unique_ptr<std::byte[]> snapshot_;   // async saves copy this rank's pieces here
  std::uint64_t snapshot_capacity_ = 0;
  std::thread worker_;
  std::string last_committed_;
  std::int64_t next_commit_ = 1;   // rank 0: the commit number of its next checkpoint (Manifest::commit)
};

}  // namespace meshgrad::checkpoint
