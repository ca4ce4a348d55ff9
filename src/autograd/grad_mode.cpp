#include "meshgrad/autograd/grad_mode.hpp"

namespace meshgrad::autograd {

namespace {
// Per thread: each rank thread records (or not) independently.
thread_local bool grad_enabled = true;
}  // namespace

bool GradMode::is_enabled() { return grad_enabled; }
void GradMode::set_enabled(bool enabled) { grad_enabled = enabled; }

}  // namespace meshgrad::autograd
