// Checking a checkpoint against its manifest (contract in include/meshgrad/checkpoint/verify.hpp).
#include "meshgrad/checkpoint/verify.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "checkpoint/piece_reads.hpp"
#include "checkpoint/file_errors.hpp"
#include "checkpoint/pieces.hpp"
#include "meshgrad/checkpoint/directory.hpp"
#include "meshgrad/io/sha256.hpp"

namespace meshgrad::checkpoint {

namespace {

using PieceOfFile = std::pair<const ManifestPiece*, const ManifestTensor*>;

// Checks file f in one sequential pass that feeds both the file's hash and each piece's (pieces in
// offset order). Throws CheckpointError naming the first bad piece, or the file.
void verify_file(CheckpointFiles& files, const Manifest& m, std::size_t f, std::vector<PieceOfFile>& pieces,
                 std::vector<std::byte>& buf) {
  std::sort(pieces.begin(), pieces.end(), [](const auto& a, const auto& b) { return a.first->offset < b.first->offset; });
  const int fd = files.fd(f);
  const std::string path = files.path(f);
  io::Sha256 whole;
  std::uint64_t pos = 0;
  const auto feed = [&](std::uint64_t n, PieceHash* piece) {
    while (n > 0) {
      const std::uint64_t k = std::min<std::uint64_t>(n, buf.size());
      as_checkpoint_error([&] { io::read_exact(fd, buf.data(), k, pos, path); });
      whole.update(buf.data(), k);
      if (piece) piece->update(buf.data(), k);
      pos += k;
      n -= k;
    }
  };
  PieceHash hash;
  for (const auto& [p, t] : pieces) {
    feed(p->offset - pos, nullptr);
    hash.reset();
    feed(p->bytes(t->dtype), &hash);
    if (hash.hex() != p->xxh3)
      throw CheckpointError(fmt::format("checkpoint: tensor '{}' box {} in '{}' at offset {} fails its hash (XXH3-128; the "
                                        "file is corrupt)", t->name, box_str(p->box), path, p->offset));
  }
  feed(m.files[f].bytes - pos, nullptr);
  if (whole.hex() != m.files[f].sha256)
    throw CheckpointError(fmt::format("checkpoint: '{}' fails its SHA-256 (the file is corrupt)", path));
}

}  // namespace

std::uint64_t verify_checkpoint(const std::string& dir) {
  const Manifest m = read_manifest(dir);
  CheckpointFiles files(dir, m);
  std::vector<std::vector<PieceOfFile>> by_file(m.files.size());
  for (const ManifestTensor& t : m.tensors) {
    for (const ManifestPiece& p : t.pieces) by_file[p.file].emplace_back(&p, &t);
  }
  std::vector<std::byte> buf(1 << 20);
  std::uint64_t checked = 0;
  for (std::size_t f = 0; f < m.files.size(); ++f) {
    verify_file(files, m, f, by_file[f], buf);
    checked += m.files[f].bytes;
  }
  return checked;
}

}  // namespace meshgrad::checkpoint
