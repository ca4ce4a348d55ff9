// Internal to the checkpoint layer: its errors are CheckpointError. The file operations of io/ throw
// io::FileIoError, whose sentence ("fsync of 'P' failed: ...") a checkpoint error repeats after
// "checkpoint: ".
#pragma once

#include <fmt/format.h>

#include <utility>

#include "meshgrad/checkpoint/manifest.hpp"
#include "meshgrad/io/file_io.hpp"

namespace meshgrad::checkpoint {

// Returns fn(); an io::FileIoError it throws becomes the CheckpointError "checkpoint: <its message>".
template <class Fn>
decltype(auto) as_checkpoint_error(Fn&& fn) {
  try {
    return std::forward<Fn>(fn)();
  } catch (const io::FileIoError& e) {
    throw CheckpointError(fmt::format("checkpoint: {}", e.what()));
  }
}

}  // namespace meshgrad::checkpoint
