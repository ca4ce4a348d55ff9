// The staging buffer pool, the O_DIRECT switch and the file sink (contract in direct_io.hpp).
#include "checkpoint/direct_io.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string_view>
#include <utility>

#include "checkpoint/file_errors.hpp"
#include "meshgrad/checkpoint/manifest.hpp"
#include "meshgrad/checkpoint/staging_buffers.hpp"

namespace meshgrad::checkpoint {

bool direct_io_wanted() {
  const char* v = std::getenv("MESHGRAD_CHECKPOINT_DIRECT");
  if (v == nullptr || *v == '\0' || std::string_view(v) == "1") return true;
  if (std::string_view(v) == "0") return false;
  throw CheckpointError(fmt::format("MESHGRAD_CHECKPOINT_DIRECT must be 0 or 1, got '{}'", v));
}

StagingPool& StagingPool::instance() {
  static StagingPool* pool = new StagingPool;
  return *pool;
}

void StagingPool::release_kept() {
  std::vector<std::byte*> kept;
  {
    std::lock_guard lock(m_);
    kept.swap(free_);
  }
  for (std::byte* b : kept) std::free(b);
}

StagingPool::Buffer StagingPool::acquire() {
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

void StagingPool::release(std::byte* b) {
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

void release_staging_buffers() { StagingPool::instance().release_kept(); }

// ---- FileSink ---------------------------------------------------------------------------------------

FileSink::FileSink(std::string path, bool try_direct) : path_(std::move(path)) {
  const int flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW;
  if (try_direct) {
    fd_ = io::UniqueFd(::open(path_.c_str(), flags | O_DIRECT, 0644));
    direct_ = fd_.get() >= 0;
    if (!direct_ && errno != EINVAL) throw CheckpointError(fmt::format("checkpoint: cannot create '{}': {}", path_, io::errno_text(errno)));
  }
  if (!direct_) fd_ = io::UniqueFd(::open(path_.c_str(), flags, 0644));
  if (fd_.get() < 0) throw CheckpointError(fmt::format("checkpoint: cannot create '{}': {}", path_, io::errno_text(errno)));
  for (auto& b : buffers_) {
    b = StagingPool::instance().acquire();
    if (!b) throw CheckpointError(fmt::format("checkpoint: cannot allocate the {} MiB write buffers for '{}'", kStaging >> 20, path_));
  }
  io_ = std::thread([this] { io_loop(); });
}

FileSink::~FileSink() {
  {
    std::lock_guard lock(m_);
    stop_ = true;
  }
  cv_.notify_all();
  if (io_.joinable()) io_.join();
}

void FileSink::append(const BoxBytes& box, io::Sha256& file_hash, PieceHash& piece_hash) {
  box.for_each_run([&](const std::byte* data, std::uint64_t n) { append_bytes(data, n, file_hash, piece_hash); });
}

void FileSink::append_bytes(const std::byte* data, std::uint64_t n, io::Sha256& file_hash, PieceHash& piece_hash) {
  while (n > 0) {
    const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>({n, kSlice, kStaging - fill_}));
    std::byte* dst = buffers_[current_].get() + fill_;
    std::memcpy(dst, data, k);
    file_hash.update(dst, k);
    piece_hash.update(dst, k);
    fill_ += k;
    data += k;
    n -= k;
    if (fill_ == kStaging) submit(kStaging, kStaging);
  }
}

std::uint64_t FileSink::finish() {
  const std::uint64_t size = queued_ + fill_;
  if (fill_ > 0) {
    const std::size_t rounded = (fill_ + kAlign - 1) / kAlign * kAlign;   // buffered writes ignore the padding
    std::memset(buffers_[current_].get() + fill_, 0, rounded - fill_);
    submit(rounded, fill_);
  }
  wait_idle();
  if (::ftruncate(fd_.get(), static_cast<off_t>(size)) != 0)
    throw CheckpointError(fmt::format("checkpoint: cannot set the size of '{}': {}", path_, io::errno_text(errno)));
  as_checkpoint_error([&] { io::fsync_file(fd_.get(), path_); });
  return size;
}

// Hands the current buffer (n bytes to write, `content` of them the file's) to the I/O thread and
// switches to the other buffer once the I/O thread is done with it.
void FileSink::submit(std::size_t n, std::size_t content) {
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
void FileSink::wait_idle() {
  std::unique_lock lock(m_);
  cv_.wait(lock, [this] { return !job_.pending; });
  if (!error_.empty()) throw CheckpointError(error_);
}

void FileSink::io_loop() {
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

void FileSink::write_at(const std::byte* data, std::size_t n, std::uint64_t offset) {
  std::size_t done = 0;
  while (done < n) {
    const ssize_t w = ::pwrite(fd_.get(), data + done, n - done, static_cast<off_t>(offset + done));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno == EINVAL && direct_) {   // the filesystem took O_DIRECT at open but not for I/O
      const int fl = ::fcntl(fd_.get(), F_GETFL);
      if (fl < 0 || ::fcntl(fd_.get(), F_SETFL, fl & ~O_DIRECT) != 0)
        throw CheckpointError(fmt::format("checkpoint: writing '{}' failed: {}", path_, io::errno_text(errno)));
      direct_ = false;   // only this thread writes it from here on (the caller reads it in no path)
      continue;
    }
    if (w <= 0) throw CheckpointError(fmt::format("checkpoint: writing '{}' at offset {} failed: {}", path_, offset + done,
                                                  w < 0 ? io::errno_text(errno) : "no progress"));
    done += static_cast<std::size_t>(w);
  }
}

}  // namespace meshgrad::checkpoint
