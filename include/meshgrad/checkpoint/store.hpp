// Sharded training checkpoints: every rank writes its own pieces of the training state in parallel,
// a manifest says which file holds which box of which tensor with hashes (SHA-256 per file, XXH3-128
// per piece), directories are
// committed atomically, and a checkpoint loads on any other mesh (resharding) reading only the
// pieces a rank needs.
//
// On disk, ROOT/step_00000100/ holds
//   manifest.json        {"format": "meshgrad-checkpoint", "version": 1, "step": 100, "mesh": "dp=2,tp=2",
//                         "state": {...the trainer's: configuration, data position, RNG, ...},
//                         "files": [{"name": "rank_00000.bin", "bytes": N, "sha256": "..."}, ...],
//                         "tensors": [{"name": "h.0.attn.c_attn.weight", "dtype": "float32", "shape": [C, 3C],
//                                      "pieces": [{"file": 0, "offset": 0, "box": [[0, C], [0, 64]],
//                                                  "xxh3": "..."}, ...]}, ...]}
//   rank_RRRRR.bin       the raw bytes (row-major, the tensor's dtype, native little-endian) of the
//                        pieces rank R wrote, back to back at the manifest's offsets; a rank with
//                        several cores to itself spreads them over rank_RRRRR_F.bin, F = 0, 1, ...,
//                        written and hashed by one thread each
// A box is one [offset, size) range per dim of the full tensor. Every element of every tensor lies in
// exactly one piece (checked when a manifest is read). A piece replicated on several ranks (over dp,
// or a parameter replicated over tp) is written once, by one of its holders chosen round-robin so the
// bytes spread over the ranks.
//
// Commit protocol (a kill at any moment leaves the earlier checkpoints, and either the complete new
// one or nothing, under step_XXXXXXXX):
//   1. every rank writes and fsyncs its file in ROOT/.step_XXXXXXXX.tmp/, hashing as it writes;
//   2. the ranks exchange sizes and hashes (a communicator of the saver's own, so a background save
//      never interleaves with training's collectives);
//   3. rank 0 writes manifest.json, fsyncs the directory, renames it to step_XXXXXXXX (atomically
//      exchanging with a same-named older directory, which is then removed), fsyncs ROOT, and only
//      then removes checkpoints beyond the newest `keep`.
// Leftover .tmp directories of a killed save are removed when the next saver opens ROOT. One run at a
// time per ROOT: the saver holds an exclusive lock (ROOT/.lock) for its lifetime.
//
// The file system must be shared by all ranks (one process with rank threads; under MPI on several
// machines, a network file system): rank 0 commits the directory the others wrote into.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "meshgrad/distributed/layout.hpp"
#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/distributed/placement.hpp"
#include "meshgrad/tensor/tensor.hpp"
#include "meshgrad/checkpoint/manifest.hpp"

namespace meshgrad::checkpoint {

// ---- Finding checkpoints ---------------------------------------------------------------------------

// The committed checkpoints under root (directories step_XXXXXXXX with a manifest.json), oldest
// first, as full paths. Temporaries and other entries are ignored.
std::vector<std::string> list_checkpoints(const std::string& root);
// True when path is a checkpoint directory (holds manifest.json) or a root holding at least one.
bool is_checkpoint_path(const std::string& path);
// `path` itself when it holds manifest.json, else the newest committed checkpoint under it. Throws
// CheckpointError naming path when there is none.
std::string resolve_checkpoint(const std::string& path);
// Reads and parses dir/manifest.json (size-bounded).
Manifest read_manifest(const std::string& dir);

// ---- Writing ---------------------------------------------------------------------------------------

// One tensor of the training state as this rank holds it: its piece of the full tensor, laid out by
// dist::piece_layout at this rank's mesh coordinates (a parameter's value, an optimizer moment).
struct StateTensor {
  std::string name;
  Shape full_shape;
  dist::Placements placements;
  Tensor local;
};

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
  // names, full shapes, placements and dtypes in the same order, and the same step; state matters on
  // rank 0). Waits for the previous save first. Copies this rank's pieces into memory, then writes them
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
  void run_job(Job& job) noexcept;

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
};

// ---- Reading ---------------------------------------------------------------------------------------

// A piece one rank needs: the full tensor `name` of `full_shape`, laid out as `layout` (this rank's
// coordinates on the mesh it runs), in `dtype`.
struct PieceRequest {
  std::string name;
  Shape full_shape;
  dist::PieceLayout layout;
  DType dtype = DType::Float32;
};

// Reads the requested pieces from checkpoint dir (whose parsed manifest is given), on any mesh: for
// each request, the saved pieces its boxes overlap are read (only their byte ranges), their XXH3-128
// checked against the manifest, and the overlaps copied into a new tensor of layout.local_shape.
// Not collective. All-or-nothing: throws CheckpointError naming the file and the tensor (a missing
// tensor, another full shape or dtype, a missing or truncated file, a hash mismatch) before returning
// anything.
std::vector<Tensor> read_pieces(const std::string& dir, const Manifest& manifest,
                                const std::vector<PieceRequest>& requests);

// The same reads straight into targets[i] (contiguous, of requests[i]'s local shape and dtype; a
// checkpoint of another floating dtype is converted), so that a resume fills memory the model
// already holds instead of new tensors plus a copy. Errors found from the manifest and the files'
// sizes (a missing tensor, another shape or dtype, a missing or truncated file) are thrown before
// any target is written. A hash mismatch or a read error found while reading is thrown after the
// other reads finished, and the targets are then partly overwritten: use it for state the caller
// drops when it throws (read_pieces when it must stay as it was). Bumps every target's version.
void read_pieces_into(const std::string& dir, const Manifest& manifest, const std::vector<PieceRequest>& requests,
                      const std::vector<Tensor>& targets);

// The full tensors `names` of checkpoint dir (each read whole from its pieces, hashes checked), in the
// given order: what `sample`, `export` and other single-file tools read from a sharded checkpoint.
std::vector<std::pair<std::string, Tensor>> read_full_tensors(const std::string& dir, const Manifest& manifest,
                                                              const std::vector<std::pair<std::string, Shape>>& names);

// Saves and loads stage O_DIRECT transfers through 8 MiB aligned buffers that the process keeps for
// the next save or load (up to 64 MiB): memory a process touches for the first time is slow on
// some hosts. This frees them (a job that saved its last checkpoint, or a benchmark that wants the
// cost of a new process).
void release_staging_buffers();

// Checks every file of the checkpoint against its size and SHA-256 and every piece against its hash.
// Throws CheckpointError naming the first bad file or tensor. Returns the bytes checked.
std::uint64_t verify_checkpoint(const std::string& dir);

}  // namespace meshgrad::checkpoint
