#include "meshgrad/diag/equivalence.hpp"

#include <algorithm>
#include <cmath>
#include <mutex>

#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/checkpoint/parameter_file.hpp"
#include "meshgrad/comm/threads.hpp"
#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/tensor/random.hpp"
#include "meshgrad/data/dataset.hpp"
#include "meshgrad/data/synthetic.hpp"
#include "meshgrad/optim/grad_sync.hpp"
#include "meshgrad/nn/parallel_context.hpp"
#include "meshgrad/optim/adamw.hpp"
#include "meshgrad/train/trainer.hpp"

namespace meshgrad::diag {

namespace {

// What one run produces on its rank 0: per step losses, last-step full gradients, final weights.
struct RunResult {
  std::vector<double> losses;
  std::map<std::string, Tensor> grads, weights;
  std::vector<std::string> order;
  dist::CommCounter first_step;   // collectives of step 1
  bool collected = false;          // filled: this process hosted the mesh's rank 0
};

// Trains on `mesh` of `world`; fills result on world rank 0. Every rank must call it.
// grad_accum: micro-batches per step (the single-rank reference of a TP-invariant dp mesh runs dp of
// them, the same micro-batches the replicas run, added in the same tree).
void train_and_collect(const EquivalenceOptions& o, const dist::DeviceMeshPtr& mesh, std::uint64_t model_seed,
                       RunResult& result, std::mutex& mu, int grad_accum = 1) {
  auto model = nn::make_model(o.model, o.parallel, mesh, model_seed);
  model->set_training(false);   // the comparison runs without dropout noise
  auto params = model->parameters();
  optim::GradientSynchronizer sync(params, mesh, {.order = model->reduce_order()});
  optim::AdamWOptions adam;
  adam.lr = o.lr;
  optim::AdamW optimizer(params, mesh, adam);
  std::vector<double> losses;
  dist::CommCounter counter;
  for (int step = 0; step < o.steps; ++step) {
    dist::CommCounter step_counter;
    dist::CountingScope counting(step == 0 ? counter : step_counter);
    const nn::Batch global_batch =
        data::make_synthetic_batch(o.model, 1, 0, o.seed * 1000003 + static_cast<std::uint64_t>(step));
    const Tensor loss = train::train_step(*model, global_batch, *mesh, sync, optimizer, 0, grad_accum).loss;
    // The global loss: each dp rank's share summed (outside the counted phases).
    dist::CommCounter ignored;
    dist::CountingScope not_counted(ignored);
    losses.push_back(train::global_loss(loss, *mesh, model->reduce_order()));
  }
  std::map<std::string, Tensor> grads, weights;
  std::vector<std::string> order;
  {
    dist::CommCounter ignored;
    dist::CountingScope not_counted(ignored);
    std::vector<std::pair<std::string, Tensor>> g_full, w_full;
    for (nn::Parameter* p : params) {
      Tensor g = p->value.grad();
      if (!g.defined()) g = Tensor::zeros(p->value.shape(), p->value.dtype());
      g_full.emplace_back(p->name, nn::gather_full(g, *p).to(DType::Float64));
      w_full.emplace_back(p->name, nn::gather_full(p->value.detach(), *p).to(DType::Float64));
    }
    if (model->stage().count > 1 && nn::parameter_shard_group(*mesh, params).rank() == 0) {
      // Every stage's tensors to stage 0 (whose first rank is the mesh's rank 0).
      g_full = checkpoint::collect_on_first_stage(std::move(g_full), mesh->group("pp"));
      w_full = checkpoint::collect_on_first_stage(std::move(w_full), mesh->group("pp"));
    }
    for (auto& [name, t] : g_full) {
      grads[name] = t;
      order.push_back(name);
    }
    for (auto& [name, t] : w_full) weights[name] = t;
  }
  if (mesh->rank() == 0) {
    std::lock_guard<std::mutex> lock(mu);
    result.losses = losses;
    result.grads = std::move(grads);
    result.weights = std::move(weights);
    result.order = std::move(order);
    result.first_step = counter;
    result.collected = true;
  }
}

std::pair<double, double> max_differences(const Tensor& a, const Tensor& b) {
  const auto va = a.to_vector();
  const auto vb = b.to_vector();
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < vb.size(); ++i) {
    diff = std::max(diff, std::abs(va[i] - vb[i]));
    scale = std::max(scale, std::abs(vb[i]));
  }
  return {diff, scale > 0 ? diff / scale : diff};
}

}  // namespace

EquivalenceReport check_equivalence(const EquivalenceOptions& o, const dist::RunOnMesh& run_on_mesh) {
  MG_CHECK(o.steps >= 1, "check: --steps must be at least 1, got {}", o.steps);
  std::mutex mu;
  RunResult reference, sharded;
  int mesh_dp = 1;   // the mesh's dp size (the TP-invariant reference runs that many micro-batches)
  const std::uint64_t mesh_seed = o.mesh_seed != 0 ? o.mesh_seed : o.seed;
  run_on_mesh([&](const dist::DeviceMeshPtr& mesh) {
    if (mesh->rank() == 0) mesh_dp = mesh->has_axis("dp") ? mesh->axis_size("dp") : 1;
    train_and_collect(o, mesh, mesh_seed, sharded, mu, o.micro_batches);
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
    nn::ParallelConfig one_rank = o.parallel;
    one_rank.pp_layers.clear();   // a pipeline's split means nothing on one rank
    EquivalenceOptions ro = o;
    ro.parallel = one_rank;
    train_and_collect(ro, mesh, o.seed, reference, mu, (o.parallel.tp_invariant ? mesh_dp : 1) * o.micro_batches);
  });

  EquivalenceReport report;
  const bool f64 = o.model.dtype == DType::Float64;
  report.grad_tolerance = f64 ? 1e-9 : 1e-4;
  report.weight_tolerance = f64 ? 1e-9 : 1e-4;
  report.loss_tolerance = f64 ? 1e-12 : 1e-5;
  report.reference_losses = reference.losses;
  report.mesh_losses = sharded.losses;
  report.passed = true;
  for (std::size_t i = 0; i < reference.losses.size() && i < sharded.losses.size(); ++i) {
    const double d = std::abs(reference.losses[i] - sharded.losses[i]) / std::max(1e-300, std::abs(reference.losses[i]));
    report.max_loss_difference = std::max(report.max_loss_difference, d);
  }
  if (report.max_loss_difference > report.loss_tolerance) report.passed = false;
  for (const auto& name : reference.order) {
    ParameterDifference d;
    d.name = name;
    auto sg = sharded.grads.find(name);
    auto sw = sharded.weights.find(name);
    MG_CHECK(sg != sharded.grads.end() && sw != sharded.weights.end(), "check: parameter {} missing on the mesh", name);
    std::tie(d.grad_max_abs, d.grad_max_rel) = max_differences(sg->second, reference.grads.at(name));
    std::tie(d.weight_max_abs, d.weight_max_rel) = max_differences(sw->second, reference.weights.at(name));
    d.passed = d.grad_max_rel <= report.grad_tolerance && d.weight_max_rel <= report.weight_tolerance;
    if (!d.passed && report.first_divergence.empty()) report.first_divergence = name;
    report.passed = report.passed && d.passed;
    report.parameters.push_back(d);
  }
  for (const auto& r : sharded.first_step.records()) {
    auto& cell = report.collectives[dist::phase_name(r.phase)][r.op + "[" + r.axis + "]"];
    cell.first += 1;
    cell.second += r.bytes;
  }
  return report;
}

}  // namespace meshgrad::diag
