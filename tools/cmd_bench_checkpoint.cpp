// meshgrad bench checkpoint: save and load throughput of sharded checkpoints at several tp degrees for
// a GPT of about 100M parameters (GPT-2 small's shape by default), next to the disk's own sequential
// write and read speed measured in the same run, and the training stall of an asynchronous save
// against a synchronous one. Prints one table.
//
// What each figure is (bytes = parameters + both AdamW moments, float32):
//   disk write   one stream writing the same number of bytes, then fsync
//   disk read    one stream reading them back after the page cache dropped them (posix_fadvise)
//   save         a synchronous save: snapshot, every rank writing and hashing its file, fsync,
//                manifest, rename (wall time of the slowest rank); the second of the process (the
//                first also writes the snapshot buffer's fresh pages: MESHGRAD_BENCH_VERBOSE=1)
//   stall        how long an asynchronous save held training up (the in-memory snapshot; the second
//                save of the run: the first one also faults in the snapshot buffer's pages)
//   load         every rank reading and checking its pieces after the cache dropped the files, into
//                new tensors, twice: the first load of the process writes memory it never touched
//                before, the second (the files dropped from the cache again) reuses the first one's
//                memory through the caching allocator, as a resume's moments and parameters reuse
//                memory the model already holds. On a VM that backs guest memory lazily the first
//                writes to fresh pages cost more than the disk: `fresh memory` is a memcpy into
//                never-touched pages, measured in the same run, which bounds the first load.
#include <fcntl.h>
#include <sys/mman.h>
#include <fmt/core.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <vector>

#include "command.hpp"
#include "launch.hpp"
#include "meshgrad/nn/model.hpp"
#include "meshgrad/tensor/allocator.hpp"
#include "meshgrad/train/checkpoint_store.hpp"
#include "meshgrad/train/optimizer.hpp"
#include "meshgrad/train/trainer.hpp"
#include "options.hpp"

namespace meshgrad::tools {
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

// The disk's own speed for `bytes` through one stream, three ways: buffered write() + fsync (through
// the page cache), O_DIRECT writes of 8 MiB from an aligned buffer (DMA, what the checkpoint writer
// uses where the filesystem allows it), and a sequential read after the pages were dropped. A save
// is compared with the faster of the two writes, so that choosing a write path cannot flatter it.
struct DiskSpeed {
  double buffered_write = 0, direct_write = 0, read = 0;   // bytes per second (direct 0: refused)
  double best_write() const { return std::max(buffered_write, direct_write); }
};

DiskSpeed disk_speed(const std::string& dir, std::uint64_t bytes) {
  const std::string path = (fs::path(dir) / "disk_probe.bin").string();
  constexpr std::size_t kChunk = 8 << 20;
  std::unique_ptr<char, decltype(&std::free)> chunk(static_cast<char*>(std::aligned_alloc(4096, kChunk)), &std::free);
  MG_CHECK(chunk != nullptr, "bench checkpoint: cannot allocate the probe buffer");
  for (std::size_t i = 0; i < kChunk; ++i) chunk.get()[i] = static_cast<char>((i * 2654435761u) >> 13);
  DiskSpeed speed;
  // Buffered + fsync, then direct (rounded up to whole chunks: same order of bytes).
  for (const bool direct : {false, true}) {
    fs::remove(path);
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | (direct ? O_DIRECT : 0), 0644);
    if (fd < 0 && direct) continue;   // the filesystem refuses O_DIRECT: only the buffered figure
    MG_CHECK(fd >= 0, "bench checkpoint: cannot create '{}'", path);
    const Clock::time_point t0 = Clock::now();
    bool ok = true;
    std::uint64_t done = 0;
    while (done < bytes && ok) {
      const std::size_t n = direct ? kChunk : static_cast<std::size_t>(std::min<std::uint64_t>(kChunk, bytes - done));
      ok = ::pwrite(fd, chunk.get(), n, static_cast<off_t>(done)) == static_cast<ssize_t>(n);
      done += n;
    }
    MG_CHECK(ok || direct, "bench checkpoint: writing '{}' failed", path);
    MG_CHECK(::fsync(fd) == 0, "bench checkpoint: fsync of '{}' failed", path);
    const double write_s = since(t0);
    ::close(fd);
    if (ok) (direct ? speed.direct_write : speed.buffered_write) = static_cast<double>(done) / write_s;
  }
  drop_cache(path);
  const int rfd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MG_CHECK(rfd >= 0, "bench checkpoint: cannot open '{}'", path);
  const Clock::time_point t1 = Clock::now();
  std::uint64_t got = 0;
  for (ssize_t r; (r = ::read(rfd, chunk.get(), kChunk)) > 0 && got < bytes;) got += static_cast<std::uint64_t>(r);
  const double read_s = since(t1);
  ::close(rfd);
  fs::remove(path);
  speed.read = static_cast<double>(bytes) / read_s;
  return speed;
}

struct TpFigures {
  double save_s = 0, stall_s = 0, async_total_s = 0, load_s = 0, reload_s = 0;
  std::uint64_t bytes = 0;
};

TpFigures measure(const BenchCheckpointOptions& o, int tp, const std::string& root) {
  nn::ModelConfig cfg;
  cfg.kind = "gpt";
  cfg.layers = o.layers;
  cfg.hidden = o.hidden;
  cfg.heads = o.heads;
  cfg.vocab = o.vocab;
  cfg.positions = o.positions;
  cfg.seq = 64;
  TpFigures f;
  std::mutex mu;
  run_on_backend("threads", tp, [&](const comm::CommunicatorPtr& world) {
    auto mesh = std::make_shared<const dist::DeviceMesh>(world, std::vector<dist::MeshAxis>{{"dp", 1}, {"tp", tp}});
    auto model = nn::make_model(cfg, {}, mesh, 1);
    const std::vector<nn::Parameter*> params = model->parameters();
    train::AdamW opt(params, mesh);
    std::vector<Tensor> m, v;
    for (const nn::Parameter* p : params) {
      m.push_back(p->value.detach().clone());
      v.push_back(p->value.detach().clone());
    }
    opt.load_state(1, m, v);
    const std::vector<train::StateTensor> state = train::training_state_tensors(params, opt);
    train::CheckpointSaver saver(root, mesh, 0);
    const nlohmann::json info{{"bench", true}};

    // Two synchronous saves: the first also writes the snapshot buffer's fresh pages (once per
    // process); the second is what every later save costs, and is the one in the table.
    world->barrier();
    Clock::time_point t0 = Clock::now();
    const train::SaveTimes first_times = saver.save(1, state, info, /*async=*/false);
    world->barrier();
    const double first_save_s = since(t0);
    if (std::getenv("MESHGRAD_BENCH_VERBOSE") != nullptr)
      fmt::print(stderr, "tp={} rank {}: first save: snapshot {:.2f} s, write+hash {:.2f} s, commit {:.2f} s, save {:.2f} s\n",
                 tp, world->rank(), first_times.snapshot_s, first_times.write_s, first_times.commit_s, first_save_s);
    world->barrier();
    t0 = Clock::now();
    const train::SaveTimes sync_times = saver.save(2, state, info, /*async=*/false);
    world->barrier();
    const double save_s = since(t0);
    if (std::getenv("MESHGRAD_BENCH_VERBOSE") != nullptr)
      fmt::print(stderr, "tp={} rank {}: snapshot {:.2f} s, write+hash {:.2f} s, commit {:.2f} s, save {:.2f} s\n", tp, world->rank(), sync_times.snapshot_s, sync_times.write_s, sync_times.commit_s, save_s);

    // Two async saves: the first also pays for the snapshot buffer's fresh pages (once per run);
    // the second's stall is what every later save costs.
    saver.save(3, state, info, /*async=*/true);
    saver.wait();
    world->barrier();
    t0 = Clock::now();
    const train::SaveTimes times = saver.save(4, state, info, /*async=*/true);
    const double stall_s = since(t0);
    saver.wait();
    world->barrier();
    const double async_total_s = since(t0);

    const std::string ck = (fs::path(root) / train::checkpoint_dir_name(4)).string();
    // One load of every rank's pieces after the files left the page cache: wall time of all ranks.
    const auto load = [&](const char* which) {
      if (world->rank() == 0) {
        for (const auto& e : fs::directory_iterator(ck)) drop_cache(e.path().string());
      }
      world->barrier();
      const Clock::time_point start = Clock::now();
      const train::Manifest manifest = train::read_manifest(ck);
      std::vector<train::PieceRequest> requests;
      for (const train::StateTensor& t : state) {
        requests.push_back({t.name, t.full_shape, dist::piece_layout(t.full_shape, *mesh, t.placements, mesh->coordinates()),
                            t.local.dtype()});
      }
      const double plan_s = since(start);
      {
        const std::vector<Tensor> loaded = train::read_pieces(ck, manifest, requests);
      }   // freed: the next load's tensors reuse this memory (caching allocator)
      const double read_s = since(start) - plan_s;
      world->barrier();
      const double all_s = since(start);
      if (std::getenv("MESHGRAD_BENCH_VERBOSE") != nullptr)
        fmt::print(stderr, "tp={} rank {}: {} load: manifest + layout {:.2f} s, read_pieces {:.2f} s, all ranks {:.2f} s\n",
                   tp, world->rank(), which, plan_s, read_s, all_s);
      return all_s;
    };
    // The allocator's cache holds blocks of earlier degrees and saves: emptied, so the first load's
    // tensors are new memory at every degree and the second load finds exactly the first one's.
    world->barrier();
    if (world->rank() == 0) memory::release_cached();
    world->barrier();
    const double load_s = load("first");
    const double reload_s = load("second");

    const std::lock_guard<std::mutex> lock(mu);
    f.save_s = std::max(f.save_s, save_s);
    f.stall_s = std::max(f.stall_s, stall_s);
    f.async_total_s = std::max(f.async_total_s, async_total_s);
    f.load_s = std::max(f.load_s, load_s);
    f.reload_s = std::max(f.reload_s, reload_s);
    f.bytes += times.bytes_written;
  });
  return f;
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
  MG_CHECK(!fs::exists(o.dir), "bench checkpoint: --dir '{}' exists; give a new directory (it is removed afterwards)", o.dir);
  fs::create_directories(o.dir);
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } cleanup{o.dir};
  // The disk's speed is measured right before and right after each degree's saves and loads (a
  // shared virtual disk's speed drifts within minutes); the row compares against their mean.
  struct Row {
    int tp;
    TpFigures f;
    DiskSpeed disk;   // mean of before and after
  };
  std::vector<Row> rows;
  std::uint64_t bytes = 0;
  for (int tp : o.tps) {
    Row row{tp, {}, {}};
    DiskSpeed before;
    if (bytes > 0) before = disk_speed(o.dir, bytes);
    row.f = measure(o, tp, (fs::path(o.dir) / fmt::format("tp{}", tp)).string());
    fs::remove_all(fs::path(o.dir) / fmt::format("tp{}", tp));
    if (bytes == 0) {
      bytes = row.f.bytes;
      before = disk_speed(o.dir, bytes);
    }
    const DiskSpeed after = disk_speed(o.dir, bytes);
    row.disk = {0.5 * (before.buffered_write + after.buffered_write), 0.5 * (before.direct_write + after.direct_write),
                0.5 * (before.read + after.read)};
    rows.push_back(row);
  }
  const double gb = 1e9;
  fmt::print("checkpoint of a GPT layers={} hidden={} heads={} vocab={} ({:.1f} M parameters; {:.2f} GB with AdamW "
             "moments, float32)\n", o.layers, o.hidden, o.heads, o.vocab, static_cast<double>(bytes) / 12 / 1e6,
             static_cast<double>(bytes) / gb);
  const double fresh = fresh_memory_speed(bytes);
  fmt::print("disk = one stream of the same bytes, mean of before and after each row: write buffered+fsync and "
             "O_DIRECT (a save is compared with the faster), read after dropping the page cache\n");
  fmt::print("load: every rank's pieces after dropping the page cache, into new tensors; 1st = the process's first "
             "load (memory never touched before: a memcpy into fresh pages runs at {:.2f} GB/s here), 2nd = the next "
             "load, whose tensors reuse that memory; % of the disk's read\n\n", fresh / gb);
  fmt::print("{:>3} | {:>9} | {:>9} | {:>9} | {:>9} | {:>10} | {:>8} | {:>9} | {:>8} | {:>5} | {:>8} | {:>5} | {:>7}\n", "tp",
             "buf+fsync", "direct", "save GB/s", "% of disk", "stall s", "stall/save", "disk read", "load 1st", "%",
             "load 2nd", "%", "save s");
  for (const Row& r : rows) {
    const double save_bw = static_cast<double>(bytes) / r.f.save_s, load_bw = static_cast<double>(bytes) / r.f.load_s,
                 reload_bw = static_cast<double>(bytes) / r.f.reload_s;
    fmt::print("{:>3} | {:>9.2f} | {:>9.2f} | {:>9.2f} | {:>8.0f}% | {:>10.3f} | {:>7.1f}% | {:>9.2f} | {:>8.2f} | {:>4.0f}% | "
               "{:>8.2f} | {:>4.0f}% | {:>7.2f}\n",
               r.tp, r.disk.buffered_write / gb, r.disk.direct_write / gb, save_bw / gb, 100 * save_bw / r.disk.best_write(),
               r.f.stall_s, 100 * r.f.stall_s / r.f.save_s, r.disk.read / gb, load_bw / gb, 100 * load_bw / r.disk.read,
               reload_bw / gb, 100 * reload_bw / r.disk.read, r.f.save_s);
  }
  return 0;
}

std::function<int()> setup(CLI::App& app) {
  auto o = std::make_shared<BenchCheckpointOptions>();
  app.add_option("--dir", o->dir, "Scratch directory (must not exist; removed afterwards)")->capture_default_str();
  app.add_option("--tp", o->tps, "Tensor-parallel degrees")->capture_default_str();
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

}  // namespace meshgrad::tools
