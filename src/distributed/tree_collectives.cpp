#include "meshgrad/distributed/tree_collectives.hpp"

#include <memory>

#include "meshgrad/ops/tree_reduce.hpp"

namespace meshgrad::dist {

namespace {

void check_group(const ProcessGroup& group) {
  MG_CHECK(tree::is_power_of_two(group.size()), "tree collective over '{}': a group of {} ranks; the fixed tree needs "
           "a power of two", group.axis, group.size());
}

// [P, ...] -> the tree sum over dim 0.
Tensor sum_leading(const Tensor& stacked) {
  std::vector<Tensor> leaves;
  const Shape leaf_shape(stacked.shape().begin() + 1, stacked.shape().end());
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

PendingTensor tree_reduce_scatter_async(const Tensor& root, const ProcessGroup& group, std::int64_t dim,
                                        const std::vector<std::int64_t>& sizes) {
  if (group.size() == 1) return PendingTensor::ready(root);
  check_group(group);
  dim = normalize_dim(dim, root.shape(), "tree_reduce_scatter");
  // Two roots: r0 + r1 per element is the backend's reduce-scatter (see tree_all_reduce_async).
  if (group.size() == 2) return reduce_scatter_async(root, group, dim, sizes);
  MG_CHECK(sizes == shard_sizes(root.size(dim), group.size()), "tree_reduce_scatter over '{}': the shards {} of dim "
           "{} (extent {}) are not the shard rule's", group.axis, shape_str(sizes), dim, root.size(dim));
  // [1, ...] split along dim by the shard rule, gathered along the new leading dim: [P, ..., shard, ...],
  // every rank's piece of this rank's shard; the tree sums them in rank order.
  const Tensor one = root.contiguous().view(with_leading_one(root.shape()));
  const Tensor pieces =
      all_to_all(one, group, dim + 1, 0, std::vector<std::int64_t>(static_cast<std::size_t>(group.size()), 1));
  return PendingTensor::ready(sum_leading(pieces));
}

}  // namespace meshgrad::dist
