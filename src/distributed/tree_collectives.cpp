#include "meshgrad/distributed/tree_collectives.hpp"

#include <memory>

#include "meshgrad/autograd/function.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/placement.hpp"
#include "meshgrad/ops/tree_reduce.hpp"

namespace meshgrad::dist {

namespace {

void check_group(const ProcessGroup& group) {
  MG_CHECK(tree::is_power_of_two(group.size()), "tree collective: a group of {} ranks; the fixed tree needs a power "
           "of two", group.size());
}

// [P, ...] -> tree sum over dim 0.
Tensor sum_leading(const Tensor& stacked) {
  std::vector<Tensor> leaves;
  Shape leaf_shape(stacked.shape().begin() + 1, stacked.shape().end());
  for (std::int64_t i = 0; i < stacked.size(0); ++i) leaves.push_back(stacked.narrow(0, i, 1).view(leaf_shape));
  return tree::sum(leaves);
}

Shape with_leading_one(const Shape& s) {
  Shape out{1};
  out.insert(out.end(), s.begin(), s.end());
  return out;
}

}  // namespace

Tensor tree_all_reduce(const Tensor& root, const ProcessGroup& group) {
  if (group.size() == 1) return root;
  return tree_all_reduce_async(root, group).wait();
}

PendingTensor tree_all_reduce_async(const Tensor& root, const ProcessGroup& group) {
  if (group.size() == 1) return PendingTensor::ready(root);
  check_group(group);
  // Two roots: the tree is the single addition r0 + r1, which is what the backend's all-reduce
  // computes by the comm contract (rank order, one addition per element, in the buffer's dtype):
  // the same bits as gathering and adding, with half the traffic and the sum split over the ranks.
  if (group.size() == 2) return all_reduce_async(root, group);
  const Tensor one = root.contiguous().view(with_leading_one(root.shape()));
  auto gathered = std::make_shared<PendingTensor>(
      all_gather_async(one, group, 0, std::vector<std::int64_t>(static_cast<std::size_t>(group.size()), 1)));
  return PendingTensor(nullptr, [gathered] { return sum_leading(gathered->wait()); });
}

Tensor tree_reduce_scatter(const Tensor& root, const ProcessGroup& group) {
  if (group.size() == 1) return root;
  check_group(group);
  // Two roots: r0 + r1 per element is the backend's reduce-scatter (see tree_all_reduce_async).
  if (group.size() == 2) return reduce_scatter(root, group, 0, shard_sizes(root.size(0), 2));
  const Tensor one = root.contiguous().view(with_leading_one(root.shape()));
  const Tensor pieces =
      all_to_all(one, group, 1, 0, std::vector<std::int64_t>(static_cast<std::size_t>(group.size()), 1));
  return sum_leading(pieces);
}

namespace {

// Marks on the group's axes are settled here; marks on other axes (dp) pass through.
void pass_other_marks(const Tensor& out, AxisMask incoming, const ProcessGroup& group) {
  if (out.defined()) set_partial_axes(out, incoming & ~group.axes);
}

class TreeReduceFn final : public autograd::Function {
 public:
  TreeReduceFn(ProcessGroup group, bool scatter) : group_(std::move(group)), scatter_(scatter) {}
  std::string_view name() const override { return scatter_ ? "tree_reduce_scatter (P -> S(0))" : "tree_all_reduce (P -> R)"; }
  bool decides_gradient_placement() const override { return true; }
  TensorList forward(const TensorList& x) override {
    if (scatter_) full_ = x[0].size(0);
    return {scatter_ ? tree_reduce_scatter(x[0], group_) : tree_all_reduce(x[0], group_)};
  }
  TensorList backward(const TensorList& g) override {
    const AxisMask incoming = partial_axes(g[0]);
    MG_CHECK((incoming & group_.axes) == 0 || group_.size() == 1, "{}: the gradient arrives partial on the group; "
             "tp-invariant mode expects it replicated", name());
    Tensor dx = g[0];
    if (scatter_ && group_.size() > 1) dx = all_gather(g[0].contiguous(), group_, 0, shard_sizes(full_, group_.size()));
    pass_other_marks(dx, incoming, group_);
    return {dx};
  }

 private:
  ProcessGroup group_;
  bool scatter_;
  std::int64_t full_ = 0;
};

class TreeReduceGradFn final : public autograd::Function {
 public:
  explicit TreeReduceGradFn(ProcessGroup group) : group_(std::move(group)) {}
  std::string_view name() const override { return "tree_reduce_grad (R -> R)"; }
  bool decides_gradient_placement() const override { return true; }
  TensorList forward(const TensorList& x) override { return {x[0]}; }
  TensorList backward(const TensorList& g) override {
    const AxisMask incoming = partial_axes(g[0]);
    Tensor dx = tree_all_reduce(g[0], group_);
    if (dx.storage() == g[0].storage()) dx = dx.contiguous();
    pass_other_marks(dx, incoming, group_);
    return {dx};
  }

 private:
  ProcessGroup group_;
};

}  // namespace

Tensor tree_reduce_from_region(const Tensor& x, const ProcessGroup& group) {
  return autograd::apply<TreeReduceFn>({x}, group, false)[0];
}

Tensor tree_reduce_scatter_to_sequence(const Tensor& x, const ProcessGroup& group) {
  return autograd::apply<TreeReduceFn>({x}, group, true)[0];
}

Tensor tree_reduce_grad(const Tensor& x, const ProcessGroup& group) {
  if (group.size() == 1) return x;
  return autograd::apply<TreeReduceGradFn>({x}, group)[0];
}

}  // namespace meshgrad::dist
