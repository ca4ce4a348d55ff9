// The manifest of a sharded checkpoint (store.hpp describes the directory): which file
// holds which box of which tensor, with hashes (SHA-256 per file, XXH3-128 per piece), and the
// trainer's state. Parsing is bounded
// and checks every field, since a manifest is read from disk: this is what the fuzz target
// fuzz/checkpoint_manifest.cpp exercises.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "meshgrad/tensor/dtype.hpp"
#include "meshgrad/tensor/error.hpp"
#include "meshgrad/tensor/shape.hpp"
#include "meshgrad/tensor/shard.hpp"

namespace meshgrad::checkpoint {

// What is wrong with a checkpoint (or with writing one); the message names the directory or file, and
// the tensor or field.
class CheckpointError : public InvalidArgument {
 public:
  explicit CheckpointError(const std::string& message) : InvalidArgument(message) {}
};

// A box of a full tensor: one [offset, offset + size) range per dim.
using Box = std::vector<ShardRange>;
std::int64_t box_volume(const Box& box);
bool boxes_overlap(const Box& a, const Box& b);
std::string box_str(const Box& box);   // "[0:2, 4:8]"

inline constexpr const char* kCheckpointFormat = "meshgrad-checkpoint";
inline constexpr int kCheckpointVersion = 1;

struct ManifestPiece {
  std::size_t file = 0;         // index into Manifest::files
  std::uint64_t offset = 0;     // byte offset in that file
  std::vector<ShardRange> box;  // per dim of the full tensor
  std::string xxh3;             // XXH3-128 of the piece's bytes (32 hex digits): checked on every read
  std::uint64_t bytes(DType dtype) const;
};
struct ManifestTensor {
  std::string name;
  DType dtype = DType::Float32;
  Shape shape;
  std::vector<ManifestPiece> pieces;
};
struct ManifestFile {
  std::string name;     // a plain file name inside the checkpoint directory
  std::uint64_t bytes = 0;
  std::string sha256;
};
// The largest commit number a manifest may hold (2^53: exact in any JSON reader; one commit a
// nanosecond would take 104 days to reach it).
inline constexpr std::int64_t kMaxCommitNumber = std::int64_t{1} << 53;

struct Manifest {
  std::int64_t step = 0;
  // The order in which the checkpoints under one root were committed: 1 + the largest of those there
  // when it was committed (0: written before meshgrad numbered its commits). The newest checkpoint is
  // the last committed, not the highest step: a run resumed from step 100 while an abandoned step 200
  // lies there writes 110, 120, ..., and those are the ones to resume from. At most
  // kMaxCommitNumber: a manifest with a larger one is refused when read (an edit; the next commit's
  // number, this + 1, must not overflow and sort oldest).
  std::int64_t commit = 0;
  std::string mesh;              // the mesh it was written on, as --mesh spells it ("dp=2,tp=2")
  nlohmann::json state;          // the trainer's state object (opaque here)
  std::vector<ManifestFile> files;
  std::vector<ManifestTensor> tensors;
  // The tensor of that name, or nullptr.
  const ManifestTensor* find(const std::string& name) const;
};

// Parses and validates a manifest (`path` names it in errors). Refuses, naming the field: bad JSON
// (nesting is bounded), a wrong format or version, a file name that is not a plain name, a tensor
// named twice, an unknown dtype, a negative or overflowing shape, a box outside the shape or with the
// wrong number of dims, a piece outside its file, a file index out of range, a hash that is not 64
// hex digits, and pieces that do not tile their tensor exactly (a gap or an overlap).
Manifest parse_manifest(std::string_view text, const std::string& path);
// The manifest as JSON text; throws CheckpointError when a string in it is not valid UTF-8.
std::string manifest_to_json(const Manifest& manifest);

// Reads and parses the manifest file at path (size-bounded; errors name path).
Manifest read_manifest_file(const std::string& path);

}  // namespace meshgrad::checkpoint
