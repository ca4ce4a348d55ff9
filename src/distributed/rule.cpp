// The one rule (see rule.hpp) and the one place that runs its primitives.
#include "meshgrad/distributed/rule.hpp"

#include <fmt/format.h>

#include "meshgrad/distributed/tree_collectives.hpp"

#include <numeric>

namespace meshgrad::dist {

const char* primitive_name(Primitive p) {
  switch (p) {
    case Primitive::Identity: return "identity";
    case Primitive::AllReduce: return "all-reduce";
    case Primitive::AllGather: return "all-gather";
    case Primitive::ReduceScatter: return "reduce-scatter";
    case Primitive::Slice: return "keep own slice";
    case Primitive::AllToAll: return "all-to-all";
    case Primitive::KeepOnRoot: return "keep on coordinate 0";
  }
  return "?";
}

bool communicates(Primitive p) {
  return p == Primitive::AllReduce || p == Primitive::AllGather || p == Primitive::ReduceScatter ||
         p == Primitive::AllToAll;
}

Primitive forward_primitive(Placement from, Placement to) {
  if (from.is_replicate() && to.is_replicate()) return Primitive::Identity;
  if (from.is_partial() && to.is_replicate()) return Primitive::AllReduce;
  if (from.is_shard() && to.is_replicate()) return Primitive::AllGather;
  if (from.is_replicate() && to.is_shard()) return Primitive::Slice;
  if (from.is_partial() && to.is_shard()) return Primitive::ReduceScatter;
  if (from.is_shard() && to.is_shard() && from.dim != to.dim) return Primitive::AllToAll;
  if (from.is_replicate() && to.is_partial()) return Primitive::KeepOnRoot;
  throw InvalidArgument(fmt::format("no single communication step changes placement {} into {} on one mesh axis "
                                    "(go through R)", from.str(), to.str()));
}

BackwardStep backward_step(Placement from, Placement to, Placement incoming) {
  const Primitive fwd = forward_primitive(from, to);
  const auto refuse = [&](const char* why) -> BackwardStep {
    throw InvalidArgument(fmt::format("backward of {} ({} -> {}): a gradient placed {} cannot arrive: {}",
                                      primitive_name(fwd), from.str(), to.str(), incoming.str(), why));
  };
  if (to.is_shard()) {
    if (!incoming.is_shard(to.dim)) refuse("the output is sharded, so its gradient is this coordinate's shard");
    switch (fwd) {
      case Primitive::Slice:            // R -> S(d): every coordinate's shard gradient makes the whole
      case Primitive::ReduceScatter:    // P -> S(d): each term's gradient is the whole gradient
        return {Primitive::AllGather, Placement::replicate()};
      case Primitive::AllToAll:         // S(i) -> S(j): the reverse exchange
        return {Primitive::AllToAll, from};
      default: break;
    }
  }
  if (incoming.is_shard()) refuse("the output is replicated or partial, so its gradient is R or P");
  const bool partial = incoming.is_partial();
  switch (fwd) {
    case Primitive::Identity:      // R -> R: the region's ops used the tensor with sharded data
    case Primitive::AllReduce:     // P -> R: d(sum)/d(term) is the whole gradient
    case Primitive::KeepOnRoot:    // R -> P
      return {partial ? Primitive::AllReduce : Primitive::Identity, Placement::replicate()};
    case Primitive::AllGather:     // S(d) -> R: sum the partial gradients and keep own shard, or just slice
      return {partial ? Primitive::ReduceScatter : Primitive::Slice, from};
    default: break;
  }
  return refuse("no rule for this step");
}

Placement arriving_placement(const Tensor& grad, Placement forward_placement, AxisMask axes, std::string_view op) {
  if (forward_placement.is_shard()) return forward_placement;
  const AxisMask marked = partial_axes(grad) & axes;
  if (marked == 0) return Placement::replicate();
  MG_CHECK(marked == axes, "{}: the gradient is partial on some but not all of the group's mesh axes (partial "
           "mask {:#x}, group axes {:#x}); reduce it over those axes first", op, marked, axes);
  return Placement::partial();
}

std::vector<RuleRow> rule_table() {
  const Placement R = Placement::replicate(), P = Placement::partial(), S0 = Placement::shard(0),
                  S1 = Placement::shard(1);
  struct Step {
    Placement from, to;
  };
  const Step steps[] = {{R, R}, {P, R}, {S0, R}, {R, S0}, {P, S0}, {S0, S1}, {R, P}};
  std::vector<RuleRow> rows;
  for (const Step& s : steps) {
    const std::vector<Placement> arriving = s.to.is_shard() ? std::vector<Placement>{s.to} : std::vector<Placement>{P, R};
    for (const Placement& in : arriving) {
      rows.push_back({s.from, s.to, in, forward_primitive(s.from, s.to), backward_step(s.from, s.to, in)});
    }
  }
  return rows;
}

std::string format_rule_table() {
  std::string out = fmt::format("{:<14} {:<21} {:<10} {:<22} {}\n", "forward", "primitive", "grad in",
                                "backward", "grad out");
  for (const RuleRow& r : rule_table()) {
    const std::string step = r.from.str() + " -> " + r.to.str();
    out += fmt::format("{:<14} {:<21} {:<10} {:<22} {}\n", step, primitive_name(r.forward), r.incoming.str(),
                       primitive_name(r.backward.op), r.backward.result.str());
  }
  return out;
}

// ---- running a step ------------------------------------------------------------------------------

const char* reduce_order_name(ReduceOrder order) {
  return order == ReduceOrder::FixedTree ? "fixed tree" : "rank order";
}

PendingTensor run_primitive_async(Primitive p, const Tensor& x, const ProcessGroup& group, const StepArgs& args,
                                  bool in_place) {
  const bool tree = args.order == ReduceOrder::FixedTree && group.size() > 1;
  switch (p) {
    case Primitive::Identity:
      return PendingTensor::ready(x);
    case Primitive::AllReduce:
      if (tree) return tree_all_reduce_async(x, group);
      return in_place ? all_reduce_in_place_async(x, group) : all_reduce_async(x, group);
    case Primitive::AllGather:
      return all_gather_async(x, group, args.dim, args.sizes);
    case Primitive::ReduceScatter:
      if (tree) return tree_reduce_scatter_async(x, group, args.dim, args.sizes);
      return reduce_scatter_async(x, group, args.dim, args.sizes);
    case Primitive::Slice: {
      if (group.size() == 1) return PendingTensor::ready(x);
      const auto& s = args.sizes;
      MG_CHECK(static_cast<int>(s.size()) == group.size() &&
                   x.size(args.dim) == std::accumulate(s.begin(), s.end(), std::int64_t{0}),
               "keep own slice over {}: extent {} along dim {} does not match the shard sizes {}", group.axis,
               x.size(args.dim), args.dim, shape_str(s));
      const std::int64_t offset = std::accumulate(s.begin(), s.begin() + group.rank(), std::int64_t{0});
      return PendingTensor::ready(x.narrow(args.dim, offset, s[static_cast<std::size_t>(group.rank())]).contiguous());
    }
    case Primitive::AllToAll:
      // Split along dim (by the shard rule), gather along dim2 (extents args.sizes).
      return PendingTensor::ready(all_to_all(x, group, args.dim, args.dim2, args.sizes));
    case Primitive::KeepOnRoot:
      return PendingTensor::ready(group.rank() == 0 ? x : Tensor::zeros(x.shape(), x.dtype()));
  }
  throw InvalidArgument("run_primitive: unknown primitive");
}

Tensor run_primitive(Primitive p, const Tensor& x, const ProcessGroup& group, const StepArgs& args) {
  if (args.order == ReduceOrder::RankOrder) {
    switch (p) {
      case Primitive::AllReduce: return all_reduce(x, group);
      case Primitive::AllGather: return all_gather(x, group, args.dim, args.sizes);
      case Primitive::ReduceScatter: return reduce_scatter(x, group, args.dim, args.sizes);
      default: break;
    }
  }
  return run_primitive_async(p, x, group, args).wait();
}

Tensor sum_over(const Tensor& x, const ProcessGroup& group, ReduceOrder order) {
  StepArgs args;
  args.order = order;
  return run_primitive(Primitive::AllReduce, x, group, args);
}

double sum_scalar_over(const Tensor& x, const ProcessGroup& group, ReduceOrder order) {
  MG_CHECK(x.numel() == 1, "sum_scalar_over '{}': expected one element, got {}", group.axis, shape_str(x.shape()));
  return sum_over(x.detach(), group, order).item();
}

}  // namespace meshgrad::dist
