// `meshgrad explain` (diag/explain.hpp) against the code and against the DESIGN table.
//
// 1. explain's graph rows equal, row for row, what a CommCounter records on rank 0 when the same
//    model runs the same step outside explain: explain reports the code, not a description of it.
// 2. Those rows equal the collectives the DESIGN table prescribes for a 2-layer model, layer by
//    layer (name, phase, op, axis, bytes): a drift between the code and the table fails here.
// 3. The gradient-synchronizer rows, the cost of each row, and the json shape.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <functional>
#include <mutex>
#include <optional>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "../distributed/dist_test_util.hpp"
#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/cost_model.hpp"
#include "meshgrad/data/synthetic.hpp"
#include "meshgrad/diag/explain.hpp"
#include "meshgrad/nn/model.hpp"

namespace meshgrad::diag::test_explain {
namespace {

using nn::make_model;

// The mesh of a spec as the CLI builds it.
std::vector<dist::MeshAxis> explain_mesh_axes(const std::string& spec) { return dist::parse_mesh(spec); }

// One collective as both sides describe it.
using Entry = std::tuple<std::string, std::string, std::string, std::string, std::int64_t>;   // layer phase op axis bytes

ModelConfig small_config(const std::string& kind) {
  ModelConfig c;
  c.kind = kind;
  c.layers = 2;
  c.hidden = 16;
  c.ffn = 32;
  c.heads = 4;
  c.vocab = 32;
  c.seq = 8;
  c.batch = 4;
  if (kind == "llama") c.kv_heads = 2;   // grouped-query: 4 query heads over 2 key/value heads
  return c;
}

const dist::Link kLink{"test", 2.0, 1.0, "closed-form test link", std::nullopt};

std::vector<Entry> graph_entries(const std::vector<ExplainRow>& rows) {
  std::vector<Entry> out;
  for (const auto& r : rows) {
    if (r.source == ExplainSource::Graph) out.emplace_back(r.layer, r.phase, r.op, r.axis, r.bytes);
  }
  return out;
}

// Rank 0's records of one forward + backward of the model, run here, independently of explain,
// on the same mesh with the same synthetic batch.
std::vector<Entry> counter_entries(const ModelConfig& config, const ParallelConfig& parallel,
                                   const std::string& mesh_spec) {
  const std::vector<dist::MeshAxis> axes = explain_mesh_axes(mesh_spec);
  int world = 1;
  for (const auto& a : axes) world *= a.size;
  std::vector<Entry> out;
  std::mutex mu;
  testing::run_on_mesh(
      world,
      [&](const dist::DeviceMeshPtr& mesh) {
        dist::CommCounter counter;
        auto model = make_model(config, parallel, mesh, /*seed=*/42);
        const int dp = mesh->axis_size("dp");
        const Batch batch = data::make_synthetic_batch(config, dp, mesh->coordinate("dp"), /*seed=*/7);
        {
          dist::CountingScope counting(counter);
          Tensor loss = model->loss(batch, static_cast<std::int64_t>(config.batch) * config.seq);
          backward(loss);
        }
        if (mesh->rank() != 0) return;
        std::lock_guard<std::mutex> lock(mu);
        for (const auto& r : counter.records()) {
          out.emplace_back(r.label, dist::phase_name(r.phase), r.op, r.axis, r.bytes);
        }
      },
      axes);
  return out;
}

// The DESIGN table applied to a GPT of `layers` blocks on tp > 1, rank 0's local batch of b rows:
//   wte (vocab-parallel embedding): its partial sums reduced over tp = "reduce from TP region"
//     (forward all-reduce) or, under SP, "reduce-scatter to SP region" (backward all-gather);
//   per block: attn.c_attn and mlp.c_fc are column-parallel, attn.c_proj and mlp.c_proj row-parallel;
//   lm_head: column-parallel (tied to wte); loss: vocab-parallel cross-entropy, three all-reduces of
//     [N, 1] in forward (row max, sum of exps, target logit), none in backward.
// act = the whole [T, B, C] activation in bytes (the nccl-tests size of every gather / reduction).
std::vector<Entry> expected_gpt(const ModelConfig& c, std::int64_t b, bool sp) {
  const std::int64_t act = c.seq * b * c.hidden * 4;
  const std::int64_t rows = c.seq * b * 4;   // [N, 1] float32, N = T * B (every rank sees all positions)
  std::vector<Entry> f, bw;
  auto column = [&](const std::string& name) {
    if (sp) {
      f.emplace_back(name, "forward", "all_gather", "tp", act);
      bw.emplace_back(name, "backward", "reduce_scatter", "tp", act);
    } else {
      bw.emplace_back(name, "backward", "all_reduce", "tp", act);
    }
  };
  auto row = [&](const std::string& name) {
    if (sp) {
      f.emplace_back(name, "forward", "reduce_scatter", "tp", act);
      bw.emplace_back(name, "backward", "all_gather", "tp", act);
    } else {
      f.emplace_back(name, "forward", "all_reduce", "tp", act);
    }
  };
  if (sp) {
    f.emplace_back("wte", "forward", "reduce_scatter", "tp", act);
    bw.emplace_back("wte", "backward", "all_gather", "tp", act);
  } else {
    f.emplace_back("wte", "forward", "all_reduce", "tp", act);
  }
  for (int i = 0; i < c.layers; ++i) {
    const std::string h = "h." + std::to_string(i);
    column(h + ".attn.c_attn");
    row(h + ".attn.c_proj");
    column(h + ".mlp.c_fc");
    row(h + ".mlp.c_proj");
  }
  column("lm_head");
  for (int k = 0; k < 3; ++k) f.emplace_back("loss", "forward", "all_reduce", "tp", rows);
  f.insert(f.end(), bw.begin(), bw.end());
  return f;
}

// The DESIGN table applied to a Llama (src/nn/llama.cpp's plan): as GPT-2 with its own linears:
//   model.embed_tokens: vocabulary-parallel as wte; per layer self_attn.q_proj, k_proj, v_proj
//   column-parallel (each its own column layer: under SP each gathers its input), o_proj row;
//   mlp.gate_proj and up_proj column (SwiGLU's two), down_proj row; lm_head column (untied or
//   tied); the same three loss all-reduces. Key/value heads fewer than tp are replicated, and their
//   projections communicate as column layers still: each rank's dX is partial (its query heads'
//   share), so it is all-reduced (reduce-scattered under SP) in backward; their weight gradients
//   are the synchroniser's (ExplainGradSync.ReplicatedKeyValueHeads...). No position table.
std::vector<Entry> expected_llama(const ModelConfig& c, std::int64_t b, bool sp) {
  const std::int64_t act = c.seq * b * c.hidden * 4;
  const std::int64_t rows = c.seq * b * 4;
  std::vector<Entry> f, bw;
  auto column = [&](const std::string& name) {
    if (sp) f.emplace_back(name, "forward", "all_gather", "tp", act);
    bw.emplace_back(name, "backward", sp ? "reduce_scatter" : "all_reduce", "tp", act);
  };
  auto row = [&](const std::string& name) {
    f.emplace_back(name, "forward", sp ? "reduce_scatter" : "all_reduce", "tp", act);
    if (sp) bw.emplace_back(name, "backward", "all_gather", "tp", act);
  };
  row("model.embed_tokens");   // the embedding's partial sums: reduced as a row layer's output
  for (int i = 0; i < c.layers; ++i) {
    const std::string l = "model.layers." + std::to_string(i);
    for (const char* proj : {".self_attn.q_proj", ".self_attn.k_proj", ".self_attn.v_proj"}) column(l + proj);
    row(l + ".self_attn.o_proj");
    column(l + ".mlp.gate_proj");
    column(l + ".mlp.up_proj");
    row(l + ".mlp.down_proj");
  }
  column("lm_head");
  for (int k = 0; k < 3; ++k) f.emplace_back("loss", "forward", "all_reduce", "tp", rows);
  f.insert(f.end(), bw.begin(), bw.end());
  return f;
}

// The DESIGN table applied to the MLP model: `layers` (column c_fc, row c_proj) pairs on a random
// input that requires grad (as the PyTorch peer benchmark does), so every c_fc, h.0's included,
// communicates its dX in backward. Under SP the loss, a sum over this rank's tokens, is all-reduced.
std::vector<Entry> expected_mlp(const ModelConfig& c, std::int64_t b, bool sp) {
  const std::int64_t act = c.seq * b * c.hidden * 4;
  std::vector<Entry> f, bw;
  for (int i = 0; i < c.layers; ++i) {
    const std::string fc = "h." + std::to_string(i) + ".mlp.c_fc", proj = "h." + std::to_string(i) + ".mlp.c_proj";
    if (sp) {
      f.emplace_back(fc, "forward", "all_gather", "tp", act);
      f.emplace_back(proj, "forward", "reduce_scatter", "tp", act);
      bw.emplace_back(proj, "backward", "all_gather", "tp", act);
      bw.emplace_back(fc, "backward", "reduce_scatter", "tp", act);
    } else {
      f.emplace_back(proj, "forward", "all_reduce", "tp", act);
      bw.emplace_back(fc, "backward", "all_reduce", "tp", act);
    }
  }
  if (sp) f.emplace_back("loss", "forward", "all_reduce", "tp", 4);
  f.insert(f.end(), bw.begin(), bw.end());
  return f;
}

std::vector<Entry> sorted(std::vector<Entry> v) {
  std::sort(v.begin(), v.end());
  return v;
}

std::string describe(const std::vector<Entry>& v) {
  std::string s;
  for (const auto& [layer, phase, op, axis, bytes] : v) {
    s += "  " + layer + " " + phase + " " + op + " " + axis + " " + std::to_string(bytes) + "\n";
  }
  return s;
}

struct Case {
  std::string kind;
  bool sp;
  std::string mesh;
  int dp;
  int kv_heads = 0;   // llama: its key/value heads (0: small_config's 2)
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.kind << (c.sp ? " sequence-parallel" : "") << " mesh " << c.mesh;
}

class ExplainMatchesCode : public ::testing::TestWithParam<Case> {};

TEST_P(ExplainMatchesCode, CounterAndDesignTable) {
  const Case& k = GetParam();
  ModelConfig config = small_config(k.kind);
  if (k.kv_heads > 0) config.kv_heads = k.kv_heads;
  ParallelConfig parallel;
  parallel.sequence_parallel = k.sp;
  const std::vector<ExplainRow> rows = explain_model(config, parallel, explain_mesh_axes(k.mesh), kLink);
  const std::vector<Entry> got = graph_entries(rows);

  // 1. Row for row what a counter records when the model runs outside explain.
  const std::vector<Entry> counted = counter_entries(config, parallel, k.mesh);
  EXPECT_EQ(got, counted) << "explain:\n" << describe(got) << "counter:\n" << describe(counted);

  // 2. The DESIGN table's collectives, layer by layer (issue order is the engine's business).
  const std::int64_t local_batch = config.batch / k.dp;
  const std::vector<Entry> expected =
      k.kind == "gpt"     ? expected_gpt(config, local_batch, k.sp)
      : k.kind == "llama" ? expected_llama(config, local_batch, k.sp)
                          : expected_mlp(config, local_batch, k.sp);
  EXPECT_EQ(sorted(got), sorted(expected)) << "explain:\n" << describe(got) << "DESIGN table:\n" << describe(expected);

  // Per phase / op counts, the figures a reader of the table checks first.
  for (const std::string phase : {"forward", "backward"}) {
    for (const std::string op : {"all_reduce", "all_gather", "reduce_scatter"}) {
      const auto n_got = std::count_if(got.begin(), got.end(), [&](const Entry& e) {
        return std::get<1>(e) == phase && std::get<2>(e) == op;
      });
      const auto n_expected = std::count_if(expected.begin(), expected.end(), [&](const Entry& e) {
        return std::get<1>(e) == phase && std::get<2>(e) == op;
      });
      EXPECT_EQ(n_got, n_expected) << phase << " " << op;
    }
  }

  // Every row is costed with n = its axis' size.
  for (const auto& r : rows) {
    const int n = r.axis == "dp" ? k.dp : 2;
    EXPECT_EQ(r.ranks, n) << r.layer;
    EXPECT_DOUBLE_EQ(r.predicted_us, dist::predict_collective(r.op, n, static_cast<double>(r.bytes), kLink).time_us)
        << r.layer << " " << r.op;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, ExplainMatchesCode,
                         ::testing::Values(Case{"gpt", false, "tp=2", 1}, Case{"gpt", true, "tp=2", 1},
                                           Case{"mlp", false, "tp=2", 1}, Case{"mlp", true, "tp=2", 1},
                                           Case{"gpt", false, "dp=2,tp=2", 2}, Case{"gpt", true, "tp=2,dp=2", 2},
                                           Case{"llama", false, "tp=2", 1}, Case{"llama", true, "tp=2", 1},
                                           Case{"llama", false, "tp=2", 1, 1}, Case{"llama", true, "tp=2", 1, 1},
                                           Case{"llama", true, "dp=2,tp=2", 2}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::string name = info.param.kind + (info.param.sp ? "_sp" : "") + "_tp2";
                           if (info.param.dp > 1) name += "_dp" + std::to_string(info.param.dp);
                           if (info.param.kv_heads > 0) name += "_kv" + std::to_string(info.param.kv_heads);
                           return name;
                         });

std::vector<const ExplainRow*> sync_rows(const std::vector<ExplainRow>& rows, const std::string& axis) {
  std::vector<const ExplainRow*> out;
  for (const auto& r : rows) {
    if (r.source == ExplainSource::GradSync && r.axis == axis) out.push_back(&r);
  }
  return out;
}

TEST(ExplainGradSync, NoneWithoutDpOrSequenceParallelism) {
  const auto rows = explain_model(small_config("gpt"), {}, explain_mesh_axes("tp=2"), kLink);
  EXPECT_TRUE(sync_rows(rows, "tp").empty());
  EXPECT_TRUE(sync_rows(rows, "dp").empty());
}

// Under SP the replicated parameters that meet sequence-sharded data (DESIGN: LayerNorm; layers.hpp
// adds the row-parallel bias and the position embedding) have gradients partial over tp, which the
// synchronizer all-reduces over tp; sharded parameters never are.
TEST(ExplainGradSync, SequenceParallelReducesReplicatedParametersOverTp) {
  const ModelConfig c = small_config("gpt");
  ParallelConfig sp;
  sp.sequence_parallel = true;
  const auto rows = explain_model(c, sp, explain_mesh_axes("tp=2"), kLink);
  std::set<std::string> got;
  for (const ExplainRow* r : sync_rows(rows, "tp")) {
    got.insert(r->layer);
    EXPECT_EQ(r->op, "all_reduce");
    EXPECT_EQ(r->phase, "backward");
  }
  std::set<std::string> expected{"wpe.weight", "ln_f.weight", "ln_f.bias"};
  for (int i = 0; i < c.layers; ++i) {
    const std::string h = "h." + std::to_string(i);
    for (const char* p : {".ln_1.weight", ".ln_1.bias", ".ln_2.weight", ".ln_2.bias", ".attn.c_proj.bias",
                          ".mlp.c_proj.bias"}) {
      expected.insert(h + p);
    }
  }
  EXPECT_EQ(got, expected);
  for (const ExplainRow* r : sync_rows(rows, "tp")) {
    const std::int64_t want = r->layer == "wpe.weight" ? c.seq * c.hidden * 4 : c.hidden * 4;
    EXPECT_EQ(r->bytes, want) << r->layer;
  }
  EXPECT_TRUE(sync_rows(rows, "dp").empty());
}

// Key/value heads fewer than tp ranks are replicated (as Megatron does): every rank holds the whole
// k_proj and v_proj, and each one's gradient is its query heads' share, so the synchroniser
// all-reduces them over tp ([hidden, kv_heads x head_dim] float32); with as many kv heads as ranks
// they are split and nothing is synchronised.
TEST(ExplainGradSync, ReplicatedKeyValueHeadsAreAllReducedOverTp) {
  ModelConfig c = small_config("llama");
  EXPECT_TRUE(sync_rows(explain_model(c, {}, explain_mesh_axes("tp=2"), kLink), "tp").empty());
  c.kv_heads = 1;
  const auto rows = explain_model(c, {}, explain_mesh_axes("tp=2"), kLink);
  std::set<std::string> got, expected;
  for (const ExplainRow* r : sync_rows(rows, "tp")) {
    got.insert(r->layer);
    EXPECT_EQ(r->op, "all_reduce");
    EXPECT_EQ(r->bytes, c.hidden * c.kv_heads * c.head_size() * 4) << r->layer;
  }
  for (int i = 0; i < c.layers; ++i) {
    for (const char* p : {".self_attn.k_proj.weight", ".self_attn.v_proj.weight"}) {
      expected.insert("model.layers." + std::to_string(i) + p);
    }
  }
  EXPECT_EQ(got, expected);
}

// explain's FLOPs are train's (the MFU's): 6 N_matmul + 12 L T (heads x head_dim), counted here from
// the closed form of the small Llama (untied: embed_tokens is a lookup and not counted).
TEST(ExplainFormat, TheTableStatesTheModelsFlops) {
  ModelConfig c = small_config("llama");
  c.head_dim = 6;   // heads x head_dim = 24, not hidden
  const std::int64_t C = c.hidden, F = c.ffn_size(), V = c.vocab, q = 4 * 6, kv = 2 * 6;
  const std::int64_t matmul = c.layers * (2 * C + C * q + 2 * C * kv + q * C + 3 * C * F) + C + C * V;
  const double per_token = 6.0 * static_cast<double>(matmul) + 12.0 * c.layers * c.seq * q;
  const auto axes = explain_mesh_axes("tp=2");
  const std::string table = format_explain_table(explain_model(c, {}, axes, kLink), {c, {}, axes, kLink, {}});
  EXPECT_NE(table.find(fmt::format("{:.4g} per token = 6 x {} matmul parameters", per_token, matmul)), std::string::npos)
      << table.substr(0, 400);
}

// With dp = 2 the synchroniser's buckets carry every parameter's local gradient once: one in-place
// all-reduce over dp per bucket (a small model fits one bucket), whose bytes are the sum of the
// local gradients' bytes.
TEST(ExplainGradSync, DataParallelReducesEveryParameterShardInBuckets) {
  const ModelConfig c = small_config("gpt");
  const auto rows = explain_model(c, {}, explain_mesh_axes("dp=2,tp=2"), kLink);
  const auto dp_rows = sync_rows(rows, "dp");
  ASSERT_EQ(dp_rows.size(), 1u);
  EXPECT_EQ(dp_rows[0]->layer, "bucket0");
  EXPECT_EQ(dp_rows[0]->ranks, 2);
  EXPECT_EQ(dp_rows[0]->phase, "backward");
  const std::int64_t C = c.hidden, F = c.ffn_size(), V = c.vocab, T = c.seq;
  // rank 0's pieces: wte half the rows, wpe whole; per block ln x4, c_attn (w, b) half, c_proj w half
  // + bias whole, c_fc (w, b) half, mlp.c_proj w half + bias whole; ln_f x2.
  const std::int64_t block = 4 * C + (C * 3 * C / 2 + 3 * C / 2) + (C / 2 * C + C) + (C * F / 2 + F / 2) + (F / 2 * C + C);
  EXPECT_EQ(dp_rows[0]->bytes, 4 * (V / 2 * C + T * C + c.layers * block + 2 * C));
  EXPECT_TRUE(sync_rows(rows, "tp").empty());
}

TEST(ExplainAggregates, LayersAndPhasesAddUp) {
  const auto rows = explain_model(small_config("gpt"), {}, explain_mesh_axes("tp=2"), kLink);
  double total_us = 0;
  int total = 0;
  for (const auto& r : rows) {
    total_us += r.predicted_us;
    ++total;
  }
  int layer_count = 0;
  double layer_us = 0;
  for (const LayerSummary& s : summarize_layers(rows)) {
    layer_count += s.forward.count + s.backward.count + s.other.count;
    layer_us += s.forward.predicted_us + s.backward.predicted_us + s.other.predicted_us;
  }
  EXPECT_EQ(layer_count, total);
  EXPECT_NEAR(layer_us, total_us, 1e-9 * total_us);
  const auto phases = summarize_phases(rows);
  ASSERT_EQ(phases.size(), 2u);
  EXPECT_EQ(phases[0].phase, "forward");
  EXPECT_EQ(phases[1].phase, "backward");
  EXPECT_EQ(phases[0].totals.count, 1 + 2 * 2 + 3);   // wte, 2 per block, 3 in the loss
  EXPECT_EQ(phases[1].totals.count, 1 + 2 * 2);       // lm_head, 2 per block
}

TEST(ExplainFormat, JsonHasExactlyTheDocumentedKeys) {
  ParallelConfig sp;
  sp.sequence_parallel = true;
  const auto rows = explain_model(small_config("gpt"), sp, explain_mesh_axes("dp=2,tp=2"), kLink);
  const nlohmann::json j = nlohmann::json::parse(format_explain_json(rows));
  ASSERT_TRUE(j.is_array());
  ASSERT_EQ(j.size(), rows.size());
  const std::set<std::string> keys{"layer", "phase", "op", "axis", "bytes", "predicted_us", "tensors"};
  for (std::size_t i = 0; i < j.size(); ++i) {
    std::set<std::string> got;
    for (const auto& [key, value] : j[i].items()) got.insert(key);
    EXPECT_EQ(got, keys) << j[i].dump();
    EXPECT_TRUE(j[i]["bytes"].is_number_integer());
    EXPECT_TRUE(j[i]["predicted_us"].is_number());
    EXPECT_EQ(j[i]["layer"], rows[i].layer);
    EXPECT_EQ(j[i]["bytes"].get<std::int64_t>(), rows[i].bytes);
    EXPECT_DOUBLE_EQ(j[i]["predicted_us"].get<double>(), rows[i].predicted_us);
    EXPECT_EQ(j[i]["tensors"].get<std::vector<std::string>>(), rows[i].tensors);
  }
}

TEST(ExplainFormat, TableNamesLayersLinkAndTotals) {
  const ModelConfig c = small_config("gpt");
  const dist::Link link = dist::link_preset("nvlink4");
  const auto rows = explain_model(c, {}, explain_mesh_axes("dp=2,tp=2"), link);
  const std::string table = format_explain_table(rows, {c, {}, explain_mesh_axes("dp=2,tp=2"), link});
  for (const char* needle : {"h.0.attn.c_proj", "h.1.mlp.c_fc", "lm_head", "wte", "loss", "nvlink4", "dp=2,tp=2",
                             "gradient synchronizer", "bucket0", "graph forward", "graph backward",
                             "grad-sync backward"}) {
    EXPECT_NE(table.find(needle), std::string::npos) << "missing '" << needle << "' in\n" << table;
  }
}

// explain counts per axis on a 2-D grid: the grid layers' collectives over tp_row and tp_col, the
// vocabulary-parallel ones over the whole grid (tp_row+tp_col, n = 4).
TEST(ExplainMesh, TwoDimensionalGridCountsPerAxis) {
  const ModelConfig c = small_config("gpt");
  const auto rows = explain_model(c, {}, {{"dp", 1}, {"tp_row", 2}, {"tp_col", 2}}, kLink);
  std::map<std::string, int> per_axis;
  for (const auto& r : rows) {
    ++per_axis[r.axis];
    const int expected_ranks = r.axis == "tp_row+tp_col" ? 4 : r.axis == "dp" ? 1 : 2;
    EXPECT_EQ(r.ranks, expected_ranks) << r.axis;
  }
  // Per block: forward 2 all-reduces + 2 all-gathers over tp_row and 2 all-reduces over tp_col;
  // backward 2 all-reduces + 2 all-gathers over tp_row (c_proj inputs, the input slices' duals)
  // and 2 all-reduces over tp_col (c_attn / c_fc inputs).
  EXPECT_EQ(per_axis["tp_row"], 8 * c.layers);
  EXPECT_EQ(per_axis["tp_col"], 4 * c.layers);
  EXPECT_EQ(per_axis["tp_row+tp_col"], 1 + 3 + 1);   // wte, loss (3), lm_head dX
}

TEST(ExplainErrors, BatchThatDoesNotSplitOverDp) {
  ModelConfig c = small_config("gpt");
  c.batch = 3;
  try {
    explain_model(c, {}, explain_mesh_axes("dp=2,tp=1"), kLink);
    FAIL() << "batch 3 over dp 2 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("batch 3"), std::string::npos) << e.what();
  }
}

// explain runs training's step (train::forward_backward): the batch is split over dp and fsdp
// together, so fsdp=2,tp=2 moves the activations of dp=2,tp=2 over tp (it used to give every fsdp
// rank the whole batch, twice the bytes; review-3 section 5).
TEST(ExplainBatch, FsdpSplitsTheBatchAsTrainingDoes) {
  ModelConfig c = small_config("gpt");
  c.batch = 4;
  using Key = std::tuple<std::string, std::string, std::string, std::int64_t>;
  auto tp_rows = [&](const std::string& mesh) {
    std::map<Key, int> seen;
    for (const ExplainRow& r : explain_model(c, {}, explain_mesh_axes(mesh), kLink)) {
      if (r.axis == "tp") ++seen[{r.layer, r.phase, r.op, r.bytes}];
    }
    return seen;
  };
  const auto fsdp = tp_rows("fsdp=2,tp=2");
  ASSERT_FALSE(fsdp.empty());
  EXPECT_EQ(fsdp, tp_rows("dp=2,tp=2"));
  EXPECT_NE(fsdp, tp_rows("tp=2"));   // one replica holds the whole batch: twice the activation bytes
  c.batch = 3;
  EXPECT_THROW(explain_model(c, {}, explain_mesh_axes("fsdp=2"), kLink), InvalidArgument);
}

// fsdp sends one all-gather and one reduce-scatter per unit per step (FSDP2's foreach style), not
// one per parameter (issue 36): each unit's forward gathers once, its backward regathers once and
// reduce-scatters once, whatever number of parameters it holds.
TEST(ExplainFsdp, OneGatherAndOneReduceScatterPerUnit) {
  ModelConfig c = small_config("gpt");
  c.batch = 4;
  std::map<std::tuple<std::string, std::string, std::string>, int> seen;   // (unit, phase, op) -> count
  std::set<std::string> units;
  for (const ExplainRow& r : explain_model(c, {}, explain_mesh_axes("fsdp=2"), kLink)) {
    if (r.axis != "fsdp") continue;
    ++seen[{r.layer, r.phase, r.op}];
    units.insert(r.layer);
  }
  ASSERT_EQ(units.size(), static_cast<std::size_t>(c.layers + 1)) << "a unit per block and the model's own";
  for (const std::string& u : units) {
    EXPECT_EQ((seen[{u, "forward", "all_gather"}]), 1) << u;
    EXPECT_EQ((seen[{u, "backward", "reduce_scatter"}]), 1) << u;
    EXPECT_LE((seen[{u, "backward", "all_gather"}]), 1) << u;
  }
}

// The rows of a grouped collective name the tensors it carries: each FSDP unit's parameters (a block's
// under its name, the model's own: the embeddings and ln_f), each dp bucket's; the table lists them.
TEST(ExplainFsdp, GroupedCollectivesNameTheirTensors) {
  ModelConfig c = small_config("gpt");
  c.batch = 4;
  const auto rows = explain_model(c, {}, explain_mesh_axes("fsdp=2"), kLink);
  std::map<std::string, std::vector<std::string>> by_unit;
  for (const ExplainRow& r : rows) {
    if (r.axis == "fsdp") by_unit[r.layer] = r.tensors;
  }
  ASSERT_EQ(by_unit.count("fsdp:h.0"), 1u);
  const std::vector<std::string>& block = by_unit["fsdp:h.0"];
  EXPECT_EQ(block.size(), 12u) << "ln_1, c_attn, c_proj, ln_2, c_fc, mlp.c_proj: weight and bias each";
  EXPECT_NE(std::find(block.begin(), block.end(), "h.0.attn.c_attn.weight"), block.end());
  EXPECT_TRUE(std::all_of(block.begin(), block.end(), [](const std::string& t) { return t.rfind("h.0.", 0) == 0; }));
  ASSERT_EQ(by_unit.count("fsdp:gpt"), 1u);
  const std::vector<std::string>& own = by_unit["fsdp:gpt"];
  for (const char* t : {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"}) {
    EXPECT_NE(std::find(own.begin(), own.end(), t), own.end()) << t;
  }
  const std::string table = format_explain_table(rows, {c, {}, explain_mesh_axes("fsdp=2"), kLink, {}});
  EXPECT_NE(table.find("tensors each grouped collective carries:"), std::string::npos) << table;
  EXPECT_NE(table.find("12 tensors: h.0."), std::string::npos) << table;
  // A dp bucket names its members; a tp collective carries no group.
  const auto dp = explain_model(c, {}, explain_mesh_axes("dp=2,tp=2"), kLink);
  for (const ExplainRow& r : dp) {
    if (r.layer == "bucket0") {
      EXPECT_NE(std::find(r.tensors.begin(), r.tensors.end(), "wte.weight"), r.tensors.end());
    }
    if (r.axis == "tp") {
      EXPECT_TRUE(r.tensors.empty()) << r.layer;
    }
  }
}

TEST(ExplainBatch, TargetsAreTheInputsShiftedByOne) {
  const ModelConfig c = small_config("gpt");
  const Batch b = data::make_synthetic_batch(c, 2, 1, 3);
  ASSERT_EQ(b.inputs.shape(), (Shape{2, c.seq}));
  const auto in = b.inputs.to_int64_vector();
  const auto tg = b.targets.to_int64_vector();
  for (std::int64_t r = 0; r < 2; ++r) {
    for (std::int64_t t = 0; t + 1 < c.seq; ++t) EXPECT_EQ(tg[r * c.seq + t], in[r * c.seq + t + 1]);
  }
  for (auto v : in) {
    EXPECT_GE(v, 0);
    EXPECT_LT(v, c.vocab);
  }
}

}  // namespace
}  // namespace meshgrad::diag::test_explain

namespace meshgrad::diag::test_explain {
namespace {

// A pipeline's step, counted on the first rank of each stage: each stage sends its activation of
// every micro-batch forward and receives its gradient back (first the partial axes, 8 bytes, then
// the gradient), the last stage mirrors it, and the tied wte crosses twice (the copy forward, the
// output layer's gradient backward). pp=2, tp=1, 4 micro-batches of 1 row.
TEST(ExplainPipeline, EachStageSendsAndReceivesEveryMicroBatchAndTheTiedWeight) {
  nn::ModelConfig c = nn::ModelConfig::gpt(2, 32, 4, 64, 8, 4);
  const int m = 4;
  const auto rows = explain_model(c, {}, explain_mesh_axes("pp=2"), kLink, {.micro_batches = m});
  const std::int64_t activation = 8 * (4 / m) * 32 * 4, wte = 64 * 32 * 4;
  // (stage, label, phase, op, bytes) -> count
  std::map<std::tuple<int, std::string, std::string, std::string, std::int64_t>, int> seen;
  for (const ExplainRow& r : rows) {
    ASSERT_EQ(r.axis, "pp") << r.layer << " " << r.op << ": a pp=2,tp=1 mesh communicates over pp only";
    ++seen[{r.stage, r.layer, r.phase, r.op, r.bytes}];
  }
  using Key = std::tuple<int, std::string, std::string, std::string, std::int64_t>;
  const std::map<Key, int> expected{
      {{0, "wte copy", "forward", "send", wte}, 1},
      {{0, "pp 0->1", "forward", "send", activation}, m},
      {{0, "pp 0->1", "backward", "recv", 8}, m},
      {{0, "pp 0->1", "backward", "recv", activation}, m},
      {{0, "wte", "backward", "recv", wte}, 1},
      {{1, "wte copy", "forward", "recv", wte}, 1},
      {{1, "pp 0->1", "forward", "recv", activation}, m},
      {{1, "pp 0->1", "backward", "send", 8}, m},
      {{1, "pp 0->1", "backward", "send", activation}, m},
      {{1, "lm_head", "backward", "send", wte}, 1},
  };
  // The step's scalar collectives over pp (none: the norm and the loss are the trainer's, not counted
  // here) and nothing else.
  EXPECT_EQ(seen, expected);
  for (const ExplainRow& r : rows) {
    EXPECT_DOUBLE_EQ(r.predicted_us, kLink.alpha_us + static_cast<double>(r.bytes) / (kLink.beta_gbs * 1e3)) << r.op;
  }
  const std::string table = format_explain_table(rows, {c, {}, explain_mesh_axes("pp=2"), kLink, {.micro_batches = m}});
  EXPECT_NE(table.find("pipeline: 2 stages, schedule 1f1b, 4 micro-batches; bubble (p-1)/(m+p-1) = 0.200"),
            std::string::npos) << table;
  EXPECT_NE(table.find("s1 lm_head"), std::string::npos) << table;
}

TEST(ExplainPipeline, MicroBatchesThatDoNotSplitTheBatchOrNeedAPipelineAreRefused) {
  const nn::ModelConfig c = nn::ModelConfig::gpt(2, 32, 4, 64, 8, 4);
  EXPECT_THROW(explain_model(c, {}, explain_mesh_axes("pp=2"), kLink, {.micro_batches = 3}), InvalidArgument);
  EXPECT_THROW(explain_model(c, {}, explain_mesh_axes("tp=2"), kLink, {.micro_batches = 2}), InvalidArgument);
}

// ---- --link measured: the probe on the run's ranks, its header and json ----------------------------

// A link fitted to exact times of a known link (the fit itself is tested in tests/distributed).
dist::Link synthetic_measured_link() {
  const dist::Link truth{"truth", 1.5, 16.0, "synthetic", std::nullopt};
  std::vector<dist::LinkSample> samples;
  for (double bytes = 1024; bytes <= 4.0 * 1024 * 1024; bytes *= 4) {
    samples.push_back({bytes, dist::ring_all_reduce(2, bytes, truth).time_us});
  }
  dist::Link link = dist::fit_ring_all_reduce_link(2, samples);
  link.measurement->backend = "threads";
  link.measurement->repeats = 3;
  link.measurement->seconds = 0.25;
  return link;
}

TEST(ExplainMeasuredLink, HeaderPrintsTheFitTheSizesAndTheResidual) {
  const ModelConfig c = small_config("mlp");
  const dist::Link link = synthetic_measured_link();
  const auto axes = explain_mesh_axes("tp=2");
  const auto rows = explain_model(c, {}, axes, link);
  const std::string table = format_explain_table(rows, {c, {}, axes, link, {}});
  for (const char* needle : {"link measured: alpha 1.5 us per step, beta 16 GB/s per rank",
                             "ring all-reduce t = 2(n-1)(alpha + bytes/(n beta))",
                             "probe: float32 all_reduce on 2 ranks (threads backend) of 7 sizes: 1.0 KiB, 4.0 KiB, "
                             "16.0 KiB, 64.0 KiB, 256.0 KiB, 1.0 MiB, 4.0 MiB",
                             "fastest of 3 timed blocks; 0.25 s", "measured us", "fitted us",
                             "fit residual: rms 0.0%, max 0.0%", "(predicted on measured:"}) {
    EXPECT_NE(table.find(needle), std::string::npos) << "missing '" << needle << "' in\n" << table;
  }
  // A named link's header has none of it.
  const std::string named = format_link_header(dist::link_preset("shm"));
  EXPECT_EQ(named.find("probe:"), std::string::npos) << named;
  EXPECT_EQ(named.find("fit residual"), std::string::npos) << named;
}

TEST(ExplainMeasuredLink, JsonRowsCarryTheMeasuredLink) {
  const ModelConfig c = small_config("mlp");
  const dist::Link link = synthetic_measured_link();
  const auto rows = explain_model(c, {}, explain_mesh_axes("tp=2"), link);
  ASSERT_FALSE(rows.empty());
  const nlohmann::json j = nlohmann::json::parse(format_explain_json(rows, link));
  ASSERT_TRUE(j.is_array());
  ASSERT_EQ(j.size(), rows.size());
  for (const auto& row : j) {
    ASSERT_TRUE(row.contains("link")) << row.dump();
    EXPECT_EQ(row["link"]["name"], "measured");
    EXPECT_DOUBLE_EQ(row["link"]["alpha_us"].get<double>(), link.alpha_us);
    EXPECT_DOUBLE_EQ(row["link"]["beta_gbs"].get<double>(), link.beta_gbs);
    const auto& m = row["link"]["measurement"];
    EXPECT_EQ(m["ranks"], 2);
    EXPECT_EQ(m["backend"], "threads");
    EXPECT_EQ(m["sizes_bytes"].size(), 7u);
    EXPECT_EQ(m["times_us"].size(), 7u);
    EXPECT_EQ(m["fitted_us"].size(), 7u);
    EXPECT_LT(m["rms_residual"].get<double>(), 1e-12);
  }
  // A named link keeps the documented keys only.
  const nlohmann::json named = nlohmann::json::parse(format_explain_json(rows, kLink));
  for (const auto& row : named) EXPECT_FALSE(row.contains("link")) << row.dump();
}

TEST(ExplainMeasuredLink, ProbesTheRunsRanksAndCostsTheRowsOnTheFit) {
  dist::LinkProbeOptions quick;   // the default sizes and blocks, shorter: see tests/distributed/test_cost_model.cpp
  quick.seconds_per_block = 0.002;
  quick.warmup_seconds = 0.001;
  const auto axes = explain_mesh_axes("tp=2");
  const std::optional<dist::Link> link = measure_mesh_link(
      [&](const std::function<void(const dist::DeviceMeshPtr&)>& fn) { testing::run_on_mesh(2, fn, axes); }, quick);
  ASSERT_TRUE(link.has_value());
  EXPECT_EQ(link->name, "measured");
  EXPECT_GT(link->beta_gbs, 0);
  EXPECT_GE(link->alpha_us, 0);
  ASSERT_TRUE(link->measurement.has_value());
  EXPECT_EQ(link->measurement->ranks, 2);
  EXPECT_EQ(link->measurement->backend, "threads");
  EXPECT_EQ(link->measurement->samples.size(), 7u);
  const auto rows = explain_model(small_config("mlp"), {}, axes, *link);
  ASSERT_FALSE(rows.empty());
  for (const auto& r : rows) {
    EXPECT_DOUBLE_EQ(r.predicted_us, dist::predict_collective(r.op, r.ranks, static_cast<double>(r.bytes), *link).time_us)
        << r.layer << " " << r.op;
  }
  // One rank: nothing to measure, and the error says so.
  try {
    (void)measure_mesh_link(
        [&](const std::function<void(const dist::DeviceMeshPtr&)>& fn) { testing::run_on_mesh(1, fn); }, quick);
    FAIL() << "a 1-rank mesh was measured";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("has 1 rank"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace meshgrad::diag::test_explain
