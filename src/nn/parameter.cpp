#include "meshgrad/nn/parameter.hpp"

#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/random.hpp"

namespace meshgrad::nn {

std::vector<ShardRange> ShardSpec::ranges(std::int64_t full, int parts, int index) const {
  if (replicated()) return {{0, full}};
  MG_CHECK(blocks >= 1 && unit >= 1 && full % blocks == 0 && (full / blocks) % unit == 0,
           "ShardSpec {}: extent {} is not {} blocks of whole units of {}", str(), full, blocks, unit);
  const std::int64_t block = full / blocks;
  const ShardRange units = shard_range(block / unit, parts, index);
  std::vector<ShardRange> out;
  for (int b = 0; b < blocks; ++b) out.push_back({b * block + units.offset * unit, units.size * unit});
  return out;
}

std::int64_t ShardSpec::local_extent(std::int64_t full, int parts, int index) const {
  std::int64_t n = 0;
  for (const auto& r : ranges(full, parts, index)) n += r.size;
  return n;
}

std::string ShardSpec::str() const {
  if (replicated()) return "R";
  if (blocks == 1 && unit == 1) return fmt::format("S({})", dim);
  return fmt::format("S({})x{}/{}", dim, blocks, unit);
}

Tensor take_shard(const Tensor& full, const ShardSpec& spec, int parts, int index) {
  if (spec.replicated()) return full.clone();
  MG_CHECK(spec.dim < full.dim(), "take_shard: spec {} for a tensor of shape {}", spec.str(), shape_str(full.shape()));
  std::vector<Tensor> pieces;
  for (const auto& r : spec.ranges(full.size(spec.dim), parts, index)) pieces.push_back(full.narrow(spec.dim, r.offset, r.size));
  return pieces.size() == 1 ? pieces[0].contiguous() : kernels::cat(pieces, spec.dim);
}

Tensor gather_full(const Tensor& local, const Parameter& param, const dist::ProcessGroup& tp) {
  const ShardSpec& spec = param.shard;
  if (spec.replicated() || tp.size() == 1) return local;
  const std::int64_t full = param.full_shape[static_cast<std::size_t>(spec.dim)];
  std::vector<std::int64_t> extents;
  for (int r = 0; r < tp.size(); ++r) extents.push_back(spec.local_extent(full, tp.size(), r));
  const Tensor gathered = dist::all_gather(local.detach(), tp, spec.dim, extents);   // rank-major
  if (spec.blocks == 1) return gathered;
  // Rank-major [r0: b0 b1 b2][r1: b0 b1 b2] -> block-major [b0: r0 r1][b1: r0 r1][b2: r0 r1].
  std::vector<Tensor> pieces;
  for (int b = 0; b < spec.blocks; ++b) {
    std::int64_t rank_offset = 0;
    for (int r = 0; r < tp.size(); ++r) {
      const auto ranges = spec.ranges(full, tp.size(), r);
      pieces.push_back(gathered.narrow(spec.dim, rank_offset + b * ranges[0].size, ranges[static_cast<std::size_t>(b)].size));
      rank_offset += extents[static_cast<std::size_t>(r)];
    }
  }
  return kernels::cat(pieces, spec.dim);
}

std::uint64_t seed_of(std::uint64_t seed, const std::string& name) {
  // FNV-1a of the name, mixed with the seed: every parameter gets its own stream.
  std::uint64_t h = 1469598103934665603ull ^ (seed * 0x9E3779B97F4A7C15ull);
  for (unsigned char c : name) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

Tensor init_normal_shard(const std::string& name, const Shape& full_shape, const ShardSpec& spec, int parts,
                         int index, std::uint64_t seed, double std, DType dtype) {
  const std::uint64_t stream = seed_of(seed, name);
  random::Box box;
  for (std::int64_t d : full_shape) box.push_back({0, d});
  if (spec.replicated()) return random::randn(full_shape, stream, dtype, 0.0, std, box);
  std::vector<Tensor> pieces;
  for (const auto& r : spec.ranges(full_shape[static_cast<std::size_t>(spec.dim)], parts, index)) {
    box[static_cast<std::size_t>(spec.dim)] = r;
    pieces.push_back(random::randn(full_shape, stream, dtype, 0.0, std, box));
  }
  return pieces.size() == 1 ? pieces[0] : kernels::cat(pieces, spec.dim);
}

}  // namespace meshgrad::nn
