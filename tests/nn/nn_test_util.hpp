// Runs a model on a mesh and collects its loss and full (gathered) gradients by parameter name,
// so tests can compare any mesh against the tp=1 model.
#pragma once

#include <map>
#include <string>

#include "../distributed/dist_test_util.hpp"
#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/placement.hpp"
#include "meshgrad/nn/model.hpp"

namespace meshgrad::testing {

struct ModelRun {
  double loss = 0;
  std::map<std::string, Tensor> grads;    // full gradients
  std::map<std::string, Tensor> params;   // full parameters
  dist::CommCounter counter;              // rank 0's collectives
};

inline nn::Batch make_batch(const nn::ModelConfig& cfg, std::uint64_t seed) {
  Tensor tokens = random::randint({cfg.batch, cfg.seq + 1}, seed, cfg.vocab);
  return {tokens.narrow(1, 0, cfg.seq).contiguous(), tokens.narrow(1, 1, cfg.seq).contiguous()};
}

// One forward+backward of the model on a "tp=P" mesh. Gradients partial over tp (replicated
// parameters used on sequence-sharded data) are summed over tp, as the trainer does.
// axes: the mesh (default "tp=P"); a 2-D grid is {{"tp_row", R}, {"tp_col", C}}.
inline ModelRun run_model(const nn::ModelConfig& cfg, const nn::ParallelConfig& parallel, int tp,
                          std::uint64_t seed = 7, std::uint64_t batch_seed = 99,
                          const std::vector<dist::MeshAxis>& axes = {}) {
  ModelRun out;
  const nn::Batch batch = make_batch(cfg, batch_seed);
  std::mutex mu;
  run_on_mesh(tp, [&](const dist::DeviceMeshPtr& mesh) {
    dist::CommCounter counter;
    dist::CountingScope counting(counter);
    auto model = nn::make_model(cfg, parallel, mesh, seed);
    Tensor loss = model->loss(batch, cfg.batch * cfg.seq);
    backward(loss);
    std::map<std::string, Tensor> grads, params;
    {
      dist::CommCounter ignored;   // gathering for the comparison is not the model's communication
      dist::CountingScope not_counted(ignored);
      for (nn::Parameter* p : model->parameters()) {
        Tensor g = p->value.grad();
        EXPECT_TRUE(g.defined()) << p->name << " got no gradient";
        if (!g.defined()) g = Tensor::zeros(p->value.shape(), p->value.dtype());
        // Reduce what the gradient is still partial on (replicated parameters on sharded data, and
        // dp), as the synchroniser would.
        const dist::AxisMask partial = dist::partial_axes(g) & p->replicated_axes();
        for (int a = 0; a < mesh->ndim(); ++a) {
          if (partial & dist::axis_bit(a)) g = dist::all_reduce(g, mesh->group(a));
        }
        grads[p->name] = nn::gather_full(g, *p);
        params[p->name] = nn::gather_full(p->value.detach(), *p);
      }
    }
    if (mesh->rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      out.loss = loss.item();
      out.grads = grads;
      out.params = params;
      out.counter = counter;
    }
  }, axes);
  return out;
}

// max |a - b| / max(max |b|, tiny) over every gradient; names the worst parameter.
inline std::pair<double, std::string> max_rel_grad_error(const ModelRun& a, const ModelRun& b) {
  double worst = 0;
  std::string where;
  for (const auto& [name, gb] : b.grads) {
    auto it = a.grads.find(name);
    if (it == a.grads.end()) return {1e300, name + " missing"};
    const auto va = it->second.to_vector();
    const auto vb = gb.to_vector();
    if (va.size() != vb.size()) return {1e300, name + " shape"};
    double scale = 1e-300, diff = 0;
    for (std::size_t i = 0; i < vb.size(); ++i) {
      scale = std::max(scale, std::abs(vb[i]));
      diff = std::max(diff, std::abs(va[i] - vb[i]));
    }
    if (diff / scale > worst) {
      worst = diff / scale;
      where = name;
    }
  }
  return {worst, where};
}

}  // namespace meshgrad::testing
