// Pipeline schedules: in which order each stage runs the forwards and backwards of a step's
// micro-batches. A schedule is only an order; the transfers between stages are the graph's own
// (distributed/p2p.hpp: a stage's forward ends in a send, its backward begins with the receive of
// that send's gradient), so every schedule computes the same gradients and differs only in time
// and memory.
//
//   GPipe  every forward, then every backward: m micro-batches' activations live at once.
//   1F1B   stage s runs min(p - s - 1, m) forwards first (the warm-up), then alternates one forward
//          and one backward, then the remaining backwards: at most p - s micro-batches' activations
//          live at once (PipeDream-flush, Megatron's non-interleaved schedule).
//
// Both run the backwards in micro-batch order 0, 1, ..., m - 1, which is what makes a pipeline's
// gradients bitwise those of one rank accumulating the same micro-batches (--grad-accum m): each
// stage adds micro-batch k's gradient to its parameters' .grad after micro-batch k - 1's.
#pragma once

#include <string>
#include <vector>

namespace meshgrad::pipeline {

enum class ScheduleKind { GPipe, OneFOneB };

// "gpipe" or "1f1b"; throws InvalidArgument naming the text and the choices.
ScheduleKind parse_schedule(const std::string& name);
const char* schedule_name(ScheduleKind kind);

struct Action {
  enum class Kind { Forward, Backward };
  Kind kind;
  int micro;
  bool operator==(const Action& o) const { return kind == o.kind && micro == o.micro; }
};

// The actions of stage `stage` (0-based, of `stages`) for `micro_batches` micro-batches, in order:
// each micro-batch's forward once and its backward once, after its forward.
std::vector<Action> stage_actions(ScheduleKind kind, int stages, int stage, int micro_batches);

// The most micro-batches whose forward ran and whose backward has not, at any point of
// stage_actions: the activations a stage keeps (GPipe m; 1F1B min(p - s, m)).
int peak_in_flight(const std::vector<Action>& actions);

// The schedule played on a model of time where a forward takes `forward_cost`, a backward
// `backward_cost`, transfers take no time, and an action starts when its stage is free and its
// input has arrived (a forward: the previous stage's forward of the micro-batch; a backward: the
// next stage's backward of it, or its own forward on the last stage).
struct Timeline {
  double makespan = 0;                 // the step's time
  std::vector<double> busy;            // per stage: time spent computing
  std::vector<double> idle_fraction;   // per stage: 1 - busy / makespan
  // Per stage: the start time of each action of stage_actions, in that order.
  std::vector<std::vector<double>> starts;
};
// Throws Error when the actions cannot all run (a schedule that deadlocks).
Timeline simulate(ScheduleKind kind, int stages, int micro_batches, double forward_cost = 1.0,
                  double backward_cost = 2.0);

// The bubble of GPipe and 1F1B with equal stages: (p - 1) / (m + p - 1) of each stage's time idle.
double ideal_bubble(int stages, int micro_batches);

}  // namespace meshgrad::pipeline
