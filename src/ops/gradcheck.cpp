// Gradient checker (see include/meshgrad/ops/gradcheck.hpp for the contract).
//
// Layout of the work:
//   leaves   fresh float64 leaf copies of the checked inputs; f(leaves) is recorded once and
//            differentiated (autograd::grad with retain_graph) for the analytic side.
//   work     separate plain copies that the numeric side perturbs in place. They never share
//            storage with the leaves: a recorded graph saves its inputs by alias, so perturbing a
//            leaf would corrupt the analytic backward.
#include "meshgrad/ops/gradcheck.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <utility>

#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/tensor/error.hpp"
#include "meshgrad/tensor/random.hpp"

namespace meshgrad {

std::string_view gradcheck_mode_name(GradcheckMode mode) {
  return mode == GradcheckMode::Full ? "full" : "projection";
}

GradcheckMode parse_gradcheck_mode(std::string_view text) {
  if (text == "full") return GradcheckMode::Full;
  if (text == "projection") return GradcheckMode::Projection;
  throw InvalidArgument(fmt::format("gradcheck: unknown mode '{}' (full or projection expected)", text));
}

namespace {

// Below this magnitude a relative error is meaningless (both values are zero up to rounding).
constexpr double kTiny = 1e-300;

std::string input_name(const TensorList& inputs, const std::vector<std::string>& names, std::size_t k) {
  if (k < names.size() && !names[k].empty()) return names[k];
  if (!inputs[k].name().empty()) return inputs[k].name();
  return fmt::format("input {}", k);
}

// Row-major multi-index of flat position `flat` in `shape`.
std::vector<std::int64_t> unravel(std::int64_t flat, const Shape& shape) {
  std::vector<std::int64_t> index(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    index[d] = shape[d] == 0 ? 0 : flat % shape[d];
    flat = shape[d] == 0 ? 0 : flat / shape[d];
  }
  return index;
}

std::string index_str(const std::vector<std::int64_t>& index) { return fmt::format("[{}]", fmt::join(index, ", ")); }

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::bit_cast<std::uint64_t>(a[i]) != std::bit_cast<std::uint64_t>(b[i])) return false;
  }
  return true;
}

// Decorrelates the seeds of the projection directions.
using random::splitmix64;

// A unit vector of n standard-normal draws (n > 0).
std::vector<double> unit_normal(std::int64_t n, std::uint64_t seed) {
  std::vector<double> v(static_cast<std::size_t>(n));
  double norm2 = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    v[static_cast<std::size_t>(i)] = random::normal(seed, static_cast<std::uint64_t>(i));
    norm2 += v[static_cast<std::size_t>(i)] * v[static_cast<std::size_t>(i)];
  }
  const double inv = norm2 > 0 ? 1.0 / std::sqrt(norm2) : 0.0;
  for (double& x : v) x *= inv;
  return v;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// State shared by both modes.
class Checker {
 public:
  Checker(const GradcheckFn& f, const TensorList& inputs, const GradcheckOptions& options)
      : f_(f), options_(options), inputs_(inputs) {
    result_.op = options.op;
    result_.shapes = describe_inputs(inputs, options.input_names);
    args_ = inputs;        // what f sees on the numeric side (work copies substituted below)
    leaf_args_ = inputs;   // what f sees on the analytic side (leaf copies substituted below)
    for (std::size_t k = 0; k < inputs.size(); ++k) {
      const Tensor& in = inputs[k];
      MG_CHECK(in.defined(), "gradcheck: op '{}': input {} is undefined", options.op, k);
      if (!in.requires_grad()) continue;
      MG_CHECK(in.dtype() == DType::Float64,
               "gradcheck: op '{}': input {} '{}' is {} and requires grad; gradient checks run in float64 "
               "(finite differences in float32 have ~1e-3 error)",
               options.op, k, input_name(inputs, options.input_names, k), in.str());
      checked_.push_back(k);
      Tensor leaf = in.detach().clone();
      leaf.set_requires_grad(true);
      leaf_args_[k] = leaf;
      leaves_.push_back(leaf);
      args_[k] = in.detach().clone();   // packed: flat index == logical row-major index
    }
    MG_CHECK(!checked_.empty(), "gradcheck: op '{}': no input requires grad, nothing to check ({})", options.op,
             result_.shapes);
  }

  GradcheckResult run(GradcheckMode mode) {
    result_.mode = mode;
    // The analytic side: one recorded evaluation at the unperturbed inputs.
    {
      autograd::EnableGradGuard grad_on;
      out_ = f_(leaf_args_);
    }
    MG_CHECK(out_.defined() && out_.is_floating(), "gradcheck: op '{}': f returned {}; a floating tensor is needed",
             options_.op, out_.defined() ? out_.str() : std::string("an undefined tensor"));
    // f must be a function of its inputs: two unrecorded evaluations and the recorded one must agree
    // bitwise, else the differences below measure noise (e.g. a dropout mask drawn afresh per call).
    const std::vector<double> recorded = out_.to_vector();
    const std::vector<double> first = evaluate();
    const std::vector<double> second = evaluate();
    if (!same_bits(first, second) || !same_bits(first, recorded)) {
      result_.passed = false;
      result_.message = fmt::format(
          "gradcheck failed: op '{}': f is not deterministic: {} at the same inputs (draw random masks from a "
          "Generator with a fixed seed created inside f)",
          options_.op,
          same_bits(first, second) ? "the recorded and the unrecorded evaluation differ"
                                   : "two evaluations differ");
      return result_;
    }
    if (mode == GradcheckMode::Full) {
      run_full();
    } else {
      run_projection();
    }
    if (result_.first_failure) result_.message = result_.first_failure->message;
    return result_;
  }

 private:
  // f at the current work inputs, unrecorded, as row-major float64 values.
  std::vector<double> evaluate() {
    autograd::NoGradGuard no_grad;
    Tensor y = f_(args_);
    MG_CHECK(y.defined() && y.shape() == out_.shape(),
             "gradcheck: op '{}': f returned {} on perturbed inputs but {} at the original ones", options_.op,
             y.defined() ? y.str() : std::string("an undefined tensor"), out_.str());
    return y.to_vector();
  }

  // Gradients of sum(out * weights) w.r.t. the checked leaves, as row-major values (zeros where
  // autograd reports no dependence). `last` frees the graph.
  std::vector<std::vector<double>> analytic(const std::vector<double>& weights, bool last) {
    std::vector<std::vector<double>> grads(leaves_.size());
    TensorList g;
    if (out_.requires_grad()) {
      Tensor root_grad = Tensor::from_values(weights, out_.shape(), out_.dtype());
      g = autograd::grad({out_}, leaves_, {root_grad}, {/*retain_graph=*/!last});
    }
    for (std::size_t c = 0; c < leaves_.size(); ++c) {
      if (c < g.size() && g[c].defined()) {
        MG_CHECK(g[c].shape() == leaves_[c].shape(), "gradcheck: op '{}': gradient of input {} is {}, input is {}",
                 options_.op, checked_[c], g[c].str(), leaves_[c].str());
        grads[c] = g[c].to_vector();
      } else {
        grads[c].assign(static_cast<std::size_t>(leaves_[c].numel()), 0.0);
      }
    }
    return grads;
  }

  // Records one comparison; returns whether it passed.
  bool compare(double analytic_value, double numeric_value) {
    const double err = std::abs(analytic_value - numeric_value);
    const double rel = err / std::max({std::abs(analytic_value), std::abs(numeric_value), kTiny});
    const bool ok = err <= options_.atol + options_.rtol * std::abs(numeric_value);   // false for NaN
    const double inf = std::numeric_limits<double>::infinity();
    result_.max_abs_error = std::max(result_.max_abs_error, std::isnan(err) ? inf : err);
    result_.max_rel_error = std::max(result_.max_rel_error, std::isnan(rel) ? inf : rel);
    ++result_.compared;
    if (!ok) result_.passed = false;
    return ok;
  }

  double tolerance(double numeric_value) const { return options_.atol + options_.rtol * std::abs(numeric_value); }

  std::string input_label(std::size_t k) const {
    return fmt::format("input {} '{}' {}", k, input_name(inputs_, options_.input_names, k), inputs_[k].str());
  }

  // ---- full mode: every Jacobian entry ---------------------------------------------------------
  void run_full() {
    const std::int64_t n_out = out_.numel();
    // jacobian[c][i * n_c + j] = d out[i] / d x_c[j], one backward per output element.
    std::vector<std::vector<double>> jacobian(leaves_.size());
    for (std::size_t c = 0; c < leaves_.size(); ++c) {
      jacobian[c].resize(static_cast<std::size_t>(n_out * leaves_[c].numel()));
    }
    std::vector<double> unit(static_cast<std::size_t>(n_out), 0.0);
    for (std::int64_t i = 0; i < n_out; ++i) {
      unit[static_cast<std::size_t>(i)] = 1.0;
      auto rows = analytic(unit, i + 1 == n_out);
      unit[static_cast<std::size_t>(i)] = 0.0;
      for (std::size_t c = 0; c < leaves_.size(); ++c) {
        std::copy(rows[c].begin(), rows[c].end(),
                  jacobian[c].begin() + static_cast<std::ptrdiff_t>(i * leaves_[c].numel()));
      }
    }
    // Numeric columns: perturb one element at a time.
    for (std::size_t c = 0; c < leaves_.size(); ++c) {
      const std::size_t k = checked_[c];
      double* x = args_[k].data<double>();
      const std::int64_t n_in = args_[k].numel();
      for (std::int64_t j = 0; j < n_in; ++j) {
        const double original = x[j];
        const double plus = original + options_.eps;
        const double minus = original - options_.eps;
        x[j] = plus;
        const std::vector<double> f_plus = evaluate();
        x[j] = minus;
        const std::vector<double> f_minus = evaluate();
        x[j] = original;
        const double step = plus - minus;   // the step actually taken (2h up to rounding of x +- h)
        for (std::int64_t i = 0; i < n_out; ++i) {
          const double numeric = (f_plus[static_cast<std::size_t>(i)] - f_minus[static_cast<std::size_t>(i)]) / step;
          const double analytic_value = jacobian[c][static_cast<std::size_t>(i * n_in + j)];
          if (compare(analytic_value, numeric) || result_.first_failure) continue;
          GradcheckFailure failure;
          failure.input_index = k;
          failure.input_name = input_name(inputs_, options_.input_names, k);
          failure.element = unravel(j, args_[k].shape());
          failure.output_element = unravel(i, out_.shape());
          failure.numeric = numeric;
          failure.analytic = analytic_value;
          failure.message = fmt::format(
              "gradcheck failed: op '{}', {}, element {}, output element {} of {}: numeric {:.12g} vs analytic "
              "{:.12g} (|diff| {:.3g} > tolerance {:.3g})",
              options_.op, input_label(k), index_str(failure.element), index_str(failure.output_element),
              out_.str(), numeric, analytic_value, std::abs(numeric - analytic_value), tolerance(numeric));
          result_.first_failure = std::move(failure);
        }
      }
    }
  }

  // ---- projection mode: v^T J_k u_k --------------------------------------------------------------
  // The perturbation x_k +- h u_k is applied as stored doubles; d = (x+) - (x-) is the step actually
  // taken, so the comparison is  (v.f(x+) - v.f(x-)) / 2h  vs  g . d / 2h  with g = J_k^T v.
  void run_projection() {
    const std::int64_t n_out = out_.numel();
    if (n_out == 0) return;
    const int projections = std::max(1, options_.projections);
    for (int p = 0; p < projections; ++p) {
      const auto index = static_cast<std::uint64_t>(p);
      const std::vector<double> v = unit_normal(n_out, splitmix64(options_.seed ^ splitmix64(2 * index)));
      const auto grads = analytic(v, p + 1 == projections);
      for (std::size_t c = 0; c < leaves_.size(); ++c) {
        const std::int64_t n_in = leaves_[c].numel();
        if (n_in == 0) continue;
        const std::uint64_t u_seed = splitmix64(options_.seed ^ splitmix64(2 * index + 1) ^ splitmix64(c + 1000));
        const std::vector<double> u = unit_normal(n_in, u_seed);
        const auto [numeric, analytic_value] = directional(c, v, grads[c], u, 0, n_in);
        if (compare(analytic_value, numeric) || result_.first_failure) continue;
        record_projection_failure(p, c, v, grads[c], u, numeric, analytic_value);
      }
    }
  }

  // {numeric, analytic} derivative of v.f along direction u restricted to elements [lo, hi) of
  // checked input c.
  std::pair<double, double> directional(std::size_t c, const std::vector<double>& v, const std::vector<double>& g,
                                        const std::vector<double>& u, std::int64_t lo, std::int64_t hi) {
    double* x = args_[checked_[c]].data<double>();
    const std::vector<double> original(x + lo, x + hi);
    std::vector<double> minus(original.size());
    double analytic_value = 0;
    for (std::int64_t j = lo; j < hi; ++j) {
      const std::size_t r = static_cast<std::size_t>(j - lo);
      x[j] = original[r] - options_.eps * u[static_cast<std::size_t>(j)];
      minus[r] = x[j];
    }
    const double f_minus = dot(v, evaluate());
    for (std::int64_t j = lo; j < hi; ++j) {
      const std::size_t r = static_cast<std::size_t>(j - lo);
      x[j] = original[r] + options_.eps * u[static_cast<std::size_t>(j)];
      analytic_value += g[static_cast<std::size_t>(j)] * (x[j] - minus[r]);
    }
    const double f_plus = dot(v, evaluate());
    std::copy(original.begin(), original.end(), x + lo);
    const double two_h = 2 * options_.eps;
    return {(f_plus - f_minus) / two_h, analytic_value / two_h};
  }

  // A projection failed: narrow it to one element by bisection on the discrepancy (analytic -
  // numeric) of each half of the direction's support, using the signs of u as the direction so a
  // wrong element is not hidden by a small |u_j|. Costs 4 log2(n) evaluations of f.
  void record_projection_failure(int p, std::size_t c, const std::vector<double>& v, const std::vector<double>& g,
                                 const std::vector<double>& u, double numeric, double analytic_value) {
    std::vector<double> signs(u.size());
    for (std::size_t j = 0; j < u.size(); ++j) signs[j] = u[j] < 0 ? -1.0 : 1.0;
    std::int64_t lo = 0;
    std::int64_t hi = static_cast<std::int64_t>(u.size());
    while (hi - lo > 1) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      const auto [n_left, a_left] = directional(c, v, g, signs, lo, mid);
      const auto [n_right, a_right] = directional(c, v, g, signs, mid, hi);
      if (std::abs(a_left - n_left) >= std::abs(a_right - n_right)) {
        hi = mid;
      } else {
        lo = mid;
      }
    }
    const auto [n_elem, a_elem] = directional(c, v, g, std::vector<double>(u.size(), 1.0), lo, lo + 1);
    const std::size_t k = checked_[c];
    GradcheckFailure failure;
    failure.input_index = k;
    failure.input_name = input_name(inputs_, options_.input_names, k);
    failure.element = unravel(lo, args_[k].shape());
    failure.numeric = n_elem;
    failure.analytic = a_elem;
    failure.message = fmt::format(
        "gradcheck failed: op '{}', {}, projection {}: numeric v.J.u {:.12g} vs analytic {:.12g} (|diff| {:.3g} > "
        "tolerance {:.3g}); bisection localizes element {}: numeric d(v.out)/dx {:.12g} vs analytic {:.12g}",
        options_.op, input_label(k), p, numeric, analytic_value, std::abs(numeric - analytic_value),
        tolerance(numeric), index_str(failure.element), n_elem, a_elem);
    result_.first_failure = std::move(failure);
  }

  const GradcheckFn& f_;
  const GradcheckOptions& options_;
  const TensorList& inputs_;
  TensorList args_;
  TensorList leaf_args_;
  TensorList leaves_;                 // leaf copies of the checked inputs, in input order
  std::vector<std::size_t> checked_;  // input index of each leaf
  Tensor out_;                        // f(leaf_args_), recorded
  GradcheckResult result_;
};

}  // namespace

std::string describe_inputs(const TensorList& inputs, const std::vector<std::string>& names) {
  std::string text;
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    if (k > 0) text += ' ';
    text += input_name(inputs, names, k);
    text += '=';
    text += inputs[k].defined() ? inputs[k].str() : std::string("undefined");
  }
  return text;
}

GradcheckResult gradcheck(const GradcheckFn& f, const TensorList& inputs, GradcheckMode mode,
                          const GradcheckOptions& options) {
  Checker checker(f, inputs, options);
  return checker.run(mode);
}

}  // namespace meshgrad
