// Internal to the checkpoint layer: which rank writes which piece of a save, and where. Every rank
// computes the same plan from the same tensors and mesh, so no one needs to send it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "meshgrad/checkpoint/manifest.hpp"
#include "meshgrad/checkpoint/state_tensor.hpp"
#include "meshgrad/distributed/mesh.hpp"

namespace meshgrad::checkpoint {

// One distinct box of one tensor, the rank that writes it, and where in which file.
struct PlannedPiece {
  std::size_t tensor = 0;    // index into the save's tensors
  Box box;
  int writer = 0;
  std::size_t file = 0;      // writer * files_per_rank + which of the writer's files
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
};

// For each tensor in order, its distinct non-empty boxes over the ranks that hold it (holders[i],
// ascending: every rank, or the ranks of one pipeline stage). A box several ranks hold (a replica
// over dp, a parameter replicated over tp) is written once, by one of its holders chosen
// round-robin over the whole save, so the bytes spread over the ranks. Each rank spreads its pieces
// over files_per_rank files (the emptiest takes the next piece), written and hashed by as many
// threads: one SHA-256 stream per file is what bounds a rank that has the cores to itself. Pieces
// lie back to back in their file, in plan order.
std::vector<PlannedPiece> plan_pieces(const std::vector<StateTensor>& tensors,
                                      const std::vector<std::vector<int>>& holders, const dist::DeviceMesh& mesh,
                                      int files_per_rank);

// rank_RRRRR.bin, or rank_RRRRR_F.bin when each rank writes several files (file as in PlannedPiece).
std::string rank_file_name(std::size_t file, int files_per_rank);

}  // namespace meshgrad::checkpoint
