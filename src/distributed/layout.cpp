#include "meshgrad/distributed/layout.hpp"

#include <algorithm>
#include <numeric>

#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/tensor/kernels.hpp"

namespace meshgrad::dist {

AxisMask sharded_axes(const Placements& placements) {
  AxisMask mask = 0;
  for (std::size_t a = 0; a < placements.size(); ++a) {
    if (placements[a].is_shard()) mask |= axis_bit(static_cast<int>(a));
  }
  return mask;
}

PieceLayout piece_layout(const Shape& full, const DeviceMesh& mesh, const Placements& placements,
                         const std::vector<int>& coords) {
  MG_CHECK(static_cast<int>(placements.size()) == mesh.ndim() && static_cast<int>(coords.size()) == mesh.ndim(),
           "layout: {} placements {} and {} coordinates for {}", placements.size(), placements_str(placements),
           coords.size(), mesh.str());
  const int nd = static_cast<int>(full.size());
  PieceLayout layout;
  layout.local_shape = full;
  int blocked_dim = -1;
  for (int d = 0; d < nd; ++d) {
    // The axes sharding dim d act as one axis of their product (mesh order, outermost first).
    int parts = 1, index = 0;
    const Placement* spec = nullptr;
    for (int a = 0; a < mesh.ndim(); ++a) {
      const Placement& p = placements[static_cast<std::size_t>(a)];
      if (!p.is_shard()) continue;
      MG_CHECK(p.dim >= 0 && p.dim < nd, "layout: placement {} on axis {} is out of range for shape {}", p.str(),
               mesh.axes()[static_cast<std::size_t>(a)].name, shape_str(full));
      if (p.dim != d || p.of_piece) continue;
      MG_CHECK(spec == nullptr || (spec->blocks == p.blocks && spec->unit == p.unit),
               "layout: placements {} split dim {} in different blocks", placements_str(placements), d);
      spec = &p;
      parts *= mesh.axis_size(a);
      index = index * mesh.axis_size(a) + coords[static_cast<std::size_t>(a)];
    }
    if (spec == nullptr) {
      layout.ranges.push_back({{0, full[static_cast<std::size_t>(d)]}});
      continue;
    }
    std::vector<ShardRange> ranges = spec->ranges(full[static_cast<std::size_t>(d)], parts, index);
    if (ranges.size() > 1) {
      MG_CHECK(blocked_dim < 0, "layout: placements {} split two dims in blocks", placements_str(placements));
      blocked_dim = d;
    }
    std::int64_t extent = 0;
    for (const auto& r : ranges) extent += r.size;
    layout.local_shape[static_cast<std::size_t>(d)] = extent;
    layout.ranges.push_back(std::move(ranges));
  }
  // Then the axes that split the piece itself (Sp(d), FSDP), in mesh order: part `index` of the
  // piece's local extent along d by the shard rule, i.e. a run of the ranges held so far.
  for (int a = 0; a < mesh.ndim(); ++a) {
    const Placement& p = placements[static_cast<std::size_t>(a)];
    if (!p.is_shard() || !p.of_piece) continue;
    const auto d = static_cast<std::size_t>(p.dim);
    const ShardRange keep = shard_range(layout.local_shape[d], mesh.axis_size(a), coords[static_cast<std::size_t>(a)]);
    std::vector<ShardRange> kept;
    std::int64_t seen = 0;   // local offset of the range being walked
    for (const ShardRange& r : layout.ranges[d]) {
      const std::int64_t lo = std::max(seen, keep.offset), hi = std::min(seen + r.size, keep.offset + keep.size);
      if (lo < hi) kept.push_back({r.offset + (lo - seen), hi - lo});
      seen += r.size;
    }
    if (kept.empty()) kept.push_back({layout.ranges[d].front().offset, 0});   // an empty part: no elements
    if (kept.size() > 1) {
      MG_CHECK(blocked_dim < 0 || blocked_dim == p.dim, "layout: placements {} split two dims in blocks",
               placements_str(placements));
      blocked_dim = p.dim;
    }
    layout.local_shape[d] = keep.size;
    layout.ranges[d] = std::move(kept);
  }
  return layout;
}

Tensor take_piece(const Tensor& full, const PieceLayout& layout) {
  MG_CHECK(static_cast<int>(layout.ranges.size()) == full.dim(), "take_piece: a layout of {} dims for {}",
           layout.ranges.size(), full.str());
  Tensor view = full;
  int blocked = -1;
  for (int d = 0; d < full.dim(); ++d) {
    const auto& r = layout.ranges[static_cast<std::size_t>(d)];
    if (r.size() == 1) {
      view = view.narrow(d, r[0].offset, r[0].size);
    } else {
      blocked = d;
    }
  }
  if (blocked < 0) return view.contiguous();
  std::vector<Tensor> pieces;
  for (const auto& r : layout.ranges[static_cast<std::size_t>(blocked)]) pieces.push_back(view.narrow(blocked, r.offset, r.size));
  return kernels::cat(pieces, blocked);
}

Tensor gather_pieces(const Tensor& local, const Shape& full, const DeviceMesh& mesh, const Placements& placements) {
  const AxisMask mask = sharded_axes(placements);
  if (mask == 0) return local;
  std::vector<int> axes;
  for (int a = 0; a < mesh.ndim(); ++a) {
    if (mask & axis_bit(a)) axes.push_back(a);
  }
  const ProcessGroup& group = mesh.flattened_group(axes);
  // Every member's coordinates: ours with the grouped axes unflattened from its group rank.
  std::vector<PieceLayout> layouts;
  std::vector<std::int64_t> counts;
  for (int member = 0; member < group.size(); ++member) {
    std::vector<int> coords = mesh.coordinates();
    int rest = member;
    for (std::size_t k = axes.size(); k-- > 0;) {
      const int size = mesh.axis_size(axes[k]);
      coords[static_cast<std::size_t>(axes[k])] = rest % size;
      rest /= size;
    }
    layouts.push_back(piece_layout(full, mesh, placements, coords));
    counts.push_back(shape_numel(layouts.back().local_shape));
  }
  const PieceLayout& mine = layouts[static_cast<std::size_t>(group.rank())];
  MG_CHECK(local.shape() == mine.local_shape, "gather_pieces: the local piece is {} but placements {} of {} give {}",
           shape_str(local.shape()), placements_str(placements), shape_str(full), shape_str(mine.local_shape));
  const Tensor flat = all_gather(local.contiguous().view({-1}), group, 0, counts);
  Tensor out = Tensor::empty(full, local.dtype());
  std::int64_t offset = 0;
  for (std::size_t m = 0; m < layouts.size(); ++m) {
    const PieceLayout& l = layouts[m];
    const Tensor piece = flat.narrow(0, offset, counts[m]).view(l.local_shape);
    offset += counts[m];
    // Place it: every dim but the blocked one is one range; the blocked one walks its blocks.
    Tensor dst = out;
    int blocked = -1;
    for (int d = 0; d < static_cast<int>(full.size()); ++d) {
      const auto& r = l.ranges[static_cast<std::size_t>(d)];
      if (r.size() == 1) {
        dst = dst.narrow(d, r[0].offset, r[0].size);
      } else {
        blocked = d;
      }
    }
    if (blocked < 0) {
      dst.copy_from(piece);
      continue;
    }
    std::int64_t in_piece = 0;
    for (const auto& r : l.ranges[static_cast<std::size_t>(blocked)]) {
      dst.narrow(blocked, r.offset, r.size).copy_from(piece.narrow(blocked, in_piece, r.size));
      in_piece += r.size;
    }
  }
  return out;
}

}  // namespace meshgrad::dist
