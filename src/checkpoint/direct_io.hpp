// Internal to the checkpoint layer: its O_DIRECT transfers. The pool of aligned staging buffers and
// the switch that turns O_DIRECT off, which saves and loads share, and the FileSink a save writes each
// file through.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/pieces.hpp"
#include "meshgrad/io/file_io.hpp"
#include "meshgrad/io/sha256.hpp"

namespace meshgrad::checkpoint {

// Whether checkpoint files are written and read with O_DIRECT: MESHGRAD_CHECKPOINT_DIRECT=0 turns it
// off (buffered I/O, the same bytes); unset or 1 tries it. Throws CheckpointError for another value.
bool direct_io_wanted();

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

  // Never destroyed: a buffer may be released by a thread still running at exit (still reachable
  // memory, not a leak report).
  static StagingPool& instance();
  // Frees the buffers kept (those handed out come back and are kept again).
  void release_kept();
  // A buffer of kBytes, or null when memory is exhausted.
  Buffer acquire();

 private:
  StagingPool() = default;
  void release(std::byte* b);
  std::mutex m_;
  std::vector<std::byte*> free_;
};


// One checkpoint file written front to back through two 4096-aligned staging buffers, hashed as it
// is written.
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

  // Creates (or truncates) path, with O_DIRECT when try_direct and the filesystem allows it. Throws
  // CheckpointError naming path.
  FileSink(std::string path, bool try_direct);
  ~FileSink();
  FileSink(const FileSink&) = delete;
  FileSink& operator=(const FileSink&) = delete;

  // Appends a box's bytes run by run, feeding them to the file's and the piece's hash.
  void append(const BoxBytes& box, io::Sha256& file_hash, PieceHash& piece_hash);
  // Writes what is left, cuts the file to its exact size and fsyncs it. Returns the file's size.
  std::uint64_t finish();

 private:
  void append_bytes(const std::byte* data, std::uint64_t n, io::Sha256& file_hash, PieceHash& piece_hash);
  void submit(std::size_t n, std::size_t content);
  void wait_idle();
  void io_loop();
  void write_at(const std::byte* data, std::size_t n, std::uint64_t offset);

  struct Job {
    int buffer = 0;
    std::size_t bytes = 0;     // to write (rounded up to kAlign for the tail)
    std::size_t content = 0;   // of which file content
    std::uint64_t offset = 0;
    bool pending = false;
  };
  std::string path_;
  io::UniqueFd fd_;
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

}  // namespace meshgrad::checkpoint
