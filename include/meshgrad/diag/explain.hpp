// `meshgrad explain`: where a tensor-parallel model communicates, and what the alpha-beta model
// (distributed/cost_model.hpp) predicts each collective costs on a chosen link.
//
// The counts are produced by running the model, not written down: explain_model starts the ranks,
// builds the model, runs one forward (loss) and one backward on a synthetic batch with a
// CommCounter active on rank 0's thread, and turns rank 0's records into rows. A drift between the
// code and this report is therefore impossible; a drift between the code and the DESIGN table is
// caught by tests/diag/test_explain.cpp, which asserts the table's counts.
//
// The gradient synchronisation is not predicted either: the step runs with the trainer's
// GradientSynchronizer (optim/grad_sync.hpp), whose collectives (labelled "grad-sync:<parameter>"
// for a tp reduction, "grad-sync:bucket<i>" for a dp bucket) become rows of source GradSync:
//   - a parameter whose gradient is partial over a tp axis (a replicated parameter used on
//     sequence-sharded data, e.g. LayerNorm under sequence parallelism): all_reduce over that axis;
//   - with dp > 1, one in-place all_reduce over dp per bucket of gradients.
//
// The link is a preset, the user's numbers, or measured (`--link measured`): measure_mesh_link times
// an all-reduce sweep on the run's ranks and fits alpha and beta (dist::measure_link), and the rows
// are costed on the fitted link; the table's header and the json carry the probe and the fit.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/cost_model.hpp"
#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/nn/model.hpp"
#include "meshgrad/pipeline/schedule.hpp"

namespace meshgrad::diag {

using nn::Batch;
using nn::ModelConfig;
using nn::ParallelConfig;

enum class ExplainSource {
  Graph,     // recorded by the CommCounter while the model's forward and backward ran
  GradSync,  // the gradient synchronizer's all-reduces (not part of the graph; see above)
};
const char* explain_source_name(ExplainSource source);   // "graph", "grad-sync"

struct ExplainRow {
  std::string layer;        // the CommLabelScope label ("h.0.mlp.c_proj"); GradSync: the parameter or "bucket<i>"
  std::string phase;        // "forward", "backward", "recompute", "optimizer" (GradSync: "backward")
  std::string op;           // as recorded: "all_reduce", "all_gather", ... (a qualified "all_gather(sizes)" costs as all_gather)
  std::string axis;         // mesh axis ("tp", "dp")
  std::int64_t bytes = 0;   // nccl-tests size: the whole gathered / unreduced buffer
  double predicted_us = 0;  // dist::predict_collective(op, ranks, bytes, link)
  int ranks = 1;            // size of the axis' group (n of the cost model)
  std::string algorithm;    // the cost model's choice ("ring", "tree", ...)
  ExplainSource source = ExplainSource::Graph;
  int stage = 0;            // the pipeline stage whose first rank issued it (0 without pp)
  // The parameters the collective carries, when it moves a group of them: an FSDP unit's
  // (nn::Model::communication_units) or a gradient bucket's (GradientSynchronizer::buckets); else empty.
  std::vector<std::string> tensors;
};

// A pipeline's part of the report (a mesh with pp > 1): the micro-batches of the step and the
// schedule that orders them.
struct ExplainPipeline {
  int micro_batches = 1;
  pipeline::ScheduleKind schedule = pipeline::ScheduleKind::OneFOneB;
};

// Rows for collective records (rank 0's), costed on link with n = the size of the record's axis
// in `axes` (throws naming the axis when the mesh has no such axis).
std::vector<ExplainRow> rows_from_records(const std::vector<dist::CollectiveRecord>& records,
                                          const std::vector<dist::MeshAxis>& axes, const dist::Link& link);

// Runs the model's forward and backward once, with the gradient synchroniser, on world = product
// of the mesh sizes rank threads (see the top of this file) and returns the rows in the order rank
// 0 issued them. axes: the mesh (the CLI's --mesh parsed; needs "dp" and "tp", or "tp_row" and
// "tp_col"). Every rank runs the same step; only rank 0 is counted. Throws (from the ranks) on an
// invalid configuration, naming what was wrong.
// With a pp axis of P > 1 stages the step is a pipeline step of `pipeline.micro_batches` through the
// stages (pipeline/executor.hpp), and the first rank of every stage (coordinate 0 on the other axes)
// is counted: rows carry their stage, and a stage's sends and receives are rows of their own.
std::vector<ExplainRow> explain_model(const ModelConfig& config, const ParallelConfig& parallel,
                                      const std::vector<dist::MeshAxis>& axes, const dist::Link& link,
                                      const ExplainPipeline& pipeline = {});

// The link of `--link measured`: on every rank run_on_mesh starts (the threads backend's rank threads,
// or the MPI world under mpirun), dist::measure_link over the mesh's world communicator, whose size
// must be >= 2 (InvalidArgument naming the size otherwise). Returns the fitted link (the same on every
// rank), or nullopt in an MPI process that does not hold mesh rank 0.
std::optional<dist::Link> measure_mesh_link(const dist::RunOnMesh& run_on_mesh,
                                            const dist::LinkProbeOptions& options = {});

// Aggregates. Layers appear in the order of their first row; phases in Phase order.
struct PhaseTotals {
  int count = 0;
  std::int64_t bytes = 0;
  double predicted_us = 0;
  void add(const ExplainRow& row);
};
struct LayerSummary {
  std::string layer;
  ExplainSource source = ExplainSource::Graph;
  PhaseTotals forward, backward, other;   // other: recompute / optimizer
};
std::vector<LayerSummary> summarize_layers(const std::vector<ExplainRow>& rows);
struct PhaseSummary {
  std::string phase;
  ExplainSource source = ExplainSource::Graph;
  PhaseTotals totals;
};
// Totals per (source, phase), graph first.
std::vector<PhaseSummary> summarize_phases(const std::vector<ExplainRow>& rows);

// "1.5 KiB", "12 B", "3.0 MiB" (powers of 1024).
std::string human_bytes(std::int64_t bytes);

// What the report says about the run (printed in the table's header).
struct ExplainHeader {
  ModelConfig config;
  ParallelConfig parallel;
  std::vector<dist::MeshAxis> axes;
  dist::Link link;
  ExplainPipeline pipeline{};
};
// The table: per layer its collectives (phase, op, axis, n, bytes human-readable and exact,
// algorithm, predicted us), then the per-layer and per-phase totals and the link used. A measured
// link's header also has the probe's sizes, measured and fitted times and the fit's residual.
std::string format_explain_table(const std::vector<ExplainRow>& rows, const ExplainHeader& header);
// The link's lines of the table's header (format_explain_table prints them).
std::string format_link_header(const dist::Link& link);
// The json: a list of objects with exactly the keys layer, phase, op, axis, bytes, predicted_us,
// tensors; with a measured link (link.measurement) every object also has "link": the fitted link
// (name, alpha_us, beta_gbs, source) and its "measurement" (ranks, backend, dtype, algorithm,
// sizes_bytes, times_us, fitted_us, rms_residual, max_residual, alpha_clamped, repeats, seconds).
std::string format_explain_json(const std::vector<ExplainRow>& rows);
std::string format_explain_json(const std::vector<ExplainRow>& rows, const dist::Link& link);

}  // namespace meshgrad::diag
