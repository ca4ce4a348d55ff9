// Where one coordinate's piece of a full tensor lies, for placements on a mesh: the layout that
// parameters, checkpoints, initialisation and gathering share. Axes placed R or P hold the whole
// extent; an axis placed S(d) (with blocks and units, placement.hpp) holds its part of dim d. Two or
// more axes that shard the same dim split it as ONE axis of their product, in mesh order with the
// first axis outermost, i.e. by the rank of mesh.make_group(those axes) (a vocabulary split over the
// whole tp grid of a 2-D mesh). An axis placed Sp(d) (FSDP) then splits dim d of that piece by
// the shard rule: its part is a run of the piece's elements along d, so the pieces of every fsdp
// coordinate, concatenated along d in coordinate order, are the piece of the other axes.
#pragma once

#include <vector>

#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/distributed/placement.hpp"

namespace meshgrad::dist {

struct PieceLayout {
  std::vector<std::vector<ShardRange>> ranges;   // per dim: the ranges held, in order (several: blocks)
  Shape local_shape;                             // the piece's shape (sums of the ranges)
};

// The layout of the piece at `coords`. Throws naming the placements when they do not fit the shape
// (dim out of range, blocks that do not divide) or more than one dim is split in blocks.
PieceLayout piece_layout(const Shape& full, const DeviceMesh& mesh, const Placements& placements,
                         const std::vector<int>& coords);
// The mesh axes that shard some dim (bit per axis).
AxisMask sharded_axes(const Placements& placements);

// A packed copy of the piece of `full` (any dtype).
Tensor take_piece(const Tensor& full, const PieceLayout& layout);
// The full tensor from every coordinate's piece: one all-gather over the axes that shard it (every
// rank of that group calls it, in the same order); the local tensor itself when nothing is sharded.
// Not differentiable (checkpoints, checks).
Tensor gather_pieces(const Tensor& local, const Shape& full, const DeviceMesh& mesh, const Placements& placements);

}  // namespace meshgrad::dist
