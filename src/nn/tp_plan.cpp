// The layers a tensor-parallel plan builds: the style from the plan's rules, the layer from the mesh.
#include "meshgrad/nn/tp_plan.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/mappings.hpp"
#include "meshgrad/nn/layers.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/trace.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad::nn {

namespace {

std::vector<std::string> components(const std::string& dotted) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (true) {
    const std::size_t dot = dotted.find('.', start);
    out.push_back(dotted.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) return out;
    start = dot + 1;
  }
}

// weight, then bias when the layer has one: the one-rank model's order.
template <class Layer>
void push(std::vector<Parameter*>& out, Layer& layer) {
  out.push_back(&layer.weight);
  if (layer.bias.value.defined()) out.push_back(&layer.bias);
}

// 1-D column: the output features split over tp.
class Column1D final : public ParallelLinear {
 public:
  Column1D(const std::string& name, const LinearSpec& s, const ParallelContextPtr& ctx, std::uint64_t seed, DType dtype)
      : layer_(name, s.in, s.out,
               ColumnParallelLinear::Options{.bias = s.bias, .blocks = s.blocks, .unit = s.out_unit,
                                             .init_std = s.init_std},
               ctx, seed, dtype) {}
  Tensor forward(const Tensor& x, std::int64_t seq) const override { return layer_.forward(x, seq); }
  std::int64_t output_features() const override { return layer_.weight.operand_shape()[1]; }
  void collect(std::vector<Parameter*>& out) override { push(out, layer_); }

 private:
  ColumnParallelLinear layer_;
};

// 1-D row: the input features split over tp, the output reduced.
class Row1D final : public ParallelLinear {
 public:
  Row1D(const std::string& name, const LinearSpec& s, const ParallelContextPtr& ctx, std::uint64_t seed, DType dtype)
      : out_(s.out),
        layer_(name, s.in, s.out,
               RowParallelLinear::Options{.bias = s.bias, .input_is_parallel = true, .unit = s.in_unit,
                                          .init_std = s.init_std},
               ctx, seed, dtype) {}
  Tensor forward(const Tensor& x, std::int64_t /*seq*/) const override { return layer_.forward(x); }
  std::int64_t output_features() const override { return out_; }
  void collect(std::vector<Parameter*>& out) override { push(out, layer_); }

 private:
  std::int64_t out_;
  RowParallelLinear layer_;
};

// A column layer of fewer whole units than tp ranks (LinearSpec::replicate_units): the weight [in,
// out] and bias are replicated over tp; rank r computes unit u = r * units / tp, so the tp / units
// ranks of a unit repeat one another's product.
//   forward:  x gathered along the sequence under SP (else used as it is) | x W[:, u] + b[u]
//   backward: dX arrives partial over tp (each rank saw its unit only): reduced by the rule (the
//             all-reduce of copy_to_region, the reduce-scatter of the SP gather); dW, db: partial
//             over tp (zero outside the unit), summed over tp by the gradient synchroniser as a
//             LayerNorm weight's under SP.
class ReplicatedUnits final : public ParallelLinear {
 public:
  ReplicatedUnits(const std::string& name, const LinearSpec& s, const ParallelContextPtr& ctx, std::uint64_t seed,
                  DType dtype)
      : name_(name), unit_(s.out_unit), ctx_(ctx) {
    const std::int64_t units = s.out / s.out_unit;
    MG_CHECK(!ctx->tp_invariant(), "{}: {} units over tp = {} ranks are replicated, which the invariant modes do not "
             "support yet (the fixed tree of a replicated unit is not the one-rank model's): use a tp that divides "
             "them", name, units, ctx->tp_size());
    weight = make_parameter(name + ".weight", {s.in, s.out}, ctx->replicated(), *ctx, seed, s.init_std, 0.0, dtype);
    if (s.bias) bias = make_parameter(name + ".bias", {s.out}, ctx->replicated(), *ctx, seed, 0.0, 0.0, dtype);
    first_ = ctx->tp_rank() * units / ctx->tp_size() * unit_;
  }
  Tensor forward(const Tensor& x, std::int64_t seq) const override {
    dist::CommLabelScope label(name_);
    trace::Scope scope(name_);
    const ParallelContext& ctx = *ctx_;
    const Tensor whole = ctx.sequence_parallel() ? dist::gather_from_sequence(x, ctx.tp, 0, seq)
                                                 : dist::copy_to_region(x, ctx.tp, ctx.reduce_order());
    const Tensor x_in = dist::mark_partial_grad(whole, ctx.tp.axes);
    const Tensor w = narrow(ctx.partial_over_tp(weight.operand()), 1, first_, unit_);
    const Tensor b = bias.operand().defined() ? narrow(ctx.partial_over_tp(bias.operand()), 0, first_, unit_) : Tensor();
    return meshgrad::linear(x_in, w, b);
  }
  std::int64_t output_features() const override { return unit_; }
  void collect(std::vector<Parameter*>& out) override { push(out, *this); }

  Parameter weight, bias;

 private:
  std::string name_;
  std::int64_t unit_, first_ = 0;
  ParallelContextPtr ctx_;
};

// 2-D: the column style's input on tp_row, output on tp_col; the row style the other way round,
// its output gathered whole (the activations between blocks are replicated on a grid).
class Grid2D final : public ParallelLinear {
 public:
  Grid2D(const std::string& name, const LinearSpec& s, LinearStyle style, const ParallelContextPtr& ctx,
         std::uint64_t seed, DType dtype)
      : column_(style == LinearStyle::Column),
        out_(s.out),
        layer_(name, s.in, s.out, /*in_on_rows=*/column_,
               GridLinear::Options{.bias = s.bias, .input_is_split = !column_, .blocks = s.blocks,
                                   .in_unit = s.in_unit, .out_unit = s.out_unit, .init_std = s.init_std},
               ctx, seed, dtype) {}
  Tensor forward(const Tensor& x, std::int64_t /*seq*/) const override {
    return column_ ? layer_.forward(x) : layer_.forward_gathered(x);
  }
  std::int64_t output_features() const override { return column_ ? layer_.weight.operand_shape()[1] : out_; }
  void collect(std::vector<Parameter*>& out) override { push(out, layer_); }

 private:
  bool column_;
  std::int64_t out_;
  GridLinear layer_;
};

}  // namespace

const char* linear_style_name(LinearStyle style) { return style == LinearStyle::Column ? "column" : "row"; }

bool plan_pattern_matches(const std::string& pattern, const std::string& name) {
  const std::vector<std::string> p = components(pattern), n = components(name);
  if (p.size() != n.size()) return false;
  for (std::size_t i = 0; i < p.size(); ++i) {
    if (p[i] != "*" && p[i] != n[i]) return false;
  }
  return true;
}

LinearStyle TensorParallelPlan::style_of(const std::string& name) const {
  for (const TensorParallelRule& rule : rules) {
    if (plan_pattern_matches(rule.pattern, name)) return rule.style;
  }
  throw InvalidArgument(fmt::format("tensor-parallel plan of {}: no rule names the linear layer '{}' (rules: {})",
                                    family, name, fmt::join(describe(), "; ")));
}

std::unique_ptr<ParallelLinear> TensorParallelPlan::linear(const std::string& name, const LinearSpec& spec,
                                                           const ParallelContextPtr& ctx, std::uint64_t seed,
                                                           DType dtype) const {
  const LinearStyle style = style_of(name);
  if (ctx->two_d) return std::make_unique<Grid2D>(name, spec, style, ctx, seed, dtype);
  if (style == LinearStyle::Column) {
    const std::int64_t units = spec.out / std::max<std::int64_t>(1, spec.out_unit);
    if (spec.blocks == 1 && units < ctx->tp_size()) {
      MG_CHECK(spec.replicate_units && ctx->tp_size() % units == 0, "{}: {} units of {} features over tp = {} ranks: "
               "a column-parallel layer needs at least one whole unit per rank{}", name, units, spec.out_unit,
               ctx->tp_size(), spec.replicate_units ? ", or a tp that is a multiple of the units (each then replicated)" : "");
      return std::make_unique<ReplicatedUnits>(name, spec, ctx, seed, dtype);
    }
    return std::make_unique<Column1D>(name, spec, ctx, seed, dtype);
  }
  return std::make_unique<Row1D>(name, spec, ctx, seed, dtype);
}

std::vector<std::string> TensorParallelPlan::describe() const {
  std::vector<std::string> out;
  for (const TensorParallelRule& rule : rules) out.push_back(fmt::format("{} {}", rule.pattern, linear_style_name(rule.style)));
  return out;
}

}  // namespace meshgrad::nn
