#include "meshgrad/nn/parameter.hpp"

#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/random.hpp"

namespace meshgrad::nn {

dist::AxisMask Parameter::replicated_axes() const {
  dist::AxisMask mask = 0;
  for (std::size_t a = 0; a < placements.size(); ++a) {
    if (!placements[a].is_shard()) mask |= dist::axis_bit(static_cast<int>(a));
  }
  return mask;
}

dist::PieceLayout Parameter::layout() const {
  MG_CHECK(mesh != nullptr, "parameter '{}' has no mesh", name);
  return dist::piece_layout(full_shape, *mesh, placements, mesh->coordinates());
}

Shape Parameter::operand_shape() const {
  MG_CHECK(mesh != nullptr, "parameter '{}' has no mesh", name);
  dist::Placements gathered_over_fsdp = placements;
  for (dist::Placement& pl : gathered_over_fsdp) {
    if (pl.is_shard() && pl.of_piece) pl = dist::Placement::replicate();
  }
  return dist::piece_layout(full_shape, *mesh, gathered_over_fsdp, mesh->coordinates()).local_shape;
}

Tensor take_shard(const Tensor& full, const Parameter& p) {
  MG_CHECK(full.shape() == p.full_shape, "take_shard: tensor {} for parameter '{}' of full shape {}", full.str(),
           p.name, shape_str(p.full_shape));
  return dist::take_piece(full, p.layout());
}

Tensor gather_full(const Tensor& local, const Parameter& p) {
  MG_CHECK(p.mesh != nullptr, "gather_full: parameter '{}' has no mesh", p.name);
  return dist::gather_pieces(local, p.full_shape, *p.mesh, p.placements);
}

std::uint64_t seed_of(std::uint64_t seed, const std::string& name) {
  // FNV-1a of the name, mixed with the seed: every parameter gets its own stream.
  std::uint64_t h = 1469598103934665603ull ^ (seed * 0x9E3779B97F4A7C15ull);
  for (unsigned char c : name) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

Tensor init_normal_piece(const std::string& name, const Shape& full_shape, const dist::PieceLayout& layout,
                         std::uint64_t seed, double std, DType dtype) {
  const std::uint64_t stream = seed_of(seed, name);
  random::Box box;
  int blocked = -1;
  for (std::size_t d = 0; d < full_shape.size(); ++d) {
    box.push_back(layout.ranges[d][0]);
    if (layout.ranges[d].size() > 1) blocked = static_cast<int>(d);
  }
  if (blocked < 0) return random::randn(full_shape, stream, dtype, 0.0, std, box);
  std::vector<Tensor> pieces;
  for (const auto& r : layout.ranges[static_cast<std::size_t>(blocked)]) {
    box[static_cast<std::size_t>(blocked)] = r;
    pieces.push_back(random::randn(full_shape, stream, dtype, 0.0, std, box));
  }
  return kernels::cat(pieces, blocked);
}

}  // namespace meshgrad::nn
