#include "meshgrad/optim/adamw.hpp"

#include <cmath>
#include <string>

#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/placement.hpp"
#include "meshgrad/tensor/parallel.hpp"
#include "meshgrad/tensor/trace.hpp"
#include "meshgrad/optim/grad_sync.hpp"

namespace meshgrad::optim {

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The update of one contiguous shard, in the parameter's own dtype T (bias corrections in double).
template <class T>
void adamw_update(T* p, const T* g, T* m, T* v, std::int64_t n, const AdamWOptions& o, double decay_factor,
                  double bias1, double bias2) {
  const T b1 = static_cast<T>(o.beta1), b2 = static_cast<T>(o.beta2);
  const T one_b1 = static_cast<T>(1.0 - o.beta1), one_b2 = static_cast<T>(1.0 - o.beta2);
  const T step_size = static_cast<T>(o.lr / bias1);
  const T inv_sqrt_bias2 = static_cast<T>(1.0 / std::sqrt(bias2));
  const T eps = static_cast<T>(o.eps);
  const T keep = static_cast<T>(decay_factor);
  for (std::int64_t i = 0; i < n; ++i) {
    const T gi = g[i];
    m[i] = b1 * m[i] + one_b1 * gi;
    v[i] = b2 * v[i] + one_b2 * gi * gi;
    const T denom = std::sqrt(v[i]) * inv_sqrt_bias2 + eps;
    p[i] = p[i] * keep - step_size * m[i] / denom;
  }
}

}  // namespace

bool decays(const nn::Parameter& p) { return ends_with(p.name, ".weight") && p.full_shape.size() == 2; }

AdamW::AdamW(std::vector<nn::Parameter*> params, dist::DeviceMeshPtr mesh, AdamWOptions options)
    : params_(std::move(params)), mesh_(std::move(mesh)), options_(options) {
  MG_CHECK(options_.lr >= 0 && options_.eps > 0 && options_.beta1 >= 0 && options_.beta1 < 1 &&
               options_.beta2 >= 0 && options_.beta2 < 1 && options_.weight_decay >= 0,
           "AdamW: invalid options lr={} betas=({}, {}) eps={} weight_decay={}", options_.lr, options_.beta1,
           options_.beta2, options_.eps, options_.weight_decay);
  for (const nn::Parameter* p : params_) {
    MG_CHECK(p != nullptr, "AdamW: null parameter");
    MG_CHECK(p->value.defined() && p->value.is_floating(), "AdamW: parameter '{}' is not a float32/float64 tensor",
             p->name);
    MG_CHECK(p->value.is_contiguous(), "AdamW: parameter '{}' is not contiguous ({})", p->name, p->value.str());
  }
  m_.resize(params_.size());
  v_.resize(params_.size());
}

void AdamW::check_gradients() const {
  for (const nn::Parameter* p : params_) {
    const Tensor g = p->value.grad();
    if (!g.defined()) continue;
    MG_CHECK(g.shape() == p->value.shape() && g.dtype() == p->value.dtype(),
             "AdamW: gradient of '{}' is {} but the parameter is {}", p->name, g.str(), p->value.str());
    const dist::AxisMask partial = dist::partial_axes(g);
    if (mesh_) {
      MG_CHECK(static_cast<int>(p->placements.size()) == mesh_->ndim(),
               "AdamW: parameter '{}' has {} placements for {} (one per mesh axis expected)", p->name,
               p->placements.size(), mesh_->str());
      const dist::AxisMask bad = partial & p->replicated_axes();
      for (int a = 0; a < mesh_->ndim(); ++a) {
        MG_CHECK(!(bad & (dist::AxisMask{1} << a)),
                 "AdamW: the gradient of '{}' is still a partial sum over mesh axis '{}', where the parameter is "
                 "replicated: run GradientSynchronizer::finish() after backward",
                 p->name, mesh_->axes()[static_cast<std::size_t>(a)].name);
      }
    } else {
      MG_CHECK(partial == 0, "AdamW: the gradient of '{}' is still a partial sum (axes mask {:#x}) and no mesh was given",
               p->name, partial);
    }
  }
}

void AdamW::step() {
  trace::Span span("optimizer", "optimizer");
  autograd::NoGradGuard no_grad;
  dist::PhaseScope phase(dist::Phase::Optimizer);
  check_gradients();
  ++t_;
  const double bias1 = 1.0 - std::pow(options_.beta1, static_cast<double>(t_));
  const double bias2 = 1.0 - std::pow(options_.beta2, static_cast<double>(t_));
  for (std::size_t i = 0; i < params_.size(); ++i) {
    nn::Parameter& p = *params_[i];
    const Tensor g = p.value.grad();
    if (!g.defined()) continue;
    if (!m_[i].defined()) {
      m_[i] = Tensor::zeros(p.value.shape(), p.value.dtype());
      v_[i] = Tensor::zeros(p.value.shape(), p.value.dtype());
    }
    const Tensor gc = g.contiguous();
    const double decay_factor = decays(p) ? 1.0 - options_.lr * options_.weight_decay : 1.0;
    // adamw_update writes through raw pointers, which the version counter cannot see: bump it by
    // hand, so that a graph that saved this parameter (a forward not yet backpropagated) refuses
    // to compute gradients from the updated values. The moments are bumped as the writes they are.
    p.value.bump_version();
    m_[i].bump_version();
    v_[i].bump_version();
    // Elementwise, so split over the rank's cores without changing a bit (tensor/parallel.hpp).
    dispatch_floating(p.value.dtype(), "AdamW::step", [&]<class T>() {
      T* pv = p.value.data<T>();
      const T* pg = gc.data<T>();
      T* pm = m_[i].data<T>();
      T* pv2 = v_[i].data<T>();
      const std::int64_t n = p.value.numel();
      parallel::for_ranges(n, parallel::workers_for(n), [&](std::int64_t b, std::int64_t e) {
        adamw_update<T>(pv + b, pg + b, pm + b, pv2 + b, e - b, options_, decay_factor, bias1, bias2);
      });
    });
  }
}

void AdamW::load_state(std::int64_t steps, std::vector<Tensor> exp_avg, std::vector<Tensor> exp_avg_sq) {
  MG_CHECK(steps >= 0, "AdamW::load_state: step count {} is negative", steps);
  MG_CHECK(exp_avg.size() == params_.size() && exp_avg_sq.size() == params_.size(),
           "AdamW::load_state: {} and {} moments for {} parameters", exp_avg.size(), exp_avg_sq.size(), params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const nn::Parameter& p = *params_[i];
    MG_CHECK(exp_avg[i].defined() == exp_avg_sq[i].defined(), "AdamW::load_state: '{}' has only one of its moments", p.name);
    for (const Tensor* t : {&exp_avg[i], &exp_avg_sq[i]}) {
      MG_CHECK(!t->defined() || (t->shape() == p.value.shape() && t->dtype() == p.value.dtype()),
               "AdamW::load_state: a moment of '{}' is {} but the parameter is {}", p.name, t->str(), p.value.str());
    }
  }
  t_ = steps;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    m_[i] = exp_avg[i].defined() ? exp_avg[i].contiguous().clone() : Tensor();
    v_[i] = exp_avg_sq[i].defined() ? exp_avg_sq[i].contiguous().clone() : Tensor();
  }
}

std::vector<Tensor> AdamW::materialize_moments() {
  std::vector<Tensor> out(2 * params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const nn::Parameter& p = *params_[i];
    if (!m_[i].defined()) {
      m_[i] = Tensor::zeros(p.value.shape(), p.value.dtype());
      v_[i] = Tensor::zeros(p.value.shape(), p.value.dtype());
    }
    out[i] = m_[i];
    out[params_.size() + i] = v_[i];
  }
  return out;
}

void AdamW::set_steps(std::int64_t steps) {
  MG_CHECK(steps >= 0, "AdamW::set_steps: step count {} is negative", steps);
  t_ = steps;
}

void AdamW::zero_grad() {
  for (nn::Parameter* p : params_) p->value.zero_grad();
}

}  // namespace meshgrad::optim
