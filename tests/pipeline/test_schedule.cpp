// The pipeline schedules (pipeline/schedule.hpp): each is a valid order (every micro-batch's forward
// once, its backward once after it, backwards in micro-batch order), 1F1B keeps at most p - s
// micro-batches in flight on stage s where GPipe keeps m, and played on unit costs both idle
// exactly the textbook bubble (p - 1) / (m + p - 1).
#include <gtest/gtest.h>

#include <set>

#include "meshgrad/pipeline/schedule.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad::pipeline::test_schedule {
namespace {

using K = Action::Kind;

TEST(Schedule, EveryStageRunsEachForwardThenItsBackwardInMicroBatchOrder) {
  for (ScheduleKind kind : {ScheduleKind::GPipe, ScheduleKind::OneFOneB}) {
    for (int p : {1, 2, 3, 4}) {
      for (int m : {1, 2, 4, 7, 8}) {
        for (int s = 0; s < p; ++s) {
          SCOPED_TRACE(fmt::format("{} p={} m={} s={}", schedule_name(kind), p, m, s));
          const std::vector<Action> actions = stage_actions(kind, p, s, m);
          ASSERT_EQ(actions.size(), static_cast<std::size_t>(2 * m));
          std::set<int> forwarded;
          int next_backward = 0;
          for (const Action& a : actions) {
            if (a.kind == K::Forward) {
              EXPECT_TRUE(forwarded.insert(a.micro).second) << "forward " << a.micro << " twice";
            } else {
              EXPECT_EQ(a.micro, next_backward++) << "backwards must run in micro-batch order";
              EXPECT_TRUE(forwarded.count(a.micro)) << "backward " << a.micro << " before its forward";
            }
          }
          EXPECT_EQ(next_backward, m);
        }
      }
    }
  }
}

TEST(Schedule, OneFOneBWarmsUpThenAlternates) {
  // Stage 0 of 4 with 6 micro-batches: 3 warm-up forwards, then F B pairs, then the last backwards.
  const std::vector<Action> a = stage_actions(ScheduleKind::OneFOneB, 4, 0, 6);
  const std::vector<Action> expected = {{K::Forward, 0}, {K::Forward, 1}, {K::Forward, 2}, {K::Forward, 3},
                                        {K::Backward, 0}, {K::Forward, 4}, {K::Backward, 1}, {K::Forward, 5},
                                        {K::Backward, 2}, {K::Backward, 3}, {K::Backward, 4}, {K::Backward, 5}};
  EXPECT_EQ(a, expected);
  // The last stage has no warm-up: F0 B0 F1 B1 ...
  const std::vector<Action> last = stage_actions(ScheduleKind::OneFOneB, 4, 3, 2);
  EXPECT_EQ(last, (std::vector<Action>{{K::Forward, 0}, {K::Backward, 0}, {K::Forward, 1}, {K::Backward, 1}}));
}

TEST(Schedule, OneFOneBHoldsAtMostStagesMinusIndexMicroBatchesGPipeHoldsAll) {
  for (int p : {2, 4}) {
    for (int m : {1, 4, 8}) {
      for (int s = 0; s < p; ++s) {
        EXPECT_EQ(peak_in_flight(stage_actions(ScheduleKind::GPipe, p, s, m)), m);
        EXPECT_EQ(peak_in_flight(stage_actions(ScheduleKind::OneFOneB, p, s, m)), std::min(p - s, m))
            << "p=" << p << " m=" << m << " s=" << s;
      }
    }
  }
}

TEST(Schedule, UnitCostBubbleIsTheTextbookFraction) {
  for (ScheduleKind kind : {ScheduleKind::GPipe, ScheduleKind::OneFOneB}) {
    for (int p : {2, 4}) {
      for (int m : {1, 4, 8}) {
        // Forward 1, backward 2: each stage computes 3m and the step takes 3(m + p - 1).
        const Timeline t = simulate(kind, p, m, 1.0, 2.0);
        EXPECT_DOUBLE_EQ(t.makespan, 3.0 * (m + p - 1)) << schedule_name(kind) << " p=" << p << " m=" << m;
        for (int s = 0; s < p; ++s) EXPECT_NEAR(t.idle_fraction[static_cast<std::size_t>(s)], ideal_bubble(p, m), 1e-12);
      }
    }
  }
  EXPECT_DOUBLE_EQ(ideal_bubble(4, 8), 3.0 / 11.0);
  EXPECT_DOUBLE_EQ(ideal_bubble(1, 8), 0.0);
}

TEST(Schedule, NamesParseAndBadOnesAreRefusedNamingTheChoices) {
  EXPECT_EQ(parse_schedule("gpipe"), ScheduleKind::GPipe);
  EXPECT_EQ(parse_schedule("1f1b"), ScheduleKind::OneFOneB);
  try {
    parse_schedule("1F1B");
    FAIL() << "accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("gpipe and 1f1b"), std::string::npos) << e.what();
  }
  EXPECT_THROW(stage_actions(ScheduleKind::GPipe, 2, 2, 4), InvalidArgument);
  EXPECT_THROW(stage_actions(ScheduleKind::GPipe, 2, 0, 0), InvalidArgument);
}

}  // namespace
}  // namespace meshgrad::pipeline::test_schedule
