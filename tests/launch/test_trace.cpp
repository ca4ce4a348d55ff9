// Traces of training (issue 12): one optimizer step of a tensor-parallel GPT on rank threads,
// recorded by tensor/trace.hpp, is a valid Chrome trace with a lane per rank and per communicator,
// properly nested spans, a forward and a backward span for every layer, and exactly one span per
// collective the communication counters saw in the same step (same op, layer label and bytes).
// Then the file of a run (run_train_job with trace_path), the refusal of a bad path before the
// first step, and the summary's arithmetic on a hand-made trace.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "meshgrad/comm/threads.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/tensor/random.hpp"
#include "meshgrad/tensor/trace.hpp"
#include "meshgrad/optim/grad_sync.hpp"
#include "meshgrad/launch/jobs.hpp"
#include "meshgrad/optim/adamw.hpp"
#include "meshgrad/diag/trace_report.hpp"
#include "meshgrad/train/trainer.hpp"

namespace meshgrad::launch::test_trace {
namespace {

namespace fs = std::filesystem;

struct Case {
  int dp, tp;
  bool sequence_parallel, overlap, checkpoint;
  bool llama = false;   // the Llama family (its module names) instead of GPT-2
};

std::string case_name(const Case& c) {
  return fmt::format("{}dp={} tp={}{}{}{}", c.llama ? "llama " : "", c.dp, c.tp, c.sequence_parallel ? " sp" : "",
                     c.overlap ? " overlap" : "", c.checkpoint ? " checkpoint-blocks" : "");
}

// Test names and failures show the case, not its bytes.
void PrintTo(const Case& c, std::ostream* os) { *os << case_name(c); }

constexpr int kLayers = 2;

nn::ModelConfig tiny_gpt() {
  return {.kind = "gpt", .layers = kLayers, .hidden = 16, .heads = 4, .vocab = 37, .seq = 8, .batch = 4};
}

// 4 query heads over 2 key/value heads, untied.
nn::ModelConfig tiny_llama() {
  nn::ModelConfig c = tiny_gpt();
  c.kind = "llama";
  c.kv_heads = 2;
  return c;
}

// What a counter saw, comparable with a collective span: (op, label, bytes).
using Collective = std::tuple<std::string, std::string, std::int64_t>;

struct TracedStep {
  std::string document;                            // the trace file's text
  std::map<int, std::vector<Collective>> counted;  // world rank -> the counters' records of the step
};

// One train_step on every rank of a dp x tp mesh, traced (only the step: the session starts after
// the model is built) and counted.
TracedStep traced_step(const Case& c) {
  TracedStep out;
  std::mutex m;
  trace::reset();
  comm::ThreadsOptions options;
  options.timeout = std::chrono::milliseconds(60000);
  const nn::Batch batch{random::randint({4, 8}, 11, 37), random::randint({4, 8}, 12, 37)};
  comm::run_ranks(c.dp * c.tp, [&](const comm::CommunicatorPtr& world) {
    auto mesh = std::make_shared<const dist::DeviceMesh>(world, std::vector<dist::MeshAxis>{{"dp", c.dp}, {"tp", c.tp}});
    nn::ParallelConfig parallel{.sequence_parallel = c.sequence_parallel, .overlap = c.overlap,
                                .checkpoint_blocks = c.checkpoint};
    auto model = nn::make_model(c.llama ? tiny_llama() : tiny_gpt(), parallel, mesh, 5);
    const std::vector<nn::Parameter*> params = model->parameters();
    optim::GradientSynchronizer sync(params, mesh);
    optim::AdamW opt(params, mesh, optim::AdamWOptions{1e-3, 0.9, 0.95, 1e-8, 0.1});
    train::train_step(*model, batch, *mesh, sync, opt);   // untraced: lazily built groups are made here
    world->barrier();
    if (world->rank() == 0) trace::start();
    world->barrier();
    dist::CommCounter counter;
    {
      dist::CountingScope counting(counter);
      trace::Span span("step", "step");
      train::train_step(*model, batch, *mesh, sync, opt);
    }
    world->barrier();
    if (world->rank() == 0) trace::stop();
    std::vector<Collective> counted;
    for (const auto& r : counter.records()) {
      // "all_gather(sizes)" is an all_gather to the communicator.
      counted.emplace_back(r.op.substr(0, r.op.find('(')), r.label, r.bytes);
    }
    std::lock_guard lock(m);
    out.counted[world->rank()] = std::move(counted);
  }, options);
  trace::ProcessInfo info;
  info.pid = 1;
  info.name = "test";
  info.origin = trace::session_start();
  out.document = trace::trace_document({trace::events_fragment(info)});
  trace::reset();
  return out;
}

const diag::TraceLane* lane_named(const diag::TraceData& trace, const std::string& name) {
  for (const diag::TraceLane& lane : trace.lanes) {
    if (lane.name == name) return &lane;
  }
  return nullptr;
}

bool has_span(const diag::TraceLane& lane, const std::string& name, const std::string& category) {
  return std::any_of(lane.spans.begin(), lane.spans.end(),
                     [&](const diag::TraceSpan& s) { return s.name == name && s.category == category; });
}

// Every layer's trace scope in the GPT (models.cpp, layers.cpp).
std::vector<std::string> gpt_layers() {
  std::vector<std::string> names{"gpt", "wte", "ln_f", "lm_head", "loss"};
  for (int i = 0; i < kLayers; ++i) {
    for (const char* part : {"", ".ln_1", ".attn", ".attn.c_attn", ".attn.c_proj", ".ln_2", ".mlp", ".mlp.c_fc",
                             ".mlp.c_proj"}) {
      names.push_back(fmt::format("h.{}{}", i, part));
    }
  }
  return names;
}

// Every module's trace scope in the Llama (llama.cpp): Hugging Face's names.
std::vector<std::string> llama_layers() {
  std::vector<std::string> names{"llama", "model.embed_tokens", "model.norm", "lm_head", "loss"};
  for (int i = 0; i < kLayers; ++i) {
    for (const char* part : {"", ".input_layernorm", ".self_attn", ".self_attn.q_proj", ".self_attn.k_proj",
                             ".self_attn.v_proj", ".self_attn.o_proj", ".post_attention_layernorm", ".mlp",
                             ".mlp.gate_proj", ".mlp.up_proj", ".mlp.down_proj"}) {
      names.push_back(fmt::format("model.layers.{}{}", i, part));
    }
  }
  return names;
}

class TraceOfAStep : public ::testing::TestWithParam<Case> {};

TEST_P(TraceOfAStep, HasEveryLaneLayerAndCollective) {
  const Case c = GetParam();
  const TracedStep step = traced_step(c);

  // Valid JSON in the Trace Event Format: every span has a name, a category and dur >= 0.
  const nlohmann::json doc = nlohmann::json::parse(step.document);
  ASSERT_TRUE(doc.at("traceEvents").is_array());
  int spans = 0;
  for (const auto& e : doc["traceEvents"]) {
    ASSERT_TRUE(e.contains("ph") && e.contains("pid") && e.contains("name")) << e.dump();
    if (e["ph"] != "X") continue;
    ++spans;
    ASSERT_TRUE(e.contains("cat") && e.contains("ts") && e.contains("tid")) << e.dump();
    ASSERT_GE(e.at("dur").get<double>(), 0.0) << e.dump();
  }
  ASSERT_GT(spans, 0);

  const diag::TraceData trace = diag::parse_trace(step.document, "the step's trace");
  // Spans nest properly on every lane: each one ends before the one it starts in. (Times are
  // microseconds with nanosecond digits; ts + dur may differ from the next ts in the last bit.)
  constexpr double kNanosecond = 1e-3;
  for (const diag::TraceLane& lane : trace.lanes) {
    std::vector<const diag::TraceSpan*> open;
    for (const diag::TraceSpan& s : lane.spans) {
      while (!open.empty() && open.back()->end_us <= s.begin_us + kNanosecond) open.pop_back();
      if (!open.empty()) {
        EXPECT_LE(s.end_us, open.back()->end_us + kNanosecond)
            << lane.name << ": " << s.name << " [" << s.category << "] overlaps the end of " << open.back()->name;
      }
      open.push_back(&s);
    }
  }

  const std::vector<std::string> groups = c.dp > 1 ? std::vector<std::string>{"tp", "dp"} : std::vector<std::string>{"tp"};
  for (int r = 0; r < c.dp * c.tp; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    const diag::TraceLane* rank = lane_named(trace, fmt::format("rank {}", r));
    ASSERT_NE(rank, nullptr);
    for (const std::string& g : groups) {
      EXPECT_NE(lane_named(trace, fmt::format("rank {} progress ({})", r, g)), nullptr) << "no progress lane of " << g;
    }
    // A forward and a backward span for every layer, and the training phases.
    for (const std::string& layer : c.llama ? llama_layers() : gpt_layers()) {
      EXPECT_TRUE(has_span(*rank, layer, "forward")) << layer;
      EXPECT_TRUE(has_span(*rank, layer, "backward")) << layer;
    }
    for (const auto& [name, category] : std::vector<std::pair<std::string, std::string>>{
             {"step", "step"}, {"backward", "backward"}, {"grad_sync", "grad_sync"}, {"grad_norm", "optimizer"},
             {"optimizer", "optimizer"}}) {
      EXPECT_TRUE(has_span(*rank, name, category)) << name;
    }
    if (c.checkpoint) {
      EXPECT_TRUE(has_span(*rank, "recompute", "recompute"));
    }
    // At least the forward's blocking all-reduce / reduce-scatter is waited for.
    EXPECT_TRUE(has_span(*rank, "wait", "wait"));

    // One collective span per collective the counters saw: same op, label and bytes.
    std::vector<Collective> traced;
    for (const diag::TraceLane& lane : trace.lanes) {
      if (lane.name.rfind(fmt::format("rank {} progress", r), 0) != 0) continue;
      for (const diag::TraceSpan& s : lane.spans) {
        EXPECT_EQ(s.category, "comm");
        EXPECT_EQ(s.name, s.op);
        if (s.op == "barrier" || s.op == "split") continue;   // the test's own, and group creation
        traced.emplace_back(s.op, s.label, s.bytes);
      }
    }
    std::vector<Collective> counted = step.counted.at(r);
    ASSERT_FALSE(counted.empty());
    std::sort(traced.begin(), traced.end());
    std::sort(counted.begin(), counted.end());
    EXPECT_EQ(traced, counted);
  }
}

INSTANTIATE_TEST_SUITE_P(Meshes, TraceOfAStep,
                         ::testing::Values(Case{1, 2, false, false, false}, Case{1, 2, true, true, false},
                                           Case{1, 2, false, true, true}, Case{2, 2, true, true, false},
                                           Case{1, 2, true, true, false, true}, Case{2, 2, false, false, true, true}),
                         [](const auto& info) {
                           std::string n = case_name(info.param);
                           std::replace_if(n.begin(), n.end(), [](char ch) { return !std::isalnum(ch); }, '_');
                           return n;
                         });

// ---- the file of a run ------------------------------------------------------------------------------

dist::RunOnMesh threads_mesh(int dp, int tp) {
  return [dp, tp](const std::function<void(const dist::DeviceMeshPtr&)>& fn) {
    comm::run_ranks(dp * tp, [&](const comm::CommunicatorPtr& world) {
      fn(std::make_shared<const dist::DeviceMesh>(world, std::vector<dist::MeshAxis>{{"dp", dp}, {"tp", tp}}));
    });
  };
}

train::TrainOptions tiny_job(int steps) {
  train::TrainOptions o;
  o.model = {.kind = "gpt", .layers = 1, .hidden = 16, .heads = 4, .vocab = 256, .seq = 8, .batch = 4};
  o.steps = steps;
  o.progress = false;
  o.parallel.overlap = true;
  return o;
}

struct ScratchDir {
  fs::path path;
  ScratchDir() : path(fs::temp_directory_path() / fmt::format("meshgrad-trace-{}", ::getpid())) {
    fs::create_directories(path);
  }
  ~ScratchDir() { fs::remove_all(path); }
};

TEST(TraceFile, RunTrainJobWritesOneTraceOfEveryRankAndStep) {
  ScratchDir dir;
  train::TrainOptions o = tiny_job(3);
  o.trace_path = (dir.path / "run.json").string();
  run_train_job(o, threads_mesh(1, 2));
  EXPECT_FALSE(trace::enabled()) << "the job stops recording";
  const diag::TraceData trace = diag::read_trace(o.trace_path);
  const auto rows = diag::summarize_trace(trace);
  ASSERT_EQ(rows.size(), 2u);
  for (const diag::RankSummary& r : rows) {
    EXPECT_EQ(r.steps, 3) << r.rank;
    EXPECT_GT(r.collectives, 0) << r.rank;
    EXPECT_GT(r.comm_ms, 0) << r.rank;
    EXPECT_LE(r.exposed_ms, r.comm_ms + 1e-9) << r.rank;
    EXPECT_LE(r.waited_ms, r.window_ms + 1e-9) << r.rank;
  }
  EXPECT_EQ(rows[0].rank, "rank 0");
  EXPECT_EQ(rows[1].rank, "rank 1");
  // The SVG of a step draws every lane.
  const std::string svg = diag::trace_svg(trace, {.step = 2, .title = ""});
  EXPECT_NE(svg.find("rank 1 progress (tp)"), std::string::npos);
  EXPECT_THROW(diag::trace_svg(trace, {.step = 4, .title = ""}), InvalidArgument);
}

TEST(TraceFile, ABadPathIsRefusedBeforeTheFirstStep) {
  ScratchDir dir;
  int steps = 0;
  for (const auto& [path, needle] : std::vector<std::pair<std::string, std::string>>{
           {dir.path.string(), "--trace"}, {(dir.path / "missing" / "t.json").string(), "--trace"},
           {(dir.path / "same.json").string(), "--metrics"}}) {
    train::TrainOptions o = tiny_job(2);
    o.trace_path = path;
    if (needle == "--metrics") o.metrics_path = path;   // the same file twice
    o.on_step = [&](const train::StepMetrics&) { ++steps; };
    try {
      run_train_job(o, threads_mesh(1, 2));
      ADD_FAILURE() << "no error for --trace " << path;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("--trace"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(trace::enabled());
  }
  EXPECT_EQ(steps, 0);
  EXPECT_FALSE(fs::exists(dir.path / "same.json"));
}

// ---- off the CPU after a launch ----------------------------------------------------------------------

// A rank that launches a collective and then does not run (here: sleeps; on a busy machine: its
// core taken by the progress thread the launch woke) finds the collective complete when it waits.
// Its wait records the time off the CPU, and the summary counts none of the collective as hidden.
TEST(TraceOffCpu, ARankOffTheCpuAfterALaunchHidesNothing) {
  trace::reset();
  trace::start();
  comm::run_ranks(2, [&](const comm::CommunicatorPtr& world) {
    float x = 1.0f;
    trace::Span step("step", "step");
    auto work = world->all_reduce_async(comm::MutableBuffer{&x, 1, DType::Float32},
                                        comm::MutableBuffer{&x, 1, DType::Float32}, comm::ReduceOp::Sum);
    if (world->rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(30));
    work->wait();
  });
  trace::stop();
  trace::ProcessInfo info;
  info.origin = trace::session_start();
  const diag::TraceData trace = diag::parse_trace(trace::trace_document({trace::events_fragment(info)}), "off-CPU trace");
  trace::reset();
  const diag::TraceLane* rank0 = lane_named(trace, "rank 0");
  ASSERT_NE(rank0, nullptr);
  const diag::TraceSpan* wait = nullptr;
  for (const diag::TraceSpan& s : rank0->spans) {
    if (s.category == "wait") wait = &s;
  }
  ASSERT_NE(wait, nullptr) << "the wait after the sleep is drawn (zero-length if the collective was done)";
  EXPECT_GE(wait->since_launch_us, 30000.0);
  EXPECT_GE(wait->off_cpu_us, 15000.0) << "asleep is off the CPU";
  const auto rows = diag::summarize_trace(trace);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].collectives, 1);
  EXPECT_GT(rows[0].comm_ms, 0.0);
  EXPECT_LE(rows[0].hidden_ms, 1e-6) << "the collective ran while rank 0 was asleep, not computing";
  EXPECT_GE(rows[0].off_cpu_ms, 15.0);
}

// ---- the summary's arithmetic -------------------------------------------------------------------------

TEST(TraceReport, SummaryCountsHiddenCommunicationInClosedForm) {
  // rank 0: step [0, 100]; collectives in flight [10, 40] and [50, 90] (70 us); waits [30, 60] (30 us),
  // and a zero-length wait at 95 whose collective was launched at 70 while the rank was off the CPU
  // for 10 us after it: blocked [30, 60] and [70, 80]; exposed [30, 40], [50, 60] and [70, 80] (30 us),
  // hidden 40 us. B/E pairs too.
  const std::string doc = R"json({"traceEvents": [
    {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "rank 0"}},
    {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "rank 0 progress (tp)"}},
    {"ph": "X", "name": "step", "cat": "step", "pid": 1, "tid": 1, "ts": 0, "dur": 100},
    {"ph": "B", "name": "wait", "cat": "wait", "pid": 1, "tid": 1, "ts": 30},
    {"ph": "E", "pid": 1, "tid": 1, "ts": 60},
    {"ph": "X", "name": "wait", "cat": "wait", "pid": 1, "tid": 1, "ts": 95, "dur": 0,
     "args": {"since_launch_us": 25, "off_cpu_us": 10}},
    {"ph": "X", "name": "all_reduce", "cat": "comm", "pid": 1, "tid": 2, "ts": 10, "dur": 30,
     "args": {"op": "all_reduce", "bytes": 1000000}},
    {"ph": "X", "name": "all_gather", "cat": "comm", "pid": 1, "tid": 2, "ts": 50, "dur": 40,
     "args": {"op": "all_gather", "bytes": 500000}},
    {"ph": "X", "name": "barrier", "cat": "comm", "pid": 1, "tid": 2, "ts": 150, "dur": 10}
  ]})json";
  const diag::TraceData trace = diag::parse_trace(doc, "hand-made");
  const auto rows = diag::summarize_trace(trace);
  ASSERT_EQ(rows.size(), 1u);
  const diag::RankSummary& r = rows[0];
  EXPECT_EQ(r.steps, 1);
  EXPECT_DOUBLE_EQ(r.window_ms, 0.100);
  EXPECT_DOUBLE_EQ(r.comm_ms, 0.070);     // the barrier is outside the step
  EXPECT_DOUBLE_EQ(r.waited_ms, 0.030);
  EXPECT_NEAR(r.off_cpu_ms, 0.010, 1e-12);
  EXPECT_NEAR(r.exposed_ms, 0.030, 1e-12);
  EXPECT_NEAR(r.hidden_ms, 0.040, 1e-12);
  EXPECT_NEAR(r.compute_ms, 0.060, 1e-12);
  EXPECT_NEAR(r.hidden_percent, 100.0 * 40 / 70, 1e-9);
  EXPECT_EQ(r.collectives, 2);
  EXPECT_EQ(r.bytes, 1500000);
  EXPECT_EQ(trace.lanes[0].depth, 2);   // the wait inside the step
  // Step 1 is the whole window here; there is no step 2.
  EXPECT_DOUBLE_EQ(diag::summarize_trace(trace, 1).at(0).hidden_ms, r.hidden_ms);
  EXPECT_THROW(diag::summarize_trace(trace, 2), InvalidArgument);
}

TEST(TraceReport, MalformedTracesAreRefusedNamingTheFile) {
  auto message = [](const std::string& text) {
    try {
      diag::parse_trace(text, "bad.json");
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message("{").find("bad.json' is not JSON"), std::string::npos);
  EXPECT_NE(message("{\"events\": []}").find("no \"traceEvents\""), std::string::npos);
  EXPECT_NE(message("[{\"ph\": \"E\", \"ts\": 1}]").find("never began"), std::string::npos);
  EXPECT_NE(message("[{\"ph\": \"B\", \"name\": \"a\", \"ts\": 1}]").find("never ends"), std::string::npos);
  EXPECT_NE(message("[{\"ph\": \"X\", \"name\": \"a\", \"ts\": 1, \"dur\": -2}]").find("non-negative"),
            std::string::npos);
  EXPECT_NE(message("[]").find("has no spans"), std::string::npos);
  const std::string wrong_type = R"([{"ph": "X", "name": "a", "tid": "x", "ts": 1, "dur": 2}])";
  EXPECT_NE(message(wrong_type).find("event 1 is malformed"), std::string::npos);
}

}  // namespace
}  // namespace meshgrad::launch::test_trace
