#include "meshgrad/distributed/dtensor.hpp"

#include "meshgrad/autograd/function.hpp"
#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/distributed/mappings.hpp"
#include "meshgrad/distributed/rule.hpp"
#include "meshgrad/ops/ops.hpp"

namespace meshgrad::dist {

namespace {

AxisMask bit(int axis) { return axis_bit(axis); }

// Checks placements against a mesh and a tensor rank: one per axis, shard dims in range, no dim
// sharded by two axes. Returns them with shard dims normalised to [0, nd).
Placements checked_placements(const Placements& placements, const DeviceMesh& mesh, int nd, const char* op) {
  MG_CHECK(static_cast<int>(placements.size()) == mesh.ndim(), "{}: {} placements {} for {} with {} axes", op,
           placements.size(), placements_str(placements), mesh.str(), mesh.ndim());
  Placements out = placements;
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (!out[i].is_shard()) continue;
    MG_CHECK(out[i].dim >= -nd && out[i].dim < nd, "{}: placement {} on axis {} is out of range for a {}-dim tensor",
             op, out[i].str(), mesh.axes()[i].name, nd);
    if (out[i].dim < 0) out[i].dim += nd;
    for (std::size_t j = 0; j < i; ++j) {
      MG_CHECK(!out[j].is_shard(out[i].dim), "{}: placements {} shard dim {} over two mesh axes ({} and {}); nested "
               "sharding is not supported", op, placements_str(placements), out[i].dim, mesh.axes()[j].name,
               mesh.axes()[i].name);
    }
  }
  return out;
}

// One axis of a redistribution: the differentiable step of mappings.hpp on that axis' group, with
// the backward the one rule derives from the gradient that arrives.
DTensor step(const DTensor& x, int axis, Placement to) {
  Placements pl = x.placements();
  const Placement from = pl[static_cast<std::size_t>(axis)];
  pl[static_cast<std::size_t>(axis)] = to;
  pl = checked_placements(pl, *x.mesh(), x.dim(), "redistribute");
  // The extent the step gathers: along from's shard dim (S -> R, S -> S').
  const std::int64_t full = from.is_shard() ? x.shape()[static_cast<std::size_t>(from.dim)] : -1;
  Tensor local = change_placement(x.local(), x.mesh()->group(axis), from, to, full);
  return DTensor(local, x.mesh(), pl, x.shape());
}

bool dim_sharded_elsewhere(const Placements& pl, int axis, int dim) {
  for (std::size_t j = 0; j < pl.size(); ++j) {
    if (static_cast<int>(j) != axis && pl[j].is_shard(dim)) return true;
  }
  return false;
}

}  // namespace

// ---- DTensor ------------------------------------------------------------------------------------------

Shape local_shape_of(const Shape& global_shape, const DeviceMesh& mesh, const Placements& placements,
                     const std::vector<int>& coords) {
  Shape local = global_shape;
  for (std::size_t i = 0; i < placements.size(); ++i) {
    if (!placements[i].is_shard()) continue;
    auto& extent = local[static_cast<std::size_t>(placements[i].dim)];
    extent = shard_range(global_shape[static_cast<std::size_t>(placements[i].dim)], mesh.axes()[i].size, coords[i]).size;
  }
  return local;
}

std::vector<std::int64_t> local_offsets_of(const Shape& global_shape, const DeviceMesh& mesh,
                                           const Placements& placements, const std::vector<int>& coords) {
  std::vector<std::int64_t> offsets(global_shape.size(), 0);
  for (std::size_t i = 0; i < placements.size(); ++i) {
    if (!placements[i].is_shard()) continue;
    const int d = placements[i].dim;
    offsets[static_cast<std::size_t>(d)] =
        shard_range(global_shape[static_cast<std::size_t>(d)], mesh.axes()[i].size, coords[i]).offset;
  }
  return offsets;
}

DTensor::DTensor(Tensor local, DeviceMeshPtr mesh, Placements placements, Shape global_shape)
    : local_(std::move(local)), mesh_(std::move(mesh)), global_shape_(std::move(global_shape)) {
  MG_CHECK(local_.defined() && mesh_ != nullptr, "DTensor: needs a local tensor and a mesh");
  MG_CHECK(local_.dim() == static_cast<int>(global_shape_.size()), "DTensor: local {} and global shape {} differ in rank",
           shape_str(local_.shape()), shape_str(global_shape_));
  placements_ = checked_placements(placements, *mesh_, local_.dim(), "DTensor");
  const Shape expected = local_shape_of(global_shape_, *mesh_, placements_, mesh_->coordinates());
  MG_CHECK(local_.shape() == expected, "DTensor: rank {} holds local shape {} but global shape {} with placements {} "
           "on {} gives {}", mesh_->rank(), shape_str(local_.shape()), shape_str(global_shape_),
           placements_str(placements_), mesh_->str(), shape_str(expected));
}

std::string DTensor::str() const {
  return fmt::format("DTensor({}{} local {} on {} {})", dtype_name(dtype()), shape_str(global_shape_),
                     shape_str(local_.shape()), mesh_->str(), placements_str(placements_));
}

DTensor from_local(const Tensor& local, DeviceMeshPtr mesh, Placements placements, Shape global_shape) {
  MG_CHECK(mesh != nullptr, "from_local: no mesh given");
  placements = checked_placements(placements, *mesh, local.dim(), "from_local");
  if (global_shape.empty() && local.dim() > 0) {
    global_shape = local.shape();
    for (std::size_t i = 0; i < placements.size(); ++i) {
      if (!placements[i].is_shard()) continue;
      std::int64_t total = 0;
      for (auto s : exchange_sizes(local.size(placements[i].dim), mesh->group(static_cast<int>(i)))) total += s;
      global_shape[static_cast<std::size_t>(placements[i].dim)] = total;
    }
  }
  AxisMask partial = 0;
  for (std::size_t i = 0; i < placements.size(); ++i) {
    if (placements[i].is_partial()) partial |= bit(static_cast<int>(i));
  }
  Tensor wrapped = mark_partial_grad(local, partial);
  return DTensor(wrapped, std::move(mesh), std::move(placements), std::move(global_shape));
}

DTensor redistribute(const DTensor& x, const Placements& target_in) {
  const Placements target = checked_placements(target_in, *x.mesh(), x.dim(), "redistribute");
  DTensor cur = x;
  const int n = x.mesh()->ndim();
  // Pass 1: leave Shard and Partial placements that must change (directly when the target dim is
  // free on the other axes, else through Replicate).
  for (int axis = 0; axis < n; ++axis) {
    const Placement from = cur.placements()[static_cast<std::size_t>(axis)];
    const Placement to = target[static_cast<std::size_t>(axis)];
    if (from == to || from.is_replicate()) continue;
    if (to.is_shard() && !dim_sharded_elsewhere(cur.placements(), axis, to.dim)) {
      cur = step(cur, axis, to);
    } else if (to.is_partial()) {
      cur = step(step(cur, axis, Placement::replicate()), axis, to);   // S -> R -> P
    } else {
      cur = step(cur, axis, Placement::replicate());
    }
  }
  // Pass 2: from Replicate to the targets.
  for (int axis = 0; axis < n; ++axis) {
    const Placement to = target[static_cast<std::size_t>(axis)];
    if (cur.placements()[static_cast<std::size_t>(axis)] != to) cur = step(cur, axis, to);
  }
  return cur;
}

Tensor full_tensor(const DTensor& x) {
  return redistribute(x, Placements(static_cast<std::size_t>(x.mesh()->ndim()), Placement::replicate())).local();
}

// ---- ops ------------------------------------------------------------------------------------------

namespace {

enum class Elementwise { Add, Sub, Mul, Div };
const char* elementwise_name(Elementwise op) {
  switch (op) {
    case Elementwise::Add: return "add";
    case Elementwise::Sub: return "sub";
    case Elementwise::Mul: return "mul";
    case Elementwise::Div: return "div";
  }
  return "?";
}

[[noreturn]] void refuse(const char* op, const DTensor& a, const DTensor& b, int axis, const std::string& why) {
  throw InvalidArgument(fmt::format("{}: placements {} and {} cannot be combined on mesh axis {} ({}): {}; "
                                    "redistribute an operand first",
                                    op, placements_str(a.placements()), placements_str(b.placements()),
                                    a.mesh()->axes()[static_cast<std::size_t>(axis)].name,
                                    a.placements()[static_cast<std::size_t>(axis)].str() + " with " +
                                        b.placements()[static_cast<std::size_t>(axis)].str(),
                                    why));
}

void check_same_mesh(const char* op, const DTensor& a, const DTensor& b) {
  MG_CHECK(a.mesh() == b.mesh(), "{}: operands live on different meshes ({} and {})", op, a.mesh()->str(),
           b.mesh()->str());
}

DTensor elementwise(Elementwise op, const DTensor& a_in, const DTensor& b_in) {
  const char* name = elementwise_name(op);
  check_same_mesh(name, a_in, b_in);
  const Shape out_shape = broadcast_shapes(a_in.shape(), b_in.shape(), name);
  const int nd = static_cast<int>(out_shape.size());
  const int lead_a = nd - a_in.dim(), lead_b = nd - b_in.dim();
  DTensor a = a_in, b = b_in;
  AxisMask mark_a = 0, mark_b = 0;
  Placements out(a.placements().size());
  // Global extent of an operand along output dim d (1 where it broadcasts).
  auto extent = [&](const DTensor& t, int lead, int d) { return d < lead ? 1 : t.shape()[static_cast<std::size_t>(d - lead)]; };
  for (int axis = 0; axis < a.mesh()->ndim(); ++axis) {
    const Placement pa = a.placements()[static_cast<std::size_t>(axis)];
    const Placement pb = b.placements()[static_cast<std::size_t>(axis)];
    Placement& po = out[static_cast<std::size_t>(axis)];
    if (pa.is_replicate() && pb.is_replicate()) {
      po = Placement::replicate();
    } else if (pa.is_shard() && pb.is_shard()) {
      const int da = pa.dim + lead_a, db = pb.dim + lead_b;
      if (da != db) refuse(name, a_in, b_in, axis, "the operands are sharded along different dims");
      if (extent(a, lead_a, da) != extent(b, lead_b, db)) refuse(name, a_in, b_in, axis, "one operand broadcasts along the sharded dim");
      po = Placement::shard(da);
    } else if ((pa.is_shard() && pb.is_replicate()) || (pa.is_replicate() && pb.is_shard())) {
      const bool a_sharded = pa.is_shard();
      DTensor& rep = a_sharded ? b : a;
      const int rep_lead = a_sharded ? lead_b : lead_a;
      const int d = a_sharded ? pa.dim + lead_a : pb.dim + lead_b;
      if (extent(rep, rep_lead, d) == 1) {
        // The replicated side broadcasts along the sharded dim: each rank uses all of it on its own
        // rows, so its gradient is a partial sum over this axis.
        (a_sharded ? mark_b : mark_a) |= bit(axis);
      } else {
        rep = step(rep, axis, Placement::shard(d - rep_lead));   // local slice, no communication
      }
      po = Placement::shard(d);
    } else if (pa.is_partial() && pb.is_partial()) {
      if (op != Elementwise::Add && op != Elementwise::Sub) {
        refuse(name, a_in, b_in, axis, "a product of two partial sums is not the partial sum of a product");
      }
      po = Placement::partial();
    } else if (pa.is_partial() && pb.is_replicate()) {
      if (op == Elementwise::Add || op == Elementwise::Sub) {
        refuse(name, a_in, b_in, axis, "the replicated value would be added once per rank");
      }
      mark_b |= bit(axis);
      po = Placement::partial();
    } else if (pa.is_replicate() && pb.is_partial()) {
      if (op != Elementwise::Mul) {
        refuse(name, a_in, b_in, axis, op == Elementwise::Div ? "dividing by a partial sum is not linear"
                                                              : "the replicated value would be added once per rank");
      }
      mark_a |= bit(axis);
      po = Placement::partial();
    } else {
      refuse(name, a_in, b_in, axis, "a partial sum and a shard do not line up");
    }
  }
  const Tensor la = mark_partial_grad(a.local(), mark_a);
  const Tensor lb = mark_partial_grad(b.local(), mark_b);
  Tensor local;
  switch (op) {
    case Elementwise::Add: local = meshgrad::add(la, lb); break;
    case Elementwise::Sub: local = meshgrad::sub(la, lb); break;
    case Elementwise::Mul: local = meshgrad::mul(la, lb); break;
    case Elementwise::Div: local = meshgrad::div(la, lb); break;
  }
  return DTensor(local, a.mesh(), out, out_shape);
}

}  // namespace

DTensor add(const DTensor& a, const DTensor& b) { return elementwise(Elementwise::Add, a, b); }
DTensor sub(const DTensor& a, const DTensor& b) { return elementwise(Elementwise::Sub, a, b); }
DTensor mul(const DTensor& a, const DTensor& b) { return elementwise(Elementwise::Mul, a, b); }
DTensor div(const DTensor& a, const DTensor& b) { return elementwise(Elementwise::Div, a, b); }

DTensor matmul(const DTensor& a, const DTensor& b) {
  check_same_mesh("matmul", a, b);
  const int na = a.dim(), nb = b.dim();
  MG_CHECK(na >= 2 && (nb == 2 || nb == na), "matmul: DTensor operands {} and {} must be [..., m, k] @ [k, n] or have "
           "the same number of dims", shape_str(a.shape()), shape_str(b.shape()));
  MG_CHECK(a.shape()[static_cast<std::size_t>(na - 1)] == b.shape()[static_cast<std::size_t>(nb - 2)],
           "matmul: inner dims of {} and {} differ", shape_str(a.shape()), shape_str(b.shape()));
  Shape out_shape(a.shape().begin(), a.shape().end() - 1);
  out_shape.push_back(b.shape().back());
  const int nout = static_cast<int>(out_shape.size());
  Placements out(a.placements().size());
  AxisMask mark_a = 0, mark_b = 0;
  for (int axis = 0; axis < a.mesh()->ndim(); ++axis) {
    const Placement pa = a.placements()[static_cast<std::size_t>(axis)];
    const Placement pb = b.placements()[static_cast<std::size_t>(axis)];
    Placement& po = out[static_cast<std::size_t>(axis)];
    if (pa.is_replicate() && pb.is_replicate()) {
      po = Placement::replicate();
    } else if (pa.is_shard(na - 2) && pb.is_replicate()) {           // S(m) . R -> S(m)
      po = Placement::shard(nout - 2);
      mark_b |= bit(axis);
    } else if (pa.is_replicate() && pb.is_shard(nb - 1)) {           // R . S(n) -> S(n)
      po = Placement::shard(nout - 1);
      mark_a |= bit(axis);
    } else if (pa.is_shard(na - 1) && pb.is_shard(nb - 2)) {         // S(k) . S(k) -> P
      po = Placement::partial();
    } else if (pa.is_shard() && pa.dim < na - 2 && pb.is_replicate()) {   // S(batch) . R -> S(batch)
      po = Placement::shard(pa.dim);
      mark_b |= bit(axis);
    } else if (pa.is_shard() && pa.dim < na - 2 && nb == na && pb.is_shard(pa.dim)) {
      po = Placement::shard(pa.dim);
    } else if (pa.is_partial() && pb.is_replicate()) {
      po = Placement::partial();
      mark_b |= bit(axis);
    } else if (pa.is_replicate() && pb.is_partial()) {
      po = Placement::partial();
      mark_a |= bit(axis);
    } else {
      refuse("matmul", a, b, axis, "the shardings do not match a local product");
    }
  }
  Tensor local = meshgrad::matmul(mark_partial_grad(a.local(), mark_a), mark_partial_grad(b.local(), mark_b));
  return DTensor(local, a.mesh(), out, out_shape);
}

DTensor sum(const DTensor& x, const std::vector<std::int64_t>& dims_in, bool keepdim) {
  const int nd = x.dim();
  std::vector<bool> reduced(static_cast<std::size_t>(nd), dims_in.empty());
  for (auto d : dims_in) reduced[static_cast<std::size_t>(normalize_dim(d, x.shape(), "sum"))] = true;
  std::vector<int> new_index(static_cast<std::size_t>(nd));
  Shape out_shape;
  for (int d = 0, k = 0; d < nd; ++d) {
    new_index[static_cast<std::size_t>(d)] = k;
    if (!reduced[static_cast<std::size_t>(d)] || keepdim) {
      out_shape.push_back(reduced[static_cast<std::size_t>(d)] ? 1 : x.shape()[static_cast<std::size_t>(d)]);
      ++k;
    }
  }
  Placements out = x.placements();
  for (auto& p : out) {
    if (!p.is_shard()) continue;
    p = reduced[static_cast<std::size_t>(p.dim)] ? Placement::partial()
                                                  : Placement::shard(new_index[static_cast<std::size_t>(p.dim)]);
  }
  std::vector<std::int64_t> dims;
  for (int d = 0; d < nd; ++d) {
    if (reduced[static_cast<std::size_t>(d)]) dims.push_back(d);
  }
  Tensor local = meshgrad::sum(x.local(), dims, keepdim);
  return DTensor(local, x.mesh(), out, out_shape);
}

// ---- parameter gradients --------------------------------------------------------------------------------

namespace {
AxisMask replicated_axes(const DTensor& p) {
  AxisMask m = 0;
  for (std::size_t i = 0; i < p.placements().size(); ++i) {
    if (!p.placements()[i].is_shard()) m |= bit(static_cast<int>(i));
  }
  return m;
}
}  // namespace

void reduce_partial_grads(const std::vector<DTensor>& params, ReduceOrder order) {
  for (const DTensor& p : params) {
    Tensor grad = p.local().grad();
    if (!grad.defined()) continue;
    Tensor reduced = grad;
    for (int axis = 0; axis < p.mesh()->ndim(); ++axis) {
      if (!(replicated_axes(p) & bit(axis))) continue;   // a shard's gradient is complete for its shard
      const Placement arriving = arriving_placement(reduced, Placement::replicate(), bit(axis), "reduce_partial_grads");
      const BackwardStep step = backward_step(Placement::replicate(), Placement::replicate(), arriving);
      StepArgs args;
      args.order = order;
      const AxisMask marks = partial_axes(reduced);
      reduced = run_primitive(step.op, reduced, p.mesh()->group(axis), args);
      set_partial_axes(reduced, marks & ~bit(axis));
    }
    if (!reduced.same_as(grad)) grad.copy_from(reduced);
    set_partial_axes(grad, 0);
  }
}

void check_grads_complete(const std::vector<DTensor>& params, const std::vector<std::string>& names) {
  for (std::size_t i = 0; i < params.size(); ++i) {
    const DTensor& p = params[i];
    const AxisMask partial = partial_axes(p.local().grad()) & replicated_axes(p);
    for (int axis = 0; axis < p.mesh()->ndim(); ++axis) {
      MG_CHECK(!(partial & bit(axis)), "parameter {} ({}) has a gradient that is a partial sum over mesh axis {}: "
               "it is replicated there but was used on sharded data; call reduce_partial_grads before the "
               "optimizer step", i < names.size() ? names[i] : fmt::format("#{}", i), p.str(),
               p.mesh()->axes()[static_cast<std::size_t>(axis)].name);
    }
  }
}

}  // namespace meshgrad::dist
