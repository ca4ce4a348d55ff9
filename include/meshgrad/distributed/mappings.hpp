// The differentiable collectives ("mappings") of the DESIGN table, over one process group.
// Each is one forward primitive paired with its dual as backward, defined once in mappings.cpp;
// mapping_table() lists them from those definitions, so docs and tests read the code, not a copy.
//
// dims: the feature dim is the last (-1) and the sequence dim is given by the caller (default 0).
// Uneven shards follow the shard rule. Where a forward gathers, full_size is the extent of the
// gathered dim; -1 = learn the shards' extents with exchange_sizes (one small extra collective).
// A group of size 1 makes every mapping an identity, bit-identical to serial code.
#pragma once

#include <string>
#include <vector>

#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/tensor/shard.hpp"
#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::dist {

// forward: identity / backward: all-reduce
Tensor copy_to_region(const Tensor& x, const ProcessGroup& group);
// forward: all-reduce / backward: identity
Tensor reduce_from_region(const Tensor& x, const ProcessGroup& group);
// forward: keep own slice (feature dim) / backward: all-gather
Tensor scatter_to_region(const Tensor& x, const ProcessGroup& group, std::int64_t dim = -1);
// forward: all-gather (feature dim) / backward: keep own slice
Tensor gather_from_region(const Tensor& x, const ProcessGroup& group, std::int64_t dim = -1,
                          std::int64_t full_size = -1);
// forward: keep own slice (sequence dim) / backward: all-gather
Tensor scatter_to_sequence(const Tensor& x, const ProcessGroup& group, std::int64_t dim = 0);
// forward: all-gather (sequence dim) / backward: reduce-scatter
Tensor gather_from_sequence(const Tensor& x, const ProcessGroup& group, std::int64_t dim = 0,
                            std::int64_t full_size = -1);
// forward: reduce-scatter (sequence dim) / backward: all-gather
Tensor reduce_scatter_to_sequence(const Tensor& x, const ProcessGroup& group, std::int64_t dim = 0);
// forward: all-to-all (split split_dim, gather cat_dim) / backward: all-to-all (split cat_dim, gather split_dim)
Tensor all_to_all(const Tensor& x, const ProcessGroup& group, std::int64_t split_dim, std::int64_t cat_dim,
                  std::int64_t cat_full_size = -1);
// An all-gather whose result carries gradient back to every rank's input:
// forward: all-gather / backward: reduce-scatter (each rank's loss may use every rank's rows).
Tensor all_gather_with_grad(const Tensor& x, const ProcessGroup& group, std::int64_t dim = 0,
                            std::int64_t full_size = -1);

struct MappingRow {
  std::string name;      // "copy to TP region"
  std::string forward;   // "identity", "all-reduce", "keep own slice", "all-gather", "reduce-scatter", ...
  std::string backward;
};
// The mappings above, described from their definitions.
std::vector<MappingRow> mapping_table();

}  // namespace meshgrad::dist
