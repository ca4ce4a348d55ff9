// meshgrad bench checkpoint: save and load throughput of sharded checkpoints at several tp degrees for
// a GPT of about 100M parameters (GPT-2 small's shape by default), next to the disk's own sequential
// write and read speed measured in the same run, and the training stall of an asynchronous save
// against a synchronous one. Prints one table.
//
// What each figure is (bytes = parameters + both AdamW moments, float32):
//   disk write   one stream writing the same number of bytes, then fsync; and with O_DIRECT
//   disk read    one stream reading them back after the page cache dropped them (posix_fadvise);
//                and with O_DIRECT. Saves and loads are compared with the faster way each.
//   save         a synchronous save: snapshot, every rank writing and hashing its file, fsync,
//                manifest, rename (wall time of the slowest rank); the second of the process (the
//                first also writes the staging buffers' fresh pages: MESHGRAD_BENCH_VERBOSE=1)
//   hash         copy + SHA-256 + XXH3 of the same bytes, one stream per core, no I/O: the CPU work
//                a save does on every byte; on a disk faster than it, the bound of a save
//   stall        how long an asynchronous save held training up (the in-memory snapshot; the second
//                save of the run: the first one also faults in the snapshot buffer's pages)
//   build        a resume's model and AdamW moments built in memory the process never touched (the
//                saved model is freed and the allocator's cache emptied first), as in a new process
//   load         train --resume's load after the page cache dropped the files: every rank reading
//                and checking its pieces straight into that model and those moments (in place); the
//                loaded state is checked against a fingerprint of the saved one
//   new tensors  an all-or-nothing load of the same pieces into new tensors (fresh memory)
// On a VM that backs guest memory lazily the first writes to fresh pages cost more than the disk:
// `fresh memory` is a memcpy into never-touched pages, measured in the same run, which bounds the
// build and the new-tensor load (a run from scratch builds the same model and moments).
#include <fcntl.h>
#include <sys/mman.h>
#include <fmt/core.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <vector>
#include <thread>

#include "command.hpp"
#include "meshgrad/launch/launch.hpp"
#include "meshgrad/nn/model.hpp"
#include "meshgrad/tensor/allocator.hpp"
#include "meshgrad/checkpoint/directory.hpp"
#include "meshgrad/checkpoint/reader.hpp"
#include "meshgrad/checkpoint/saver.hpp"
#include "meshgrad/checkpoint/staging_buffers.hpp"
#include "meshgrad/optim/adamw.hpp"
#include "meshgrad/io/output_path.hpp"
#include "meshgrad/io/sha256.hpp"
#include "meshgrad/train/trainer.hpp"
#include "options.hpp"

namespace meshgrad::tools::cmd_bench_checkpoint {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct BenchCheckpointOptions {
  std::string dir = "meshgrad-bench-checkpoint";
  std::vector<int> tps{1, 2, 4};
  int layers = 12, hidden = 768, heads = 12, vocab = 50257, positions = 1024;
};

// Drops a file's pages from the page cache (they are clean after fsync), so the next read hits the disk.
void drop_cache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  (void)::fdatasync(fd);
  (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

// The disk's own speed through one stream, four ways: buffered write() + fsync (through the page
// cache), O_DIRECT writes of 8 MiB from an aligned buffer (DMA, what the checkpoint writer uses where
// the filesystem allows it), and reading the file back buffered (after its pages were dropped) and
// with O_DIRECT (what the reader uses). A save or load is compared with the faster way, so that
// choosing an I/O path cannot flatter it. Speeds in bytes per second; 0 where O_DIRECT is refused.
struct DiskSpeed {
  double buffered_write = 0, direct_write = 0, buffered_read = 0, direct_read = 0;
  double best_write() const { return std::max(buffered_write, direct_write); }
  double best_read() const { return std::max(buffered_read, direct_read); }
  // The faster of each figure: several probes taken between the measurements they stand for.
  void keep_best(const DiskSpeed& o) {
    buffered_write = std::max(buffered_write, o.buffered_write);
    direct_write = std::max(direct_write, o.direct_write);
    buffered_read = std::max(buffered_read, o.buffered_read);
    direct_read = std::max(direct_read, o.direct_read);
  }
};

class DiskProbe {
 public:
  static constexpr std::size_t kChunk = 8u << 20;
  DiskProbe(const std::string& dir, std::uint64_t bytes)
      : path_((fs::path(dir) / "disk_probe.bin").string()), bytes_(bytes),
        chunk_(static_cast<char*>(std::aligned_alloc(4096, kChunk)), &std::free) {
    MG_CHECK(chunk_ != nullptr, "bench checkpoint: cannot allocate the probe buffer");
    for (std::size_t i = 0; i < kChunk; ++i) chunk_.get()[i] = static_cast<char>((i * 2654435761u) >> 13);
  }
  ~DiskProbe() {
    std::error_code ec;
    fs::remove(path_, ec);
  }
  // Writes the bytes buffered + fsync, then with O_DIRECT (rounded up to whole chunks); the file stays
  // for reads().
  DiskSpeed writes() {
    DiskSpeed speed;
    for (const bool direct : {false, true}) {
      fs::remove(path_);
      const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | (direct ? O_DIRECT : 0), 0644);
      if (fd < 0 && direct) continue;   // the filesystem refuses O_DIRECT: only the buffered figure
      MG_CHECK(fd >= 0, "bench checkpoint: cannot create '{}'", path_);
      const Clock::time_point t0 = Clock::now();
      bool ok = true;
      std::uint64_t done = 0;
      while (done < bytes_ && ok) {
        const std::size_t n = direct ? kChunk : static_cast<std::size_t>(std::min<std::uint64_t>(kChunk, bytes_ - done));
        ok = ::pwrite(fd, chunk_.get(), n, static_cast<off_t>(done)) == static_cast<ssize_t>(n);
        done += n;
      }
      MG_CHECK(ok || direct, "bench checkpoint: writing '{}' failed", path_);
      MG_CHECK(::fsync(fd) == 0, "bench checkpoint: fsync of '{}' failed", path_);
      const double write_s = since(t0);
      ::close(fd);
      if (ok) (direct ? speed.direct_write : speed.buffered_write) = static_cast<double>(done) / write_s;
    }
    written_ = true;
    return speed;
  }
  // Reads the file writes() left, buffered after dropping its pages, then with O_DIRECT.
  DiskSpeed reads() {
    if (!written_) writes();
    DiskSpeed speed;
    for (const bool direct : {false, true}) {
      drop_cache(path_);
      const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
      if (fd < 0 && direct) continue;
      MG_CHECK(fd >= 0, "bench checkpoint: cannot open '{}'", path_);
      const Clock::time_point t0 = Clock::now();
      std::uint64_t got = 0;
      ssize_t r = 0;
      while (got < bytes_ && (r = ::read(fd, chunk_.get(), kChunk)) > 0) got += static_cast<std::uint64_t>(r);
      const double read_s = since(t0);
      ::close(fd);
      MG_CHECK(got >= bytes_ || (direct && r < 0), "bench checkpoint: reading '{}' back failed after {} bytes", path_, got);
      if (got >= bytes_) (direct ? speed.direct_read : speed.buffered_read) = static_cast<double>(got) / read_s;
    }
    return speed;
  }

 private:
  std::string path_;
  std::uint64_t bytes_;
  std::unique_ptr<char, decltype(&std::free)> chunk_;
  bool written_ = false;
};

struct TpFigures {
  double save_s = 0, stall_s = 0, async_total_s = 0;
  double build_s = 0, first_load_s = 0, load_s = 0, raw_read_s = 0, new_tensors_load_s = 0;
  std::uint64_t bytes = 0;
  double hash_bound = 0;   // bytes per second: hash_bound_speed, the best of 3 taken after the row
  DiskSpeed disk;   // the best of the probes taken between this degree's saves and loads
};

// Reads the files of checkpoint dir with O_DIRECT, one stream per file, all at once (what the loader
// does, without checking or placing anything): the disk's own speed for exactly those bytes.
// Returns 0 when the filesystem refuses O_DIRECT.
double raw_read_seconds(const std::string& dir) {
  std::vector<std::string> paths;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ".bin") paths.push_back(e.path().string());
  }
  std::atomic<bool> refused{false};
  const Clock::time_point t0 = Clock::now();
  std::vector<std::thread> readers;
  for (const std::string& path : paths) {
    readers.emplace_back([&refused, path] {
      constexpr std::size_t kChunk = 8u << 20;
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
      std::unique_ptr<char, decltype(&std::free)> buf(static_cast<char*>(std::aligned_alloc(4096, kChunk)), &std::free);
      if (fd < 0 || !buf) {
        refused = true;
      } else {
        for (std::uint64_t at = 0;;) {
          const ssize_t r = ::pread(fd, buf.get(), kChunk, static_cast<off_t>(at));
          if (r <= 0) {
            refused = refused || r < 0;
            break;
          }
          at += static_cast<std::uint64_t>(r);
        }
      }
      if (fd >= 0) ::close(fd);
    });
  }
  for (std::thread& t : readers) t.join();
  return refused ? 0 : since(t0);
}

// An order-sensitive fingerprint of a rank's training state (its bytes as 64-bit words), to check
// that a load brought back exactly what was saved.
std::uint64_t fingerprint(const std::vector<checkpoint::StateTensor>& state) {
  std::uint64_t h = 0;
  for (const checkpoint::StateTensor& t : state) {
    const Tensor c = t.local.contiguous();
    const auto* bytes = static_cast<const unsigned char*>(c.raw_data());
    const std::size_t n = static_cast<std::size_t>(c.numel()) * dtype_size(c.dtype());
    for (std::size_t i = 0; i + 8 <= n; i += 8) {
      std::uint64_t w;
      std::memcpy(&w, bytes + i, 8);
      h = (h ^ w) * 0x100000001b3ull + 0x9e3779b97f4a7c15ull;
    }
  }
  return h;
}

// The bytes a checkpoint of `state` holds: every tensor once, whatever its placements.
std::uint64_t checkpoint_bytes(const std::vector<checkpoint::StateTensor>& state) {
  std::uint64_t n = 0;
  for (const checkpoint::StateTensor& t : state) n += static_cast<std::uint64_t>(shape_numel(t.full_shape)) * dtype_size(t.local.dtype());
  return n;
}

// The model of the benchmark: a GPT of the options' shape.
nn::ModelConfig bench_model_config(const BenchCheckpointOptions& o) {
  nn::ModelConfig cfg = nn::ModelConfig::gpt(o.layers, o.hidden, o.heads, o.vocab, /*seq=*/64);
  cfg.positions = o.positions;
  return cfg;
}

// One rank's part of a degree's measurements (measure() below), in the order every rank takes them:
// run_saves, forget_saved_state, run_loads, load_into_new_tensors. Each step is collective (barriers
// between the timed parts, so that a figure is the slowest rank's); rank 0 also probes the disk
// between them. Repeated measurements keep the best of each.
class RankBench {
 public:
  static constexpr int kRepeats = 3;

  RankBench(const nn::ModelConfig& cfg, int tp, const std::string& root, comm::CommunicatorPtr world)
      : cfg_(cfg), tp_(tp), root_(root), world_(std::move(world)),
        mesh_(std::make_shared<const dist::DeviceMesh>(world_, std::vector<dist::MeshAxis>{{"dp", 1}, {"tp", tp}})),
        saver_(root, mesh_, 0), verbose_(std::getenv("MESHGRAD_BENCH_VERBOSE") != nullptr) {}

  // Synchronous saves of a model and its AdamW moments: the first also writes the staging buffers'
  // fresh pages (once per process); then kRepeats, each right after a write probe. Then two async
  // saves: the first also pays for the snapshot buffer's fresh pages (once per run); the second's
  // stall is what every later save costs. The model is gone when this returns: the resume builds
  // its own, as a new process does.
  void run_saves() {
    auto model = nn::make_model(cfg_, {}, mesh_, 1);
    const std::vector<nn::Parameter*> params = model->parameters();
    optim::AdamW opt(params, mesh_);
    std::vector<Tensor> m, v;
    for (const nn::Parameter* p : params) {
      m.push_back(p->value.detach().clone());
      v.push_back(p->value.detach().clone());
    }
    opt.load_state(1, m, v);
    const std::vector<checkpoint::StateTensor> state = train::training_state_tensors(params, opt);
    saved_fingerprint_ = fingerprint(state);
    if (world_->rank() == 0) probe_ = std::make_unique<DiskProbe>(fs::path(root_).parent_path().string(), checkpoint_bytes(state));

    sync_save(state, "first");
    for (int rep = 0; rep < kRepeats; ++rep) {
      probe_disk(/*writes=*/true);
      fig_.save_s = std::min(fig_.save_s, sync_save(state, "next"));
    }
    save_async(state);
    saver_.wait();
    world_->barrier();
    const Clock::time_point t0 = Clock::now();
    const checkpoint::SaveTimes times = save_async(state);
    fig_.stall_s = since(t0);
    saver_.wait();
    world_->barrier();
    fig_.async_total_s = since(t0);
    bytes_ = times.bytes_written;
    checkpoint_ = (fs::path(root_) / checkpoint::checkpoint_dir_name(step_)).string();
  }

  // The allocator's cache holds the saved model's blocks, and the staging pool the saves' buffers:
  // both emptied, so that the resume's model, moments and buffers are memory the process never
  // touched, as in a new process.
  void forget_saved_state() {
    world_->barrier();
    if (world_->rank() == 0) {
      memory::release_cached();
      checkpoint::release_staging_buffers();
    }
    drop_checkpoint_cache();
  }

  // The resume as train --resume does it: build the model (another seed: a load that did nothing
  // fails the check) and the optimizer with its moments, then read the checkpoint into them in place;
  // then kRepeats loads, each right after a read probe and a plain read of the same files.
  void run_loads() {
    const Clock::time_point t0 = Clock::now();
    model_ = nn::make_model(cfg_, {}, mesh_, 2);
    const std::vector<nn::Parameter*> params = model_->parameters();
    opt_ = std::make_unique<optim::AdamW>(params, mesh_);
    opt_->materialize_moments();
    world_->barrier();
    fig_.build_s = since(t0);
    fig_.first_load_s = load_in_place();
    loaded_state_ = train::training_state_tensors(params, *opt_);
    MG_CHECK(opt_->steps() == 1 && fingerprint(loaded_state_) == saved_fingerprint_,
             "bench checkpoint: tp={} rank {}: the resumed state differs from the saved one", tp_, world_->rank());
    for (int rep = 0; rep < kRepeats; ++rep) {
      probe_disk(/*writes=*/false);
      drop_checkpoint_cache();
      double raw = 0;
      if (world_->rank() == 0) raw = raw_read_seconds(checkpoint_);
      world_->barrier();
      fig_.raw_read_s = std::min(fig_.raw_read_s, raw);
      fig_.load_s = std::min(fig_.load_s, load_in_place());
    }
  }

  // All-or-nothing into new tensors (what a load into a live model uses), with the resume's model
  // alive: the new tensors are memory this process never touched.
  void load_into_new_tensors() {
    drop_checkpoint_cache();
    const Clock::time_point t0 = Clock::now();
    {
      const checkpoint::Manifest manifest = checkpoint::read_manifest(checkpoint_);
      std::vector<checkpoint::PieceRequest> requests;
      for (const checkpoint::StateTensor& t : loaded_state_) {
        requests.push_back({t.name, t.full_shape, dist::piece_layout(t.full_shape, *mesh_, t.placements, mesh_->coordinates()),
                            t.local.dtype()});
      }
      const std::vector<Tensor> loaded = checkpoint::read_pieces(checkpoint_, manifest, requests);
    }
    world_->barrier();
    fig_.new_tensors_load_s = since(t0);
    if (verbose_)
      fmt::print(stderr, "tp={} rank {}: resume: build {:.2f} s, first load in place {:.2f} s, best of {} {:.2f} s; load into "
                 "new tensors {:.2f} s\n", tp_, world_->rank(), fig_.build_s, fig_.first_load_s, kRepeats, fig_.load_s,
                 fig_.new_tensors_load_s);
    probe_.reset();
  }

  // Adds this rank's figures to the degree's: the slowest rank's times, rank 0's probes and plain
  // reads, every rank's bytes.
  void add_to(TpFigures& f) const {
    f.save_s = std::max(f.save_s, fig_.save_s);
    f.stall_s = std::max(f.stall_s, fig_.stall_s);
    f.async_total_s = std::max(f.async_total_s, fig_.async_total_s);
    f.build_s = std::max(f.build_s, fig_.build_s);
    f.first_load_s = std::max(f.first_load_s, fig_.first_load_s);
    f.load_s = std::max(f.load_s, fig_.load_s);
    f.new_tensors_load_s = std::max(f.new_tensors_load_s, fig_.new_tensors_load_s);
    if (world_->rank() == 0) {
      f.raw_read_s = fig_.raw_read_s;
      f.disk = disk_;
    }
    f.bytes += bytes_;
  }

 private:
  // The state a checkpoint at `step` holds besides the tensors (what load_training_state reads).
  static nlohmann::json info(std::int64_t step) {
    return nlohmann::json{{"step", step}, {"optimizer_steps", 1}, {"random_state", 7}};
  }

  void probe_disk(bool writes) {
    world_->barrier();
    if (world_->rank() == 0) disk_.keep_best(writes ? probe_->writes() : probe_->reads());
    world_->barrier();
  }

  // The seconds of one synchronous save of the next step, between barriers.
  double sync_save(const std::vector<checkpoint::StateTensor>& state, const char* which) {
    world_->barrier();
    const Clock::time_point t0 = Clock::now();
    ++step_;
    const checkpoint::SaveTimes times = saver_.save(step_, state, info(step_), /*async=*/false);
    world_->barrier();
    const double s = since(t0);
    if (verbose_)
      fmt::print(stderr, "tp={} rank {}: {} save: snapshot {:.2f} s, write+hash {:.2f} s, commit {:.2f} s, save {:.2f} s\n",
                 tp_, world_->rank(), which, times.snapshot_s, times.write_s, times.commit_s, s);
    return s;
  }

  checkpoint::SaveTimes save_async(const std::vector<checkpoint::StateTensor>& state) {
    ++step_;
    return saver_.save(step_, state, info(step_), /*async=*/true);
  }

  void drop_checkpoint_cache() {
    if (world_->rank() == 0) {
      for (const auto& e : fs::directory_iterator(checkpoint_)) drop_cache(e.path().string());
    }
    world_->barrier();
  }

  // The seconds of train --resume's load of the last checkpoint into the model and optimizer, in
  // place, after the page cache dropped its files.
  double load_in_place() {
    drop_checkpoint_cache();
    const Clock::time_point start = Clock::now();
    const checkpoint::Manifest manifest = checkpoint::read_manifest(checkpoint_);
    const int loaded_step = train::load_training_state(checkpoint_, manifest, *model_, *opt_, train::StateLoad::in_place);
    world_->barrier();
    MG_CHECK(loaded_step == step_, "bench checkpoint: loaded step {}, saved step {}", loaded_step, step_);
    return since(start);
  }

  struct Figures {
    double save_s = 1e30, stall_s = 0, async_total_s = 0;
    double build_s = 0, first_load_s = 0, load_s = 1e30, raw_read_s = 1e30, new_tensors_load_s = 0;
  };
  const nn::ModelConfig& cfg_;
  int tp_;
  std::string root_;
  comm::CommunicatorPtr world_;
  dist::DeviceMeshPtr mesh_;
  checkpoint::CheckpointSaver saver_;
  bool verbose_;
  std::unique_ptr<DiskProbe> probe_;   // rank 0's
  DiskSpeed disk_;                     // the best of rank 0's probes
  std::int64_t step_ = 0;              // of the last save
  std::string checkpoint_;             // its directory
  std::uint64_t saved_fingerprint_ = 0, bytes_ = 0;
  std::unique_ptr<nn::Model> model_;   // the resume's
  std::unique_ptr<optim::AdamW> opt_;
  std::vector<checkpoint::StateTensor> loaded_state_;
  Figures fig_;
};

// One degree: saves and loads of a checkpoint written at tp, with disk probes (rank 0, the other
// ranks waiting) between them. The figures of repeated measurements are the best of each, the
// probes' too: a shared virtual disk's speed changes from one second to the next, and the best of
// several tries on both sides is what the code and the disk can do.
TpFigures measure(const BenchCheckpointOptions& o, int tp, const std::string& root) {
  const nn::ModelConfig cfg = bench_model_config(o);
  TpFigures f;
  std::mutex mu;
  launch::run_on_backend("threads", tp, [&](const comm::CommunicatorPtr& world) {
    RankBench rank(cfg, tp, root, world);
    rank.run_saves();
    rank.forget_saved_state();
    rank.run_loads();
    rank.load_into_new_tensors();
    const std::lock_guard<std::mutex> lock(mu);
    rank.add_to(f);
  });
  return f;
}

// Bytes per second of the work a save does on every byte besides writing it, with no I/O: copied in
// 1 MiB slices into an 8 MiB staging buffer, then fed to a SHA-256 (the file's) and an XXH3-128 (the
// piece's), as FileSink::append does, on one stream per core (a save's files are hashed in
// parallel, one stream each, and a file's SHA-256 cannot be split). Where the disk writes faster
// than this, it bounds the save, not the disk. The source is a resident buffer larger than the
// caches, cycled.
double hash_bound_speed(std::uint64_t bytes) {
  constexpr std::size_t kSlice = 1u << 20, kStaging = 8u << 20, kSource = 64u << 20;
  const unsigned streams = std::max(1u, std::thread::hardware_concurrency());
  const std::uint64_t per_stream = bytes / streams / kSlice * kSlice;
  std::vector<std::vector<std::byte>> sources;
  for (unsigned i = 0; i < streams; ++i) sources.emplace_back(kSource, std::byte{static_cast<unsigned char>(i + 1)});
  std::vector<std::string> digests(streams);
  const Clock::time_point t0 = Clock::now();
  std::vector<std::thread> threads;
  for (unsigned i = 0; i < streams; ++i) {
    threads.emplace_back([&, i] {
      std::unique_ptr<std::byte, decltype(&std::free)> staging(static_cast<std::byte*>(std::aligned_alloc(4096, kStaging)), &std::free);
      const std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> piece(XXH3_createState(), XXH3_freeState);
      if (!staging || !piece) return;
      XXH3_128bits_reset(piece.get());
      io::Sha256 file;
      for (std::uint64_t done = 0; done < per_stream; done += kSlice) {
        std::byte* dst = staging.get() + done % kStaging;
        std::memcpy(dst, sources[i].data() + done % kSource, kSlice);
        file.update(dst, kSlice);
        XXH3_128bits_update(piece.get(), dst, kSlice);
      }
      const XXH128_hash_t h = XXH3_128bits_digest(piece.get());
      digests[i] = file.hex() + fmt::format("{:016x}{:016x}", h.high64, h.low64);
    });
  }
  for (std::thread& t : threads) t.join();
  const double s = since(t0);
  for (const std::string& d : digests) MG_CHECK(!d.empty(), "bench checkpoint: cannot allocate the hash probe's buffers");
  return static_cast<double>(per_stream * streams) / s;
}

// Bytes per second of a memcpy from a resident 8 MiB buffer into `bytes` of memory this process
// never touched (a fresh anonymous mapping): what writing the first load's new tensors can cost.
double fresh_memory_speed(std::uint64_t bytes) {
  constexpr std::size_t kChunk = 8u << 20;
  const std::size_t n = (static_cast<std::size_t>(bytes) + kChunk - 1) / kChunk * kChunk;
  void* fresh = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (fresh == MAP_FAILED) return 0;
  std::vector<std::byte> source(kChunk, std::byte{1});
  const Clock::time_point t0 = Clock::now();
  for (std::size_t off = 0; off < n; off += kChunk) std::memcpy(static_cast<std::byte*>(fresh) + off, source.data(), kChunk);
  const double s = since(t0);
  ::munmap(fresh, n);
  return static_cast<double>(n) / s;
}

int run(const BenchCheckpointOptions& o) {
  // An empty path, a parent that is not a writable directory, ... named as --dir (reliability-2 B2).
  io::check_output_directory({"--dir", o.dir}, {});
  MG_CHECK(!fs::exists(o.dir), "bench checkpoint: --dir '{}' exists; give a new directory (it is removed afterwards)", o.dir);
  fs::create_directories(o.dir);
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } cleanup{o.dir};
  std::vector<std::pair<int, TpFigures>> rows;
  for (int tp : o.tps) {
    TpFigures f = measure(o, tp, (fs::path(o.dir) / fmt::format("tp{}", tp)).string());
    for (int rep = 0; rep < 3; ++rep) f.hash_bound = std::max(f.hash_bound, hash_bound_speed(f.bytes));
    rows.emplace_back(tp, f);
    fs::remove_all(fs::path(o.dir) / fmt::format("tp{}", tp));
  }
  const std::uint64_t bytes = rows.empty() ? 0 : rows.front().second.bytes;
  const double gb = 1e9;
  fmt::print("checkpoint of a GPT layers={} hidden={} heads={} vocab={} ({:.1f} M parameters; {:.2f} GB with AdamW "
             "moments, float32)\n", o.layers, o.hidden, o.heads, o.vocab, static_cast<double>(bytes) / 12 / 1e6,
             static_cast<double>(bytes) / gb);
  const double fresh = fresh_memory_speed(bytes);
  fmt::print("disk = one stream of the same bytes, buffered (write + fsync; read after dropping the page cache) and "
             "O_DIRECT, the best of 3 probes taken right before the 3 saves (writes) and the 3 loads (reads) of each "
             "row, which are the best of 3 too; a save or load is compared with the faster way\n\n");
  fmt::print("hash = copy + SHA-256 + XXH3 of the same bytes on {} streams (one per core), no I/O: what every byte of a "
             "save costs besides its write, the best of 3 after each row; where it is slower than the disk it bounds the "
             "save\n\n", std::max(1u, std::thread::hardware_concurrency()));
  fmt::print("{:>3} | {:>10} | {:>10} | {:>9} | {:>9} | {:>14} | {:>9} | {:>7} | {:>8} | {:>10}\n", "tp", "write buf",
             "write dir", "hash GB/s", "save GB/s", "% of the write", "% of hash", "save s", "stall s", "stall/save");
  for (const auto& [tp, f] : rows) {
    const double save_bw = static_cast<double>(bytes) / f.save_s;
    fmt::print("{:>3} | {:>10.2f} | {:>10.2f} | {:>9.2f} | {:>9.2f} | {:>13.0f}% | {:>8.0f}% | {:>7.2f} | {:>8.3f} | {:>9.1f}%\n",
               tp, f.disk.buffered_write / gb, f.disk.direct_write / gb, f.hash_bound / gb, save_bw / gb,
               100 * save_bw / f.disk.best_write(), 100 * save_bw / f.hash_bound, f.save_s, f.stall_s,
               100 * f.stall_s / f.save_s);
  }
  fmt::print("\nresume = what train --resume does in a new process: build the model and the optimizer's moments in "
             "memory never touched before (a memcpy into fresh pages runs at {:.2f} GB/s here; a run from scratch "
             "builds the same), then load the checkpoint into them in place; 1st = that first load (its staging buffers "
             "fresh too), load = best of 3 more, each right after a plain O_DIRECT read of the same files (files = best "
             "of those); % of write: against the save table's write probes; new tensors = an all-or-nothing load into memory "
             "never touched before\n\n", fresh / gb);
  fmt::print("{:>3} | {:>8} | {:>8} | {:>10} | {:>7} | {:>8} | {:>9} | {:>10} | {:>9} | {:>10} | {:>11}\n", "tp", "read buf",
             "read dir", "files GB/s", "build s", "1st GB/s", "load GB/s", "% of files", "% of read", "% of write",
             "new tensors");
  for (const auto& [tp, f] : rows) {
    const double b = static_cast<double>(bytes);
    const double first_bw = b / f.first_load_s, load_bw = b / f.load_s, new_bw = b / f.new_tensors_load_s;
    const double files_bw = f.raw_read_s > 0 ? b / f.raw_read_s : 0;
    fmt::print("{:>3} | {:>8.2f} | {:>8.2f} | {:>10.2f} | {:>7.2f} | {:>8.2f} | {:>9.2f} | {:>9.0f}% | {:>8.0f}% | {:>9.0f}% | "
               "{:>11.2f}\n", tp, f.disk.buffered_read / gb, f.disk.direct_read / gb, files_bw / gb, f.build_s, first_bw / gb,
               load_bw / gb, files_bw > 0 ? 100 * load_bw / files_bw : 0.0, 100 * load_bw / f.disk.best_read(),
               100 * load_bw / f.disk.best_write(), new_bw / gb);
  }
  return 0;
}

std::function<int()> setup(CLI::App& app) {
  auto o = std::make_shared<BenchCheckpointOptions>();
  app.add_option("--dir", o->dir, "Scratch directory (must not exist; removed afterwards)")->capture_default_str();
  app.add_option("--tp", o->tps, "Tensor-parallel degrees")->check(at_least(1, 4096))->capture_default_str();
  app.add_option("--layers", o->layers, "Model layers")->check(at_least(1))->capture_default_str();
  app.add_option("--hidden", o->hidden, "Model width")->check(at_least(1))->capture_default_str();
  app.add_option("--heads", o->heads, "Attention heads")->check(at_least(1))->capture_default_str();
  app.add_option("--vocab", o->vocab, "Vocabulary")->check(at_least(1))->capture_default_str();
  return [o] { return run(*o); };
}

}  // namespace

MESHGRAD_REGISTER_COMMAND(bench_checkpoint, {"bench", "checkpoint",
                                             "save/load throughput of sharded checkpoints against the disk, and the "
                                             "stall of an async save", setup});

}  // namespace meshgrad::tools::cmd_bench_checkpoint
