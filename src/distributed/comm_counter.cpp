#include "meshgrad/distributed/comm_counter.hpp"

#include "meshgrad/autograd/grad_mode.hpp"

namespace meshgrad::dist {

namespace {
thread_local CommCounter* active_counter = nullptr;
thread_local std::string active_label;
thread_local int declared_phase = -1;   // -1: derive from the autograd pass state
thread_local double blocked_seconds = 0;
}  // namespace

double comm_blocked_seconds() { return blocked_seconds; }
void reset_comm_blocked_seconds() { blocked_seconds = 0; }
void add_comm_blocked_seconds(double seconds) { blocked_seconds += seconds; }

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::Forward: return "forward";
    case Phase::Backward: return "backward";
    case Phase::Recompute: return "recompute";
    case Phase::Optimizer: return "optimizer";
  }
  return "?";
}

int CommCounter::count(Phase phase, const std::string& op, const std::string& axis) const {
  int n = 0;
  for (const auto& r : records_) {
    if (r.phase == phase && (op.empty() || r.op == op) && (axis.empty() || r.axis == axis)) ++n;
  }
  return n;
}


CountingScope::CountingScope(CommCounter& counter) : previous_(active_counter) { active_counter = &counter; }
CountingScope::~CountingScope() { active_counter = previous_; }

CommLabelScope::CommLabelScope(std::string label) : previous_(active_label) { active_label = std::move(label); }
CommLabelScope::~CommLabelScope() { active_label = previous_; }
const std::string& current_comm_label() { return active_label; }

PhaseScope::PhaseScope(Phase phase) : previous_(declared_phase) { declared_phase = static_cast<int>(phase); }
PhaseScope::~PhaseScope() { declared_phase = previous_; }

Phase current_phase() {
  if (declared_phase >= 0) return static_cast<Phase>(declared_phase);
  if (autograd::PassState::recomputing()) return Phase::Recompute;
  if (autograd::PassState::in_backward()) return Phase::Backward;
  return Phase::Forward;
}

void record_collective(const std::string& op, const std::string& axis, std::int64_t bytes, const std::string& label) {
  if (active_counter == nullptr) return;
  active_counter->record({current_phase(), op, axis, bytes, label.empty() ? active_label : label});
}

}  // namespace meshgrad::dist
