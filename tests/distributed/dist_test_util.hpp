// Helpers for dist/ tests: P rank threads with a 1-D mesh, global float64 data made with the
// counter-based generator (every rank builds the same global tensors), and central differences
// on the single-rank computation.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>

#include "meshgrad/comm/threads.hpp"
#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/random.hpp"

namespace meshgrad::testing {

// Runs fn(mesh) on P rank threads over a mesh "tp=P" (or the given axes). Short deadline: a
// broken collective fails the test in seconds instead of hanging it.
inline void run_on_mesh(int ranks, const std::function<void(const dist::DeviceMeshPtr&)>& fn,
                        std::vector<dist::MeshAxis> axes = {}) {
  if (axes.empty()) axes = {{"tp", ranks}};
  comm::ThreadsOptions options;
  options.timeout = std::chrono::milliseconds(20000);
  comm::run_ranks(
      ranks,
      [&](const comm::CommunicatorPtr& world) {
        auto mesh = std::make_shared<const dist::DeviceMesh>(world, axes);
        fn(mesh);
      },
      options);
}

inline Tensor global_randn(const Shape& shape, std::uint64_t seed) {
  return random::randn(shape, seed, DType::Float64);
}

// sum over elements of y * w, without a graph (single-rank losses for central differences).
inline double weighted_sum_value(const Tensor& y, const Tensor& w) {
  return kernels::sum(kernels::binary(kernels::Binary::Mul, y, w), {}, false).item();
}

// Tensors that differ per rank (weights of per-rank losses, the parts of a Partial tensor): rank r's
// is randn(seed_base + r); rank_order_sum adds ranks 0..p-1 in rank order, as the collectives do, so
// the single-rank reference has the same bits.
inline Tensor per_rank_randn(const Shape& shape, std::uint64_t seed_base, int r) {
  return global_randn(shape, seed_base + static_cast<std::uint64_t>(r));
}
inline Tensor rank_order_sum(const Shape& shape, std::uint64_t seed_base, int p) {
  Tensor total = per_rank_randn(shape, seed_base, 0);
  for (int r = 1; r < p; ++r) total = kernels::binary(kernels::Binary::Add, total, per_rank_randn(shape, seed_base, r));
  return total;
}

// d loss / d x by central differences in float64, element by element. loss is the single-rank
// computation. h = 1e-6: for the (piecewise) smooth losses here the truncation error O(h^2 f''')
// is ~1e-12 and rounding ~eps |f| / h ~ 1e-10, so comparisons use 1e-7.
inline Tensor central_differences(const std::function<double(const Tensor&)>& loss, const Tensor& x,
                                  double h = 1e-6) {
  Tensor probe = x.clone();
  Tensor grad = Tensor::zeros(x.shape(), DType::Float64);
  double* p = probe.data<double>();
  double* g = grad.data<double>();
  for (std::int64_t i = 0; i < probe.numel(); ++i) {
    const double saved = p[i];
    p[i] = saved + h;
    const double up = loss(probe);
    p[i] = saved - h;
    const double down = loss(probe);
    p[i] = saved;
    g[i] = (up - down) / (2 * h);
  }
  return grad;
}

// Max |a - b| over elements; shapes must match.
inline double max_abs_diff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  const auto va = a.to_vector();
  const auto vb = b.to_vector();
  double m = 0;
  for (std::size_t i = 0; i < va.size() && i < vb.size(); ++i) m = std::max(m, std::abs(va[i] - vb[i]));
  return m;
}

}  // namespace meshgrad::testing
