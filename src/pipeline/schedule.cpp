// Pipeline schedules (contracts in include/meshgrad/pipeline/schedule.hpp).
#include "meshgrad/pipeline/schedule.hpp"

#include <algorithm>
#include <limits>

#include "meshgrad/tensor/error.hpp"

namespace meshgrad::pipeline {

ScheduleKind parse_schedule(const std::string& name) {
  if (name == "gpipe") return ScheduleKind::GPipe;
  if (name == "1f1b") return ScheduleKind::OneFOneB;
  throw InvalidArgument(fmt::format("--pp-schedule '{}': the schedules are gpipe and 1f1b", name));
}

const char* schedule_name(ScheduleKind kind) { return kind == ScheduleKind::GPipe ? "gpipe" : "1f1b"; }

std::vector<Action> stage_actions(ScheduleKind kind, int stages, int stage, int micro_batches) {
  MG_CHECK(stages >= 1 && stage >= 0 && stage < stages && micro_batches >= 1,
           "pipeline schedule: stage {} of {} with {} micro-batches is not a schedule", stage, stages, micro_batches);
  using K = Action::Kind;
  std::vector<Action> out;
  out.reserve(static_cast<std::size_t>(2 * micro_batches));
  if (kind == ScheduleKind::GPipe) {
    for (int m = 0; m < micro_batches; ++m) out.push_back({K::Forward, m});
    for (int m = 0; m < micro_batches; ++m) out.push_back({K::Backward, m});
    return out;
  }
  const int warmup = std::min(stages - stage - 1, micro_batches);
  int next_forward = 0, next_backward = 0;
  for (; next_forward < warmup; ++next_forward) out.push_back({K::Forward, next_forward});
  while (next_forward < micro_batches) {
    out.push_back({K::Forward, next_forward++});
    out.push_back({K::Backward, next_backward++});
  }
  while (next_backward < micro_batches) out.push_back({K::Backward, next_backward++});
  return out;
}

int peak_in_flight(const std::vector<Action>& actions) {
  int live = 0, peak = 0;
  for (const Action& a : actions) {
    live += a.kind == Action::Kind::Forward ? 1 : -1;
    peak = std::max(peak, live);
  }
  return peak;
}

Timeline simulate(ScheduleKind kind, int stages, int micro_batches, double forward_cost, double backward_cost) {
  constexpr double kNotYet = std::numeric_limits<double>::infinity();
  const auto p = static_cast<std::size_t>(stages);
  const auto m = static_cast<std::size_t>(micro_batches);
  std::vector<std::vector<Action>> actions(p);
  for (int s = 0; s < stages; ++s) actions[static_cast<std::size_t>(s)] = stage_actions(kind, stages, s, micro_batches);
  // When each stage's forward / backward of each micro-batch finished (infinity: not yet).
  std::vector<std::vector<double>> fwd_done(p, std::vector<double>(m, kNotYet)), bwd_done = fwd_done;
  std::vector<std::size_t> next(p, 0);
  std::vector<double> free_at(p, 0.0);
  Timeline t;
  t.busy.assign(p, 0.0);
  t.starts.assign(p, {});
  std::size_t remaining = 2 * p * m;
  while (remaining > 0) {
    bool progressed = false;
    for (std::size_t s = 0; s < p; ++s) {
      if (next[s] == actions[s].size()) continue;
      const Action a = actions[s][next[s]];
      const auto mb = static_cast<std::size_t>(a.micro);
      double ready = 0;
      if (a.kind == Action::Kind::Forward) {
        ready = s == 0 ? 0.0 : fwd_done[s - 1][mb];
      } else {
        ready = s + 1 == p ? fwd_done[s][mb] : bwd_done[s + 1][mb];
      }
      if (ready == kNotYet) continue;
      const double start = std::max(ready, free_at[s]);
      const double cost = a.kind == Action::Kind::Forward ? forward_cost : backward_cost;
      (a.kind == Action::Kind::Forward ? fwd_done : bwd_done)[s][mb] = start + cost;
      free_at[s] = start + cost;
      t.busy[s] += cost;
      t.starts[s].push_back(start);
      ++next[s];
      --remaining;
      progressed = true;
    }
    MG_CHECK(progressed, "pipeline schedule {} deadlocks with {} stages and {} micro-batches", schedule_name(kind),
             stages, micro_batches);
  }
  t.makespan = *std::max_element(free_at.begin(), free_at.end());
  for (std::size_t s = 0; s < p; ++s) t.idle_fraction.push_back(1.0 - t.busy[s] / t.makespan);
  return t;
}

double ideal_bubble(int stages, int micro_batches) {
  return static_cast<double>(stages - 1) / static_cast<double>(micro_batches + stages - 1);
}

}  // namespace meshgrad::pipeline
