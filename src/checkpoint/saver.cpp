// Saving sharded checkpoints (contract and commit protocol in include/meshgrad/checkpoint/saver.hpp).
#include "meshgrad/checkpoint/saver.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <set>

#include "checkpoint/commit.hpp"
#include "checkpoint/pieces.hpp"
#include "checkpoint/rank_writes.hpp"
#include "checkpoint/write_plan.hpp"
#include "meshgrad/checkpoint/directory.hpp"
#include "meshgrad/comm/agreement.hpp"
#include "meshgrad/io/atomic_commit.hpp"
#include "meshgrad/tensor/parallel.hpp"

namespace meshgrad::checkpoint {

namespace fs = std::filesystem;

// The bytes of each piece a rank writes, for its file writers. Outside the anonymous namespace:
// CheckpointSaver::Job holds one.
struct PieceBytes {
  std::vector<BoxBytes> data;       // per piece written, in the order of `mine`
  std::vector<Tensor> keep_alive;   // the tensors `data` points into (none with a snapshot)
};

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The saves exchange hashes after writing: a slow disk may keep a peer busy for long, but never forever.
constexpr comm::Milliseconds kSaveExchangeTimeout{30 * 60 * 1000};

// Files per rank when the caller leaves it to the saver: as many as the cores a rank has to itself
// (one hashing stream each), at most 8.
int files_per_rank_from_cores(int ranks) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  return static_cast<int>(std::clamp<std::int64_t>(static_cast<std::int64_t>(cores) / ranks, 1, 8));
}

// Every tensor's piece must be the one its placements give this rank (a wrong piece would be written
// under another box), and names unique. Returns what the manifest needs of them: names, full shapes,
// placements and dtypes, no data.
std::vector<StateTensor> check_and_describe(const std::vector<StateTensor>& tensors, const dist::DeviceMesh& mesh) {
  std::vector<StateTensor> meta;
  std::set<std::string> names;
  for (const StateTensor& t : tensors) {
    MG_CHECK(names.insert(t.name).second, "checkpoint: two state tensors are named '{}'", t.name);
    MG_CHECK(t.local.defined(), "checkpoint: state tensor '{}' has no value", t.name);
    const dist::PieceLayout layout = dist::piece_layout(t.full_shape, mesh, t.placements, mesh.coordinates());
    MG_CHECK(t.local.shape() == layout.local_shape, "checkpoint: state tensor '{}' has local shape {}, but full shape {} "
             "placed {} gives {} on rank {}", t.name, shape_str(t.local.shape()), shape_str(t.full_shape),
             dist::placements_str(t.placements), shape_str(layout.local_shape), mesh.rank());
    meta.push_back({t.name, t.full_shape, t.placements, Tensor::empty({0}, t.local.dtype())});
  }
  return meta;
}

// ---- Every rank's tensors -------------------------------------------------------------------------
// Ranks may hold different tensors (a pipeline stage holds its own blocks): the save is of the union,
// each tensor written by the ranks that hold it. A tensor several ranks hold must be described the
// same on all of them.

// A description (name, dtype, full shape, placements) as int64 words, for an all-gather.
void encode_description(const StateTensor& t, std::vector<std::int64_t>& out) {
  out.push_back(static_cast<std::int64_t>(t.name.size()));
  for (std::size_t i = 0; i < t.name.size(); i += 8) {
    std::int64_t word = 0;
    std::memcpy(&word, t.name.data() + i, std::min<std::size_t>(8, t.name.size() - i));
    out.push_back(word);
  }
  out.push_back(static_cast<std::int64_t>(t.local.dtype()));
  out.push_back(static_cast<std::int64_t>(t.full_shape.size()));
  for (const std::int64_t d : t.full_shape) out.push_back(d);
  out.push_back(static_cast<std::int64_t>(t.placements.size()));
  for (const dist::Placement& p : t.placements) {
    for (const std::int64_t v : {static_cast<std::int64_t>(p.kind), std::int64_t{p.dim}, std::int64_t{p.blocks}, p.unit,
                                 std::int64_t{p.of_piece}}) {
      out.push_back(v);
    }
  }
}

// The descriptions in words[begin, end) (one rank's), as StateTensors without data.
std::vector<StateTensor> decode_descriptions(const std::vector<std::int64_t>& words, std::size_t begin, std::size_t end) {
  std::vector<StateTensor> out;
  std::size_t i = begin;
  auto next = [&] {
    MG_CHECK(i < end, "checkpoint: internal error: a tensor description ends early");
    return words[i++];
  };
  while (i < end) {
    StateTensor t;
    const auto length = static_cast<std::size_t>(next());
    t.name.resize(length);
    for (std::size_t k = 0; k < length; k += 8) {
      const std::int64_t word = next();
      std::memcpy(t.name.data() + k, &word, std::min<std::size_t>(8, length - k));
    }
    const auto dtype = static_cast<DType>(next());
    for (std::int64_t d = next(); d > 0; --d) t.full_shape.push_back(next());
    for (std::int64_t n = next(); n > 0; --n) {
      dist::Placement p;
      p.kind = static_cast<dist::Placement::Kind>(next());
      p.dim = static_cast<int>(next());
      p.blocks = static_cast<int>(next());
      p.unit = next();
      p.of_piece = next() != 0;
      t.placements.push_back(p);
    }
    t.local = Tensor::empty({0}, dtype);
    out.push_back(std::move(t));
  }
  return out;
}

struct SaveTensors {
  std::vector<StateTensor> tensors;        // the union: no data (Tensor::empty of the dtype)
  std::vector<std::vector<int>> holders;   // per tensor, the ranks holding it, ascending
  std::vector<int> local;                  // per tensor, its index in this rank's list (-1: not held)
};

// The union of every rank's tensors (comm: the saver's communicator over the whole mesh), in rank
// order of first appearance: when every rank holds the same list, that list, held by every rank.
SaveTensors every_ranks_tensors(const std::vector<StateTensor>& mine, comm::Communicator& comm,
                                const comm::CollectiveOptions& opt) {
  std::vector<std::int64_t> words;
  for (const StateTensor& t : mine) encode_description(t, words);
  std::int64_t count = static_cast<std::int64_t>(words.size());
  std::vector<std::int64_t> counts(static_cast<std::size_t>(comm.size()));
  comm.all_gather(comm::ConstBuffer{&count, 1, DType::Int64},
                  comm::MutableBuffer{counts.data(), counts.size(), DType::Int64}, {}, opt);
  std::vector<std::size_t> sizes(counts.begin(), counts.end());
  std::size_t total = 0;
  for (const std::size_t n : sizes) total += n;
  std::vector<std::int64_t> all(total);
  comm.all_gather(comm::ConstBuffer{words.data(), words.size(), DType::Int64},
                  comm::MutableBuffer{all.data(), all.size(), DType::Int64}, sizes, opt);
  SaveTensors out;
  std::map<std::string, std::size_t> index;
  std::size_t begin = 0;
  for (int r = 0; r < comm.size(); ++r) {
    const std::size_t end = begin + sizes[static_cast<std::size_t>(r)];
    for (StateTensor& t : decode_descriptions(all, begin, end)) {
      const auto [it, fresh] = index.emplace(t.name, out.tensors.size());
      if (fresh) {
        out.tensors.push_back(std::move(t));
        out.holders.emplace_back();
      } else {
        const StateTensor& first = out.tensors[it->second];
        if (first.full_shape != t.full_shape || first.placements != t.placements ||
            first.local.dtype() != t.local.dtype()) {
          throw CheckpointError(fmt::format(
              "checkpoint: ranks describe state tensor '{}' differently: {} {} placed {} on rank {}, {} {} placed {} "
              "on rank {}", t.name, dtype_name(first.local.dtype()), shape_str(first.full_shape),
              dist::placements_str(first.placements), out.holders[it->second].front(), dtype_name(t.local.dtype()),
              shape_str(t.full_shape), dist::placements_str(t.placements), r));
        }
      }
      out.holders[it->second].push_back(r);
    }
    begin = end;
  }
  out.local.assign(out.tensors.size(), -1);
  for (std::size_t k = 0; k < mine.size(); ++k) out.local[index.at(mine[k].name)] = static_cast<int>(k);
  return out;
}

// ---- The pieces this rank writes ----------------------------------------------------------------

// One run of an async save's snapshot: n bytes from src to dst.
struct SnapshotCopy {
  std::byte* dst = nullptr;
  const std::byte* src = nullptr;
  std::uint64_t n = 0;
};

// Does the copies with the threads of the rank's cores (parallel::workers_for: the BLAS threads a
// rank owns), each thread an equal share of the bytes, cut anywhere inside a run: the snapshot is
// what an async save stalls training for, and one core's memcpy leaves memory bandwidth unused.
void copy_on_the_ranks_cores(const std::vector<SnapshotCopy>& copies) {
  std::vector<std::uint64_t> starts;   // each copy's first byte in the concatenation of all of them
  starts.reserve(copies.size());
  std::uint64_t total = 0;
  for (const SnapshotCopy& c : copies) {
    starts.push_back(total);
    total += c.n;
  }
  const auto workers = parallel::workers_for(static_cast<std::int64_t>(total / sizeof(float)));
  parallel::for_ranges(static_cast<std::int64_t>(total), workers, [&](std::int64_t begin, std::int64_t end) {
    const auto lo = static_cast<std::uint64_t>(begin), hi = static_cast<std::uint64_t>(end);
    std::size_t i = static_cast<std::size_t>(std::upper_bound(starts.begin(), starts.end(), lo) - starts.begin()) - 1;
    for (; i < copies.size() && starts[i] < hi; ++i) {
      const std::uint64_t from = std::max(lo, starts[i]) - starts[i], to = std::min(hi, starts[i] + copies[i].n) - starts[i];
      std::memcpy(copies[i].dst + from, copies[i].src + from, to - from);
    }
  });
}

// The box of this rank's piece of t that p is, with the contiguous local tensor holding it.
std::pair<Tensor, LocalBox> find_box(const PlannedPiece& p, const StateTensor& t, const dist::DeviceMesh& mesh) {
  const dist::PieceLayout layout = dist::piece_layout(t.full_shape, mesh, t.placements, mesh.coordinates());
  for (const LocalBox& lb : local_boxes(layout)) {
    if (same_box(lb.box, p.box)) return {t.local.detach().contiguous(), lb};   // itself: parameters and moments are contiguous
  }
  MG_CHECK(false, "checkpoint: internal error: rank {} writes box {} of '{}' but does not hold it", mesh.rank(),
           box_str(p.box), t.name);
  return {};
}

// The pieces of the plan that `rank` writes: indices into plan, in plan order.
std::vector<std::size_t> pieces_written_by(const std::vector<PlannedPiece>& plan, int rank) {
  std::vector<std::size_t> mine;
  for (std::size_t k = 0; k < plan.size(); ++k) {
    if (plan[k].writer == rank) mine.push_back(k);
  }
  return mine;
}

// Finds each piece of `mine` (pieces_written_by this rank) among this rank's boxes of its tensor.
// With a snapshot (async saves: training may change the tensors as soon as save() returns; room for
// every piece's bytes) the pieces are copied into it back to back, with the threads of the rank's
// cores, and data points there. Without (sync saves) data points into the tensors, no copy. Either
// way a box of a blocked dim (the q, k and v blocks of an attention weight) is gathered run by run
// (BoxBytes) where it goes, never packed into a temporary first. Throws InvalidArgument when a piece
// is not where the plan says (an internal error).
PieceBytes find_piece_bytes(const std::vector<PlannedPiece>& plan, const std::vector<std::size_t>& mine,
                            const std::vector<StateTensor>& tensors, const dist::DeviceMesh& mesh, std::byte* snapshot) {
  PieceBytes out;
  std::uint64_t snapshot_used = 0;   // pieces lie back to back in the snapshot (p.offset is within p.file)
  std::vector<SnapshotCopy> copies;  // with a snapshot: the runs to copy into it, after the loop
  std::vector<Tensor> sources;       // with a snapshot: keeps what the copies read alive until they ran
  for (std::size_t k : mine) {
    const PlannedPiece& p = plan[k];
    const StateTensor& t = tensors[p.tensor];
    const auto [local, lb] = find_box(p, t, mesh);
    const BoxBytes box = box_bytes(local, lb);
    MG_CHECK(box.bytes() == p.bytes, "checkpoint: internal error: box {} of '{}' is {} bytes, planned {}", box_str(p.box),
             t.name, box.bytes(), p.bytes);
    if (snapshot == nullptr) {
      out.data.push_back(box);
      out.keep_alive.push_back(local);
      continue;
    }
    std::byte* dst = snapshot + snapshot_used;
    box.for_each_run([&](const std::byte* run, std::uint64_t n) {
      copies.push_back({dst, run, n});
      dst += n;
    });
    sources.push_back(local);
    out.data.push_back({snapshot + snapshot_used, 1, p.bytes, 0});
    snapshot_used += p.bytes;
  }
  copy_on_the_ranks_cores(copies);
  return out;
}

comm::CollectiveOptions save_collective_options() {
  comm::CollectiveOptions opt;
  opt.timeout = kSaveExchangeTimeout;
  return opt;
}

}  // namespace

struct CheckpointSaver::Job {
  std::int64_t step = 0;
  std::string stage_dir, final_dir;
  std::vector<PlannedPiece> plan;
  std::vector<std::size_t> mine;             // indices into plan this rank writes, in file order
  PieceBytes pieces;                         // the bytes of each of `mine`: in the snapshot or a tensor
  std::uint64_t bytes = 0;
  std::vector<StateTensor> meta;             // names, shapes, dtypes (no data) for the manifest
  nlohmann::json state;
  RankReport written;                        // step 1: this rank's files (ok false when it failed)
  std::vector<RankReport> reports;           // step 2: every rank's
  std::string error;                         // this rank's first error (writing, or a collective)
  std::string commit_error;                  // rank 0's (step 3)
  SaveTimes times;
  std::exception_ptr outcome;                // what wait() rethrows
};

// ---- Opening the root -----------------------------------------------------------------------------

CheckpointSaver::CheckpointSaver(std::string root, dist::DeviceMeshPtr mesh, int keep, int files_per_rank)
    : root_(std::move(root)), mesh_(std::move(mesh)), keep_(keep) {
  MG_CHECK(mesh_ != nullptr, "checkpoint: no mesh");
  MG_CHECK(keep_ >= 0, "checkpoint: --keep must be >= 0 (0 keeps every checkpoint), got {}", keep_);
  MG_CHECK(files_per_rank >= 0 && files_per_rank <= 64, "checkpoint: files per rank must be 0 (chosen from the cores) to 64, "
           "got {}", files_per_rank);
  // Rank 0 prepares the root; every rank throws its error when it fails (the threads backend reports
  // whichever rank failed first, so all say the same).
  std::string problem;
  if (mesh_->rank() == 0) {
    try {
      lock_fd_ = lock_root_and_remove_leftovers(root_);
      // Numbered after every readable checkpoint already there.
      for (const std::string& existing : list_checkpoints(root_)) {
        if (const std::optional<std::int64_t> commit = commit_number(existing)) next_commit_ = std::max(next_commit_, *commit + 1);
      }
      // Readable manifests hold at most kMaxCommitNumber (so the + 1 above cannot overflow); a
      // checkpoint numbered beyond it would be refused when read.
      if (next_commit_ > kMaxCommitNumber)
        throw CheckpointError(fmt::format("checkpoint: '{}' holds a checkpoint of commit number {}, the largest there may "
                                          "be; give the new checkpoints another --checkpoint-dir", root_, kMaxCommitNumber));
    } catch (const std::exception& e) {
      problem = e.what();
    }
  }
  if (const std::optional<comm::RankFailure> failed = comm::first_failure(*mesh_->world(), problem)) {
    if (lock_fd_ >= 0) ::close(lock_fd_);
    throw CheckpointError(failed->message);
  }
  // The files per rank, decided by rank 0 so that every rank plans the same files.
  std::int64_t files = files_per_rank > 0 ? files_per_rank : files_per_rank_from_cores(mesh_->size());
  mesh_->world()->broadcast(comm::MutableBuffer{&files, 1, DType::Int64}, 0);
  files_per_rank_ = static_cast<int>(files);
  comm_ = mesh_->world()->split(0, mesh_->rank());
}

CheckpointSaver::~CheckpointSaver() {
  try {
    wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "meshgrad: a checkpoint save failed: %s\n", e.what());
  }
  if (lock_fd_ >= 0) ::close(lock_fd_);
}

// ---- Saving ---------------------------------------------------------------------------------------

SaveTimes CheckpointSaver::wait() {
  if (worker_.joinable()) worker_.join();
  if (!job_) return {};
  const std::unique_ptr<Job> job = std::move(job_);
  if (job->outcome) std::rethrow_exception(job->outcome);
  return job->times;
}

SaveTimes CheckpointSaver::save(std::int64_t step, const std::vector<StateTensor>& tensors, const nlohmann::json& state,
                                bool async) {
  wait();
  const Clock::time_point t0 = Clock::now();
  auto job = std::make_unique<Job>();
  // What can fail on one rank only (a tensor that is not this rank's piece, no memory for the
  // snapshot) is agreed on before any rank goes on, so that no rank waits for one that gave up.
  comm::run_agreed(*comm_, [&] { (void)check_and_describe(tensors, *mesh_); }, save_collective_options());
  // The same on every rank (an inconsistency throws everywhere alike).
  SaveTensors every = every_ranks_tensors(tensors, *comm_, save_collective_options());
  comm::run_agreed(*comm_, [&] {
    job->step = step;
    job->final_dir = (fs::path(root_) / checkpoint_dir_name(step)).string();
    job->stage_dir = stage_path(root_, step);
    job->state = state;
    job->plan = plan_pieces(every.tensors, every.holders, *mesh_, files_per_rank_);
    // This rank's tensors at the union's indices (the pieces it writes are all among them).
    std::vector<StateTensor> aligned = every.tensors;
    for (std::size_t i = 0; i < aligned.size(); ++i) {
      if (every.local[i] >= 0) aligned[i] = tensors[static_cast<std::size_t>(every.local[i])];
    }
    job->meta = every.tensors;
    collect_pieces(*job, aligned, async);   // the stall of an async save
  }, save_collective_options());
  job->times.snapshot_s = seconds_since(t0);
  job->times.bytes_written = job->bytes;
  const SaveTimes snapshot_times = job->times;
  job_ = std::move(job);
  if (async) {
    worker_ = std::thread([this] { run_job(*job_); });
    return snapshot_times;
  }
  run_job(*job_);
  return wait();
}

void CheckpointSaver::collect_pieces(Job& job, const std::vector<StateTensor>& tensors, bool async) {
  job.mine = pieces_written_by(job.plan, mesh_->rank());
  for (std::size_t k : job.mine) job.bytes += job.plan[k].bytes;
  // Async: the snapshot buffer is kept for the next save, so only the first one pays for fresh pages.
  if (async && snapshot_capacity_ < job.bytes) {
    snapshot_.reset();
    snapshot_ = std::make_unique_for_overwrite<std::byte[]>(job.bytes);
    snapshot_capacity_ = job.bytes;
  }
  job.pieces = find_piece_bytes(job.plan, job.mine, tensors, *mesh_, async ? snapshot_.get() : nullptr);
}

// ---- The commit protocol --------------------------------------------------------------------------

void CheckpointSaver::run_job(Job& job) noexcept {
  const Clock::time_point t0 = Clock::now();
  try {
    write_files(job);
  } catch (const std::exception& e) {
    job.error = e.what();
  }
  job.pieces.keep_alive.clear();
  job.times.write_s = seconds_since(t0);
  std::optional<comm::RankFailure> failure;
  try {
    share_reports(job);
    if (mesh_->rank() == 0) (void)commit(job);
    failure = share_verdict(job);
  } catch (const std::exception& e) {
    failure = comm::RankFailure{mesh_->rank(), job.error.empty() ? e.what() : job.error};
  }
  if (!failure) return;
  // The cause is in every rank's error: the threads backend reports the rank that failed first, and
  // an MPI launcher may show any rank's, so none may say "see the error of another rank".
  const std::string from = failure->rank == mesh_->rank() ? "" : fmt::format("rank {}: ", failure->rank);
  job.outcome = std::make_exception_ptr(
      CheckpointError(fmt::format("checkpoint of step {} was not committed: {}{}", job.step, from, failure->message)));
}

void CheckpointSaver::write_files(Job& job) const {
  create_stage(job.stage_dir);
  delay_here_if_asked("write");     // test-only (commit.hpp): windows for a kill during the writing
  job.written = write_rank_files(job.stage_dir, mesh_->rank(), files_per_rank_, job.plan, job.mine, job.pieces.data);
  delay_here_if_asked("written");
}

void CheckpointSaver::share_reports(Job& job) const {
  job.written.ok = job.error.empty();
  job.reports = exchange_reports(*comm_, job.written, job.plan, files_per_rank_, save_collective_options());
}

bool CheckpointSaver::commit(Job& job) {
  // A rank that could not write its files has its own error, which share_verdict passes on.
  if (std::any_of(job.reports.begin(), job.reports.end(), [](const RankReport& r) { return !r.ok; })) return false;
  const Clock::time_point t0 = Clock::now();
  try {
    // Removed unless committed: a save that fails leaves nothing behind.
    io::StagedDirectory stage = io::StagedDirectory::adopt(job.stage_dir, job.final_dir);
    commit_stage(stage, manifest_of(job));
    last_committed_ = job.final_dir;
    ++next_commit_;
    prune_checkpoints(root_, keep_, job.final_dir);   // only now that the new one is safe
  } catch (const std::exception& e) {
    job.commit_error = e.what();
  }
  job.times.commit_s = seconds_since(t0);
  return job.commit_error.empty();
}

Manifest CheckpointSaver::manifest_of(const Job& job) const {
  Manifest m;
  m.step = job.step;
  m.commit = next_commit_;
  m.mesh = mesh_->str();
  m.state = job.state;
  for (const StateTensor& t : job.meta) m.tensors.push_back({t.name, t.local.dtype(), t.full_shape, {}});
  add_written_files(m, job.reports, job.plan, files_per_rank_);
  return m;
}

std::optional<comm::RankFailure> CheckpointSaver::share_verdict(const Job& job) const {
  // This rank's writing error, else (rank 0) its commit's; the lowest rank's wins on every rank.
  const std::string& mine = job.error.empty() ? job.commit_error : job.error;
  return comm::first_failure(*comm_, mine, save_collective_options());
}

}  // namespace meshgrad::checkpoint
