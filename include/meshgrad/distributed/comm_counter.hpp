// Counting communication: every collective that dist/ issues is recorded, per rank, with the
// phase it ran in, the op, the mesh axis, the bytes and the label of the layer that issued it.
// Tests assert exact counts per phase (as PyTorch's CommDebugMode tests do) and `meshgrad explain`
// prints what a model's graph actually did, so neither can drift from the code.
//
// The phase is found, not declared: forward unless the autograd engine is running a backward pass
// on this thread (backward) or a checkpoint is recomputing a forward (recompute); an optimizer
// step declares itself with PhaseScope(Phase::Optimizer).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace meshgrad::dist {

enum class Phase { Forward, Backward, Recompute, Optimizer };
const char* phase_name(Phase phase);

struct CollectiveRecord {
  Phase phase;
  std::string op;      // "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"
  std::string axis;    // mesh axis name ("tp", "dp", ...)
  std::int64_t bytes;  // nccl-tests convention: the whole (gathered / unreduced) buffer
  std::string label;   // the layer that issued it ("h.0.mlp.c_fc"), "" when none was set
};

class CommCounter {
 public:
  void record(CollectiveRecord record) { records_.push_back(std::move(record)); }
  const std::vector<CollectiveRecord>& records() const { return records_; }
  // Number of records matching phase (and op / axis when not empty).
  int count(Phase phase, const std::string& op = "", const std::string& axis = "") const;
  void clear() { records_.clear(); }

 private:
  std::vector<CollectiveRecord> records_;
};

// Makes counter the active one of this thread (rank) for its scope; scopes nest.
class CountingScope {
 public:
  explicit CountingScope(CommCounter& counter);
  ~CountingScope();
  CountingScope(const CountingScope&) = delete;
  CountingScope& operator=(const CountingScope&) = delete;

 private:
  CommCounter* previous_;
};

// Labels the collectives issued in its scope (and the backward of ops recorded in it).
class CommLabelScope {
 public:
  explicit CommLabelScope(std::string label);
  ~CommLabelScope();
  CommLabelScope(const CommLabelScope&) = delete;
  CommLabelScope& operator=(const CommLabelScope&) = delete;

 private:
  std::string previous_;
};
const std::string& current_comm_label();

// Declares the phase for its scope (used by optimizers: Phase::Optimizer).
class PhaseScope {
 public:
  explicit PhaseScope(Phase phase);
  ~PhaseScope();
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  int previous_;
};

// The phase this thread is in now.
Phase current_phase();

// Records into the active counter, if any (a no-op otherwise). label "" = current_comm_label().
void record_collective(const std::string& op, const std::string& axis, std::int64_t bytes,
                       const std::string& label = "");

// Wall time this thread (rank) spent blocked waiting for dist/ collectives to finish, since the
// last reset. With overlap, communication that finished while the rank computed costs nothing
// here: benchmarks compare it with the same step run without overlap to tell what was hidden.
double comm_blocked_seconds();
void reset_comm_blocked_seconds();
void add_comm_blocked_seconds(double seconds);

}  // namespace meshgrad::dist
