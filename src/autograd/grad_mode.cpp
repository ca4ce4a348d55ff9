#include "meshgrad/autograd/grad_mode.hpp"

namespace meshgrad::autograd {

namespace {
// Per thread: each rank thread records (or not) independently.
thread_local bool grad_enabled = true;
thread_local bool backward_running = false;
thread_local bool recompute_running = false;
}  // namespace

bool GradMode::is_enabled() { return grad_enabled; }
void GradMode::set_enabled(bool enabled) { grad_enabled = enabled; }

bool PassState::in_backward() { return backward_running; }
bool PassState::recomputing() { return recompute_running; }

BackwardPassGuard::BackwardPassGuard() : previous_(backward_running) { backward_running = true; }
BackwardPassGuard::~BackwardPassGuard() { backward_running = previous_; }
// A recomputation's own nested backward is backward again; its forward is not.
RecomputeGuard::RecomputeGuard() : previous_(recompute_running) {
  recompute_running = true;
}
RecomputeGuard::~RecomputeGuard() { recompute_running = previous_; }

}  // namespace meshgrad::autograd
