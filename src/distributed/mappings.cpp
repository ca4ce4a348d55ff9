// The differentiable collectives. A mapping = a forward primitive and its dual; the single
// MappingFunction below runs the first in forward and the second in backward, so each pair is
// written once and both directions share one implementation of every primitive.
#include "meshgrad/distributed/mappings.hpp"

#include <numeric>

#include "meshgrad/autograd/function.hpp"
#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/distributed/comm_counter.hpp"

namespace meshgrad::dist {

namespace {

enum class Primitive { Identity, AllReduce, KeepOwnSlice, AllGather, ReduceScatter, AllToAll };

const char* describe(Primitive p) {
  switch (p) {
    case Primitive::Identity: return "identity";
    case Primitive::AllReduce: return "all-reduce";
    case Primitive::KeepOwnSlice: return "keep own slice";
    case Primitive::AllGather: return "all-gather";
    case Primitive::ReduceScatter: return "reduce-scatter";
    case Primitive::AllToAll: return "all-to-all";
  }
  return "?";
}

struct Mapping {
  const char* name;
  Primitive forward;
  Primitive backward;
};

// The table. Sequence-parallel and feature-dim mappings differ only in the dim they act on.
constexpr Mapping kCopyToRegion{"copy to TP region", Primitive::Identity, Primitive::AllReduce};
constexpr Mapping kReduceFromRegion{"reduce from TP region", Primitive::AllReduce, Primitive::Identity};
constexpr Mapping kScatterToRegion{"scatter to TP region (feature dim)", Primitive::KeepOwnSlice, Primitive::AllGather};
constexpr Mapping kGatherFromRegion{"gather from TP region (feature dim)", Primitive::AllGather, Primitive::KeepOwnSlice};
constexpr Mapping kScatterToSequence{"scatter to sequence-parallel region", Primitive::KeepOwnSlice, Primitive::AllGather};
constexpr Mapping kGatherFromSequence{"gather from sequence-parallel region", Primitive::AllGather,
                                      Primitive::ReduceScatter};
constexpr Mapping kReduceScatterToSequence{"reduce-scatter to sequence-parallel region", Primitive::ReduceScatter,
                                           Primitive::AllGather};
constexpr Mapping kAllToAll{"all-to-all", Primitive::AllToAll, Primitive::AllToAll};
constexpr Mapping kAllGatherWithGrad{"all-gather with gradient", Primitive::AllGather, Primitive::ReduceScatter};

// Shard extents of every rank along the mapping's dim, learnt in forward and reused by backward.
struct ShardExtents {
  std::vector<std::int64_t> sizes;
};

// Applies one primitive along dim. `extents` is read when known and filled when this primitive
// is the one that learns it (forward of a slice, gather or reduce-scatter).
Tensor run_primitive(Primitive p, const Tensor& x, const ProcessGroup& group, int dim, int dim2,
                     std::int64_t full_size, ShardExtents& extents) {
  switch (p) {
    case Primitive::Identity:
      return x;
    case Primitive::AllReduce:
      return all_reduce(x, group);
    case Primitive::KeepOwnSlice: {
      if (extents.sizes.empty()) extents.sizes = shard_sizes(x.size(dim), group.size());
      if (group.size() == 1) return x;
      const auto& s = extents.sizes;
      const std::int64_t offset = std::accumulate(s.begin(), s.begin() + group.rank(), std::int64_t{0});
      MG_CHECK(x.size(dim) == std::accumulate(s.begin(), s.end(), std::int64_t{0}),
               "keep own slice over {}: extent {} along dim {} does not match the shard sizes {}", group.axis,
               x.size(dim), dim, shape_str(s));
      return x.narrow(dim, offset, s[static_cast<std::size_t>(group.rank())]).contiguous();
    }
    case Primitive::AllGather:
      if (extents.sizes.empty()) {
        extents.sizes = full_size >= 0 ? shard_sizes(full_size, group.size()) : exchange_sizes(x.size(dim), group);
      }
      return all_gather(x, group, dim, extents.sizes);
    case Primitive::ReduceScatter:
      if (extents.sizes.empty()) extents.sizes = shard_sizes(x.size(dim), group.size());
      return reduce_scatter(x, group, dim, extents.sizes);
    case Primitive::AllToAll:
      break;
  }
  // All-to-all: split along dim, gather along dim2.
  if (extents.sizes.empty()) {
    extents.sizes = full_size >= 0 ? shard_sizes(full_size, group.size()) : exchange_sizes(x.size(dim2), group);
  }
  return dist::all_to_all(x, group, dim, dim2, extents.sizes);
}

class MappingFunction final : public autograd::Function {
 public:
  MappingFunction(const Mapping& mapping, ProcessGroup group, std::int64_t dim, std::int64_t dim2,
                  std::int64_t full_size)
      : mapping_(mapping), group_(std::move(group)), dim_arg_(dim), dim2_arg_(dim2), full_size_(full_size),
        label_(current_comm_label()) {}
  std::string_view name() const override { return mapping_.name; }

  TensorList forward(const TensorList& x) override {
    // Identity / all-reduce pairs take any shape (a scalar too); the others act along a dim.
    const bool uses_dim = mapping_.forward != Primitive::Identity && mapping_.forward != Primitive::AllReduce;
    dim_ = uses_dim ? normalize_dim(dim_arg_, x[0].shape(), mapping_.name) : 0;
    dim2_ = mapping_.forward == Primitive::AllToAll ? normalize_dim(dim2_arg_, x[0].shape(), mapping_.name) : dim_;
    if (mapping_.forward == Primitive::AllToAll) split_full_ = x[0].size(dim_);
    return {run_primitive(mapping_.forward, x[0], group_, dim_, dim2_, full_size_, extents_)};
  }

  TensorList backward(const TensorList& g) override {
    CommLabelScope label(label_);
    if (mapping_.backward == Primitive::AllToAll) {
      // The reverse exchange: split what forward gathered, gather what forward split.
      ShardExtents reverse{shard_sizes(split_full_, group_.size())};
      return {run_primitive(Primitive::AllToAll, g[0], group_, dim2_, dim_, split_full_, reverse)};
    }
    return {run_primitive(mapping_.backward, g[0], group_, dim_, dim2_, -1, extents_)};
  }

 private:
  Mapping mapping_;
  ProcessGroup group_;
  std::int64_t dim_arg_, dim2_arg_, full_size_;
  std::string label_;
  int dim_ = 0, dim2_ = 0;
  std::int64_t split_full_ = 0;
  ShardExtents extents_;
};

Tensor apply_mapping(const Mapping& m, const Tensor& x, const ProcessGroup& group, std::int64_t dim = 0,
                     std::int64_t dim2 = 0, std::int64_t full_size = -1) {
  check_floating(x, m.name);
  return autograd::apply<MappingFunction>({x}, m, group, dim, dim2, full_size)[0];
}

}  // namespace

Tensor copy_to_region(const Tensor& x, const ProcessGroup& group) { return apply_mapping(kCopyToRegion, x, group); }
Tensor reduce_from_region(const Tensor& x, const ProcessGroup& group) {
  return apply_mapping(kReduceFromRegion, x, group);
}
Tensor scatter_to_region(const Tensor& x, const ProcessGroup& group, std::int64_t dim) {
  return apply_mapping(kScatterToRegion, x, group, dim);
}
Tensor gather_from_region(const Tensor& x, const ProcessGroup& group, std::int64_t dim, std::int64_t full_size) {
  return apply_mapping(kGatherFromRegion, x, group, dim, dim, full_size);
}
Tensor scatter_to_sequence(const Tensor& x, const ProcessGroup& group, std::int64_t dim) {
  return apply_mapping(kScatterToSequence, x, group, dim);
}
Tensor gather_from_sequence(const Tensor& x, const ProcessGroup& group, std::int64_t dim, std::int64_t full_size) {
  return apply_mapping(kGatherFromSequence, x, group, dim, dim, full_size);
}
Tensor reduce_scatter_to_sequence(const Tensor& x, const ProcessGroup& group, std::int64_t dim) {
  return apply_mapping(kReduceScatterToSequence, x, group, dim);
}
Tensor all_to_all(const Tensor& x, const ProcessGroup& group, std::int64_t split_dim, std::int64_t cat_dim,
                  std::int64_t cat_full_size) {
  return apply_mapping(kAllToAll, x, group, split_dim, cat_dim, cat_full_size);
}
Tensor all_gather_with_grad(const Tensor& x, const ProcessGroup& group, std::int64_t dim, std::int64_t full_size) {
  return apply_mapping(kAllGatherWithGrad, x, group, dim, dim, full_size);
}

std::vector<MappingRow> mapping_table() {
  std::vector<MappingRow> rows;
  for (const Mapping* m : {&kCopyToRegion, &kReduceFromRegion, &kScatterToRegion, &kGatherFromRegion,
                           &kScatterToSequence, &kGatherFromSequence, &kReduceScatterToSequence, &kAllToAll,
                           &kAllGatherWithGrad}) {
    rows.push_back({m->name, describe(m->forward), describe(m->backward)});
  }
  return rows;
}

}  // namespace meshgrad::dist
