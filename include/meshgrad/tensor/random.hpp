// Counter-based random numbers (Philox 4x32-10): the value of element i of a generated tensor
// depends only on (seed, i), never on how many other numbers were drawn or on which rank draws it.
// So a shard of a parameter is initialised to exactly the slice of the unsharded one, whatever the
// number of ranks: generate with the global shape and the shard's box.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "meshgrad/tensor/shard.hpp"
#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::random {

// Philox4x32-10 of (counter, key): four independent 32-bit outputs.
std::array<std::uint32_t, 4> philox(std::uint64_t counter, std::uint64_t key);
// Uniform in [0, 1) with 53 random bits, for stream `index` of `seed`.
double uniform(std::uint64_t seed, std::uint64_t index);
// Standard normal (Box-Muller on two 53-bit uniforms), for stream `index` of `seed`.
double normal(std::uint64_t seed, std::uint64_t index);

// splitmix64's finaliser: a bijection of 64-bit words that spreads every input bit over the output,
// for deriving independent seeds from a seed and an index.
constexpr std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The sub-box of a global tensor: per dim {offset, size}. An empty box means the whole tensor.
using Box = std::vector<ShardRange>;

// Elements of the box of a global tensor of `global_shape` whose element at global row-major index
// g is mean + std * normal(seed, g) (randn) or low + (high - low) * uniform(seed, g) (rand).
Tensor randn(const Shape& global_shape, std::uint64_t seed, DType dtype = DType::Float32, double mean = 0.0,
             double std = 1.0, const Box& box = {});
Tensor rand(const Shape& global_shape, std::uint64_t seed, DType dtype = DType::Float32, double low = 0.0,
            double high = 1.0, const Box& box = {});
// Integers uniform in [0, high) as int64.
Tensor randint(const Shape& global_shape, std::uint64_t seed, std::int64_t high, const Box& box = {});

// A stream of seeds for ops that draw fresh randomness each call (dropout): call i gets
// (seed, i). Copyable state, so activation checkpointing can replay the same masks.
class Generator {
 public:
  explicit Generator(std::uint64_t seed = 0) : seed_(seed) {}
  // The seed for the next draw; advances the counter.
  std::uint64_t next_seed();
  std::uint64_t seed() const { return seed_; }
  std::uint64_t counter() const { return counter_; }
  void set_counter(std::uint64_t c) { counter_ = c; }

 private:
  std::uint64_t seed_;
  std::uint64_t counter_ = 0;
};

}  // namespace meshgrad::random
