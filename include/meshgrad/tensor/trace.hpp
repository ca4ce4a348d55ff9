// Tracing: timed spans of what every rank and every communicator did, for a Chrome trace (Trace
// Event Format JSON: chrome://tracing, https://ui.perfetto.dev, `meshgrad trace-summary`).
//
// It sits in the lowest layer so that every layer records into the same trace:
//   comm/      each collective from launch to completion, on its communicator's progress lane,
//              and each time a rank blocks on Work::wait (a "wait" span on the rank's lane);
//   autograd/  "backward", split into one span per layer by the scope each node was recorded in;
//   nn/        each layer's forward (Scope);
//   train/     step, forward, gradient sync, optimizer, evaluation; and the file itself
//              (train/trace_file.hpp: atomic write, one file for all processes of an MPI run).
//
// Lanes (Chrome "tid"s) are named: a thread that runs a rank names itself ("rank 0", run_ranks and
// MpiSession do it), a communicator names the lane of its operations after the rank that created it
// ("rank 0 progress (tp)"); any other thread that records gets "thread N".
//
// Cost: while no session records (the default), every call below is one relaxed atomic load and a
// branch, and records nothing. While recording, an event is a few hundred nanoseconds appended to a
// buffer of the recording thread (its own lock, never contended but by the final collection), about
// 200 bytes of memory each until the session is written. A session keeps at most kMaxEvents events
// (a GPT step records about 30 per layer and rank); later ones are counted (dropped_events()) and
// lost.
//
// Thread safety: every function may be called from any thread. start() / stop() are meant for the
// program around the ranks (before they start, after they finished): events recorded while a new
// session starts may land in either session.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace meshgrad::trace {

using Clock = std::chrono::steady_clock;

namespace detail {
inline std::atomic<bool> recording{false};
}  // namespace detail

// Whether a session records now. One relaxed load: check it before building anything to record.
inline bool enabled() { return detail::recording.load(std::memory_order_relaxed); }

// Starts a new session: forgets every event, lane and count of the previous one, and records.
void start();
// Stops recording; what was recorded stays until the next start() or reset().
void stop();
// Stops recording and forgets what was recorded.
void reset();
// When the current (or last) session started: timestamps are written relative to it.
Clock::time_point session_start();
// The most events one session keeps, and how many it lost beyond that.
inline constexpr std::size_t kMaxEvents = std::size_t(1) << 21;
std::uint64_t dropped_events();

// The CPU time this thread has used (CLOCK_THREAD_CPUTIME_ID). Next to the wall time it tells how
// long a thread was off the CPU (descheduled, or asleep) in between.
Clock::duration thread_cpu_time();

// ---- lanes ------------------------------------------------------------------------------------------

// Lanes are listed by sort index, then name. Rank r's lane sorts at r * kRankLaneStride; the lanes of
// its communicators just after it. A name is one lane per session: threads that take the same name
// one after the other (the ranks of two run_ranks calls) share it.
inline constexpr int kRankLaneStride = 16;

// Names the lane of this thread's events (the current and later sessions): "rank 3", sort index 48.
// Cheap; may be called whether or not a session records.
void name_this_thread(std::string name, int sort_index);
// This thread's lane name and sort index ("thread N" and a large index when never named).
std::pair<std::string, int> this_thread_lane_name();
// This thread's lane id in the current session (registers it on first use).
int this_thread_lane();

// A lane that is not a thread: a communicator's operations, which run on its progress thread or on
// the calling thread, one at a time. Name it before its first id().
class Lane {
 public:
  Lane() = default;
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;
  void set_name(std::string name, int sort_index);
  bool named() const;
  // Its id in the current session (registers it on first use).
  int id();

 private:
  mutable std::mutex m_;
  std::string name_;
  int sort_index_ = 0;
  std::uint64_t session_ = 0;
  int id_ = 0;
};

// ---- events -----------------------------------------------------------------------------------------

using ArgValue = std::variant<std::int64_t, double, std::string>;
struct Arg {
  std::string key;
  ArgValue value;
};
using Args = std::vector<Arg>;

// A complete span ("X" event) [begin, end] on lane. Nothing when no session records.
void complete(int lane, std::string_view name, std::string_view category, Clock::time_point begin,
              Clock::time_point end, Args args = {});

// A span on this thread's lane over the lifetime of the object (also when left by an exception).
//   trace::Span span("optimizer", "optimizer");
class Span {
 public:
  Span(std::string_view name, std::string_view category) {
    if (enabled()) begin(name, category);
  }
  ~Span() {
    if (active_) end();
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;
  bool active() const { return active_; }
  // Adds an argument (shown with the span); nothing when inactive.
  void arg(std::string key, ArgValue value) {
    if (active_) args_.push_back({std::move(key), std::move(value)});
  }

 private:
  void begin(std::string_view name, std::string_view category);
  void end();
  bool active_ = false;
  Clock::time_point begin_;
  std::string name_, category_;
  Args args_;
};

// ---- scopes: the layer a piece of work belongs to ---------------------------------------------------

// A node of the tree of scope names (interned: one per path, never freed, shared by all threads).
// Scope names should be few and fixed (layer names), not per step.
struct ScopeNode {
  std::string name;
  const ScopeNode* parent = nullptr;
  int depth = 0;  // 1 for a scope opened outside any other
};

// The innermost Scope open on this thread (nullptr: none, or no session recording when it opened).
// The autograd engine keeps it with every node it records, and draws each node's backward inside
// spans of the same names, so a layer has a forward span and a backward span.
const ScopeNode* current_scope();

// A forward span of a layer on this thread's lane that is also the current scope while it lives:
//   trace::Scope scope(name_);   // "h.0.mlp.c_fc"
class Scope {
 public:
  explicit Scope(std::string_view name, std::string_view category = "forward") {
    if (enabled()) open(name, category);
  }
  ~Scope() {
    if (node_ != nullptr) close();
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  void open(std::string_view name, std::string_view category);
  void close();
  const ScopeNode* node_ = nullptr;
  const ScopeNode* previous_ = nullptr;
  std::string_view category_;
  Clock::time_point begin_;
};

// ---- output -----------------------------------------------------------------------------------------

struct ProcessInfo {
  std::int64_t pid = 0;          // the "pid" of this process's events
  std::string name;              // its "process_name" ("meshgrad (threads backend)")
  int sort_index = 0;            // its "process_sort_index" (the MPI rank)
  Clock::time_point origin;      // timestamp 0 (this process's clock)
};

// Everything this process recorded in the current session, as Trace Event Format objects separated
// by commas and without the enclosing brackets (so fragments of several processes join with ","):
// "M" metadata naming the process and each lane (thread_name, thread_sort_index), then the "X"
// spans, sorted by lane, start time and longest first. ts and dur are microseconds (fractional).
std::string events_fragment(const ProcessInfo& process);

// A whole trace file from fragments: {"traceEvents": [...], "displayTimeUnit": "ms",
// "otherData": {key: value, ...}}.
std::string trace_document(const std::vector<std::string>& fragments,
                           const std::vector<std::pair<std::string, std::string>>& other_data = {});

}  // namespace meshgrad::trace
