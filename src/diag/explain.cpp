#include "meshgrad/diag/explain.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/data/synthetic.hpp"
#include "meshgrad/comm/threads.hpp"
#include "meshgrad/distributed/placement.hpp"
#include "meshgrad/optim/grad_sync.hpp"
#include "meshgrad/optim/micro_batches.hpp"
#include "meshgrad/pipeline/executor.hpp"
#include "meshgrad/interop/model_tensors.hpp"
#include "meshgrad/train/step.hpp"
#include "meshgrad/train/trainer.hpp"
#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/error.hpp"
#include "meshgrad/tensor/random.hpp"

namespace meshgrad::diag {

using nn::Model;
using nn::Parameter;

namespace {

constexpr std::uint64_t kModelSeed = 1234;   // any fixed seed: counts and bytes do not depend on values
constexpr std::uint64_t kBatchSeed = 5678;

// The size of the group a record names: one axis ("tp") or several ("tp_row+tp_col", the grid).
int group_size_of(const std::vector<dist::MeshAxis>& axes, const std::string& group) {
  int size = 1;
  std::size_t pos = 0;
  while (pos <= group.size()) {
    const std::size_t plus = std::min(group.find('+', pos), group.size());
    const std::string name = group.substr(pos, plus - pos);
    auto it = std::find_if(axes.begin(), axes.end(), [&](const dist::MeshAxis& a) { return a.name == name; });
    if (it == axes.end()) {
      throw InvalidArgument(fmt::format("explain: a collective ran over mesh axis '{}' but the mesh {} has no such "
                                        "axis", name, dist::mesh_spec(axes)));
    }
    size *= it->size;
    pos = plus + 1;
  }
  return size;
}


// The cost-model op of a recorded op: distributed/ records some metadata exchanges with a qualifier,
// e.g. "all_gather(sizes)" (the shard sizes of an uneven gather); they cost as the plain op.
std::string base_op(const std::string& op) { return op.substr(0, op.find('(')); }

ExplainRow make_row(std::string layer, std::string phase, std::string op, std::string axis, std::int64_t bytes,
                    int ranks, const dist::Link& link, ExplainSource source) {
  const dist::CollectiveCost cost = dist::predict_collective(base_op(op), ranks, static_cast<double>(bytes), link);
  ExplainRow row;
  row.layer = std::move(layer);
  row.phase = std::move(phase);
  row.op = std::move(op);
  row.axis = std::move(axis);
  row.bytes = bytes;
  row.predicted_us = cost.time_us;
  row.ranks = ranks;
  row.algorithm = cost.algorithm;
  row.source = source;
  return row;
}

// Phase order for sorting within a layer: forward, backward, recompute, optimizer, then unknown.
int phase_rank(const std::string& phase) {
  for (int p = 0; p <= static_cast<int>(dist::Phase::Optimizer); ++p) {
    if (phase == dist::phase_name(static_cast<dist::Phase>(p))) return p;
  }
  return 99;
}

// The synchroniser labels its collectives "grad-sync:<what>" (grad_sync.cpp).
constexpr std::string_view kGradSyncPrefix = "grad-sync:";

std::string on_off(bool b) { return b ? "on" : "off"; }

// The model's FLOPs of one step (train::model_flops_per_token, the figure train's MFU divides by),
// for the decoder families (the MLP stack has no parameter list of its own: "").
std::string model_flops_line(const ModelConfig& c) {
  if (c.kind != "gpt" && c.kind != "llama") return "";
  std::int64_t parameters = 0;
  for (const auto& [name, shape] : interop::model_parameter_shapes(c)) parameters += shape_numel(shape);
  const std::int64_t matmul = parameters - train::lookup_only_parameters(c);
  const double per_token = train::model_flops_per_token(c, matmul);
  const double attention_width = c.kind == "llama" ? static_cast<double>(c.heads) * c.head_size() : c.hidden;
  const std::int64_t inactive = train::inactive_expert_parameters(c);
  const std::string which = inactive > 0 ? fmt::format(" active (of {}: {} of {} experts per token)", matmul,
                                                       c.experts_per_token, c.experts)
                                         : std::string();
  return fmt::format("model FLOPs forward + backward: {:.4g} per token = 6 x {} matmul parameters{} + 12 x {} layers x "
                     "seq {} x {:g} attention width; {:.4g} per step of {} tokens\n",
                     per_token, matmul - inactive, which, c.layers, c.seq, attention_width, per_token * c.batch * c.seq,
                     c.batch * c.seq);
}

}  // namespace

const char* explain_source_name(ExplainSource source) {
  switch (source) {
    case ExplainSource::Graph: return "graph";
    case ExplainSource::GradSync: return "grad-sync";
  }
  return "?";
}

std::vector<ExplainRow> rows_from_records(const std::vector<dist::CollectiveRecord>& records,
                                          const std::vector<dist::MeshAxis>& axes, const dist::Link& link) {
  std::vector<ExplainRow> rows;
  rows.reserve(records.size());
  for (const auto& r : records) {
    const bool sync = r.label.rfind(kGradSyncPrefix, 0) == 0;
    rows.push_back(make_row(sync ? r.label.substr(kGradSyncPrefix.size()) : r.label, dist::phase_name(r.phase), r.op,
                            r.axis, r.bytes, group_size_of(axes, r.axis), link,
                            sync ? ExplainSource::GradSync : ExplainSource::Graph));
  }
  return rows;
}

std::vector<ExplainRow> explain_model(const ModelConfig& config, const ParallelConfig& parallel,
                                      const std::vector<dist::MeshAxis>& axes, const dist::Link& link,
                                      const ExplainPipeline& pipe) {
  int world = 1;
  for (const auto& axis : axes) world *= axis.size;
  // The ranks that split the batch, as training splits it: dp, fsdp and ep together.
  int dp_size = 1;
  for (const auto& axis : axes) {
    if (axis.name == "dp" || axis.name == "fsdp" || axis.name == "ep") dp_size *= axis.size;
  }
  const auto pp = std::find_if(axes.begin(), axes.end(), [](const dist::MeshAxis& a) { return a.name == "pp"; });
  const int stages = pp == axes.end() ? 1 : pp->size;
  // Fail before starting ranks when the batch does not split (the same check every rank would make).
  MG_CHECK(config.batch % dp_size == 0,
           "explain: the global batch {} does not split over dp x fsdp x ep = {} ranks (make --batch a multiple of it)",
           config.batch, dp_size);
  MG_CHECK(pipe.micro_batches >= 1 && (config.batch / dp_size) % pipe.micro_batches == 0,
           "explain: each dp replica's {} rows of --batch {} do not divide into {} micro-batches",
           config.batch / dp_size, config.batch, pipe.micro_batches);
  MG_CHECK(stages > 1 || pipe.micro_batches == 1, "explain: --micro-batches {} needs a pipeline (pp=N in --mesh)",
           pipe.micro_batches);

  std::vector<std::vector<dist::CollectiveRecord>> records(static_cast<std::size_t>(stages));   // per stage
  // Per stage: a row's layer -> the tensors it carries (FSDP units, gradient buckets).
  std::vector<std::map<std::string, std::vector<std::string>>> carried(static_cast<std::size_t>(stages));
  blas::ThreadsPerRank blas_policy(world);   // the rank threads share this process's cores
  comm::run_ranks(world, [&](const comm::CommunicatorPtr& comm) {
    auto mesh = std::make_shared<const dist::DeviceMesh>(comm, axes);
    std::unique_ptr<Model> model = nn::make_model(config, parallel, mesh, kModelSeed);
    model->set_training(true);
    const std::vector<Parameter*> params = model->parameters();
    optim::GradientSynchronizer sync(params, mesh,
                                     {.order = model->reduce_order(), .reduce_dtype = parallel.reduce_dtype});
    const Batch global_batch = data::make_synthetic_batch(config, 1, 0, kBatchSeed);
    // The first rank of each stage counts (rank 0 without pp); every rank runs the same step.
    bool counts = true;
    for (int a = 0; a < mesh->ndim(); ++a) {
      if (mesh->axes()[static_cast<std::size_t>(a)].name != "pp" && mesh->coordinate(a) != 0) counts = false;
    }
    const int stage = model->stage().index;
    dist::CommCounter counter;
    {
      std::unique_ptr<dist::CountingScope> counting;
      if (counts) counting = std::make_unique<dist::CountingScope>(counter);
      // The step train runs (train::forward_backward), without the loss's and the norm's scalar
      // collectives, which are the trainer's.
      (void)train::forward_backward(*model, global_batch, *mesh, sync, pipe.micro_batches, pipe.schedule);
    }
    if (counts) {
      records[static_cast<std::size_t>(stage)] = counter.records();
      auto& tensors = carried[static_cast<std::size_t>(stage)];
      for (auto& [label, names] : model->communication_units()) tensors[label] = std::move(names);
      const std::vector<std::vector<std::string>> buckets = sync.buckets();
      for (std::size_t b = 0; b < buckets.size(); ++b) tensors[fmt::format("bucket{}", b)] = buckets[b];
    }
  });
  std::vector<ExplainRow> rows;
  for (int s = 0; s < stages; ++s) {
    const auto& tensors = carried[static_cast<std::size_t>(s)];
    for (ExplainRow& row : rows_from_records(records[static_cast<std::size_t>(s)], axes, link)) {
      row.stage = s;
      if (const auto it = tensors.find(row.layer); it != tensors.end()) row.tensors = it->second;
      rows.push_back(std::move(row));
    }
  }
  return rows;
}

void PhaseTotals::add(const ExplainRow& row) {
  ++count;
  bytes += row.bytes;
  predicted_us += row.predicted_us;
}

std::vector<LayerSummary> summarize_layers(const std::vector<ExplainRow>& rows) {
  std::vector<LayerSummary> out;
  std::map<std::pair<int, std::string>, std::size_t> index;   // (source, layer) -> position in out
  for (const auto& row : rows) {
    const auto key = std::make_pair(static_cast<int>(row.source), row.layer);
    auto it = index.find(key);
    if (it == index.end()) {
      it = index.emplace(key, out.size()).first;
      out.push_back({row.layer, row.source, {}, {}, {}});
    }
    LayerSummary& s = out[it->second];
    if (row.phase == "forward") {
      s.forward.add(row);
    } else if (row.phase == "backward") {
      s.backward.add(row);
    } else {
      s.other.add(row);
    }
  }
  return out;
}

std::vector<PhaseSummary> summarize_phases(const std::vector<ExplainRow>& rows) {
  std::vector<PhaseSummary> out;
  for (ExplainSource source : {ExplainSource::Graph, ExplainSource::GradSync}) {
    std::vector<PhaseSummary> mine;
    for (const auto& row : rows) {
      if (row.source != source) continue;
      auto it = std::find_if(mine.begin(), mine.end(), [&](const PhaseSummary& s) { return s.phase == row.phase; });
      if (it == mine.end()) {
        mine.push_back({row.phase, source, {}});
        it = mine.end() - 1;
      }
      it->totals.add(row);
    }
    std::stable_sort(mine.begin(), mine.end(),
                     [](const PhaseSummary& a, const PhaseSummary& b) { return phase_rank(a.phase) < phase_rank(b.phase); });
    out.insert(out.end(), mine.begin(), mine.end());
  }
  return out;
}

std::string human_bytes(std::int64_t bytes) {
  if (bytes < 1024) return fmt::format("{} B", bytes);
  static const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes) / 1024.0;
  int unit = 0;
  while (value >= 1024.0 && unit < 3) {
    value /= 1024.0;
    ++unit;
  }
  return fmt::format("{:.1f} {}", value, units[unit]);
}

namespace {

// A pipeline's section of the table: the stages, the schedule's bubble, and per stage its
// point-to-point transfers (from the rows) and the micro-batches it keeps in flight.
std::string format_pipeline_section(const std::vector<ExplainRow>& rows, const ExplainHeader& h, int stages) {
  const int m = h.pipeline.micro_batches;
  const pipeline::ScheduleKind kind = h.pipeline.schedule;
  const std::vector<int> counts = nn::stage_layer_counts(h.config.layers, stages, h.parallel.pp_layers);
  const pipeline::Timeline t = pipeline::simulate(kind, stages, m, 1.0, 2.0);
  std::string out = fmt::format(
      "\npipeline: {} stages, schedule {}, {} micro-batches; bubble (p-1)/(m+p-1) = {:.3f} of each stage's step "
      "(the schedule played with forward 1, backward 2: {:.3f})\n",
      stages, pipeline::schedule_name(kind), m, pipeline::ideal_bubble(stages, m),
      *std::max_element(t.idle_fraction.begin(), t.idle_fraction.end()));
  out += fmt::format("  {:<6} {:<8} {:>9} {:>6} {:>6} {:>10} {:>13}\n", "stage", "blocks", "in flight", "sends", "recvs",
                     "p2p bytes", "p2p pred. us");
  int first = 0;
  for (int s = 0; s < stages; ++s) {
    const int n = counts[static_cast<std::size_t>(s)];
    int sends = 0, recvs = 0;
    std::int64_t bytes = 0;
    double us = 0;
    for (const ExplainRow& r : rows) {
      if (r.stage != s || (r.op != "send" && r.op != "recv")) continue;
      (r.op == "send" ? sends : recvs) += 1;
      bytes += r.bytes;
      us += r.predicted_us;
    }
    out += fmt::format("  {:<6} {:<8} {:>9} {:>6} {:>6} {:>10} {:>13.2f}\n", s, fmt::format("{}..{}", first, first + n - 1),
                       pipeline::peak_in_flight(pipeline::stage_actions(kind, stages, s, m)), sends, recvs,
                       human_bytes(bytes), us);
    first += n;
  }
  out += "  (sends and receives of activations and their gradients, and of the tied wte between the first and\n"
         "   last stage; a stage's receives wait for its neighbour, which is where the bubble shows)\n";
  return out;
}

}  // namespace

std::string format_explain_table(const std::vector<ExplainRow>& stage_rows, const ExplainHeader& h) {
  const ModelConfig& c = h.config;
  int world = 1, stages = 1;
  for (const auto& axis : h.axes) {
    world *= axis.size;
    if (axis.name == "pp") stages = axis.size;
  }
  // A pipeline's rows name their stage with their layer ("s1 h.2.attn"): each stage has its own.
  std::vector<ExplainRow> rows = stage_rows;
  if (stages > 1) {
    for (ExplainRow& r : rows) r.layer = fmt::format("s{} {}", r.stage, r.layer.empty() ? "(unlabelled)" : r.layer);
  }
  std::string out;
  out += fmt::format("meshgrad explain: model {}, layers {}, hidden {}, ffn {}, heads {}{}, vocab {}, seq {}, batch {}, {}\n",
                     c.kind, c.layers, c.hidden, c.ffn_size(), c.heads,
                     c.kind == "llama" ? fmt::format(" (kv heads {}, head dim {})", c.kv_head_count(), c.head_size())
                                       : std::string(),
                     c.vocab, c.seq, c.batch, dtype_name(c.dtype));
  out += model_flops_line(c);
  out += stages > 1
             ? fmt::format("mesh {} ({} ranks), sequence parallel {}; counted on the first rank of each stage over one "
                           "pipeline step of {} micro-batches\n", dist::mesh_spec(h.axes), world,
                           on_off(h.parallel.sequence_parallel), h.pipeline.micro_batches)
             : fmt::format("mesh {} ({} ranks), sequence parallel {}; counted on rank 0 over one forward + backward\n",
                           dist::mesh_spec(h.axes), world, on_off(h.parallel.sequence_parallel));
  out += format_link_header(h.link);
  out += "bytes: nccl-tests size (the whole gathered / unreduced buffer); n: ranks in the axis' group\n";

  // The layer column fits the longest name (Llama's "model.layers.0.self_attn.q_proj.weight").
  std::size_t width = 28;
  for (const auto& row : rows) width = std::max(width, row.layer.size() + 1);
  const auto print_rows = [&](ExplainSource source) {
    std::string text;
    // Layers in order of first appearance; within a layer, by phase, then in issue order.
    std::vector<std::string> layers;
    for (const auto& row : rows) {
      if (row.source == source && std::find(layers.begin(), layers.end(), row.layer) == layers.end()) {
        layers.push_back(row.layer);
      }
    }
    text += fmt::format("{:<{}} {:<10} {:<15} {:<4} {:>3} {:>10} {:>12} {:<15} {:>13}\n", "layer", width, "phase", "op",
                        "axis", "n", "bytes", "exact bytes", "algorithm", "predicted us");
    for (const auto& layer : layers) {
      std::vector<const ExplainRow*> mine;
      for (const auto& row : rows) {
        if (row.source == source && row.layer == layer) mine.push_back(&row);
      }
      std::stable_sort(mine.begin(), mine.end(), [](const ExplainRow* a, const ExplainRow* b) {
        return phase_rank(a->phase) < phase_rank(b->phase);
      });
      bool first = true;
      for (const ExplainRow* row : mine) {
        text += fmt::format("{:<{}} {:<10} {:<15} {:<4} {:>3} {:>10} {:>12} {:<15} {:>13.2f}\n",
                            first ? (layer.empty() ? "(unlabelled)" : layer) : "", width, row->phase, row->op, row->axis,
                            row->ranks, human_bytes(row->bytes), row->bytes, row->algorithm, row->predicted_us);
        first = false;
      }
    }
    return text;
  };

  const bool any_graph = std::any_of(rows.begin(), rows.end(), [](const ExplainRow& r) { return r.source == ExplainSource::Graph; });
  const bool any_sync = std::any_of(rows.begin(), rows.end(), [](const ExplainRow& r) { return r.source == ExplainSource::GradSync; });
  out += "\ncollectives of the model's graph (recorded while it ran):\n";
  out += any_graph ? print_rows(ExplainSource::Graph) : "  none (every axis has size 1)\n";
  if (any_sync) {
    out += "\ngradient synchronizer (not in the graph: issued by the trainer before the optimizer step;\n"
           "one all-reduce per parameter's local gradient: over tp for gradients partial over tp, over dp for all):\n";
    out += print_rows(ExplainSource::GradSync);
  }

  // What the grouped collectives carry: an FSDP unit's tensors, a gradient bucket's.
  std::vector<std::string> listed;
  std::string carried;
  for (const auto& row : rows) {
    if (row.tensors.empty() || std::find(listed.begin(), listed.end(), row.layer) != listed.end()) continue;
    listed.push_back(row.layer);
    std::string names;
    for (const std::string& t : row.tensors) names += (names.empty() ? "" : ", ") + t;
    carried += fmt::format("  {:<{}} {} tensors: {}\n", row.layer, width - 2, row.tensors.size(), names);
  }
  if (!carried.empty()) out += "\ntensors each grouped collective carries:\n" + carried;

  out += fmt::format("\n{:<{}} {:>3} {:>10} {:>12} {:>9} {:>10} {:>12}\n", "per layer (graph)", width, "fwd", "fwd bytes",
                     "fwd us", "bwd", "bwd bytes", "bwd us");
  for (const LayerSummary& s : summarize_layers(rows)) {
    if (s.source != ExplainSource::Graph) continue;
    out += fmt::format("  {:<{}} {:>3} {:>10} {:>12.2f} {:>9} {:>10} {:>12.2f}{}\n", s.layer.empty() ? "(unlabelled)" : s.layer, width - 2,
                       s.forward.count, human_bytes(s.forward.bytes), s.forward.predicted_us, s.backward.count,
                       human_bytes(s.backward.bytes), s.backward.predicted_us,
                       s.other.count > 0 ? fmt::format("  (+{} recompute/optimizer, {:.2f} us)", s.other.count,
                                                       s.other.predicted_us)
                                         : std::string());
  }

  out += fmt::format("\n{:<28} {:>11} {:>10} {:>12} {:>13}\n", "totals", "collectives", "bytes", "exact bytes",
                     "predicted us");
  PhaseTotals all;
  for (const PhaseSummary& s : summarize_phases(rows)) {
    out += fmt::format("  {:<26} {:>11} {:>10} {:>12} {:>13.2f}\n",
                       fmt::format("{} {}", explain_source_name(s.source), s.phase), s.totals.count,
                       human_bytes(s.totals.bytes), s.totals.bytes, s.totals.predicted_us);
    all.count += s.totals.count;
    all.bytes += s.totals.bytes;
    all.predicted_us += s.totals.predicted_us;
  }
  out += fmt::format("  {:<26} {:>11} {:>10} {:>12} {:>13.2f}\n", "all", all.count, human_bytes(all.bytes), all.bytes,
                     all.predicted_us);
  out += fmt::format("(predicted on {}: collectives one after another, no overlap with compute)\n", h.link.name);
  if (stages > 1) out += format_pipeline_section(stage_rows, h, stages);
  return out;
}

std::string format_link_header(const dist::Link& link) {
  std::string out = fmt::format("link {}: alpha {:g} us per step, beta {:g} GB/s per rank ({})\n", link.name,
                                link.alpha_us, link.beta_gbs, link.source);
  if (!link.measurement) return out;
  const dist::LinkMeasurement& m = *link.measurement;
  std::string sizes;
  for (const dist::LinkSample& s : m.samples) {
    sizes += (sizes.empty() ? "" : ", ") + human_bytes(static_cast<std::int64_t>(s.bytes));
  }
  out += fmt::format("  probe: {} all_reduce on {} ranks ({} backend) of {} sizes: {}; each time the slowest rank's, "
                     "the fastest of {} timed blocks; {:.2f} s\n",
                     m.dtype, m.ranks, m.backend.empty() ? "no" : m.backend, m.samples.size(), sizes, m.repeats,
                     m.seconds);
  std::string bytes_line = fmt::format("  {:<13}", "bytes"), measured = fmt::format("  {:<13}", "measured us"),
              fitted = fmt::format("  {:<13}", "fitted us");
  for (std::size_t i = 0; i < m.samples.size(); ++i) {
    bytes_line += fmt::format(" {:>10}", static_cast<std::int64_t>(m.samples[i].bytes));
    measured += fmt::format(" {:>10.2f}", m.samples[i].time_us);
    fitted += fmt::format(" {:>10.2f}", i < m.fitted_us.size() ? m.fitted_us[i] : 0.0);
  }
  out += bytes_line + "\n" + measured + "\n" + fitted + "\n";
  out += fmt::format("  fit residual: rms {:.1f}%, max {:.1f}% of the measured times{}\n", 100 * m.rms_residual,
                     100 * m.max_residual,
                     m.alpha_clamped ? " (the free fit's alpha was negative: fitted through 0 with alpha = 0)" : "");
  return out;
}

namespace {

nlohmann::ordered_json row_json(const ExplainRow& row) {
  return {{"layer", row.layer},
          {"phase", row.phase},
          {"op", row.op},
          {"axis", row.axis},
          {"bytes", row.bytes},
          {"predicted_us", row.predicted_us},
          {"tensors", row.tensors}};
}

nlohmann::ordered_json link_json(const dist::Link& link) {
  nlohmann::ordered_json j = {{"name", link.name},
                              {"alpha_us", link.alpha_us},
                              {"beta_gbs", link.beta_gbs},
                              {"source", link.source}};
  if (link.measurement) {
    const dist::LinkMeasurement& m = *link.measurement;
    std::vector<double> sizes, times;
    for (const dist::LinkSample& s : m.samples) {
      sizes.push_back(s.bytes);
      times.push_back(s.time_us);
    }
    j["measurement"] = {{"ranks", m.ranks},
                        {"backend", m.backend},
                        {"dtype", m.dtype},
                        {"algorithm", "ring all_reduce: t = 2(n-1)(alpha + bytes/(n beta))"},
                        {"sizes_bytes", sizes},
                        {"times_us", times},
                        {"fitted_us", m.fitted_us},
                        {"rms_residual", m.rms_residual},
                        {"max_residual", m.max_residual},
                        {"alpha_clamped", m.alpha_clamped},
                        {"repeats", m.repeats},
                        {"seconds", m.seconds}};
  }
  return j;
}

}  // namespace

std::string format_explain_json(const std::vector<ExplainRow>& rows) {
  nlohmann::ordered_json list = nlohmann::ordered_json::array();   // keys in the documented order
  for (const auto& row : rows) list.push_back(row_json(row));
  return list.dump(2) + "\n";
}

std::string format_explain_json(const std::vector<ExplainRow>& rows, const dist::Link& link) {
  if (!link.measurement) return format_explain_json(rows);
  // A measured link travels with every row: the list stays a list of rows, and each says what costed it.
  const nlohmann::ordered_json described = link_json(link);
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (const auto& row : rows) {
    nlohmann::ordered_json j = row_json(row);
    j["link"] = described;
    list.push_back(std::move(j));
  }
  return list.dump(2) + "\n";
}

std::optional<dist::Link> measure_mesh_link(const dist::RunOnMesh& run_on_mesh, const dist::LinkProbeOptions& options) {
  std::optional<dist::Link> out;
  run_on_mesh([&](const dist::DeviceMeshPtr& mesh) {
    dist::Link link = dist::measure_link(*mesh->world(), options);   // collective: every rank
    if (mesh->world()->rank() == 0) out = std::move(link);            // written by one rank thread only
  });
  return out;
}

}  // namespace meshgrad::diag
