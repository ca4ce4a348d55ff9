#include "meshgrad/nn/linear2d.hpp"

#include "meshgrad/tensor/random.hpp"

namespace meshgrad::nn {

Linear2D::Linear2D(const std::string& name, std::int64_t in, std::int64_t out, dist::DeviceMeshPtr mesh,
                   const std::string& row_axis, const std::string& col_axis, std::uint64_t seed, DType dtype)
    : mesh_(std::move(mesh)) {
  MG_CHECK(mesh_->ndim() == 2, "Linear2D {}: needs a 2-D mesh, got {}", name, mesh_->str());
  row_ = mesh_->axis_index(row_axis);
  col_ = mesh_->axis_index(col_axis);
  dist::Placements pl(2);
  pl[static_cast<std::size_t>(row_)] = dist::Shard(0);
  pl[static_cast<std::size_t>(col_)] = dist::Shard(1);
  const Shape full{in, out};
  const auto offsets = dist::local_offsets_of(full, *mesh_, pl, mesh_->coordinates());
  const Shape local = dist::local_shape_of(full, *mesh_, pl, mesh_->coordinates());
  Tensor w = random::randn(full, seed_of(seed, name + ".weight"), dtype, 0.0, 0.02,
                           {{offsets[0], local[0]}, {offsets[1], local[1]}});
  w.set_requires_grad();
  w.set_name(name + ".weight");
  weight_ = dist::DTensor(w, mesh_, pl, full);
}

dist::DTensor Linear2D::forward(const dist::DTensor& x) const {
  dist::Placements x_pl(2), y_pl(2);
  x_pl[static_cast<std::size_t>(row_)] = dist::Shard(1);
  x_pl[static_cast<std::size_t>(col_)] = dist::Replicate();
  y_pl[static_cast<std::size_t>(row_)] = dist::Replicate();
  y_pl[static_cast<std::size_t>(col_)] = dist::Shard(1);
  return dist::redistribute(dist::matmul(dist::redistribute(x, x_pl), weight_), y_pl);
}

}  // namespace meshgrad::nn
