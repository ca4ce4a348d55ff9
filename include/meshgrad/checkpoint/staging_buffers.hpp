// The memory checkpoint saves and loads move their bytes through.
#pragma once

namespace meshgrad::checkpoint {

// Saves and loads stage O_DIRECT transfers through 8 MiB aligned buffers that the process keeps for
// the next save or load (up to 64 MiB): memory a process touches for the first time is slow on
// some hosts. This frees them (a job that saved its last checkpoint, or a benchmark that wants the
// cost of a new process).
void release_staging_buffers();

}  // namespace meshgrad::checkpoint
