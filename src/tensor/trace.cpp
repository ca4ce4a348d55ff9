#include "meshgrad/tensor/trace.hpp"

#include <fmt/format.h>
#include <time.h>

#include <algorithm>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <tuple>

namespace meshgrad::trace {
namespace {

struct Event {
  int lane = 0;
  Clock::time_point begin;
  Clock::duration dur{};
  std::string name, category;
  Args args;
};

// One per recording thread and session: only its thread appends, the collection reads it.
struct ThreadBuffer {
  std::mutex m;
  std::vector<Event> events;
};

struct LaneInfo {
  std::string name;
  int sort_index = 0;
};

// Orders (parent, name) keys; looks up with a string_view name without building a string.
struct ScopeLess {
  using is_transparent = void;
  template <class A, class B>
  bool operator()(const A& a, const B& b) const {
    if (a.first != b.first) return std::less<const ScopeNode*>()(a.first, b.first);
    return std::string_view(a.second) < std::string_view(b.second);
  }
};

struct State {
  std::mutex m;                               // guards everything below but the atomics
  std::atomic<std::uint64_t> session{0};      // 0: never started; written under m
  Clock::time_point start = Clock::now();
  std::vector<LaneInfo> lanes;                // lane id = index + 1
  std::vector<std::shared_ptr<ThreadBuffer>> buffers;
  std::atomic<std::size_t> events{0};
  std::atomic<std::uint64_t> dropped{0};
  std::atomic<int> unnamed_threads{0};

  std::mutex scope_m;
  std::map<std::pair<const ScopeNode*, std::string>, std::unique_ptr<ScopeNode>, ScopeLess> scopes;
};

// Never destroyed: a thread may still record while the program exits.
State& state() {
  static State* s = new State;
  return *s;
}

struct ThreadState {
  std::shared_ptr<ThreadBuffer> buffer;
  std::uint64_t buffer_session = 0;
  std::string lane_name;
  int lane_sort = 0;
  bool named = false;
  std::uint64_t lane_session = 0;
  int lane_id = 0;
  const ScopeNode* scope = nullptr;
};
thread_local ThreadState tl;

// The id of lane `name` in the current session, registering it if new; returns (session, id). A
// name is one lane: the rank threads of two run_ranks calls in one session share "rank 0".
std::pair<std::uint64_t, int> register_lane(const std::string& name, int sort_index) {
  State& s = state();
  std::lock_guard lock(s.m);
  const std::uint64_t session = s.session.load(std::memory_order_relaxed);
  for (std::size_t i = 0; i < s.lanes.size(); ++i) {
    if (s.lanes[i].name == name) return {session, static_cast<int>(i) + 1};
  }
  s.lanes.push_back({name, sort_index});
  return {session, static_cast<int>(s.lanes.size())};
}

void append(Event e) {
  State& s = state();
  if (s.events.fetch_add(1, std::memory_order_relaxed) >= kMaxEvents) {
    s.dropped.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  if (!tl.buffer || tl.buffer_session != s.session.load(std::memory_order_acquire)) {
    auto fresh = std::make_shared<ThreadBuffer>();
    std::lock_guard lock(s.m);
    s.buffers.push_back(fresh);
    tl.buffer_session = s.session.load(std::memory_order_relaxed);
    tl.buffer = std::move(fresh);
  }
  std::lock_guard lock(tl.buffer->m);
  tl.buffer->events.push_back(std::move(e));
}

// The node of (parent, name): from this thread's cache, else from the process-wide tree (nodes are
// never freed, so cached pointers stay valid).
const ScopeNode* intern(const ScopeNode* parent, std::string_view name) {
  thread_local std::map<std::pair<const ScopeNode*, std::string>, const ScopeNode*, ScopeLess> cache;
  const auto key = std::pair<const ScopeNode*, std::string_view>(parent, name);
  if (auto hit = cache.find(key); hit != cache.end()) return hit->second;
  State& s = state();
  const ScopeNode* node = nullptr;
  {
    std::lock_guard lock(s.scope_m);
    auto it = s.scopes.find(key);
    if (it == s.scopes.end()) {
      auto fresh = std::make_unique<ScopeNode>(ScopeNode{std::string(name), parent, parent ? parent->depth + 1 : 1});
      it = s.scopes.emplace(std::pair<const ScopeNode*, std::string>(parent, std::string(name)), std::move(fresh)).first;
    }
    node = it->second.get();
  }
  cache.emplace(std::pair<const ScopeNode*, std::string>(parent, std::string(name)), node);
  return node;
}

nlohmann::json arg_json(const ArgValue& v) {
  return std::visit([](const auto& x) { return nlohmann::json(x); }, v);
}

double micros(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

}  // namespace

void start() {
  State& s = state();
  {
    std::lock_guard lock(s.m);
    s.session.store(s.session.load(std::memory_order_relaxed) + 1, std::memory_order_release);
    s.start = Clock::now();
    s.lanes.clear();
    s.buffers.clear();
    s.events.store(0);
    s.dropped.store(0);
  }
  detail::recording.store(true, std::memory_order_relaxed);
}

void stop() { detail::recording.store(false, std::memory_order_relaxed); }

void reset() {
  stop();
  State& s = state();
  std::lock_guard lock(s.m);
  s.session.store(s.session.load(std::memory_order_relaxed) + 1, std::memory_order_release);
  s.lanes.clear();
  s.buffers.clear();
  s.events.store(0);
  s.dropped.store(0);
}

Clock::time_point session_start() {
  State& s = state();
  std::lock_guard lock(s.m);
  return s.start;
}

std::uint64_t dropped_events() { return state().dropped.load(std::memory_order_relaxed); }

Clock::duration thread_cpu_time() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return std::chrono::duration_cast<Clock::duration>(std::chrono::seconds(ts.tv_sec) +
                                                     std::chrono::nanoseconds(ts.tv_nsec));
}

void name_this_thread(std::string name, int sort_index) {
  tl.lane_name = std::move(name);
  tl.lane_sort = sort_index;
  tl.named = true;
  tl.lane_session = 0;   // a lane of the new name from the next event on
  tl.lane_id = 0;
}

std::pair<std::string, int> this_thread_lane_name() {
  if (!tl.named) {
    const int n = ++state().unnamed_threads;
    tl.lane_name = fmt::format("thread {}", n);
    tl.lane_sort = (1 << 30) + n;
    tl.named = true;
  }
  return {tl.lane_name, tl.lane_sort};
}

int this_thread_lane() {
  if (tl.lane_id == 0 || tl.lane_session != state().session.load(std::memory_order_acquire)) {
    const auto [name, sort] = this_thread_lane_name();
    std::tie(tl.lane_session, tl.lane_id) = register_lane(name, sort);
  }
  return tl.lane_id;
}

void Lane::set_name(std::string name, int sort_index) {
  std::lock_guard lock(m_);
  name_ = std::move(name);
  sort_index_ = sort_index;
  id_ = 0;
}

bool Lane::named() const {
  std::lock_guard lock(m_);
  return !name_.empty();
}

int Lane::id() {
  std::lock_guard lock(m_);
  if (id_ == 0 || session_ != state().session.load(std::memory_order_acquire)) {
    std::tie(session_, id_) = register_lane(name_.empty() ? std::string("lane") : name_, sort_index_);
  }
  return id_;
}

void complete(int lane, std::string_view name, std::string_view category, Clock::time_point begin,
              Clock::time_point end, Args args) {
  if (!enabled()) return;
  append(Event{lane, begin, std::max(end - begin, Clock::duration::zero()), std::string(name), std::string(category),
               std::move(args)});
}

void Span::begin(std::string_view name, std::string_view category) {
  active_ = true;
  name_ = name;
  category_ = category;
  begin_ = Clock::now();
}

void Span::end() { complete(this_thread_lane(), name_, category_, begin_, Clock::now(), std::move(args_)); }

const ScopeNode* current_scope() { return tl.scope; }

void Scope::open(std::string_view name, std::string_view category) {
  previous_ = tl.scope;
  node_ = intern(previous_, name);
  category_ = category;
  tl.scope = node_;
  begin_ = Clock::now();
}

void Scope::close() {
  const Clock::time_point end = Clock::now();
  tl.scope = previous_;
  complete(this_thread_lane(), node_->name, category_, begin_, end);
}

std::string events_fragment(const ProcessInfo& process) {
  State& s = state();
  std::vector<LaneInfo> lanes;
  std::vector<std::shared_ptr<ThreadBuffer>> buffers;
  {
    std::lock_guard lock(s.m);
    lanes = s.lanes;
    buffers = s.buffers;
  }
  std::vector<Event> events;
  for (const auto& b : buffers) {
    std::lock_guard lock(b->m);
    events.insert(events.end(), b->events.begin(), b->events.end());
  }
  // A lane id from before the session started (a race with start()) names no lane: dropped.
  std::erase_if(events, [&](const Event& e) { return e.lane < 1 || e.lane > static_cast<int>(lanes.size()); });
  // Lanes are numbered in the order they are listed (sort index, name): tid 1 is rank 0's, whichever
  // thread recorded first.
  std::vector<int> order(lanes.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    return std::tie(lanes[a].sort_index, lanes[a].name) < std::tie(lanes[b].sort_index, lanes[b].name);
  });
  std::vector<int> tid_of(lanes.size() + 1);
  for (std::size_t k = 0; k < order.size(); ++k) {
    tid_of[static_cast<std::size_t>(order[k]) + 1] = static_cast<int>(k) + 1;
  }
  for (Event& e : events) e.lane = tid_of[static_cast<std::size_t>(e.lane)];
  std::sort(events.begin(), events.end(), [](const Event& a, const Event& b) {
    return std::tie(a.lane, a.begin) < std::tie(b.lane, b.begin) ||
           (a.lane == b.lane && a.begin == b.begin && a.dur > b.dur);
  });

  std::string out;
  auto add = [&](const nlohmann::json& object) {
    if (!out.empty()) out += ",\n";
    out += object.dump();
  };
  const std::int64_t pid = process.pid;
  add({{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"tid", 0}, {"args", {{"name", process.name}}}});
  add({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", pid}, {"tid", 0},
       {"args", {{"sort_index", process.sort_index}}}});
  for (std::size_t k = 0; k < order.size(); ++k) {
    const int tid = static_cast<int>(k) + 1;
    const LaneInfo& lane = lanes[static_cast<std::size_t>(order[k])];
    add({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", tid}, {"args", {{"name", lane.name}}}});
    add({{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", pid}, {"tid", tid},
         {"args", {{"sort_index", lane.sort_index}}}});
  }
  for (const Event& e : events) {
    nlohmann::json object{{"name", e.name},          {"cat", e.category}, {"ph", "X"},
                          {"pid", pid},              {"tid", e.lane},     {"ts", micros(e.begin - process.origin)},
                          {"dur", micros(e.dur)}};
    if (!e.args.empty()) {
      nlohmann::json args = nlohmann::json::object();
      for (const Arg& a : e.args) args[a.key] = arg_json(a.value);
      object["args"] = std::move(args);
    }
    add(object);
  }
  return out;
}

std::string trace_document(const std::vector<std::string>& fragments,
                           const std::vector<std::pair<std::string, std::string>>& other_data) {
  nlohmann::json other = nlohmann::json::object();
  for (const auto& [key, value] : other_data) other[key] = value;
  std::string out = "{\"displayTimeUnit\": \"ms\", \"otherData\": " + other.dump() + ",\n\"traceEvents\": [\n";
  bool first = true;
  for (const std::string& f : fragments) {
    if (f.empty()) continue;
    if (!first) out += ",\n";
    out += f;
    first = false;
  }
  out += "\n]}\n";
  return out;
}

}  // namespace meshgrad::trace
