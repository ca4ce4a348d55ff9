#include "meshgrad/optim/grad_norm.hpp"

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>

#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/layout.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/trace.hpp"

namespace meshgrad::optim {

namespace {

// In float64 over kLanes independent partial sums (added pairwise at the end): one accumulator is a
// chain of dependent adds, 4 cycles an element; independent lanes vectorise. The order differs from
// a sequential sum only in float64 rounding (relative 1e-16 per term), far below float32 gradients'.
double sum_of_squares(const Tensor& g) {
  const Tensor c = g.contiguous();
  constexpr std::int64_t kLanes = 16;
  double lanes[kLanes] = {};
  dispatch_floating(c.dtype(), "global_grad_norm", [&]<class T>() {
    const T* p = c.data<T>();
    const std::int64_t n = c.numel();
    std::int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      for (std::int64_t l = 0; l < kLanes; ++l) {
        const double v = static_cast<double>(p[i + l]);
        lanes[l] += v * v;
      }
    }
    for (; i < n; ++i) lanes[i % kLanes] += static_cast<double>(p[i]) * static_cast<double>(p[i]);
  });
  for (std::int64_t width = kLanes / 2; width >= 1; width /= 2) {
    for (std::int64_t l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  return lanes[0];
}

// An exact sum of non-negative finite doubles: bin e counts multiples of 2^(e - 1075) (e the biased
// binary exponent; subnormals go to bin 1), so adding a value adds its integer significand to one
// bin, exactly. A bin that grows past 2^62 carries into the next (twice the unit). Integer sums do
// not depend on order: neither does the result.
class ExactSum {
 public:
  static constexpr int kBins = 2048 + 80;
  void add(double v) {
    if (!std::isfinite(v)) {
      special_ += v;
      return;
    }
    const auto bits = std::bit_cast<std::uint64_t>(v);
    int e = static_cast<int>((bits >> 52) & 0x7ff);
    std::uint64_t mantissa = bits & ((std::uint64_t{1} << 52) - 1);
    if (e != 0) {
      mantissa |= std::uint64_t{1} << 52;
    } else {
      e = 1;
    }
    bins_[static_cast<std::size_t>(e)] += static_cast<std::int64_t>(mantissa);
    if (bins_[static_cast<std::size_t>(e)] >= (std::int64_t{1} << 62)) carry_from(e);
  }
  // Every bin but the last becomes 0 or 1 (so that summing over up to 2^61 ranks cannot overflow).
  void normalize() {
    for (int e = 0; e + 1 < kBins; ++e) carry_one(e);
  }
  // Adds the integer m (< 2^62) times the unit of bin e: exact, like add().
  void add_integer(int e, std::uint64_t m) {
    bins_[static_cast<std::size_t>(e)] += static_cast<std::int64_t>(m);
    if (bins_[static_cast<std::size_t>(e)] >= (std::int64_t{1} << 62)) carry_from(e);
  }
  std::vector<std::int64_t>& bins() { return bins_; }
  double& special() { return special_; }
  double value() {
    normalize();
    double total = 0;
    for (int e = 1; e < kBins; ++e) {
      if (bins_[static_cast<std::size_t>(e)] != 0) {
        total += std::ldexp(static_cast<double>(bins_[static_cast<std::size_t>(e)]), e - 1075);
      }
    }
    return total + special_;
  }
  void add_bins(const ExactSum& other) {
    for (int e = 0; e < kBins; ++e) bins_[static_cast<std::size_t>(e)] += other.bins_[static_cast<std::size_t>(e)];
    special_ += other.special_;
  }

 private:
  void carry_one(int e) {
    bins_[static_cast<std::size_t>(e) + 1] += bins_[static_cast<std::size_t>(e)] >> 1;
    bins_[static_cast<std::size_t>(e)] &= 1;
  }
  void carry_from(int e) {
    for (; e + 1 < kBins && bins_[static_cast<std::size_t>(e)] >= (std::int64_t{1} << 62); ++e) carry_one(e);
  }
  std::vector<std::int64_t> bins_ = std::vector<std::int64_t>(kBins, 0);
  double special_ = 0;   // inf / NaN squares: the norm is then inf / NaN
};

// float32 gradients: g = m 2^(e - 150) with m < 2^24 an integer (e the biased float32 exponent,
// 1 for subnormals), so g^2 = m^2 2^(2e - 300) exactly, with m^2 < 2^48: bin 2e + 775 of ExactSum
// (whose bin b counts multiples of 2^(b - 1075)). The integers m^2 are first added per float32
// exponent in kTables interleaved tables (consecutive elements usually share an exponent: one
// table would chain every add through the same memory word), kChunk elements at a time so no
// table word passes 2^61, and then moved into the ExactSum: the same exact integer sums as adding
// every square to the ExactSum one by one, so the same result, several times faster.
void add_squares_float32(ExactSum& acc, const float* p, std::int64_t n) {
  constexpr int kTables = 4;
  constexpr std::int64_t kChunk = std::int64_t{1} << 13;   // 2^13 * 2^48 = 2^61 per word at most
  std::vector<std::uint64_t> tables(static_cast<std::size_t>(kTables) * 256, 0);
  const auto flush = [&] {
    for (int t = 0; t < kTables; ++t) {
      for (int e = 1; e < 255; ++e) {
        std::uint64_t& word = tables[static_cast<std::size_t>(t * 256 + e)];
        if (word != 0) acc.add_integer(2 * e + 775, word);
        word = 0;
      }
    }
  };
  for (std::int64_t start = 0; start < n; start += kChunk) {
    const std::int64_t end = std::min(n, start + kChunk);
    std::int64_t i = start;
    const auto add_one = [&](std::int64_t j, int t) {
      const auto bits = std::bit_cast<std::uint32_t>(p[j]);
      const std::uint32_t e = (bits >> 23) & 0xff;
      if (e == 255) {   // inf / NaN: the norm is inf / NaN
        acc.special() += static_cast<double>(p[j]) * static_cast<double>(p[j]);
        return;
      }
      const std::uint64_t m = (bits & 0x7fffff) | (e != 0 ? 0x800000u : 0u);
      tables[static_cast<std::size_t>(t * 256) + (e != 0 ? e : 1)] += m * m;
    };
    for (; i + kTables <= end; i += kTables) {
      for (int t = 0; t < kTables; ++t) add_one(i + t, t);
    }
    for (; i < end; ++i) add_one(i, 0);
    flush();
  }
}

void add_squares(ExactSum& acc, const Tensor& g) {
  const Tensor c = g.contiguous();
  if (c.dtype() == DType::Float32) return add_squares_float32(acc, c.data<float>(), c.numel());
  dispatch_floating(c.dtype(), "global_grad_norm", [&]<class T>() {
    const T* p = c.data<T>();
    for (std::int64_t i = 0; i < c.numel(); ++i) acc.add(static_cast<double>(p[i]) * static_cast<double>(p[i]));
  });
}

// The pp group when the mesh is a pipeline of more than one stage (each stage holds other
// parameters), else nullptr.
const dist::ProcessGroup* pipeline_stages(const dist::DeviceMesh& mesh) {
  if (!mesh.has_axis("pp") || mesh.axis_size(mesh.axis_index("pp")) == 1) return nullptr;
  return &mesh.group("pp");
}

// Every stage's terms (mask, sum of squares per parameter), concatenated in stage order: the
// one-rank model's parameter order (Model::parameters), so the sums below add them in its order
// and a pipeline's norm is the bits of the model it splits.
std::vector<double> terms_of_every_stage(const std::vector<double>& terms, const dist::ProcessGroup& stages) {
  const auto n = static_cast<std::int64_t>(terms.size());
  const Tensor local = Tensor::from_values(terms, {n}, DType::Float64);
  const Tensor all = dist::all_gather(local, stages, 0, dist::exchange_sizes(n, stages));
  const double* v = all.data<double>();
  return std::vector<double>(v, v + all.numel());
}

double exact_grad_norm(const std::vector<nn::Parameter*>& params, const dist::DeviceMesh& mesh) {
  std::map<dist::AxisMask, ExactSum> sums;
  for (const nn::Parameter* p : params) {
    const Tensor g = p->value.grad();
    ExactSum& acc = sums[dist::sharded_axes(p->placements)];
    if (g.defined()) add_squares(acc, g);
  }
  dist::PhaseScope phase(dist::Phase::Optimizer);
  ExactSum total;
  for (auto& [mask, local] : sums) {
    if (mask != 0) {
      std::vector<int> axes;
      for (int a = 0; a < mesh.ndim(); ++a) {
        if (mask & dist::axis_bit(a)) axes.push_back(a);
      }
      // Normalised bins are 0 or 1 (the last one small): their float64 sum over the group is an exact
      // integer whatever the order the backend adds in.
      local.normalize();
      const dist::ProcessGroup& group = mesh.flattened_group(axes);
      std::vector<double> bins(local.bins().begin(), local.bins().end());
      // Through dist::all_reduce, so that counters and traces see it like every other collective.
      const Tensor counts = dist::all_reduce(Tensor::from_values(bins, {static_cast<std::int64_t>(bins.size())},
                                                                 DType::Float64), group);
      const double* c = counts.data<double>();
      for (std::size_t e = 0; e < bins.size(); ++e) local.bins()[e] = static_cast<std::int64_t>(c[e]);
      // Inf / NaN squares are rare: one more scalar all-reduce keeps every rank's verdict the same.
      local.special() = dist::all_reduce(Tensor::scalar(local.special(), DType::Float64), group).item();
    }
    total.add_bins(local);
    total.normalize();
  }
  if (const dist::ProcessGroup* stages = pipeline_stages(mesh)) {
    // Each stage's exact sum, added exactly over the stages (normalised bins, as above).
    std::vector<double> bins(total.bins().begin(), total.bins().end());
    const Tensor counts = dist::all_reduce(Tensor::from_values(bins, {static_cast<std::int64_t>(bins.size())},
                                                               DType::Float64), *stages);
    const double* c = counts.data<double>();
    for (std::size_t e = 0; e < bins.size(); ++e) total.bins()[e] = static_cast<std::int64_t>(c[e]);
    total.special() = dist::all_reduce(Tensor::scalar(total.special(), DType::Float64), *stages).item();
    total.normalize();
  }
  return std::sqrt(total.value());
}

}  // namespace

double global_grad_norm(const std::vector<nn::Parameter*>& params, const dist::DeviceMesh& mesh, bool exact) {
  trace::Span span("grad_norm", "optimizer");
  // One term per parameter: its sharding axes (0: replicated everywhere) and its sum of squares.
  std::vector<double> terms;   // mask, value, mask, value, ...
  for (const nn::Parameter* p : params) {
    MG_CHECK(static_cast<int>(p->placements.size()) == mesh.ndim(), "global_grad_norm: parameter '{}' has {} "
             "placements for {}", p->name, p->placements.size(), mesh.str());
    const Tensor g = p->value.grad();
    MG_CHECK(!g.defined() || dist::partial_axes(g) == 0, "global_grad_norm: the gradient of '{}' is still partial: "
             "run GradientSynchronizer::finish() first", p->name);
    if (!exact) {
      terms.push_back(static_cast<double>(dist::sharded_axes(p->placements)));
      terms.push_back(g.defined() ? sum_of_squares(g) : 0.0);
    }
  }
  if (exact) return exact_grad_norm(params, mesh);
  dist::PhaseScope phase(dist::Phase::Optimizer);
  if (pipeline_stages(mesh) != nullptr) terms = terms_of_every_stage(terms, *pipeline_stages(mesh));
  // Sums of squares per set of sharding axes, each in the one-rank model's parameter order.
  std::map<dist::AxisMask, double> sums;
  for (std::size_t i = 0; i < terms.size(); i += 2) sums[static_cast<dist::AxisMask>(terms[i])] += terms[i + 1];
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

double clip_grad_norm(const std::vector<nn::Parameter*>& params, const dist::DeviceMesh& mesh, double max_norm,
                      bool exact) {
  MG_CHECK(max_norm > 0 && std::isfinite(max_norm), "clip_grad_norm: the maximum norm must be positive, got {}",
           max_norm);
  const double norm = global_grad_norm(params, mesh, exact);
  if (!(norm > max_norm)) return norm;
  const double factor = max_norm / (norm + 1e-6);
  for (nn::Parameter* p : params) {
    Tensor g = p->value.grad();
    if (!g.defined()) continue;
    g.copy_from(kernels::binary(kernels::Binary::Mul, g, Tensor::scalar(factor, g.dtype())));   // bumps its version
  }
  return norm;
}

}  // namespace meshgrad::optim
