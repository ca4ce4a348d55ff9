// Checking a sharded checkpoint on disk against its manifest (`meshgrad checkpoint verify`).
#pragma once

#include <cstdint>
#include <string>

namespace meshgrad::checkpoint {

// Checks every file of the checkpoint against its size and SHA-256 and every piece against its hash.
// Throws CheckpointError naming the first bad file or tensor. Returns the bytes checked.
std::uint64_t verify_checkpoint(const std::string& dir);

}  // namespace meshgrad::checkpoint
