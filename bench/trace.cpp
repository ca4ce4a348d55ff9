// What tracing costs (tensor/trace.hpp): a layer scope and a span, with no session recording (the
// default: one relaxed atomic load) and while one records (an event appended to the thread's
// buffer). The end-to-end cost on training is bench/compare_trace.sh.
#include <benchmark/benchmark.h>

#include "meshgrad/tensor/trace.hpp"

using namespace meshgrad;

namespace {

void BM_ScopeNotRecording(benchmark::State& state) {
  trace::reset();
  for (auto _ : state) {
    trace::Scope scope("h.0.mlp.c_fc");
    benchmark::DoNotOptimize(trace::current_scope());
  }
}
BENCHMARK(BM_ScopeNotRecording);

void BM_SpanNotRecording(benchmark::State& state) {
  trace::reset();
  for (auto _ : state) {
    trace::Span span("optimizer", "optimizer");
    benchmark::DoNotOptimize(span.active());
  }
}
BENCHMARK(BM_SpanNotRecording);

// Recording: a fresh session per run of the loop; few enough iterations to stay under the event
// limit (beyond it events are only counted, which would be cheaper).
void BM_ScopeRecording(benchmark::State& state) {
  trace::start();
  for (auto _ : state) {
    trace::Scope scope("h.0.mlp.c_fc");
    benchmark::DoNotOptimize(trace::current_scope());
  }
  trace::reset();
}
BENCHMARK(BM_ScopeRecording)->Iterations(500000);

void BM_CollectiveSpanRecording(benchmark::State& state) {
  trace::start();
  trace::Lane lane;
  lane.set_name("rank 0 progress (tp)", 1);
  for (auto _ : state) {
    const auto t = trace::Clock::now();
    trace::complete(lane.id(), "all_reduce", "comm", t, t,
                    {{"op", std::string("all_reduce")}, {"seq", std::int64_t{1}}, {"bytes", std::int64_t{1 << 20}},
                     {"group", std::string("tp")}, {"label", std::string("h.0.mlp.c_proj")}});
  }
  trace::reset();
}
BENCHMARK(BM_CollectiveSpanRecording)->Iterations(500000);

// The CPU clock a traced collective reads twice (at its launch and at its wait).
void BM_ThreadCpuTime(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(trace::thread_cpu_time());
}
BENCHMARK(BM_ThreadCpuTime);

}  // namespace

BENCHMARK_MAIN();
