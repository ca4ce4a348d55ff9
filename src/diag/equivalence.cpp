// The mesh model against the one-rank model (contracts and the criterion in diag/equivalence.hpp).
#include "meshgrad/diag/equivalence.hpp"

#include "meshgrad/tensor/kernels.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <mutex>

#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/checkpoint/directory.hpp"
#include "meshgrad/checkpoint/parameter_file.hpp"
#include "meshgrad/checkpoint/reader.hpp"
#include "meshgrad/comm/threads.hpp"
#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/tensor/random.hpp"
#include "meshgrad/data/dataset.hpp"
#include "meshgrad/data/synthetic.hpp"
#include "meshgrad/optim/grad_sync.hpp"
#include "meshgrad/nn/parallel_context.hpp"
#include "meshgrad/optim/adamw.hpp"
#include "meshgrad/pipeline/executor.hpp"
#include "meshgrad/train/trainer.hpp"

namespace meshgrad::diag {

namespace {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// What one run produces on its rank 0, every tensor full and in float64: per step losses and
// gradients, the initial and the final weights.
struct RunResult {
  std::vector<double> losses;
  std::vector<std::string> order;                      // parameter names, forward order
  std::map<std::string, Tensor> initial, weights;
  std::map<std::string, std::vector<Tensor>> grads;   // per step
  dist::CommCounter first_step;   // collectives of step 1
  bool collected = false;          // filled: this process hosted the mesh's rank 0
};

// take(p) of every parameter as full float64 copies (never the parameter's or gradient's own storage,
// which later steps overwrite: gather_full of one rank and to() of float64 return their input); on
// the mesh's rank 0 every stage's, in forward order. Collective over the mesh; not counted.
NamedTensors gather_full(const nn::Model& model, const std::vector<nn::Parameter*>& params,
                         const dist::DeviceMesh& mesh, const std::function<Tensor(nn::Parameter&)>& take) {
  dist::CommCounter ignored;
  dist::CountingScope not_counted(ignored);
  NamedTensors full;
  for (nn::Parameter* p : params) full.emplace_back(p->name, nn::gather_full(take(*p), *p).to(DType::Float64).clone());
  const dist::ProcessGroup* stages = pipeline::parameter_stages(model, mesh);
  if (stages != nullptr && nn::parameter_shard_group(mesh, params).rank() == 0) {
    // Every stage's tensors to stage 0 (whose first rank is the mesh's rank 0).
    full = checkpoint::collect_on_first_stage(std::move(full), *stages);
  }
  return full;
}

Tensor weight_of(nn::Parameter& p) { return p.value.detach(); }
Tensor grad_of(nn::Parameter& p) {
  Tensor g = p.value.grad();
  return g.defined() ? g : Tensor::zeros(p.value.shape(), p.value.dtype());
}

// Copies this rank's pieces of checkpoint dir's parameters into params (the optimizer state is not read).
void load_checkpoint_parameters(const std::string& dir, const std::vector<nn::Parameter*>& params) {
  const checkpoint::Manifest manifest = checkpoint::read_manifest(dir);
  std::vector<checkpoint::PieceRequest> requests;
  for (const nn::Parameter* p : params) requests.push_back({p->name, p->full_shape, p->layout(), p->value.dtype()});
  const std::vector<Tensor> pieces = checkpoint::read_pieces(dir, manifest, requests);
  autograd::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params.size(); ++i) params[i]->value.detach().copy_from(pieces[i]);
}

// Trains on `mesh`; fills result on the mesh's rank 0. Every rank must call it. model_seed 0: the
// parameters come from o.checkpoint. grad_accum: micro-batches per step (the single-rank reference
// of a TP-invariant dp mesh runs dp of them, the same micro-batches the replicas run, added in the
// same tree).
void train_and_collect(const EquivalenceOptions& o, const dist::DeviceMeshPtr& mesh, std::uint64_t model_seed,
                       RunResult& result, std::mutex& mu, int grad_accum = 1) {
  const kernels::ProductPrecisionScope precision(o.precision == "bf16" ? kernels::ProductPrecision::BFloat16
                                                                        : kernels::ProductPrecision::Float32);
  auto model = nn::make_model(o.model, o.parallel, mesh, model_seed != 0 ? model_seed : 1);
  model->set_training(false);   // the comparison runs without dropout noise
  auto params = model->parameters();
  if (model_seed == 0) load_checkpoint_parameters(o.checkpoint, params);
  optim::GradientSynchronizer sync(params, mesh, {.order = model->reduce_order()});
  optim::AdamWOptions adam;
  adam.lr = o.lr;
  optim::AdamW optimizer(params, mesh, adam);
  RunResult run;
  const NamedTensors initial = gather_full(*model, params, *mesh, weight_of);
  dist::CommCounter counter;
  for (int step = 0; step < o.steps; ++step) {
    dist::CommCounter step_counter;
    {
      dist::CountingScope counting(step == 0 ? counter : step_counter);
      const nn::Batch global_batch =
          data::make_synthetic_batch(o.model, 1, 0, o.seed * 1000003 + static_cast<std::uint64_t>(step));
      const Tensor loss = train::train_step(*model, global_batch, *mesh, sync, optimizer, 0, grad_accum).loss;
      // The global loss: each dp rank's share summed (outside the counted phases).
      dist::CommCounter ignored;
      dist::CountingScope not_counted(ignored);
      run.losses.push_back(train::global_loss(loss, *mesh, *model));
    }
    for (auto& [name, g] : gather_full(*model, params, *mesh, grad_of)) run.grads[name].push_back(g);
  }
  for (auto& [name, w] : initial) {
    run.order.push_back(name);
    run.initial[name] = w;
  }
  for (auto& [name, w] : gather_full(*model, params, *mesh, weight_of)) run.weights[name] = w;
  if (mesh->rank() == 0) {
    std::lock_guard<std::mutex> lock(mu);
    run.first_step = counter;
    run.collected = true;
    result = std::move(run);
  }
}

// The larger of a and b, NaN when either is: std::max(a, NaN) is a (NaN compares false), so a NaN
// error would vanish from a running maximum and pass every "<= tolerance" test downstream.
double worse(double a, double b) { return std::isnan(a) || std::isnan(b) ? std::nan("") : std::max(a, b); }

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = worse(m, std::abs(x));
  return m;
}

// {max |a - b|, that / max |b|} (the absolute difference where b is all zero); NaN when any element
// of either is NaN, or both are the same infinity (inf - inf).
std::pair<double, double> max_differences(const Tensor& a, const Tensor& b) {
  const auto va = a.to_vector();
  const auto vb = b.to_vector();
  double diff = 0;
  for (std::size_t i = 0; i < vb.size(); ++i) diff = worse(diff, std::abs(va[i] - vb[i]));
  const double scale = max_abs(vb);
  return {diff, scale > 0 ? diff / scale : diff};
}

// Appends to `found` what of `run` is not finite (NaN or infinite): the losses by step, the initial
// weights, the gradients by step and the final weights by parameter; `side` names the run.
void find_non_finite(const RunResult& run, const char* side, std::vector<std::string>& found) {
  const auto finite = [](const Tensor& t) {
    const auto v = t.to_vector();
    return std::all_of(v.begin(), v.end(), [](double x) { return std::isfinite(x); });
  };
  for (std::size_t i = 0; i < run.losses.size(); ++i) {
    if (!std::isfinite(run.losses[i])) found.push_back(fmt::format("{} loss of step {} ({})", side, i + 1, run.losses[i]));
  }
  for (const std::string& name : run.order) {
    if (run.initial.count(name) && !finite(run.initial.at(name))) found.push_back(fmt::format("{} initial {}", side, name));
    if (run.grads.count(name)) {
      const auto& steps = run.grads.at(name);
      for (std::size_t i = 0; i < steps.size(); ++i) {
        if (!finite(steps[i])) found.push_back(fmt::format("{} gradient of {} at step {}", side, name, i + 1));
      }
    }
    if (run.weights.count(name) && !finite(run.weights.at(name))) found.push_back(fmt::format("{} final {}", side, name));
  }
}

// Per element: true when the reference gradient is at the floor (|g| <= floor x max |g|) at some step.
std::vector<bool> floor_elements(const std::vector<Tensor>& reference_grads, double floor) {
  std::vector<bool> at_floor;
  for (const Tensor& g : reference_grads) {
    const auto v = g.to_vector();
    at_floor.resize(v.size(), false);
    const double bound = floor * max_abs(v);
    for (std::size_t i = 0; i < v.size(); ++i) at_floor[i] = at_floor[i] || std::abs(v[i]) <= bound;
  }
  return at_floor;
}

// Fills d's update fields: |u_mesh - u_ref| / (lr K) over settled and over floor elements.
void compare_updates(const RunResult& mesh, const RunResult& ref, const std::string& name, double movement,
                     double floor, ParameterDifference& d) {
  const auto w0m = mesh.initial.at(name).to_vector(), wkm = mesh.weights.at(name).to_vector();
  const auto w0r = ref.initial.at(name).to_vector(), wkr = ref.weights.at(name).to_vector();
  const std::vector<bool> at_floor = floor_elements(ref.grads.at(name), floor);
  d.elements = static_cast<std::int64_t>(w0r.size());
  for (std::size_t i = 0; i < w0r.size(); ++i) {
    const double e = std::abs((wkm[i] - w0m[i]) - (wkr[i] - w0r[i])) / movement;
    double& worst = at_floor[i] ? d.floor_update_max_rel : d.update_max_rel;
    worst = worse(worst, e);
    d.floor_elements += at_floor[i] ? 1 : 0;
  }
}

ParameterDifference compare_parameter(const RunResult& mesh, const RunResult& ref, const std::string& name,
                                      const EquivalenceOptions& o, const Tolerances& t) {
  ParameterDifference d;
  d.name = name;
  MG_CHECK(mesh.grads.count(name) && mesh.weights.count(name) && mesh.initial.count(name),
           "check: parameter {} missing on the mesh", name);
  d.init_max_rel = max_differences(mesh.initial.at(name), ref.initial.at(name)).second;
  const auto& gm = mesh.grads.at(name);
  const auto& gr = ref.grads.at(name);
  // Step 1's: both models hold the same weights there, so a difference is the computation's. Later
  // steps' gradients are taken at weights that Adam already moved apart (the floor elements), and the
  // update test covers them.
  std::tie(d.grad_max_abs, d.grad_max_rel) = max_differences(gm.front(), gr.front());
  compare_updates(mesh, ref, name, o.lr * o.steps, t.floor, d);
  d.passed = d.init_max_rel <= t.init && d.grad_max_rel <= t.grad && d.update_max_rel <= t.update &&
             d.floor_update_max_rel <= t.floor_update;
  return d;
}

// The largest error / tolerance of d.
double margin_of(const ParameterDifference& d, const Tolerances& t) {
  return worse(worse(d.init_max_rel / t.init, d.grad_max_rel / t.grad),
               worse(d.update_max_rel / t.update, d.floor_update_max_rel / t.floor_update));
}

EquivalenceReport compare_runs(const RunResult& mesh, const RunResult& ref, const EquivalenceOptions& o) {
  EquivalenceReport report;
  report.tolerance = tolerances_for(o.model.dtype, o.precision);
  const Tolerances& t = report.tolerance;
  report.reference_losses = ref.losses;
  report.mesh_losses = mesh.losses;
  for (std::size_t i = 0; i < ref.losses.size() && i < mesh.losses.size(); ++i) {
    const double d = std::abs(ref.losses[i] - mesh.losses[i]) / std::max(1e-300, std::abs(ref.losses[i]));
    report.max_loss_difference = worse(report.max_loss_difference, d);
  }
  // Every test below is "error <= tolerance", false for NaN; the non-finite values are also named,
  // since two runs that both blow up can agree (or be NaN) everywhere.
  find_non_finite(ref, "reference", report.non_finite);
  find_non_finite(mesh, "mesh", report.non_finite);
  report.passed = report.max_loss_difference <= t.loss && report.non_finite.empty();
  report.margin = report.max_loss_difference / t.loss;
  for (const auto& name : ref.order) {
    ParameterDifference d = compare_parameter(mesh, ref, name, o, t);
    if (!d.passed && report.first_divergence.empty()) report.first_divergence = name;
    report.passed = report.passed && d.passed;
    report.margin = worse(report.margin, margin_of(d, t));
    report.parameters.push_back(std::move(d));
  }
  for (const auto& r : mesh.first_step.records()) {
    auto& cell = report.collectives[dist::phase_name(r.phase)][r.op + "[" + r.axis + "]"];
    cell.first += 1;
    cell.second += r.bytes;
  }
  return report;
}

}  // namespace

Tolerances tolerances_for(DType dtype, const std::string& precision) {
  // Stated and justified in diag/equivalence.hpp.
  if (precision == "bf16") {
    return {.init = 1e-6, .grad = 1e-2, .floor = 1e-1, .update = 1e-1, .floor_update = 2.5, .loss = 1e-4};
  }
  if (dtype == DType::Float64) {
    return {.init = 1e-12, .grad = 1e-9, .floor = 1e-7, .update = 1e-6, .floor_update = 2.5, .loss = 1e-12};
  }
  return {.init = 1e-6, .grad = 1e-5, .floor = 1e-3, .update = 1e-2, .floor_update = 2.5, .loss = 1e-5};
}

EquivalenceReport check_equivalence(const EquivalenceOptions& o, const dist::RunOnMesh& run_on_mesh) {
  MG_CHECK(o.steps >= 1, "check: --steps must be at least 1, got {}", o.steps);
  MG_CHECK(o.precision == "float32" || o.precision == "bf16", "check: --precision must be float32 or bf16, got '{}'",
           o.precision);
  MG_CHECK(o.precision == "float32" || o.model.dtype == DType::Float32, "check: --precision bf16 needs --dtype float32 "
           "(its master weights and accumulation are float32), got --dtype {}", o.model.dtype);
  MG_CHECK(o.lr > 0, "check: --lr must be positive (the weights are compared by their update relative to lr), got {}",
           o.lr);
  std::mutex mu;
  RunResult reference, sharded;
  int mesh_dp = 1;   // the mesh's dp x fsdp (the TP-invariant reference runs that many micro-batches)
  // Seed 0 below: the parameters come from the checkpoint.
  const std::uint64_t reference_seed = o.checkpoint.empty() ? o.seed : 0;
  const std::uint64_t mesh_seed = o.mesh_seed != 0 ? o.mesh_seed : reference_seed;
  run_on_mesh([&](const dist::DeviceMeshPtr& mesh) {
    const int split = train::batch_split_size(*mesh);
    if (o.parallel.mesh_invariant()) {
      train::check_mesh_invariant_split(o.model.batch, split, o.micro_batches, o.parallel.batch_blocks);
    }
    if (mesh->has_axis("pp") && mesh->axis_size("pp") > 1) {
      // As train refuses it: a pipeline's micro-batches are of equal rows (their activations are
      // sent between stages in one shape).
      const int micro = train::micro_batches_per_replica(o.parallel, *mesh, o.micro_batches);
      MG_CHECK(o.model.batch % split == 0 && (o.model.batch / split) % micro == 0,
               "check: --micro-batches {} on {}: each data-parallel replica's {} rows of --batch {} must divide into "
               "{} micro-batches of equal rows", micro, mesh->str(), o.model.batch / split, o.model.batch, micro);
    }
    if (mesh->rank() == 0) mesh_dp = split;
    train_and_collect(o, mesh, mesh_seed, sharded, mu, train::micro_batches_per_replica(o.parallel, *mesh, o.micro_batches));
  });
  if (!sharded.collected) {
    // Under mpi, ranks other than 0 live in other processes: the results (and the verdict) are rank 0's.
    EquivalenceReport report;
    report.passed = true;
    report.compared = false;
    return report;
  }
  // The reference: the same model on one rank.
  comm::run_ranks(1, [&](const comm::CommunicatorPtr& world) {
    auto mesh = std::make_shared<const dist::DeviceMesh>(world, std::vector<dist::MeshAxis>{{"dp", 1}, {"tp", 1}});
    EquivalenceOptions ro = o;
    ro.parallel.pp_layers.clear();   // a pipeline's split means nothing on one rank
    // Mesh-invariant: one micro-batch per row block; TP-invariant: the mesh's dp x fsdp x micro-batches.
    const int micro = o.parallel.mesh_invariant() ? train::micro_batches_per_replica(o.parallel, *mesh, o.micro_batches)
                      : o.parallel.tp_invariant() ? mesh_dp * o.micro_batches
                                                : o.micro_batches;
    train_and_collect(ro, mesh, reference_seed, reference, mu, micro);
  });
  return compare_runs(sharded, reference, o);
}

}  // namespace meshgrad::diag
