// Ranks agreeing on a failure before any of them waits on the others. A rank that fails alone while
// the others go on to their next collective leaves them waiting for the communication deadline (5
// minutes by default, 30 for a checkpoint's exchange); a step that can fail on one rank only (reading
// a file, allocating a buffer) ends with this instead, so every rank fails together and says why.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "meshgrad/comm/communicator.hpp"

namespace meshgrad::comm {

struct RankFailure {
  int rank = 0;            // the lowest rank that failed
  std::string message;     // its error message (at most 4096 bytes of it)
};

// Collective over comm (every rank calls it, in the same order relative to its other collectives):
// `error` is this rank's error message, "" when it succeeded. Returns the failure of the lowest rank
// that failed, the same on every rank, or nothing when none failed. Costs one one-word all-reduce
// when nothing failed, and a broadcast of the message when something did.
std::optional<RankFailure> first_failure(Communicator& comm, const std::string& error,
                                         const CollectiveOptions& opt = {});

// Runs step on this rank, then agrees over comm (collective, as first_failure) on whether any rank's
// step threw. Returns when none did. Otherwise the rank whose step threw rethrows its own exception
// (its type kept), and every other rank throws the first failed rank's message, as an
// InvalidArgument when that was one (bad input), else as an Error. step must not communicate over
// comm (a rank that throws early would leave the others in that collective).
void run_agreed(Communicator& comm, const std::function<void()>& step, const CollectiveOptions& opt = {});

}  // namespace meshgrad::comm
