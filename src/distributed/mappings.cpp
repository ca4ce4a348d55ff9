// The differentiable collectives: every one is a change of placement on a group, run forward by
// the rule's forward primitive and backward by the rule's answer for the gradient that arrives
// (rule.hpp). DTensor's redistribute steps are the same function (dtensor.cpp).
#include "meshgrad/distributed/mappings.hpp"

#include <numeric>

#include "meshgrad/autograd/function.hpp"
#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/rule.hpp"

namespace meshgrad::dist {

namespace {

std::string step_name(Placement from, Placement to) {
  return fmt::format("{} ({} -> {})", primitive_name(forward_primitive(from, to)), from.str(), to.str());
}

// x placed `from` on group -> placed `to`. Shard dims are normalised to [0, x.dim()).
class ChangePlacementFn final : public autograd::Function {
 public:
  ChangePlacementFn(ProcessGroup group, Placement from, Placement to, std::int64_t full_size, ReduceOrder order)
      : group_(std::move(group)), from_(from), to_(to), full_size_(full_size), order_(order),
        name_(step_name(from, to)), label_(current_comm_label()) {}
  std::string_view name() const override { return name_; }
  // The gradient's placement on this group is decided here (by the rule), not inherited.
  bool decides_gradient_placement() const override { return true; }

  TensorList forward(const TensorList& x) override {
    const Primitive p = forward_primitive(from_, to_);
    StepArgs args;
    args.order = order_;
    switch (p) {
      case Primitive::AllGather:   // S(d) -> R: gather d
        args.dim = from_.dim;
        args.sizes = gathered_sizes(x[0].size(from_.dim));
        gathered_ = args.sizes;
        break;
      case Primitive::Slice:          // R -> S(d)
      case Primitive::ReduceScatter:  // P -> S(d)
        args.dim = to_.dim;
        args.sizes = shard_sizes(x[0].size(to_.dim), group_.size());
        scattered_ = args.sizes;
        break;
      case Primitive::AllToAll:    // S(i) -> S(j): split j, gather i
        args.dim = to_.dim;
        args.dim2 = from_.dim;
        args.sizes = gathered_sizes(x[0].size(from_.dim));
        gathered_ = args.sizes;
        scattered_ = shard_sizes(x[0].size(to_.dim), group_.size());
        break;
      default:
        break;
    }
    return {run_primitive(p, x[0], group_, args)};
  }

  TensorList backward(const TensorList& g) override {
    CommLabelScope label(label_);
    const Placement incoming = arriving_placement(g[0], to_, group_.axes, name_);
    const BackwardStep step = backward_step(from_, to_, incoming);
    StepArgs args;
    args.order = order_;
    switch (step.op) {
      case Primitive::AllGather:       // back from R -> S(d) or P -> S(d)
        args.dim = to_.dim;
        args.sizes = scattered_;
        break;
      case Primitive::ReduceScatter:   // back from S(d) -> R
      case Primitive::Slice:
        args.dim = from_.dim;
        args.sizes = gathered_;
        break;
      case Primitive::AllToAll:        // back from S(i) -> S(j): split i, gather j
        args.dim = from_.dim;
        args.dim2 = to_.dim;
        args.sizes = scattered_;
        break;
      default:
        break;
    }
    Tensor grad = run_primitive(step.op, g[0], group_, args);
    Tensor out = grad.same_as(g[0]) ? grad.detach() : grad;   // a new handle for the new placement
    set_partial_axes(out, partial_axes(g[0]) & ~group_.axes);
    return {out};
  }

 private:
  std::vector<std::int64_t> gathered_sizes(std::int64_t local) const {
    return full_size_ >= 0 ? shard_sizes(full_size_, group_.size()) : exchange_sizes(local, group_);
  }

  ProcessGroup group_;
  Placement from_, to_;
  std::int64_t full_size_;
  ReduceOrder order_;
  std::string name_, label_;
  std::vector<std::int64_t> gathered_;    // every coordinate's extent along the gathered dim
  std::vector<std::int64_t> scattered_;   // ... along the dim that forward sharded
};

// all_to_all_rows: forward sends send_rows to each rank; backward asks the rule for the gradient of
// S(source) -> S(destination) and runs it with the counts exchanged.
class AllToAllRowsFn final : public autograd::Function {
 public:
  AllToAllRowsFn(ProcessGroup group, std::vector<std::int64_t> send_rows, std::vector<std::int64_t> recv_rows)
      : group_(std::move(group)), send_(std::move(send_rows)), recv_(std::move(recv_rows)),
        label_(current_comm_label()) {}
  std::string_view name() const override { return "all-to-all of rows (S(source) -> S(destination))"; }
  bool decides_gradient_placement() const override { return true; }
  TensorList forward(const TensorList& x) override { return {exchange_rows(x[0], group_, send_, recv_)}; }
  TensorList backward(const TensorList& g) override {
    CommLabelScope label(label_);
    const Placement by_source = Placement::shard(0), by_destination = Placement::shard(1);
    const Placement incoming = arriving_placement(g[0], by_destination, group_.axes, name());
    const BackwardStep step = backward_step(by_source, by_destination, incoming);
    MG_CHECK(step.op == Primitive::AllToAll, "all_to_all_rows over {}: the rule answers {} for its gradient",
             group_.axis, primitive_name(step.op));
    Tensor out = exchange_rows(g[0], group_, recv_, send_);
    // The exchange adds nothing: the gradient keeps its marks. On a batch axis (ep is one) the mark
    // is the loss's share of the replicas, which the rows' gradient still is after travelling.
    set_partial_axes(out, partial_axes(g[0]));
    return {out};
  }

 private:
  ProcessGroup group_;
  std::vector<std::int64_t> send_, recv_;
  std::string label_;
};

Placement normalized(Placement p, const Tensor& x, const char* op) {
  if (p.is_shard()) p.dim = normalize_dim(p.dim, x.shape(), op);
  return p;
}

// The mappings for the DESIGN table, with symbolic shard dims (the dim does not change the rule's
// answer) and the gradient each usually receives.
struct Mapping {
  const char* name;
  Placement from, to;
  Placement usual_incoming;
};
const Placement kR = Placement::replicate(), kP = Placement::partial(), kS0 = Placement::shard(0),
                kS1 = Placement::shard(1);
const Mapping kMappings[] = {
    {"copy to TP region", kR, kR, kP},
    {"reduce from TP region", kP, kR, kR},
    {"scatter to TP region (feature dim)", kR, kS1, kS1},
    {"gather from TP region (feature dim)", kS1, kR, kR},
    {"scatter to sequence-parallel region", kR, kS0, kS0},
    {"gather from sequence-parallel region", kS0, kR, kP},
    {"reduce-scatter to sequence-parallel region", kP, kS0, kS0},
    {"all-to-all", kS1, kS0, kS0},
    {"all-gather with gradient", kS0, kR, kP},
};

}  // namespace

Tensor change_placement(const Tensor& x, const ProcessGroup& group, Placement from, Placement to,
                        std::int64_t full_size, ReduceOrder order) {
  check_floating(x, "change_placement");
  MG_CHECK(group.size() == 1 || group.axes != 0, "change_placement over '{}': the group is not a mesh group (no "
           "mesh axes), so gradient placements cannot be read on it", group.axis);
  from = normalized(from, x, "change_placement");
  to = normalized(to, x, "change_placement");
  // Nothing moves; bit-identical, nothing recorded. R -> R is a step of its own (identity forward,
  // all-reduce of a partial gradient backward), never folded away.
  if (group.size() == 1 || (from == to && !from.is_replicate())) return x;
  return autograd::apply<ChangePlacementFn>({x}, group, from, to, full_size, order)[0];
}

Tensor copy_to_region(const Tensor& x, const ProcessGroup& group, ReduceOrder order) {
  return change_placement(x, group, kR, kR, -1, order);
}
Tensor reduce_from_region(const Tensor& x, const ProcessGroup& group, ReduceOrder order) {
  return change_placement(x, group, kP, kR, -1, order);
}
Tensor scatter_to_region(const Tensor& x, const ProcessGroup& group, std::int64_t dim) {
  return change_placement(x, group, kR, Placement::shard(static_cast<int>(dim)));
}
Tensor gather_from_region(const Tensor& x, const ProcessGroup& group, std::int64_t dim, std::int64_t full_size) {
  return change_placement(x, group, Placement::shard(static_cast<int>(dim)), kR, full_size);
}
Tensor scatter_to_sequence(const Tensor& x, const ProcessGroup& group, std::int64_t dim) {
  return change_placement(x, group, kR, Placement::shard(static_cast<int>(dim)));
}
Tensor gather_from_sequence(const Tensor& x, const ProcessGroup& group, std::int64_t dim, std::int64_t full_size) {
  return change_placement(x, group, Placement::shard(static_cast<int>(dim)), kR, full_size);
}
Tensor reduce_scatter_to_sequence(const Tensor& x, const ProcessGroup& group, std::int64_t dim, ReduceOrder order) {
  return change_placement(x, group, kP, Placement::shard(static_cast<int>(dim)), -1, order);
}
Tensor all_to_all(const Tensor& x, const ProcessGroup& group, std::int64_t split_dim, std::int64_t cat_dim,
                  std::int64_t cat_full_size) {
  return change_placement(x, group, Placement::shard(static_cast<int>(cat_dim)),
                          Placement::shard(static_cast<int>(split_dim)), cat_full_size);
}
Tensor all_to_all_rows(const Tensor& x, const ProcessGroup& group, std::vector<std::int64_t> send_rows,
                       std::vector<std::int64_t> recv_rows) {
  check_floating(x, "all_to_all_rows");
  if (group.size() == 1) {
    MG_CHECK(send_rows.size() == 1 && recv_rows == send_rows && send_rows[0] == x.size(0), "all_to_all_rows over a group "
             "of one: {} rows, the counts say {} sent and {} received", x.size(0), send_rows.size() == 1 ? send_rows[0] : -1,
             recv_rows.size() == 1 ? recv_rows[0] : -1);
    return x;
  }
  return autograd::apply<AllToAllRowsFn>({x}, group, std::move(send_rows), std::move(recv_rows))[0];
}

Tensor all_gather_with_grad(const Tensor& x, const ProcessGroup& group, std::int64_t dim, std::int64_t full_size) {
  return mark_partial_grad(gather_from_sequence(x, group, dim, full_size), group.size() > 1 ? group.axes : 0);
}

std::vector<MappingRow> mapping_table() {
  std::vector<MappingRow> rows;
  for (const Mapping& m : kMappings) {
    const auto answer = [&](Placement in) { return primitive_name(backward_step(m.from, m.to, in).op); };
    MappingRow row;
    row.name = m.name;
    row.forward = primitive_name(forward_primitive(m.from, m.to));
    if (m.to.is_shard()) {
      row.backward = answer(m.to);   // a shard's gradient is always its shard
    } else {
      row.backward_if_partial = answer(kP);
      row.backward_if_replicated = answer(kR);
      row.backward = m.usual_incoming.is_partial() ? row.backward_if_partial : row.backward_if_replicated;
    }
    rows.push_back(std::move(row));
  }
  return rows;
}

}  // namespace meshgrad::dist
