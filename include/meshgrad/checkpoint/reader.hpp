// Reading sharded checkpoints (store.hpp describes what one holds on disk) on any mesh: each rank
// reads only the saved pieces that overlap what it needs, and checks every one against its hash.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "meshgrad/checkpoint/manifest.hpp"
#include "meshgrad/distributed/layout.hpp"
#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::checkpoint {

// A piece one rank needs: the full tensor `name` of `full_shape`, laid out as `layout` (this rank's
// coordinates on the mesh it runs), in `dtype`.
struct PieceRequest {
  std::string name;
  Shape full_shape;
  dist::PieceLayout layout;
  DType dtype = DType::Float32;
};

// Reads the requested pieces from checkpoint dir (whose parsed manifest is given), on any mesh: for
// each request, the saved pieces its boxes overlap are read (only their byte ranges), their XXH3-128
// checked against the manifest, and the overlaps copied into a new tensor of layout.local_shape.
// Not collective. All-or-nothing: throws CheckpointError naming the file and the tensor (a missing
// tensor, another full shape or dtype, a missing or truncated file, a hash mismatch) before returning
// anything.
std::vector<Tensor> read_pieces(const std::string& dir, const Manifest& manifest,
                                const std::vector<PieceRequest>& requests);

// The same reads straight into targets[i] (contiguous, of requests[i]'s local shape and dtype; a
// checkpoint of another floating dtype is converted), so that a resume fills memory the model
// already holds instead of new tensors plus a copy. Errors found from the manifest and the files'
// sizes (a missing tensor, another shape or dtype, a missing or truncated file) are thrown before
// any target is written. A hash mismatch or a read error found while reading is thrown after the
// other reads finished, and the targets are then partly overwritten: use it for state the caller
// drops when it throws (read_pieces when it must stay as it was). Bumps every target's version.
void read_pieces_into(const std::string& dir, const Manifest& manifest, const std::vector<PieceRequest>& requests,
                      const std::vector<Tensor>& targets);

// The full tensors `names` of checkpoint dir (each read whole from its pieces, hashes checked), in the
// given order: what `sample`, `export` and other single-file tools read from a sharded checkpoint.
std::vector<std::pair<std::string, Tensor>> read_full_tensors(const std::string& dir, const Manifest& manifest,
                                                              const std::vector<std::pair<std::string, Shape>>& names);

}  // namespace meshgrad::checkpoint
