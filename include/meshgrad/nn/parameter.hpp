// Parameters of tensor-parallel modules: the local shard (a leaf tensor), the full tensor's shape
// and name (Hugging Face GPT-2 names: "h.0.attn.c_attn.weight"), and how the full tensor maps to
// this rank's shard over the tensor-parallel group.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/tensor/shard.hpp"
#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::nn {

// How a full parameter is split over the tp group. Replicated (dim = -1) or sharded along `dim`,
// where that dim is made of `blocks` equal blocks (QKV: 3) and each block is split by the shard
// rule in units of `unit` elements (attention: a head's width, so heads are never split).
// This rank's shard is the concatenation along dim of its piece of every block.
//   c_attn.weight [C, 3C]: dim 1, blocks 3, unit head_dim -> [C, 3 * local_heads * head_dim]
//   c_fc.weight   [C, 4C]: dim 1 -> [C, shard of 4C];   c_proj.weight [4C, C]: dim 0
//   wte.weight    [V, C]:  dim 0 (vocab-parallel)
struct ShardSpec {
  int dim = -1;
  int blocks = 1;
  std::int64_t unit = 1;

  bool replicated() const { return dim < 0; }
  // The ranges of the full dim (extent `full`) that rank `index` of `parts` holds, one per block.
  std::vector<ShardRange> ranges(std::int64_t full, int parts, int index) const;
  // The shard's extent along dim.
  std::int64_t local_extent(std::int64_t full, int parts, int index) const;
  std::string str() const;   // "R", "S(1)", "S(1)x3/64"
};

struct Parameter {
  std::string name;
  Tensor value;          // this rank's shard: a leaf with requires_grad
  Shape full_shape;
  ShardSpec shard;       // over the tensor-parallel group
};

// This rank's shard of a full tensor (a packed copy; int64 and floats alike).
Tensor take_shard(const Tensor& full, const ShardSpec& spec, int parts, int index);
// The full tensor from every rank's shard (an all-gather over the tp group; replicated: the local
// tensor itself). Every rank of the group must call it.
Tensor gather_full(const Tensor& local, const Parameter& param, const dist::ProcessGroup& tp);

// Deterministic initialisation of this rank's shard: element g of the full tensor is
// mean + std * normal(seed_of(seed, name), g), so shards equal slices of the tp=1 tensor.
Tensor init_normal_shard(const std::string& name, const Shape& full_shape, const ShardSpec& spec, int parts,
                         int index, std::uint64_t seed, double std, DType dtype);
std::uint64_t seed_of(std::uint64_t seed, const std::string& name);

}  // namespace meshgrad::nn
