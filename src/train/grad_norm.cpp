#include "meshgrad/train/grad_norm.hpp"

#include <cmath>
#include <map>

#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/layout.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/trace.hpp"

namespace meshgrad::train {

namespace {

double sum_of_squares(const Tensor& g) {
  const Tensor c = g.contiguous();
  double s = 0;
  dispatch_floating(c.dtype(), "global_grad_norm", [&]<class T>() {
    const T* p = c.data<T>();
    for (std::int64_t i = 0; i < c.numel(); ++i) s += static_cast<double>(p[i]) * static_cast<double>(p[i]);
  });
  return s;
}

}  // namespace

double global_grad_norm(const std::vector<nn::Parameter*>& params, const dist::DeviceMesh& mesh) {
  trace::Span span("grad_norm", "optimizer");
  // Sums of squares per set of sharding axes (0: replicated everywhere), in a fixed order.
  std::map<dist::AxisMask, double> sums;
  for (const nn::Parameter* p : params) {
    MG_CHECK(static_cast<int>(p->placements.size()) == mesh.ndim(), "global_grad_norm: parameter '{}' has {} "
             "placements for {}", p->name, p->placements.size(), mesh.str());
    const Tensor g = p->value.grad();
    MG_CHECK(!g.defined() || dist::partial_axes(g) == 0, "global_grad_norm: the gradient of '{}' is still partial: "
             "run GradientSynchronizer::finish() first", p->name);
    sums[dist::sharded_axes(p->placements)] += g.defined() ? sum_of_squares(g) : 0.0;
  }
  dist::PhaseScope phase(dist::Phase::Optimizer);
  double total = 0;
  for (const auto& [mask, local] : sums) {
    if (mask == 0) {
      total += local;
      continue;
    }
    std::vector<int> axes;
    for (int a = 0; a < mesh.ndim(); ++a) {
      if (mask & dist::axis_bit(a)) axes.push_back(a);
    }
    total += dist::all_reduce(Tensor::scalar(local, DType::Float64), mesh.flattened_group(axes)).item();
  }
  return std::sqrt(total);
}

double clip_grad_norm(const std::vector<nn::Parameter*>& params, const dist::DeviceMesh& mesh, double max_norm) {
  MG_CHECK(max_norm > 0 && std::isfinite(max_norm), "clip_grad_norm: the maximum norm must be positive, got {}",
           max_norm);
  const double norm = global_grad_norm(params, mesh);
  if (!(norm > max_norm)) return norm;
  const double factor = max_norm / (norm + 1e-6);
  for (nn::Parameter* p : params) {
    Tensor g = p->value.grad();
    if (!g.defined()) continue;
    g.copy_from(kernels::binary(kernels::Binary::Mul, g, Tensor::scalar(factor, g.dtype())));   // bumps its version
  }
  return norm;
}

}  // namespace meshgrad::train
