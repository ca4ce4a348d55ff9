// Reading the files of one checkpoint (contract in piece_reads.hpp).
#include "checkpoint/piece_reads.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <future>
#include <string>
#include <system_error>
#include <utility>

#include "checkpoint/direct_io.hpp"
#include "checkpoint/file_errors.hpp"
#include "checkpoint/pieces.hpp"

namespace meshgrad::checkpoint {

// ---- CheckpointFiles ---------------------------------------------------------------------------------

CheckpointFiles::CheckpointFiles(std::string dir, const Manifest& m)
    : dir_(std::move(dir)), m_(m), fds_(m.files.size()), direct_fds_(m.files.size()), direct_refused_(m.files.size(), 0) {}

int CheckpointFiles::fd(std::size_t file) {
  io::UniqueFd& fd = fds_.at(file);
  if (fd.get() >= 0) return fd.get();
  const ManifestFile& f = m_.files[file];
  const std::string path = this->path(file);
  std::uint64_t size = 0;
  // Never blocks on a FIFO put in a file's place (it used to hang verify and resume in open()).
  as_checkpoint_error([&] { fd = io::open_regular_file(path, &size); });
  if (size != f.bytes)
    throw CheckpointError(fmt::format("checkpoint: '{}' has {} bytes but the manifest says {} ({})", path, size, f.bytes,
                                      size < f.bytes ? "truncated" : "grown"));
  return fd.get();
}

int CheckpointFiles::direct_fd(std::size_t file) {
  fd(file);
  io::UniqueFd& d = direct_fds_.at(file);
  if (d.get() >= 0 || direct_refused_.at(file)) return d.get();
  if (direct_io_wanted()) d = io::UniqueFd(::open(path(file).c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT));
  direct_refused_.at(file) = d.get() < 0;
  return d.get();
}

void CheckpointFiles::refuse_direct(std::size_t file) {
  direct_fds_.at(file).reset();
  direct_refused_.at(file) = true;
}

std::string CheckpointFiles::path(std::size_t file) const {
  return (std::filesystem::path(dir_) / m_.files.at(file).name).string();
}

// ---- Pieces out of one file -------------------------------------------------------------------------

namespace {

// A span of the file read with one O_DIRECT pread: (position, length), both multiples of 4096.
using Span = std::pair<std::uint64_t, std::uint64_t>;

// Reads a span into buf: the bytes read (short at the end of the file), or -errno.
ssize_t pread_span(int fd, std::byte* buf, Span span) {
  std::uint64_t got = 0;
  while (got < span.second) {
    const ssize_t r = ::pread(fd, buf + got, span.second - got, static_cast<off_t>(span.first + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return got > 0 ? static_cast<ssize_t>(got) : -errno;
    if (r == 0) break;
    got += static_cast<std::uint64_t>(r);
  }
  return static_cast<ssize_t>(got);
}

// The pieces of one file in offset order and how far each is read; they complete, and are checked
// against their hash, in that order.
class FilePieceReader {
 public:
  FilePieceReader(std::string path, std::vector<PieceRead>& pieces) : path_(std::move(path)), pieces_(pieces) {
    std::sort(pieces_.begin(), pieces_.end(), [](const PieceRead& a, const PieceRead& b) { return a.piece->offset < b.piece->offset; });
    progress_.resize(pieces_.size());
    for (std::size_t i = 0; i < pieces_.size(); ++i) {
      progress_[i].begin = pieces_[i].piece->offset;
      progress_[i].end = progress_[i].begin + pieces_[i].piece->bytes(pieces_[i].tensor->dtype);
    }
  }

  // Streams the spans the pieces need from direct (an O_DIRECT descriptor) through the two buffers,
  // reading the next span while the current one is taken apart. Returns false, with the pieces read
  // so far kept, when the filesystem refuses O_DIRECT reads (EINVAL): read_rest_buffered goes on.
  bool stream_direct(int direct, std::byte* const (&buffers)[2]) {
    const std::vector<Span> spans = direct_spans();
    int current = 0;
    std::future<ssize_t> next;
    if (!spans.empty()) next = std::async(std::launch::deferred, pread_span, direct, buffers[0], spans[0]);
    for (std::size_t k = 0; k < spans.size(); ++k) {
      const ssize_t r = next.get();
      if (r == -EINVAL) return false;   // O_DIRECT accepted at open, not for I/O
      if (r < 0)
        throw CheckpointError(fmt::format("checkpoint: reading '{}' at offset {} failed: {}", path_, spans[k].first,
                                          io::errno_text(static_cast<int>(-r))));
      if (k + 1 < spans.size()) next = read_ahead(direct, buffers[1 - current], spans[k + 1]);
      try {
        take_span(buffers[current], spans[k], static_cast<std::uint64_t>(r));
      } catch (...) {
        if (next.valid()) next.wait();   // the read in flight writes a buffer the caller owns
        throw;
      }
      current = 1 - current;
    }
    return true;
  }

  // Buffered reads of whatever stream_direct did not read (everything when it did not run), through
  // a 1 MiB slice, piece by piece.
  void read_rest_buffered(int fd) {
    constexpr std::size_t kSlice = 1u << 20;
    thread_local std::vector<std::byte> slice(kSlice);
    for (std::size_t i = first_open_; i < pieces_.size(); ++i) {
      Progress& pr = progress_[i];
      while (pr.begin + pr.done < pr.end) {
        const std::uint64_t at = pr.begin + pr.done;
        const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(pr.end - at, kSlice));
        as_checkpoint_error([&] { io::read_exact(fd, slice.data(), k, at, path_); });
        feed(i, slice.data(), at, k);
      }
      check(i);
    }
  }

 private:
  struct Progress {
    PieceHash hash;
    std::uint64_t begin = 0, end = 0, done = 0;   // the piece's bytes in the file; how many are in its target
  };

  // The pieces' byte ranges rounded out to 4096, merged where they touch, cut into spans of at most
  // a staging buffer.
  std::vector<Span> direct_spans() const {
    static constexpr std::uint64_t kAlign = StagingPool::kAlign, kSpan = StagingPool::kBytes;
    std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;   // [lo, hi)
    for (const Progress& pr : progress_) {
      const std::uint64_t lo = pr.begin / kAlign * kAlign, hi = (pr.end + kAlign - 1) / kAlign * kAlign;
      if (!ranges.empty() && lo <= ranges.back().second) ranges.back().second = std::max(ranges.back().second, hi);
      else ranges.emplace_back(lo, hi);
    }
    std::vector<Span> spans;
    for (const auto& [lo, hi] : ranges) {
      for (std::uint64_t pos = lo; pos < hi; pos += kSpan) spans.emplace_back(pos, std::min(kSpan, hi - pos));
    }
    return spans;
  }

  // The read of the next span, on a thread of its own; when no thread can be had, read when needed.
  static std::future<ssize_t> read_ahead(int direct, std::byte* buf, Span span) {
    try {
      return std::async(std::launch::async, pread_span, direct, buf, span);
    } catch (const std::system_error&) {
      return std::async(std::launch::deferred, pread_span, direct, buf, span);
    }
  }

  // Hands the `got` bytes read of span (in buf) to the open pieces it holds, checking each piece that
  // completes; throws when the file ended inside the span where an open piece still needed bytes.
  void take_span(const std::byte* buf, Span span, std::uint64_t got) {
    const std::uint64_t pos = span.first, got_end = pos + got;
    for (std::size_t i = first_open_; i < pieces_.size() && progress_[i].begin < got_end; ++i) {
      Progress& pr = progress_[i];
      const std::uint64_t lo = std::max(pos, pr.begin + pr.done), hi = std::min(got_end, pr.end);
      if (hi > lo) feed(i, buf + (lo - pos), lo, hi - lo);
      if (pr.done == pr.end - pr.begin && i == first_open_) {
        check(i);
        ++first_open_;
      }
    }
    const std::uint64_t span_end = pos + span.second;
    if (got_end < span_end && first_open_ < pieces_.size() && progress_[first_open_].begin < span_end)
      throw CheckpointError(fmt::format("checkpoint: '{}' ends before offset {} (truncated)", path_,
                                        std::max(got_end, progress_[first_open_].begin + progress_[first_open_].done)));
  }

  // Feeds bytes [at, at + n) of the file, which lie inside piece i, to its hash and its target, in
  // slices that stay in the core's cache between the two: the bytes come from memory once.
  void feed(std::size_t i, const std::byte* bytes, std::uint64_t at, std::uint64_t n) {
    constexpr std::uint64_t kCached = 128u << 10;
    Progress& pr = progress_[i];
    for (std::uint64_t off = 0; off < n; off += kCached) {
      const std::size_t k = static_cast<std::size_t>(std::min(kCached, n - off));
      pr.hash.update(bytes + off, k);
      std::memcpy(pieces_[i].target + (at - pr.begin) + off, bytes + off, k);
    }
    pr.done += n;
  }

  void check(std::size_t i) const {
    if (progress_[i].hash.hex() != pieces_[i].piece->xxh3)
      throw CheckpointError(fmt::format("checkpoint: tensor '{}' box {} in '{}' at offset {} fails its hash (XXH3-128; the "
                                        "file is corrupt)", pieces_[i].tensor->name, box_str(pieces_[i].piece->box), path_,
                                        pieces_[i].piece->offset));
  }

  std::string path_;
  std::vector<PieceRead>& pieces_;
  std::vector<Progress> progress_;
  std::size_t first_open_ = 0;   // pieces before it are read and checked
};

}  // namespace

void read_file_pieces(CheckpointFiles& files, std::size_t file, std::vector<PieceRead>& pieces) {
  FilePieceReader reader(files.path(file), pieces);
  const StagingPool::Buffer buffers[2] = {StagingPool::instance().acquire(), StagingPool::instance().acquire()};
  const int direct = buffers[0] && buffers[1] ? files.direct_fd(file) : -1;
  if (direct >= 0) {
    std::byte* const raw[2] = {buffers[0].get(), buffers[1].get()};
    if (!reader.stream_direct(direct, raw)) files.refuse_direct(file);
  }
  reader.read_rest_buffered(files.fd(file));
}

}  // namespace meshgrad::checkpoint
