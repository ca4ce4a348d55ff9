// Sharded checkpoints (contract and on-disk format in include/meshgrad/checkpoint/store.hpp).
#include "meshgrad/checkpoint/store.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <filesystem>
#include <future>
#include <map>
#include <set>

#include "meshgrad/comm/communicator.hpp"
#include "meshgrad/tensor/parallel.hpp"
#include "meshgrad/io/sha256.hpp"

#include <xxhash.h>   // XXH3-128 of the pieces (libxxhash)

namespace meshgrad::checkpoint {

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

constexpr const char* kManifestName = "manifest.json";
// The saves exchange hashes after writing: a slow disk may keep a peer busy for long, but never forever.
constexpr comm::Milliseconds kSaveExchangeTimeout{30 * 60 * 1000};

std::string errno_text(int e) { return std::strerror(e); }

std::string hex_of(const unsigned char* bytes, std::size_t n) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(2 * n);
  for (std::size_t i = 0; i < n; ++i) {
    hex += digits[bytes[i] >> 4];
    hex += digits[bytes[i] & 15];
  }
  return hex;
}
// An XXH3-128 digest in hex: what the manifest records per piece and every read checks. (The files'
// SHA-256 is the content hash a user can check with sha256sum; a piece hash must be cheap enough to
// compute on every save and every partial read.)
std::string xxh3_hex(const XXH128_hash_t& h) {
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, h);
  return hex_of(c.digest, sizeof c.digest);
}

// ---- Boxes -------------------------------------------------------------------------------------------

// One box of a rank's piece: where it lies in the full tensor, and where in the local (packed) piece.
// A piece is the product of one range per dim, except the dim split in blocks (at most one), which
// holds several ranges side by side in the local tensor.
struct LocalBox {
  Box box;
  int split_dim = -1;          // the blocked dim, -1 when the piece is one box
  std::int64_t local_offset = 0;   // along split_dim in the local tensor
};

std::vector<LocalBox> local_boxes(const dist::PieceLayout& layout) {
  const std::size_t nd = layout.ranges.size();
  int split = -1;
  for (std::size_t d = 0; d < nd; ++d) {
    MG_CHECK(!layout.ranges[d].empty(), "checkpoint: a piece layout with no range in dim {}", d);
    if (layout.ranges[d].size() > 1) split = static_cast<int>(d);
  }
  std::vector<LocalBox> out;
  const std::size_t blocks = split < 0 ? 1 : layout.ranges[static_cast<std::size_t>(split)].size();
  std::int64_t local = 0;
  for (std::size_t k = 0; k < blocks; ++k) {
    LocalBox lb;
    lb.split_dim = split;
    lb.local_offset = local;
    for (std::size_t d = 0; d < nd; ++d) {
      lb.box.push_back(static_cast<int>(d) == split ? layout.ranges[d][k] : layout.ranges[d][0]);
    }
    if (split >= 0) local += layout.ranges[static_cast<std::size_t>(split)][k].size;
    out.push_back(std::move(lb));
  }
  return out;
}

// The part of `local` (the packed piece) that holds lb's box.
Tensor local_view(const Tensor& local, const LocalBox& lb) {
  if (lb.split_dim < 0) return local;
  return local.narrow(lb.split_dim, lb.local_offset, lb.box[static_cast<std::size_t>(lb.split_dim)].size);
}

// Where a box's bytes lie in a contiguous local tensor, in the order the checkpoint stores them
// (row-major over the box): `runs` runs of `run_bytes`, `stride` bytes apart. A box of a blocked dim
// d is one run per index of the dims before d (each run: the block's extent of d times every later
// dim); any other box is one run. Saves pack a box from this directly into the snapshot or the
// write buffers, without a packed copy of the view first.
struct BoxBytes {
  const std::byte* base = nullptr;
  std::uint64_t runs = 1, run_bytes = 0, stride = 0;
  std::uint64_t bytes() const { return runs * run_bytes; }
  // Calls fn(pointer, n) for each run in order.
  template <class Fn>
  void for_each_run(Fn&& fn) const {
    for (std::uint64_t r = 0; r < runs; ++r) fn(base + r * stride, run_bytes);
  }
};
BoxBytes box_bytes(const Tensor& local, const LocalBox& lb) {
  MG_CHECK(local.is_contiguous(), "checkpoint: internal error: box bytes of a non-contiguous tensor");
  const std::uint64_t item = dtype_size(local.dtype());
  const auto* base = static_cast<const std::byte*>(local.raw_data());
  if (lb.split_dim < 0) return {base, 1, static_cast<std::uint64_t>(local.numel()) * item, 0};
  const Shape& shape = local.shape();
  const auto d = static_cast<std::size_t>(lb.split_dim);
  std::uint64_t outer = 1, inner = item;   // rows before d; bytes of one index of d
  for (std::size_t k = 0; k < d; ++k) outer *= static_cast<std::uint64_t>(shape[k]);
  for (std::size_t k = d + 1; k < shape.size(); ++k) inner *= static_cast<std::uint64_t>(shape[k]);
  const auto block = static_cast<std::uint64_t>(lb.box[d].size);
  return {base + static_cast<std::uint64_t>(lb.local_offset) * inner, outer, block * inner,
          static_cast<std::uint64_t>(shape[d]) * inner};
}

// ---- Files -------------------------------------------------------------------------------------------

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  int get() const { return fd_; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

void write_all(int fd, const std::byte* data, std::uint64_t n, const std::string& path) {
  while (n > 0) {
    // 8 MiB per call: one huge write() is several times slower here than the same bytes in pieces.
    const std::size_t chunk = static_cast<std::size_t>(std::min<std::uint64_t>(n, 8u << 20));
    const ssize_t w = ::write(fd, data, chunk);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) throw CheckpointError(fmt::format("checkpoint: writing '{}' failed: {}", path, w < 0 ? errno_text(errno) : "no progress"));
    data += w;
    n -= static_cast<std::uint64_t>(w);
  }
}

// 8 MiB 4096-aligned staging buffers for O_DIRECT transfers, kept for the process's next save or
// load. Why a pool: memory a process touches for the first time is expensive on some hosts (on the
// paravirtualised VM these benchmarks ran on, a first write runs at 0.2-0.3 GB/s against ~17 GB/s
// into the same pages again), and each file written or read takes two of these per save or load, in
// threads that do not outlive it. Up to kKept buffers (64 MiB) stay; more are freed on release.
class StagingPool {
 public:
  static constexpr std::size_t kAlign = 4096;
  static constexpr std::size_t kBytes = 8u << 20;
  static constexpr std::size_t kKept = 8;
  struct Release {
    void operator()(std::byte* b) const { StagingPool::instance().release(b); }
  };
  using Buffer = std::unique_ptr<std::byte, Release>;

  static StagingPool& instance() {
    // Never destroyed: a buffer may be released by a thread still running at exit (still reachable
    // memory, not a leak report).
    static StagingPool* pool = new StagingPool;
    return *pool;
  }
  // Frees the buffers kept (those handed out come back and are kept again).
  void release_kept() {
    std::vector<std::byte*> kept;
    {
      std::lock_guard lock(m_);
      kept.swap(free_);
    }
    for (std::byte* b : kept) std::free(b);
  }
  // A buffer of kBytes, or null when memory is exhausted.
  Buffer acquire() {
    {
      std::lock_guard lock(m_);
      if (!free_.empty()) {
        std::byte* b = free_.back();
        free_.pop_back();
        return Buffer(b);
      }
    }
    return Buffer(static_cast<std::byte*>(std::aligned_alloc(kAlign, kBytes)));
  }

 private:
  StagingPool() = default;
  void release(std::byte* b) {
    if (b == nullptr) return;
    {
      std::lock_guard lock(m_);
      if (free_.size() < kKept) {
        free_.push_back(b);
        return;
      }
    }
    std::free(b);
  }
  std::mutex m_;
  std::vector<std::byte*> free_;
};

// Whether checkpoint files are written with O_DIRECT: MESHGRAD_CHECKPOINT_DIRECT=0 turns it off
// (buffered writes + fsync, the same bytes); unset or 1 tries it.
bool direct_writes_wanted() {
  const char* v = std::getenv("MESHGRAD_CHECKPOINT_DIRECT");
  if (v == nullptr || *v == '\0' || std::string_view(v) == "1") return true;
  if (std::string_view(v) == "0") return false;
  throw CheckpointError(fmt::format("MESHGRAD_CHECKPOINT_DIRECT must be 0 or 1, got '{}'", v));
}

// One checkpoint file written front to back through two 4096-aligned staging buffers.
//
// Why O_DIRECT: the data goes from a staging buffer to the device by DMA, with no copy into the
// page cache and no writeback to wait for at fsync (on this kind of virtual disk 1.5-2.3 GB/s and no
// system time, against 0.5-2.2 GB/s for buffered writes + fsync). Bytes are copied into the staging
// buffer 1 MiB at a time and hashed there while the slice is in the cache (SHA-256 of the file, XXH3
// of the piece), so every byte is read from the tensor once. A full buffer (8 MiB) goes to this
// file's I/O thread, which writes it with one pwrite at an aligned offset while the caller fills the
// other buffer: copying and hashing overlap the transfer. The tail is written rounded up to 4096 and
// the file cut to its exact size. If the filesystem refuses O_DIRECT (EINVAL at open or at the first
// write) the same bytes are written buffered: only the speed differs. MESHGRAD_CHECKPOINT_DIRECT=0
// asks for buffered writes.
class FileSink {
 public:
  static constexpr std::size_t kAlign = StagingPool::kAlign;
  static constexpr std::size_t kStaging = StagingPool::kBytes;
  static constexpr std::size_t kSlice = 1u << 20;

  FileSink(std::string path, bool try_direct) : path_(std::move(path)) {
    const int flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW;
    if (try_direct) {
      fd_ = Fd(::open(path_.c_str(), flags | O_DIRECT, 0644));
      direct_ = fd_.get() >= 0;
      if (!direct_ && errno != EINVAL) throw CheckpointError(fmt::format("checkpoint: cannot create '{}': {}", path_, errno_text(errno)));
    }
    if (!direct_) fd_ = Fd(::open(path_.c_str(), flags, 0644));
    if (fd_.get() < 0) throw CheckpointError(fmt::format("checkpoint: cannot create '{}': {}", path_, errno_text(errno)));
    for (auto& b : buffers_) {
      b = StagingPool::instance().acquire();
      if (!b) throw CheckpointError(fmt::format("checkpoint: cannot allocate the {} MiB write buffers for '{}'", kStaging >> 20, path_));
    }
    io_ = std::thread([this] { io_loop(); });
  }
  ~FileSink() {
    {
      std::lock_guard lock(m_);
      stop_ = true;
    }
    cv_.notify_all();
    if (io_.joinable()) io_.join();
  }
  FileSink(const FileSink&) = delete;
  FileSink& operator=(const FileSink&) = delete;

  // Appends a box's bytes run by run, feeding them to the file's and the piece's hash.
  void append(const BoxBytes& box, io::Sha256& file_hash, XXH3_state_t* piece_hash) {
    box.for_each_run([&](const std::byte* data, std::uint64_t n) { append_bytes(data, n, file_hash, piece_hash); });
  }

 private:
  // Appends n bytes, feeding them to the file's and the piece's hash.
  void append_bytes(const std::byte* data, std::uint64_t n, io::Sha256& file_hash, XXH3_state_t* piece_hash) {
    while (n > 0) {
      const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>({n, kSlice, kStaging - fill_}));
      std::byte* dst = buffers_[current_].get() + fill_;
      std::memcpy(dst, data, k);
      file_hash.update(dst, k);
      XXH3_128bits_update(piece_hash, dst, k);
      fill_ += k;
      data += k;
      n -= k;
      if (fill_ == kStaging) submit(kStaging, kStaging);
    }
  }

 public:
  // Writes what is left, cuts the file to its exact size and fsyncs it. Returns the file's size.
  std::uint64_t finish() {
    const std::uint64_t size = queued_ + fill_;
    if (fill_ > 0) {
      const std::size_t rounded = (fill_ + kAlign - 1) / kAlign * kAlign;   // buffered writes ignore the padding
      std::memset(buffers_[current_].get() + fill_, 0, rounded - fill_);
      submit(rounded, fill_);
    }
    wait_idle();
    if (::ftruncate(fd_.get(), static_cast<off_t>(size)) != 0)
      throw CheckpointError(fmt::format("checkpoint: cannot set the size of '{}': {}", path_, errno_text(errno)));
    if (::fsync(fd_.get()) != 0) throw CheckpointError(fmt::format("checkpoint: fsync of '{}' failed: {}", path_, errno_text(errno)));
    return size;
  }

 private:
  // Hands the current buffer (n bytes to write, `content` of them the file's) to the I/O thread and
  // switches to the other buffer once the I/O thread is done with it.
  void submit(std::size_t n, std::size_t content) {
    wait_idle();   // the other buffer's write (the previous submit) is complete
    {
      std::lock_guard lock(m_);
      job_ = Job{current_, n, content, queued_, true};
    }
    cv_.notify_all();
    queued_ += content;
    current_ ^= 1;
    fill_ = 0;
  }

  // Waits until no write is in flight; rethrows the I/O thread's error.
  void wait_idle() {
    std::unique_lock lock(m_);
    cv_.wait(lock, [this] { return !job_.pending; });
    if (!error_.empty()) throw CheckpointError(error_);
  }

  void io_loop() {
    std::unique_lock lock(m_);
    for (;;) {
      cv_.wait(lock, [this] { return stop_ || job_.pending; });
      if (!job_.pending) return;   // stopping with nothing to write
      const Job job = job_;
      lock.unlock();
      std::string error;
      try {
        write_at(buffers_[job.buffer].get(), direct_ ? job.bytes : job.content, job.offset);
      } catch (const std::exception& e) {
        error = e.what();
      }
      lock.lock();
      if (error_.empty()) error_ = error;
      job_.pending = false;
      cv_.notify_all();
    }
  }

  void write_at(const std::byte* data, std::size_t n, std::uint64_t offset) {
    std::size_t done = 0;
    while (done < n) {
      const ssize_t w = ::pwrite(fd_.get(), data + done, n - done, static_cast<off_t>(offset + done));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0 && errno == EINVAL && direct_) {   // the filesystem took O_DIRECT at open but not for I/O
        const int fl = ::fcntl(fd_.get(), F_GETFL);
        if (fl < 0 || ::fcntl(fd_.get(), F_SETFL, fl & ~O_DIRECT) != 0)
          throw CheckpointError(fmt::format("checkpoint: writing '{}' failed: {}", path_, errno_text(errno)));
        direct_ = false;   // only this thread writes it from here on (the caller reads it in no path)
        continue;
      }
      if (w <= 0) throw CheckpointError(fmt::format("checkpoint: writing '{}' at offset {} failed: {}", path_, offset + done,
                                                    w < 0 ? errno_text(errno) : "no progress"));
      done += static_cast<std::size_t>(w);
    }
  }

  struct Job {
    int buffer = 0;
    std::size_t bytes = 0;     // to write (rounded up to kAlign for the tail)
    std::size_t content = 0;   // of which file content
    std::uint64_t offset = 0;
    bool pending = false;
  };
  std::string path_;
  Fd fd_;
  bool direct_ = false;
  StagingPool::Buffer buffers_[2];
  int current_ = 0;              // the buffer being filled
  std::size_t fill_ = 0;         // bytes in it
  std::uint64_t queued_ = 0;     // content bytes handed to the I/O thread
  std::mutex m_;
  std::condition_variable cv_;
  Job job_;                      // the write in flight (at most one)
  std::string error_;            // the I/O thread's first error
  bool stop_ = false;
  std::thread io_;               // last: started after everything it uses
};

void read_exact(int fd, std::byte* data, std::uint64_t n, std::uint64_t offset, const std::string& path) {
  while (n > 0) {
    const std::size_t chunk = static_cast<std::size_t>(std::min<std::uint64_t>(n, 8ull << 20));
    const ssize_t r = ::pread(fd, data, chunk, static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw CheckpointError(fmt::format("checkpoint: reading '{}' at offset {} failed: {}", path, offset, errno_text(errno)));
    if (r == 0) throw CheckpointError(fmt::format("checkpoint: '{}' ends before offset {} (truncated)", path, offset));
    data += r;
    n -= static_cast<std::uint64_t>(r);
    offset += static_cast<std::uint64_t>(r);
  }
}

void fsync_path(const std::string& path, bool directory) {
  Fd fd(::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC));
  if (fd.get() < 0) throw CheckpointError(fmt::format("checkpoint: cannot open '{}' to flush it: {}", path, errno_text(errno)));
  // Some file systems refuse fsync on a directory (EINVAL); the data files were flushed already.
  if (::fsync(fd.get()) != 0 && !(directory && errno == EINVAL))
    throw CheckpointError(fmt::format("checkpoint: fsync of '{}' failed: {}", path, errno_text(errno)));
}

bool is_step_name(const std::string& name, std::int64_t* step) {
  if (name.size() != 13 || name.rfind("step_", 0) != 0) return false;
  std::int64_t s = 0;
  for (std::size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return false;
    s = s * 10 + (name[i] - '0');
  }
  if (step) *step = s;
  return true;
}

// Removes a directory tree; errors are ignored (a leftover is cleaned up next time).
void remove_tree_quietly(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
}



}  // namespace

std::string checkpoint_dir_name(std::int64_t step) {
  MG_CHECK(step >= 0 && step <= 99999999, "checkpoint: step {} does not fit step_XXXXXXXX", step);
  return fmt::format("step_{:08d}", step);
}

// ---- Finding ---------------------------------------------------------------------------------------

std::vector<std::string> list_checkpoints(const std::string& root) {
  std::vector<std::pair<std::int64_t, std::string>> found;
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    std::int64_t step = 0;
    const std::string name = it->path().filename().string();
    if (!is_step_name(name, &step)) continue;
    std::error_code e2;
    if (it->is_directory(e2) && fs::is_regular_file(it->path() / kManifestName, e2)) found.emplace_back(step, it->path().string());
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& [step, p] : found) out.push_back(std::move(p));
  return out;
}

bool is_checkpoint_path(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return false;
  return fs::is_regular_file(fs::path(path) / kManifestName, ec) || !list_checkpoints(path).empty();
}

std::string resolve_checkpoint(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec))
    throw CheckpointError(fmt::format("checkpoint '{}' is not a directory (a checkpoint directory step_XXXXXXXX, or the "
                                      "--checkpoint-dir holding them)", path));
  if (fs::exists(fs::path(path) / kManifestName, ec)) return path;
  const std::vector<std::string> all = list_checkpoints(path);
  if (all.empty())
    throw CheckpointError(fmt::format("checkpoint '{}' holds no complete checkpoint (no step_XXXXXXXX/manifest.json)", path));
  return all.back();
}

Manifest read_manifest(const std::string& dir) {
  return read_manifest_file((fs::path(dir) / kManifestName).string());
}

// ---- Writing ---------------------------------------------------------------------------------------

namespace {

// The write plan every rank computes identically: for each tensor, its distinct boxes over all
// ranks, the rank that writes each, and where in that rank's file it goes.
struct PlannedPiece {
  std::size_t tensor = 0;
  Box box;
  int writer = 0;
  std::size_t file = 0;      // writer * files_per_rank + which of the writer's files
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
};

// files_per_rank: each rank spreads its pieces over that many files (the emptiest takes the next
// piece), written and hashed by as many threads: one SHA-256 stream per file is what bounds a rank
// that has the cores to itself.
std::vector<PlannedPiece> plan_pieces(const std::vector<StateTensor>& tensors, const dist::DeviceMesh& mesh,
                                      int files_per_rank) {
  std::vector<PlannedPiece> plan;
  const std::size_t k = static_cast<std::size_t>(files_per_rank);
  std::vector<std::uint64_t> file_end(static_cast<std::size_t>(mesh.size()) * k, 0);
  std::size_t counter = 0;   // spreads replicated pieces over their holders
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const StateTensor& t = tensors[i];
    std::map<std::vector<std::pair<std::int64_t, std::int64_t>>, std::size_t> index;
    std::vector<std::pair<Box, std::vector<int>>> unique;
    for (int r = 0; r < mesh.size(); ++r) {
      const dist::PieceLayout layout = dist::piece_layout(t.full_shape, mesh, t.placements, mesh.coordinates_of(r));
      for (const LocalBox& lb : local_boxes(layout)) {
        if (box_volume(lb.box) == 0) continue;
        std::vector<std::pair<std::int64_t, std::int64_t>> key;
        for (const ShardRange& s : lb.box) key.emplace_back(s.offset, s.size);
        auto [it, fresh] = index.emplace(key, unique.size());
        if (fresh) unique.emplace_back(lb.box, std::vector<int>{});
        unique[it->second].second.push_back(r);
      }
    }
    for (auto& [box, holders] : unique) {
      PlannedPiece p;
      p.tensor = i;
      p.box = box;
      p.writer = holders[counter++ % holders.size()];
      p.bytes = static_cast<std::uint64_t>(box_volume(box)) * dtype_size(t.local.dtype());
      const std::size_t first = static_cast<std::size_t>(p.writer) * k;
      p.file = first;
      for (std::size_t f = first + 1; f < first + k; ++f) {
        if (file_end[f] < file_end[p.file]) p.file = f;
      }
      p.offset = file_end[p.file];
      file_end[p.file] += p.bytes;
      plan.push_back(std::move(p));
    }
  }
  return plan;
}

// rank_RRRRR.bin, or rank_RRRRR_F.bin when each rank writes several files.
std::string rank_file_name(std::size_t file, int files_per_rank) {
  const std::size_t rank = file / static_cast<std::size_t>(files_per_rank);
  if (files_per_rank == 1) return fmt::format("rank_{:05d}.bin", rank);
  return fmt::format("rank_{:05d}_{}.bin", rank, file % static_cast<std::size_t>(files_per_rank));
}

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

// A hex digest as 8 int64 words for the exchange, and back.
constexpr std::size_t kHashWords = 8;
void put_hash(const std::string& hex, std::int64_t* out) {
  std::memset(out, 0, kHashWords * sizeof(std::int64_t));
  std::memcpy(out, hex.data(), std::min<std::size_t>(hex.size(), kHashWords * sizeof(std::int64_t)));
}
std::string get_hash(const std::int64_t* in, std::size_t digits) { return std::string(reinterpret_cast<const char*>(in), digits); }

}  // namespace

struct CheckpointSaver::Job {
  std::int64_t step = 0;
  std::string tmp_dir, final_dir;
  std::vector<PlannedPiece> plan;
  std::vector<std::size_t> mine;             // indices into plan this rank writes, in file order
  std::vector<BoxBytes> piece_data;         // the bytes of each of `mine`: in the snapshot or a tensor
  std::vector<Tensor> keep_alive;            // sync saves: the tensors piece_data points into
  std::uint64_t bytes = 0;
  std::vector<StateTensor> meta;             // names, shapes, dtypes (no data) for the manifest
  nlohmann::json state;
  SaveTimes times;
  std::exception_ptr error;
  bool done = false;
};

CheckpointSaver::CheckpointSaver(std::string root, dist::DeviceMeshPtr mesh, int keep, int files_per_rank)
    : root_(std::move(root)), mesh_(std::move(mesh)), keep_(keep) {
  MG_CHECK(mesh_ != nullptr, "checkpoint: no mesh");
  MG_CHECK(keep_ >= 0, "checkpoint: --keep must be >= 0 (0 keeps every checkpoint), got {}", keep_);
  MG_CHECK(files_per_rank >= 0 && files_per_rank <= 64, "checkpoint: files per rank must be 0 (chosen from the cores) to 64, "
           "got {}", files_per_rank);
  // Rank 0 prepares the root; the outcome is broadcast so every rank fails together.
  std::string problem;
  if (mesh_->rank() == 0) {
    try {
      std::error_code ec;
      const fs::file_status st = fs::symlink_status(root_, ec);
      if (fs::is_symlink(st))
        throw CheckpointError(fmt::format("--checkpoint-dir '{}' is a symbolic link: give the directory it points to", root_));
      if (fs::exists(st) && !fs::is_directory(st))
        throw CheckpointError(fmt::format("--checkpoint-dir '{}' exists and is not a directory", root_));
      if (!fs::exists(st) && (::mkdir(root_.c_str(), 0755) != 0 && errno != EEXIST))
        throw CheckpointError(fmt::format("--checkpoint-dir '{}' cannot be created: {}", root_, errno_text(errno)));
      const std::string lock = (fs::path(root_) / ".lock").string();
      lock_fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
      if (lock_fd_ < 0) throw CheckpointError(fmt::format("--checkpoint-dir '{}': cannot open '{}': {}", root_, lock, errno_text(errno)));
      if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0)
        throw CheckpointError(fmt::format("--checkpoint-dir '{}' is in use by another run (it holds '{}'); give each run its own "
                                          "directory", root_, lock));
      // Nobody else writes here now: temporaries of killed saves can go.
      for (fs::directory_iterator it(root_, ec), end; !ec && it != end; it.increment(ec)) {
        const std::string name = it->path().filename().string();
        if (name.rfind(".step_", 0) == 0 && name.find(".tmp") != std::string::npos) remove_tree_quietly(it->path().string());
      }
    } catch (const std::exception& e) {
      problem = e.what();
    }
  }
  // Files per rank: as many as the cores a rank has to itself (one hashing stream each), at most 8.
  // Rank 0 decides so that every rank plans the same files.
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  // decided[0]: the length of rank 0's error (0: none), whose text follows in a second broadcast, so
  // that every rank throws it (the threads backend reports whichever rank failed first).
  std::int64_t decided[2] = {static_cast<std::int64_t>(problem.size()),
                             files_per_rank > 0 ? files_per_rank
                                                : std::clamp<std::int64_t>(static_cast<std::int64_t>(cores) / mesh_->size(), 1, 8)};
  mesh_->world()->broadcast(comm::MutableBuffer{decided, 2, DType::Int64}, 0);
  files_per_rank_ = static_cast<int>(decided[1]);
  if (decided[0] != 0) {
    if (lock_fd_ >= 0) ::close(lock_fd_);
    const auto length = static_cast<std::size_t>(decided[0]);
    std::vector<std::int64_t> words((length + sizeof(std::int64_t) - 1) / sizeof(std::int64_t), 0);
    if (mesh_->rank() == 0) std::memcpy(words.data(), problem.data(), length);
    mesh_->world()->broadcast(comm::MutableBuffer{words.data(), words.size(), DType::Int64}, 0);
    throw CheckpointError(std::string(reinterpret_cast<const char*>(words.data()), length));
  }
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

SaveTimes CheckpointSaver::wait() {
  if (worker_.joinable()) worker_.join();
  if (!job_) return {};
  const std::unique_ptr<Job> job = std::move(job_);
  if (job->error) std::rethrow_exception(job->error);
  return job->times;
}

SaveTimes CheckpointSaver::save(std::int64_t step, const std::vector<StateTensor>& tensors, const nlohmann::json& state,
                                bool async) {
  wait();
  const Clock::time_point t0 = Clock::now();
  const dist::DeviceMesh& mesh = *mesh_;
  auto job = std::make_unique<Job>();
  job->step = step;
  job->final_dir = (fs::path(root_) / checkpoint_dir_name(step)).string();
  job->tmp_dir = (fs::path(root_) / ("." + checkpoint_dir_name(step) + ".tmp")).string();
  job->state = state;
  // Every tensor's piece must be the one its placements give this rank: a wrong piece would be
  // written under another box.
  std::set<std::string> names;
  for (const StateTensor& t : tensors) {
    MG_CHECK(names.insert(t.name).second, "checkpoint: two state tensors are named '{}'", t.name);
    MG_CHECK(t.local.defined(), "checkpoint: state tensor '{}' has no value", t.name);
    const dist::PieceLayout layout = dist::piece_layout(t.full_shape, mesh, t.placements, mesh.coordinates());
    MG_CHECK(t.local.shape() == layout.local_shape, "checkpoint: state tensor '{}' has local shape {}, but full shape {} "
             "placed {} gives {} on rank {}", t.name, shape_str(t.local.shape()), shape_str(t.full_shape),
             dist::placements_str(t.placements), shape_str(layout.local_shape), mesh.rank());
    job->meta.push_back({t.name, t.full_shape, t.placements, Tensor::empty({0}, t.local.dtype())});
  }
  job->plan = plan_pieces(tensors, mesh, files_per_rank_);

  // This rank's pieces. Async: copied into the saver's snapshot buffer (training may change the
  // tensors as soon as save() returns; the buffer is kept for the next save, so only the first one
  // pays for fresh pages). Sync: written straight from the tensors, no copy. Either way a box of a
  // blocked dim (the q, k and v blocks of an attention weight) is gathered run by run (BoxBytes)
  // where it goes, never packed into a temporary first.
  for (std::size_t k = 0; k < job->plan.size(); ++k) {
    if (job->plan[k].writer == mesh.rank()) {
      job->mine.push_back(k);
      job->bytes += job->plan[k].bytes;
    }
  }
  if (async && snapshot_capacity_ < job->bytes) {
    snapshot_.reset();
    snapshot_ = std::make_unique_for_overwrite<std::byte[]>(job->bytes);
    snapshot_capacity_ = job->bytes;
  }
  std::uint64_t snapshot_used = 0;   // pieces lie back to back in the snapshot (p.offset is within p.file)
  std::vector<SnapshotCopy> copies;  // async: the runs to copy into the snapshot, after the loop
  std::vector<Tensor> sources;       // async: keeps what the copies read alive until they ran
  for (std::size_t k : job->mine) {
    const PlannedPiece& p = job->plan[k];
    const StateTensor& t = tensors[p.tensor];
    const dist::PieceLayout layout = dist::piece_layout(t.full_shape, mesh, t.placements, mesh.coordinates());
    bool found = false;
    for (const LocalBox& lb : local_boxes(layout)) {
      if (lb.box.size() != p.box.size() || !std::equal(lb.box.begin(), lb.box.end(), p.box.begin(), [](const ShardRange& a, const ShardRange& b) {
            return a.offset == b.offset && a.size == b.size;
          }))
        continue;
      const Tensor local = t.local.detach().contiguous();   // itself: parameters and moments are contiguous
      const BoxBytes box = box_bytes(local, lb);
      MG_CHECK(box.bytes() == p.bytes, "checkpoint: internal error: box {} of '{}' is {} bytes, planned {}", box_str(p.box),
               t.name, box.bytes(), p.bytes);
      if (async) {
        std::byte* dst = snapshot_.get() + snapshot_used;
        box.for_each_run([&](const std::byte* run, std::uint64_t n) {
          copies.push_back({dst, run, n});
          dst += n;
        });
        sources.push_back(local);
        job->piece_data.push_back({snapshot_.get() + snapshot_used, 1, p.bytes, 0});
        snapshot_used += p.bytes;
      } else {
        job->piece_data.push_back(box);
        job->keep_alive.push_back(local);
      }
      found = true;
      break;
    }
    MG_CHECK(found, "checkpoint: internal error: rank {} writes box {} of '{}' but does not hold it", mesh.rank(),
             box_str(p.box), t.name);
  }
  copy_on_the_ranks_cores(copies);   // the stall of an async save
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

void CheckpointSaver::run_job(Job& job) noexcept {
  const int rank = mesh_->rank();
  const int world = mesh_->size();
  std::string my_error;
  const std::size_t k = static_cast<std::size_t>(files_per_rank_);
  std::vector<std::string> piece_hash(job.mine.size());
  std::vector<std::string> file_hash(k);
  std::vector<std::uint64_t> file_bytes(k, 0);
  const Clock::time_point t0 = Clock::now();
  // 1. This rank's files, one thread each: per piece its XXH3 (fast), then chunks of 8 MiB hashed
  // into the file's SHA-256 while still in the cache and written.
  try {
    if (::mkdir(job.tmp_dir.c_str(), 0755) != 0 && errno != EEXIST)
      throw CheckpointError(fmt::format("checkpoint: cannot create '{}': {}", job.tmp_dir, errno_text(errno)));
    std::vector<std::exception_ptr> errors(k);
    const bool direct = direct_writes_wanted();
    const auto write_file = [&](std::size_t sub) {
      try {
        const std::size_t file_index = static_cast<std::size_t>(rank) * k + sub;
        const std::string file = (fs::path(job.tmp_dir) / rank_file_name(file_index, files_per_rank_)).string();
        FileSink sink(file, direct);
        io::Sha256 whole;
        const std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(), XXH3_freeState);
        if (!state) throw CheckpointError("checkpoint: cannot allocate an XXH3 state");
        for (std::size_t i = 0; i < job.mine.size(); ++i) {
          const PlannedPiece& p = job.plan[job.mine[i]];
          if (p.file != file_index) continue;
          XXH3_128bits_reset(state.get());
          sink.append(job.piece_data[i], whole, state.get());
          piece_hash[i] = xxh3_hex(XXH3_128bits_digest(state.get()));
        }
        file_bytes[sub] = sink.finish();
        file_hash[sub] = whole.hex();
      } catch (...) {
        errors[sub] = std::current_exception();
      }
    };
    std::vector<std::thread> writers;
    for (std::size_t sub = 1; sub < k; ++sub) writers.emplace_back(write_file, sub);
    write_file(0);
    for (std::thread& t : writers) t.join();
    for (const std::exception_ptr& e : errors) {
      if (e) std::rethrow_exception(e);
    }
  } catch (const std::exception& e) {
    my_error = e.what();
  }
  job.keep_alive.clear();
  job.times.write_s = seconds_since(t0);

  // 2. Exchange sizes and hashes from every rank: [status, per file (bytes, SHA-256), per piece XXH3].
  const std::size_t header_words = 1 + k * (1 + kHashWords);
  std::vector<std::size_t> counts(static_cast<std::size_t>(world), header_words);
  for (const PlannedPiece& p : job.plan) counts[static_cast<std::size_t>(p.writer)] += kHashWords;
  std::vector<std::int64_t> mine(counts[static_cast<std::size_t>(rank)], 0);
  mine[0] = my_error.empty() ? 0 : 1;
  if (my_error.empty()) {
    for (std::size_t f = 0; f < k; ++f) {
      mine[1 + f * (1 + kHashWords)] = static_cast<std::int64_t>(file_bytes[f]);
      put_hash(file_hash[f], &mine[2 + f * (1 + kHashWords)]);
    }
    for (std::size_t i = 0; i < piece_hash.size(); ++i) put_hash(piece_hash[i], &mine[header_words + kHashWords * i]);
  }
  std::size_t total = 0;
  for (std::size_t c : counts) total += c;
  std::vector<std::int64_t> all(total, 0);
  std::int64_t committed = 0;
  std::string commit_error;
  try {
    comm::CollectiveOptions opt;
    opt.timeout = kSaveExchangeTimeout;
    comm_->all_gather(comm::ConstBuffer{mine.data(), mine.size(), DType::Int64},
                      comm::MutableBuffer{all.data(), all.size(), DType::Int64}, counts, opt);
    std::vector<std::size_t> start(static_cast<std::size_t>(world), 0);
    for (int r = 1; r < world; ++r) start[static_cast<std::size_t>(r)] = start[static_cast<std::size_t>(r - 1)] + counts[static_cast<std::size_t>(r - 1)];
    std::vector<int> failed;
    for (int r = 0; r < world; ++r) {
      if (all[start[static_cast<std::size_t>(r)]] != 0) failed.push_back(r);
    }
    // 3. Rank 0 commits.
    if (rank == 0) {
      const Clock::time_point tc = Clock::now();
      try {
        if (!failed.empty())
          throw CheckpointError(fmt::format("checkpoint of step {}: rank {} could not write its file (its error is above)", job.step,
                                            failed.front()));
        Manifest m;
        m.step = job.step;
        m.mesh = mesh_->str();
        m.state = job.state;
        for (int r = 0; r < world; ++r) {
          for (std::size_t f = 0; f < k; ++f) {
            const std::int64_t* w = &all[start[static_cast<std::size_t>(r)] + 1 + f * (1 + kHashWords)];
            m.files.push_back({rank_file_name(static_cast<std::size_t>(r) * k + f, files_per_rank_),
                               static_cast<std::uint64_t>(w[0]), get_hash(w + 1, 64)});
          }
        }
        for (const StateTensor& t : job.meta) m.tensors.push_back({t.name, t.local.dtype(), t.full_shape, {}});
        std::vector<std::size_t> next(static_cast<std::size_t>(world), 0);
        for (const PlannedPiece& p : job.plan) {
          const std::size_t r = static_cast<std::size_t>(p.writer);
          const std::int64_t* h = &all[start[r] + header_words + kHashWords * next[r]++];
          m.tensors[p.tensor].pieces.push_back({p.file, p.offset, p.box, get_hash(h, 32)});
        }
        const std::string manifest_path = (fs::path(job.tmp_dir) / kManifestName).string();
        {
          const std::string text = manifest_to_json(m);
          Fd fd(::open(manifest_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644));
          if (fd.get() < 0) throw CheckpointError(fmt::format("checkpoint: cannot create '{}': {}", manifest_path, errno_text(errno)));
          write_all(fd.get(), reinterpret_cast<const std::byte*>(text.data()), text.size(), manifest_path);
          if (::fsync(fd.get()) != 0) throw CheckpointError(fmt::format("checkpoint: fsync of '{}' failed: {}", manifest_path, errno_text(errno)));
        }
        fsync_path(job.tmp_dir, true);
        if (const char* fault = std::getenv("MESHGRAD_CHECKPOINT_FAULT"); fault != nullptr && std::string(fault) == "before-rename") {
          std::fprintf(stderr, "meshgrad: MESHGRAD_CHECKPOINT_FAULT=before-rename: exiting as if killed\n");
          std::_Exit(137);
        }
        // Into place: a plain rename, or an atomic exchange with a same-named older checkpoint (a
        // run resumed from an earlier step writes the step again), which is then removed.
        if (::renameat2(AT_FDCWD, job.tmp_dir.c_str(), AT_FDCWD, job.final_dir.c_str(), RENAME_NOREPLACE) != 0) {
          const int e = errno;
          if (e != EEXIST && e != ENOTEMPTY)
            throw CheckpointError(fmt::format("checkpoint: cannot rename '{}' to '{}': {}", job.tmp_dir, job.final_dir, errno_text(e)));
          if (::renameat2(AT_FDCWD, job.tmp_dir.c_str(), AT_FDCWD, job.final_dir.c_str(), RENAME_EXCHANGE) != 0)
            throw CheckpointError(fmt::format("checkpoint: cannot replace '{}': {}", job.final_dir, errno_text(errno)));
          remove_tree_quietly(job.tmp_dir);
        }
        fsync_path(root_, true);
        last_committed_ = job.final_dir;
        // Only now that the new one is safe: the older ones beyond `keep`.
        if (keep_ > 0) {
          const std::vector<std::string> all_ck = list_checkpoints(root_);
          for (std::size_t i = 0; i + static_cast<std::size_t>(keep_) < all_ck.size(); ++i) {
            if (all_ck[i] == job.final_dir) continue;
            // Out of the committed names first (atomic), then deleted: a kill in the middle of the
            // deletion leaves a temporary the next start removes, never a half-deleted checkpoint.
            const std::string doomed = (fs::path(root_) / ("." + fs::path(all_ck[i]).filename().string() + ".tmp-deleting")).string();
            if (::rename(all_ck[i].c_str(), doomed.c_str()) == 0) remove_tree_quietly(doomed);
          }
        }
        committed = 1;
      } catch (const std::exception& e) {
        commit_error = e.what();
        remove_tree_quietly(job.tmp_dir);
      }
      job.times.commit_s = seconds_since(tc);
    }
    // 4. Every rank learns whether the checkpoint exists, so all of them fail (or go on) together.
    comm_->broadcast(comm::MutableBuffer{&committed, 1, DType::Int64}, 0, opt);
  } catch (const std::exception& e) {
    if (my_error.empty()) my_error = e.what();
  }
  if (!my_error.empty()) {
    job.error = std::make_exception_ptr(CheckpointError(my_error));
  } else if (!commit_error.empty()) {
    job.error = std::make_exception_ptr(CheckpointError(commit_error));
  } else if (committed == 0) {
    job.error = std::make_exception_ptr(CheckpointError(
        fmt::format("checkpoint of step {} was not committed (see the error of rank 0 or of the rank that failed)", job.step)));
  }
  job.done = true;
}

void release_staging_buffers() { StagingPool::instance().release_kept(); }

// ---- Reading ---------------------------------------------------------------------------------------

namespace {

// The files of one checkpoint, opened on first use, their sizes checked against the manifest.
class CheckpointFiles {
 public:
  CheckpointFiles(std::string dir, const Manifest& m) : dir_(std::move(dir)), m_(m), fds_(m.files.size()) {}

  int fd(std::size_t file) {
    Fd& fd = fds_.at(file);
    if (fd.get() >= 0) return fd.get();
    const ManifestFile& f = m_.files[file];
    const std::string path = (fs::path(dir_) / f.name).string();
    fd = Fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() < 0) throw CheckpointError(fmt::format("checkpoint: cannot open '{}': {}", path, errno_text(errno)));
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode))
      throw CheckpointError(fmt::format("checkpoint: '{}' is not a regular file", path));
    if (static_cast<std::uint64_t>(st.st_size) != f.bytes)
      throw CheckpointError(fmt::format("checkpoint: '{}' has {} bytes but the manifest says {} ({})", path, st.st_size, f.bytes,
                                        static_cast<std::uint64_t>(st.st_size) < f.bytes ? "truncated" : "grown"));
    return fd.get();
  }
  // The same file opened with O_DIRECT (after fd() checked it), or -1 when the filesystem refuses
  // it or MESHGRAD_CHECKPOINT_DIRECT=0. Like fd(), one thread per file.
  int direct_fd(std::size_t file) {
    fd(file);
    Fd& d = direct_fds_.at(file);
    if (d.get() >= 0 || direct_refused_.at(file)) return d.get();
    if (direct_writes_wanted()) d = Fd(::open(path(file).c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT));
    direct_refused_.at(file) = d.get() < 0;
    return d.get();
  }
  void refuse_direct(std::size_t file) {
    direct_fds_.at(file).reset();
    direct_refused_.at(file) = true;
  }
  std::string path(std::size_t file) const { return (fs::path(dir_) / m_.files.at(file).name).string(); }

 private:
  std::string dir_;
  const Manifest& m_;
  std::vector<Fd> fds_;
  std::vector<Fd> direct_fds_ = std::vector<Fd>(m_.files.size());
  std::vector<char> direct_refused_ = std::vector<char>(m_.files.size(), 0);
};

bool same_box(const Box& a, const Box& b) {
  return a.size() == b.size() &&
         std::equal(a.begin(), a.end(), b.begin(), [](const ShardRange& x, const ShardRange& y) {
           return x.offset == y.offset && x.size == y.size;
         });
}

// One piece to read from a file: its bytes go to `target`, checked against the manifest's XXH3.
struct PieceRead {
  const ManifestTensor* tensor = nullptr;
  const ManifestPiece* piece = nullptr;
  std::byte* target = nullptr;
};

// Reads the pieces of one checkpoint file into their targets, checking each against its hash; the
// pieces are sorted by offset here. Throws CheckpointError naming the file, the tensor and the offset
// (a read error, a file that ends early, a hash mismatch) after any read in flight finished.
//
// With O_DIRECT where the filesystem allows it, the file is read as one stream: the byte ranges the
// pieces need (rounded out to 4096, adjacent ones merged, so that a file read whole is read front to
// back) go in spans of up to 8 MiB by DMA into two pooled aligned buffers, and while one span is
// hashed and copied out to the pieces it holds, the next one is already being read. Streaming the
// file rather than each piece on its own keeps the disk busy across the many small pieces of a
// model (biases, LayerNorms, attention blocks of one or two spans): read piece by piece, the load ran
// at half the speed of a plain read of the same files. Buffered reads through the page cache cost a
// kernel copy into freshly allocated cache pages, which on the VM this was measured on were slower
// than the disk. Elsewhere, or when the filesystem refuses O_DIRECT: buffered reads through a 1 MiB
// slice, piece by piece.
void read_file_pieces(CheckpointFiles& files, std::size_t file, std::vector<PieceRead>& pieces) {
  std::sort(pieces.begin(), pieces.end(), [](const PieceRead& a, const PieceRead& b) { return a.piece->offset < b.piece->offset; });
  const std::string path = files.path(file);
  struct Progress {
    std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> hash{XXH3_createState(), XXH3_freeState};
    std::uint64_t begin = 0, end = 0, done = 0;   // the piece's bytes in the file; how many are in its target
  };
  std::vector<Progress> progress(pieces.size());
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    if (!progress[i].hash) throw CheckpointError("checkpoint: cannot allocate an XXH3 state");
    XXH3_128bits_reset(progress[i].hash.get());
    progress[i].begin = pieces[i].piece->offset;
    progress[i].end = progress[i].begin + pieces[i].piece->bytes(pieces[i].tensor->dtype);
  }
  // Feeds bytes [at, at + n) of the file, which lie inside piece i, to its hash and its target, in
  // slices that stay in the core's cache between the two: the bytes come from memory once.
  const auto feed = [&](std::size_t i, const std::byte* bytes, std::uint64_t at, std::uint64_t n) {
    constexpr std::uint64_t kCached = 128u << 10;
    Progress& pr = progress[i];
    for (std::uint64_t off = 0; off < n; off += kCached) {
      const std::size_t k = static_cast<std::size_t>(std::min(kCached, n - off));
      XXH3_128bits_update(pr.hash.get(), bytes + off, k);
      std::memcpy(pieces[i].target + (at - pr.begin) + off, bytes + off, k);
    }
    pr.done += n;
  };
  const auto check = [&](std::size_t i) {
    if (xxh3_hex(XXH3_128bits_digest(progress[i].hash.get())) != pieces[i].piece->xxh3)
      throw CheckpointError(fmt::format("checkpoint: tensor '{}' box {} in '{}' at offset {} fails its hash (XXH3-128; the "
                                        "file is corrupt)", pieces[i].tensor->name, box_str(pieces[i].piece->box), path,
                                        pieces[i].piece->offset));
  };

  static constexpr std::uint64_t kAlign = StagingPool::kAlign, kSpan = StagingPool::kBytes;
  const StagingPool::Buffer buffers[2] = {StagingPool::instance().acquire(), StagingPool::instance().acquire()};
  const int direct = buffers[0] && buffers[1] ? files.direct_fd(file) : -1;
  std::size_t first_open = 0;   // pieces before it are read and checked (they complete in offset order)
  if (direct >= 0) {
    // The spans: the pieces' ranges rounded out to kAlign, merged where they touch, cut at kSpan.
    std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;   // [lo, hi)
    for (const Progress& pr : progress) {
      const std::uint64_t lo = pr.begin / kAlign * kAlign, hi = (pr.end + kAlign - 1) / kAlign * kAlign;
      if (!ranges.empty() && lo <= ranges.back().second) ranges.back().second = std::max(ranges.back().second, hi);
      else ranges.emplace_back(lo, hi);
    }
    std::vector<std::pair<std::uint64_t, std::uint64_t>> spans;    // (position, length)
    for (const auto& [lo, hi] : ranges) {
      for (std::uint64_t pos = lo; pos < hi; pos += kSpan) spans.emplace_back(pos, std::min(kSpan, hi - pos));
    }
    // One O_DIRECT pread of a span into a buffer: the bytes read (short at the end of the file), or -errno.
    const auto read_span = [direct](std::byte* buf, std::pair<std::uint64_t, std::uint64_t> span) -> ssize_t {
      std::uint64_t got = 0;
      while (got < span.second) {
        const ssize_t r = ::pread(direct, buf + got, span.second - got, static_cast<off_t>(span.first + got));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return got > 0 ? static_cast<ssize_t>(got) : -errno;
        if (r == 0) break;
        got += static_cast<std::uint64_t>(r);
      }
      return static_cast<ssize_t>(got);
    };
    int current = 0;
    std::future<ssize_t> next;
    if (!spans.empty()) next = std::async(std::launch::deferred, read_span, buffers[0].get(), spans[0]);
    for (std::size_t k = 0; k < spans.size(); ++k) {
      const ssize_t r = next.get();
      if (r == -EINVAL) {   // O_DIRECT accepted at open, not for I/O: the rest buffered, below
        files.refuse_direct(file);
        break;
      }
      if (r < 0)
        throw CheckpointError(fmt::format("checkpoint: reading '{}' at offset {} failed: {}", path, spans[k].first,
                                          errno_text(static_cast<int>(-r))));
      const std::uint64_t pos = spans[k].first, got_end = pos + static_cast<std::uint64_t>(r);
      if (k + 1 < spans.size()) {   // the next span is read while this one is copied out
        try {
          next = std::async(std::launch::async, read_span, buffers[1 - current].get(), spans[k + 1]);
        } catch (const std::system_error&) {   // no thread to be had: read it when it is needed
          next = std::async(std::launch::deferred, read_span, buffers[1 - current].get(), spans[k + 1]);
        }
      }
      const std::byte* buf = buffers[current].get();
      try {
        for (std::size_t i = first_open; i < pieces.size() && progress[i].begin < got_end; ++i) {
          Progress& pr = progress[i];
          const std::uint64_t lo = std::max(pos, pr.begin + pr.done), hi = std::min(got_end, pr.end);
          if (hi > lo) feed(i, buf + (lo - pos), lo, hi - lo);
          if (pr.done == pr.end - pr.begin && i == first_open) {
            check(i);
            ++first_open;
          }
        }
        if (got_end < pos + spans[k].second && first_open < pieces.size() && progress[first_open].begin < pos + spans[k].second)
          throw CheckpointError(fmt::format("checkpoint: '{}' ends before offset {} (truncated)", path,
                                            std::max(got_end, progress[first_open].begin + progress[first_open].done)));
      } catch (...) {
        if (next.valid()) next.wait();   // the read in flight writes a buffer this frame owns
        throw;
      }
      current = 1 - current;
    }
  }
  // Buffered: whatever O_DIRECT did not read (everything when it is not used).
  constexpr std::size_t kSlice = 1u << 20;
  thread_local std::vector<std::byte> slice(kSlice);
  const int fd = files.fd(file);
  for (std::size_t i = first_open; i < pieces.size(); ++i) {
    Progress& pr = progress[i];
    while (pr.begin + pr.done < pr.end) {
      const std::uint64_t at = pr.begin + pr.done;
      const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(pr.end - at, kSlice));
      read_exact(fd, slice.data(), k, at, path);
      feed(i, slice.data(), at, k);
    }
    check(i);
  }
}

}  // namespace

void read_pieces_into(const std::string& dir, const Manifest& manifest, const std::vector<PieceRequest>& requests,
                      const std::vector<Tensor>& targets) {
  MG_CHECK(targets.size() == requests.size(), "read_pieces_into: {} targets for {} requests", targets.size(), requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const Tensor& t = targets[i];
    MG_CHECK(t.defined() && t.is_contiguous() && t.shape() == requests[i].layout.local_shape && t.dtype() == requests[i].dtype,
             "read_pieces_into: the target of '{}' is {}{}, but the request is a contiguous {} of shape {}", requests[i].name,
             t.defined() ? t.str() : std::string("undefined"), t.defined() && !t.is_contiguous() ? " (not contiguous)" : "",
             dtype_name(requests[i].dtype), shape_str(requests[i].layout.local_shape));
  }
  CheckpointFiles files(dir, manifest);
  // 1. What to read: every saved piece that overlaps one of this rank's boxes, into the local tensor
  // itself when it is exactly the box (same mesh, or a replica), else into a piece-shaped tensor whose
  // overlap is copied over after every read passed its check. The local tensor is the target, or,
  // when the checkpoint holds another floating dtype, a tensor of the saved one converted at the end.
  struct Read {
    const ManifestTensor* tensor;
    const ManifestPiece* piece;
    std::byte* target = nullptr;   // where the piece's bytes go: the local tensor or a piece buffer
    Tensor overlap_src;            // with a piece buffer: its part this rank holds (a view of it) ...
    Tensor overlap_dst;            // ... and where that goes in the local tensor
  };
  std::vector<Read> reads;
  std::vector<Tensor> locals;
  locals.reserve(requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const PieceRequest& req = requests[i];
    const ManifestTensor* t = manifest.find(req.name);
    if (t == nullptr) throw CheckpointError(fmt::format("checkpoint '{}' has no tensor '{}'", dir, req.name));
    if (t->shape != req.full_shape)
      throw CheckpointError(fmt::format("checkpoint '{}': tensor '{}' has shape {} but the model needs {}", dir, req.name,
                                        shape_str(t->shape), shape_str(req.full_shape)));
    const bool saved_int = t->dtype == DType::Int64, wanted_int = req.dtype == DType::Int64;
    if (saved_int != wanted_int)
      throw CheckpointError(fmt::format("checkpoint '{}': tensor '{}' is {} but the model needs {}", dir, req.name,
                                        dtype_name(t->dtype), dtype_name(req.dtype)));
    Tensor local = t->dtype == req.dtype ? targets[i] : Tensor::empty(req.layout.local_shape, t->dtype);
    for (const LocalBox& lb : local_boxes(req.layout)) {
      if (box_volume(lb.box) == 0) continue;
      const Tensor dst_box = local_view(local, lb);
      for (const ManifestPiece& p : t->pieces) {
        if (box_volume(p.box) == 0 || !boxes_overlap(p.box, lb.box)) continue;
        if (lb.split_dim < 0 && same_box(p.box, lb.box)) {
          reads.push_back({t, &p, static_cast<std::byte*>(local.raw_data()), {}, {}});
          continue;
        }
        Shape shape;
        for (const ShardRange& r : p.box) shape.push_back(r.size);
        Tensor whole = Tensor::empty(shape, t->dtype);
        Tensor s = whole, d = dst_box;
        for (std::size_t k = 0; k < p.box.size(); ++k) {
          const std::int64_t lo = std::max(p.box[k].offset, lb.box[k].offset);
          const std::int64_t hi = std::min(p.box[k].offset + p.box[k].size, lb.box[k].offset + lb.box[k].size);
          s = s.narrow(static_cast<std::int64_t>(k), lo - p.box[k].offset, hi - lo);
          d = d.narrow(static_cast<std::int64_t>(k), lo - lb.box[k].offset, hi - lo);
        }
        reads.push_back({t, &p, static_cast<std::byte*>(whole.raw_data()), s, d});   // s keeps whole alive
      }
    }
    locals.push_back(local);
  }
  // 2. The reads, one thread per file, each file read as one stream in offset order
  // (read_file_pieces; at tp=1 a rank reads all of a checkpoint's files at once), each piece checked
  // against its XXH3 as it lands. The first error (in file order) is thrown after every thread finished.
  std::map<std::size_t, std::vector<PieceRead>> by_file;
  for (const Read& r : reads) by_file[r.piece->file].push_back({r.tensor, r.piece, r.target});
  // Every file opened and its size checked against the manifest before any target is written: a
  // missing or truncated file leaves the targets as they were.
  for (const auto& [file, list] : by_file) files.fd(file);
  // The reads write through raw pointers: a graph that saved a target's values refuses to use them.
  for (const Tensor& t : targets) t.bump_version();
  std::vector<std::exception_ptr> errors(by_file.size());
  const auto read_file = [&](std::size_t slot, std::size_t file, std::vector<PieceRead>& list) {
    try {
      read_file_pieces(files, file, list);
    } catch (...) {
      errors[slot] = std::current_exception();
    }
  };
  {
    std::vector<std::thread> readers;
    std::size_t slot = 0;
    try {
      for (auto& [file, list] : by_file) {
        if (slot > 0) readers.emplace_back(read_file, slot, file, std::ref(list));
        ++slot;
      }
    } catch (...) {   // no thread for this file (system limits): the started ones finish first
      for (std::thread& t : readers) t.join();
      throw;
    }
    if (!by_file.empty()) read_file(0, by_file.begin()->first, by_file.begin()->second);
    for (std::thread& t : readers) t.join();
  }
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  // 3. Overlaps of pieces that are not exactly this rank's boxes, then conversions of other dtypes.
  for (const Read& r : reads) {
    if (r.overlap_dst.defined()) Tensor(r.overlap_dst).copy_from(r.overlap_src);
  }
  for (std::size_t i = 0; i < requests.size(); ++i) {
    if (locals[i].dtype() != requests[i].dtype) Tensor(targets[i]).copy_from(locals[i].to(requests[i].dtype));
  }
}

std::vector<Tensor> read_pieces(const std::string& dir, const Manifest& manifest, const std::vector<PieceRequest>& requests) {
  // New tensors as the targets: whatever fails, the caller gets nothing, so nothing is half-loaded.
  std::vector<Tensor> out;
  out.reserve(requests.size());
  for (const PieceRequest& req : requests) out.push_back(Tensor::empty(req.layout.local_shape, req.dtype));
  read_pieces_into(dir, manifest, requests, out);
  return out;
}

std::vector<std::pair<std::string, Tensor>> read_full_tensors(const std::string& dir, const Manifest& manifest,
                                                              const std::vector<std::pair<std::string, Shape>>& names) {
  std::vector<PieceRequest> requests;
  for (const auto& [name, shape] : names) {
    const ManifestTensor* t = manifest.find(name);
    if (t == nullptr) throw CheckpointError(fmt::format("checkpoint '{}' has no tensor '{}'", dir, name));
    dist::PieceLayout whole;
    for (const std::int64_t n : shape) whole.ranges.push_back({ShardRange{0, n}});
    whole.local_shape = shape;
    requests.push_back({name, shape, whole, t->dtype});
  }
  std::vector<Tensor> read = read_pieces(dir, manifest, requests);
  std::vector<std::pair<std::string, Tensor>> out;
  for (std::size_t i = 0; i < names.size(); ++i) out.emplace_back(names[i].first, std::move(read[i]));
  return out;
}

std::uint64_t verify_checkpoint(const std::string& dir) {
  const Manifest m = read_manifest(dir);
  CheckpointFiles files(dir, m);
  std::uint64_t checked = 0;
  // Pieces by file in offset order: one sequential pass per file feeds both the file's hash and
  // each piece's.
  std::vector<std::vector<std::pair<const ManifestPiece*, const ManifestTensor*>>> by_file(m.files.size());
  for (const ManifestTensor& t : m.tensors) {
    for (const ManifestPiece& p : t.pieces) by_file[p.file].emplace_back(&p, &t);
  }
  std::vector<std::byte> buf(1 << 20);
  for (std::size_t f = 0; f < m.files.size(); ++f) {
    auto& pieces = by_file[f];
    std::sort(pieces.begin(), pieces.end(), [](const auto& a, const auto& b) { return a.first->offset < b.first->offset; });
    const int fd = files.fd(f);
    io::Sha256 whole;
    std::uint64_t pos = 0;
    auto feed = [&](std::uint64_t n, XXH3_state_t* piece) {
      while (n > 0) {
        const std::uint64_t k = std::min<std::uint64_t>(n, buf.size());
        read_exact(fd, buf.data(), k, pos, files.path(f));
        whole.update(buf.data(), k);
        if (piece) XXH3_128bits_update(piece, buf.data(), k);
        pos += k;
        n -= k;
      }
    };
    const std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(), XXH3_freeState);
    MG_CHECK(state != nullptr, "checkpoint: cannot allocate an XXH3 state");
    for (const auto& [p, t] : pieces) {
      feed(p->offset - pos, nullptr);
      XXH3_128bits_reset(state.get());
      feed(p->bytes(t->dtype), state.get());
      if (xxh3_hex(XXH3_128bits_digest(state.get())) != p->xxh3)
        throw CheckpointError(fmt::format("checkpoint: tensor '{}' box {} in '{}' at offset {} fails its hash (XXH3-128; the "
                                          "file is corrupt)", t->name, box_str(p->box), files.path(f), p->offset));
    }
    feed(m.files[f].bytes - pos, nullptr);
    if (whole.hex() != m.files[f].sha256)
      throw CheckpointError(fmt::format("checkpoint: '{}' fails its SHA-256 (the file is corrupt)", files.path(f)));
    checked += m.files[f].bytes;
  }
  return checked;
}

}  // namespace meshgrad::checkpoint
