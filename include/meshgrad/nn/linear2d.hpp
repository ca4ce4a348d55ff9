// A linear layer whose weight is sharded over both axes of a 2-D mesh (rows x cols): rank (i, j)
// holds W[in_i, out_j]. Built on DTensor ops, so its backward is derived from placements:
//
//   x: [N, in]   placements [S(1) over rows, R over cols]   (each row group holds its in-slice)
//   W: [in, out] placements [S(0) over rows, S(1) over cols]
//   y = x W: rows: S(k)·S(k) -> P;  cols: R·S(n) -> S(n)      -> y [P, S(1)]
//   then all-reduce over rows                                   -> y [R, S(1)]
//
// Backward (derived): dy [R, S(1)] -> dx = dy W^T is partial over cols (summed by the
// redistribution that produced x), dW = x^T dy is local.
#pragma once

#include "meshgrad/distributed/dtensor.hpp"
#include "meshgrad/nn/parameter.hpp"

namespace meshgrad::nn {

class Linear2D {
 public:
  // mesh axes named row_axis and col_axis; W initialised as the [in, out] tensor of `seed` would be on one rank.
  Linear2D(const std::string& name, std::int64_t in, std::int64_t out, dist::DeviceMeshPtr mesh,
           const std::string& row_axis, const std::string& col_axis, std::uint64_t seed, DType dtype);
  // x: DTensor [N, in] (any placements: it is redistributed to [S(1), R] first) -> y [N, out] as [R, S(1)].
  dist::DTensor forward(const dist::DTensor& x) const;
  const dist::DTensor& weight() const { return weight_; }

 private:
  dist::DeviceMeshPtr mesh_;
  int row_, col_;
  dist::DTensor weight_;
};

}  // namespace meshgrad::nn
