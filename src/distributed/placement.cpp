#include "meshgrad/distributed/placement.hpp"

#include "meshgrad/autograd/function.hpp"

namespace meshgrad::dist {

std::string Placement::str() const {
  switch (kind) {
    case Kind::Shard:
      if (of_piece) return fmt::format("Sp({})", dim);
      return blocks == 1 && unit == 1 ? fmt::format("S({})", dim) : fmt::format("S({})x{}/{}", dim, blocks, unit);
    case Kind::Replicate: return "R";
    case Kind::Partial: return "P";
  }
  return "?";
}

std::vector<ShardRange> Placement::ranges(std::int64_t full, int parts, int index) const {
  MG_CHECK(is_shard(), "placement {} has no shard ranges", str());
  if (blocks == 1 && unit == 1) return {shard_range(full, parts, index)};
  MG_CHECK(blocks >= 1 && unit >= 1 && full % blocks == 0 && (full / blocks) % unit == 0,
           "placement {}: extent {} is not {} blocks of whole units of {}", str(), full, blocks, unit);
  const std::int64_t block = full / blocks;
  const ShardRange units = shard_range(block / unit, parts, index);
  std::vector<ShardRange> out;
  for (int b = 0; b < blocks; ++b) out.push_back({b * block + units.offset * unit, units.size * unit});
  return out;
}

std::string placements_str(const Placements& p) {
  std::string s = "[";
  for (std::size_t i = 0; i < p.size(); ++i) s += (i ? ", " : "") + p[i].str();
  return s + "]";
}

Placement parse_placement(const std::string& text) {
  if (text == "R") return Placement::replicate();
  if (text == "P") return Placement::partial();
  const bool of_piece = text.rfind("Sp(", 0) == 0;
  const std::size_t open = of_piece ? 3 : 2;
  if (text.size() >= open + 2 && (of_piece || text.rfind("S(", 0) == 0) && text.back() == ')') {
    try {
      std::size_t used = 0;
      const std::string digits = text.substr(open, text.size() - open - 1);
      const int d = std::stoi(digits, &used);
      if (used == digits.size() && d >= 0) return of_piece ? Placement::shard_of_piece(d) : Placement::shard(d);
    } catch (const std::exception&) {
    }
  }
  throw InvalidArgument(fmt::format("placement '{}' is not one of S(dim), Sp(dim), R, P", text));
}

namespace {
AxisMask partial_axes_of(const Annotation& a) {
  auto* p = dynamic_cast<const PartialGradient*>(&a);
  MG_CHECK(p != nullptr, "dist: a gradient carries an annotation that is not a placement: {}", a.str());
  return p->axes();
}

std::string mask_str(AxisMask axes) {
  std::string s;
  for (int i = 0; i < 32; ++i) {
    if (axes & (1u << i)) s += fmt::format("{}{}", s.empty() ? "" : ",", i);
  }
  return s.empty() ? "complete" : "partial over mesh axes {" + s + "}";
}
}  // namespace

std::string PartialGradient::str() const { return mask_str(axes_); }

AnnotationPtr PartialGradient::combine(const AnnotationPtr& other) const {
  const AxisMask other_axes = other ? partial_axes_of(*other) : 0;
  MG_CHECK(other_axes == axes_,
           "autograd: two gradients for one tensor disagree on placement ({} vs {}): the sum would be "
           "neither a complete nor a partial gradient; reduce the partial one (all-reduce over its axes) "
           "before the paths join", mask_str(axes_), mask_str(other_axes));
  return std::make_shared<PartialGradient>(axes_);
}

AxisMask partial_axes(const Tensor& grad) {
  if (!grad.defined() || !grad.annotation()) return 0;
  return partial_axes_of(*grad.annotation());
}

void set_partial_axes(const Tensor& grad, AxisMask axes) {
  grad.set_annotation(axes == 0 ? nullptr : std::make_shared<PartialGradient>(axes));
}

namespace {
class MarkPartialGradFn final : public autograd::Function {
 public:
  explicit MarkPartialGradFn(AxisMask axes) : axes_(axes) {}
  std::string_view name() const override { return "mark_partial_grad"; }
  bool decides_gradient_placement() const override { return true; }
  TensorList forward(const TensorList& x) override { return {x[0]}; }
  TensorList backward(const TensorList& g) override {
    Tensor out = g[0].detach();   // a new handle: the annotation must not leak to other holders
    set_partial_axes(out, partial_axes(g[0]) | axes_);
    return {out};
  }

 private:
  AxisMask axes_;
};
}  // namespace

Tensor mark_partial_grad(const Tensor& x, AxisMask axes) {
  if (axes == 0) return x;
  return autograd::apply<MarkPartialGradFn>({x}, axes)[0];
}

}  // namespace meshgrad::dist
