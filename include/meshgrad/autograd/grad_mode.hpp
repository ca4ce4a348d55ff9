// Whether ops record a graph. Per thread: every rank thread of the threads backend has its own.
#pragma once

namespace meshgrad::autograd {

class GradMode {
 public:
  static bool is_enabled();
  static void set_enabled(bool enabled);
};

// Disables recording for its scope (restores the previous mode on exit).
class NoGradGuard {
 public:
  NoGradGuard() : previous_(GradMode::is_enabled()) { GradMode::set_enabled(false); }
  ~NoGradGuard() { GradMode::set_enabled(previous_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

// Enables recording for its scope (used when checkpointing recomputes a forward inside backward).
class EnableGradGuard {
 public:
  EnableGradGuard() : previous_(GradMode::is_enabled()) { GradMode::set_enabled(true); }
  ~EnableGradGuard() { GradMode::set_enabled(previous_); }
  EnableGradGuard(const EnableGradGuard&) = delete;
  EnableGradGuard& operator=(const EnableGradGuard&) = delete;

 private:
  bool previous_;
};

// Where this thread is in a training step, for tools that attribute work to phases (distributed/'s
// communication counter): inside the engine's backward pass, and inside a checkpoint's
// recomputation of a forward (which runs during backward). Per thread.
class PassState {
 public:
  static bool in_backward();
  static bool recomputing();
};

// Set by the engine for the duration of a backward pass.
class BackwardPassGuard {
 public:
  BackwardPassGuard();
  ~BackwardPassGuard();
  BackwardPassGuard(const BackwardPassGuard&) = delete;
  BackwardPassGuard& operator=(const BackwardPassGuard&) = delete;

 private:
  bool previous_;
};

// Set by checkpoint() while it recomputes a forward.
class RecomputeGuard {
 public:
  RecomputeGuard();
  ~RecomputeGuard();
  RecomputeGuard(const RecomputeGuard&) = delete;
  RecomputeGuard& operator=(const RecomputeGuard&) = delete;

 private:
  bool previous_;
};

}  // namespace meshgrad::autograd
