// The tracing facility (tensor/trace.hpp): nothing is recorded while no session records; spans and
// scopes land on the lane of the thread that recorded them, properly nested; scopes are interned
// per path; the output is valid Trace Event Format JSON with named lanes.
#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "meshgrad/tensor/trace.hpp"

namespace test_trace {

using namespace meshgrad;

namespace {

// The session's events as JSON objects (metadata and spans).
nlohmann::json recorded_events() {
  trace::ProcessInfo info;
  info.pid = 7;
  info.name = "test";
  info.origin = trace::session_start();
  const nlohmann::json doc = nlohmann::json::parse(trace::trace_document({trace::events_fragment(info)}));
  return doc.at("traceEvents");
}

std::vector<nlohmann::json> spans_of(const nlohmann::json& events) {
  std::vector<nlohmann::json> out;
  for (const auto& e : events) {
    if (e.at("ph") == "X") out.push_back(e);
  }
  return out;
}

std::map<int, std::string> lane_names(const nlohmann::json& events) {
  std::map<int, std::string> out;
  for (const auto& e : events) {
    if (e.at("ph") == "M" && e.at("name") == "thread_name") out[e.at("tid").get<int>()] = e.at("args").at("name");
  }
  return out;
}

// Resets the facility around each test: sessions are process-wide.
class Trace : public ::testing::Test {
 protected:
  void SetUp() override { trace::reset(); }
  void TearDown() override { trace::reset(); }
};

}  // namespace

TEST_F(Trace, DisabledRecordsNothing) {
  ASSERT_FALSE(trace::enabled());
  {
    trace::Span span("step", "step");
    span.arg("step", std::int64_t{1});
    EXPECT_FALSE(span.active());
    trace::Scope scope("layer");
    EXPECT_EQ(trace::current_scope(), nullptr) << "a scope opened while nothing records is not current";
    trace::complete(trace::this_thread_lane(), "x", "comm", trace::Clock::now(), trace::Clock::now());
  }
  // A session started afterwards holds none of it.
  trace::start();
  trace::stop();
  EXPECT_TRUE(spans_of(recorded_events()).empty());
}

TEST_F(Trace, StoppedSessionRecordsNothingMore) {
  trace::start();
  { trace::Span span("kept", "step"); }
  trace::stop();
  { trace::Span span("after", "step"); }
  const auto spans = spans_of(recorded_events());
  ASSERT_EQ(spans.size(), 1u);
  EXPECT_EQ(spans[0].at("name"), "kept");
}

TEST_F(Trace, ScopesNestAndAreInternedPerPath) {
  trace::start();
  const trace::ScopeNode* first = nullptr;
  {
    trace::Scope outer("h.0");
    trace::Scope inner("h.0.mlp");
    first = trace::current_scope();
    ASSERT_NE(first, nullptr);
    EXPECT_EQ(first->name, "h.0.mlp");
    EXPECT_EQ(first->depth, 2);
    ASSERT_NE(first->parent, nullptr);
    EXPECT_EQ(first->parent->name, "h.0");
    EXPECT_EQ(first->parent->parent, nullptr);
  }
  EXPECT_EQ(trace::current_scope(), nullptr);
  {
    trace::Scope outer("h.0");
    trace::Scope inner("h.0.mlp");
    EXPECT_EQ(trace::current_scope(), first) << "the same path is the same node";
  }
  {
    trace::Scope inner("h.0.mlp");
    EXPECT_NE(trace::current_scope(), first) << "another path is another node";
  }
  trace::stop();
  // Each scope was a forward span; inner ones inside outer ones.
  const auto spans = spans_of(recorded_events());
  ASSERT_EQ(spans.size(), 5u);
  for (const auto& s : spans) EXPECT_EQ(s.at("cat"), "forward");
}

TEST_F(Trace, EachThreadRecordsOnItsOwnNamedLaneProperlyNested) {
  trace::start();
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([r] {
      trace::name_this_thread("rank " + std::to_string(r), r * trace::kRankLaneStride);
      for (int step = 0; step < 20; ++step) {
        trace::Span s("step", "step");
        s.arg("step", std::int64_t{step});
        trace::Scope a("a");
        { trace::Scope b("b"); }
        { trace::Scope c("c"); }
      }
    });
  }
  for (auto& t : threads) t.join();
  { trace::Span unnamed("main", "step"); }   // this thread has no name: a "thread N" lane
  trace::stop();
  const nlohmann::json events = recorded_events();
  const auto names = lane_names(events);
  // Lanes are numbered in sort order: the ranks first.
  ASSERT_GE(names.size(), 4u);
  EXPECT_EQ(names.at(1), "rank 0");
  EXPECT_EQ(names.at(2), "rank 1");
  EXPECT_EQ(names.at(3), "rank 2");
  EXPECT_EQ(names.at(4).rfind("thread ", 0), 0u) << names.at(4);

  std::map<int, std::vector<nlohmann::json>> per_lane;
  for (const auto& s : spans_of(events)) per_lane[s.at("tid").get<int>()].push_back(s);
  for (int tid = 1; tid <= 3; ++tid) {
    const auto& spans = per_lane[tid];
    ASSERT_EQ(spans.size(), 20u * 4) << names.at(tid);
    // Sorted by start; every span ends before the enclosing one ends (a stack of open spans).
    std::vector<double> open_ends;
    double last_start = -1;
    for (const auto& s : spans) {
      const double ts = s.at("ts"), dur = s.at("dur");
      ASSERT_GE(dur, 0.0);
      ASSERT_GE(ts, last_start);
      last_start = ts;
      while (!open_ends.empty() && open_ends.back() <= ts + 1e-3) open_ends.pop_back();   // 1 ns: rounding
      if (!open_ends.empty()) {
        EXPECT_LE(ts + dur, open_ends.back() + 1e-3) << s.dump();
      }
      open_ends.push_back(ts + dur);
    }
  }
  // Arguments travel with their span.
  EXPECT_EQ(per_lane[1].front().at("args").at("step"), 0);
}

TEST_F(Trace, LogicalLanesAndStartForgetsTheLastSession) {
  trace::Lane lane;
  lane.set_name("rank 0 progress (tp)", 1);
  trace::start();
  const auto t = trace::Clock::now();
  trace::complete(lane.id(), "all_reduce", "comm", t, t + std::chrono::microseconds(5),
                  {{"bytes", std::int64_t{64}}, {"group", std::string("tp")}});
  trace::stop();
  auto events = recorded_events();
  auto spans = spans_of(events);
  ASSERT_EQ(spans.size(), 1u);
  EXPECT_EQ(lane_names(events).at(spans[0].at("tid").get<int>()), "rank 0 progress (tp)");
  EXPECT_EQ(spans[0].at("args").at("bytes"), 64);
  EXPECT_DOUBLE_EQ(spans[0].at("dur").get<double>(), 5.0);

  trace::start();   // a new session: the lane registers again, the old span is gone
  trace::complete(lane.id(), "barrier", "comm", trace::Clock::now(), trace::Clock::now());
  trace::stop();
  events = recorded_events();
  spans = spans_of(events);
  ASSERT_EQ(spans.size(), 1u);
  EXPECT_EQ(spans[0].at("name"), "barrier");
  EXPECT_EQ(lane_names(events).at(spans[0].at("tid").get<int>()), "rank 0 progress (tp)");
}

}  // namespace test_trace
