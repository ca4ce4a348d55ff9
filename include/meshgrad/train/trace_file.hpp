// `--trace FILE.json`: a Chrome trace (Trace Event Format) of a run, recorded by tensor/trace.hpp and
// written once, atomically (AtomicFileWriter), when the run finished. Open it in chrome://tracing or
// https://ui.perfetto.dev, draw it with `meshgrad trace-svg`, sum it up with `meshgrad trace-summary`.
//
// One file per run, whatever the backend:
//  - threads: the ranks are threads of this process: one "pid" (the OS pid) with a lane per rank
//    ("rank 0") and per communicator a rank used ("rank 0 progress (tp)");
//  - mpi: each process records its own rank; at the end the processes send their events to world
//    rank 0, which writes the file: one pid per process (its OS pid; sorted by rank, named
//    "rank R (pid P on HOST)"). The processes' clocks are aligned at a barrier at the end (each
//    reads its clock as it leaves the barrier and takes those readings as the same instant), so
//    spans of different processes line up to within the barrier's exit skew (microseconds on one
//    machine, more across a network).
// Timestamps start at 0 = when the recording started (the earliest process under mpi).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "meshgrad/comm/communicator.hpp"

namespace meshgrad::train {

class TraceRecorder {
 public:
  // path "" = no trace: every call below does nothing. Otherwise checks that path can be written
  // (check_output_paths: InvalidArgument naming `option` and the path), then starts recording
  // (trace::start). about: written into the file's "otherData" (command line, version ...).
  // announce: say on stderr where the trace went.
  TraceRecorder(std::string path, std::string option = "--trace",
                std::vector<std::pair<std::string, std::string>> about = {}, bool announce = true);
  // Stops recording and frees the events (an error before finish: no file).
  ~TraceRecorder();
  TraceRecorder(const TraceRecorder&) = delete;
  TraceRecorder& operator=(const TraceRecorder&) = delete;

  bool active() const { return !path_.empty(); }

  // Called on every rank after its work, while its communicators live. Under a backend with one
  // process per rank (world.backend() != "threads") this is collective over world: the processes
  // gather their events to world rank 0, which writes the file. Under threads it does nothing
  // (finish() writes).
  void finish_rank(comm::Communicator& world);
  // Called once after every rank returned: writes the file when this process holds the whole run
  // (threads backend). Does nothing after finish_rank wrote (or sent) it.
  void finish();

 private:
  void write(const std::string& text) const;
  std::string path_;
  std::vector<std::pair<std::string, std::string>> about_;
  bool announce_ = true;
  bool done_ = false;   // finish_rank handled the file (mpi)
};

}  // namespace meshgrad::train
