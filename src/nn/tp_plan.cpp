// The layers a tensor-parallel plan builds: the style from the plan's rules, the layer from the mesh.
#include "meshgrad/nn/tp_plan.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "meshgrad/nn/layers.hpp"
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
  if (style == LinearStyle::Column) return std::make_unique<Column1D>(name, spec, ctx, seed, dtype);
  return std::make_unique<Row1D>(name, spec, ctx, seed, dtype);
}

std::vector<std::string> TensorParallelPlan::describe() const {
  std::vector<std::string> out;
  for (const TensorParallelRule& rule : rules) out.push_back(fmt::format("{} {}", rule.pattern, linear_style_name(rule.style)));
  return out;
}

}  // namespace meshgrad::nn
