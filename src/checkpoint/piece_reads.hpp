// Internal to the checkpoint layer: reading the files of one checkpoint. The files opened and
// checked against the manifest, and the saved pieces read out of one of them, hash-checked.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "meshgrad/checkpoint/manifest.hpp"
#include "meshgrad/io/file_io.hpp"

namespace meshgrad::checkpoint {

// The files of checkpoint dir that its manifest lists, opened on first use, each one's size checked
// against the manifest when it is opened. Not thread-safe across a file: one thread per file.
class CheckpointFiles {
 public:
  CheckpointFiles(std::string dir, const Manifest& m);

  // The file's descriptor. Throws CheckpointError naming the file: it cannot be opened, is not a
  // regular file, or has another size than the manifest says (truncated or grown).
  int fd(std::size_t file);
  // The same file opened with O_DIRECT (after fd() checked it), or -1 when the filesystem refuses
  // it or MESHGRAD_CHECKPOINT_DIRECT=0.
  int direct_fd(std::size_t file);
  // The filesystem took O_DIRECT at open but not for reads: direct_fd() answers -1 from now on.
  void refuse_direct(std::size_t file);
  std::string path(std::size_t file) const;

 private:
  std::string dir_;
  const Manifest& m_;
  std::vector<io::UniqueFd> fds_;
  std::vector<io::UniqueFd> direct_fds_;
  std::vector<char> direct_refused_;
};

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
void read_file_pieces(CheckpointFiles& files, std::size_t file, std::vector<PieceRead>& pieces);

}  // namespace meshgrad::checkpoint
