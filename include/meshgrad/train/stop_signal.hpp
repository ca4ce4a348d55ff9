// Preemption: SIGTERM (a scheduler's notice) or SIGINT (Ctrl-C) asks a training run to stop after the
// current step and write a checkpoint; a second SIGINT aborts at once (the default action). While a
// StopSignalScope lives the process handles both signals this way; the previous handlers come back
// when the last scope ends (rank threads each hold one).
#pragma once

namespace meshgrad::train {

class StopSignalScope {
 public:
  StopSignalScope();
  ~StopSignalScope();
  StopSignalScope(const StopSignalScope&) = delete;
  StopSignalScope& operator=(const StopSignalScope&) = delete;
};

// The signal that asked this process to stop (SIGTERM or SIGINT), or 0. Ranks must agree on it before
// acting (a signal may land between two ranks' checks): the trainer reduces it over the mesh.
int stop_requested();
// Forgets a request (tests; a run that handled it).
void clear_stop_request();

}  // namespace meshgrad::train
