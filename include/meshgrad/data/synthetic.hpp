// Random token batches from a seed: the data of `meshgrad explain`, `check` and `grads --seed`,
// where what matters is the shapes and that every mesh sees the same tokens.
#pragma once

#include <cstdint>

#include "meshgrad/nn/model.hpp"

namespace meshgrad::data {

// The synthetic batch of dp rank `dp_rank` of `dp_size`: config.batch is the global batch and
// must be divisible by dp_size (throws naming both otherwise); this rank gets batch / dp_size
// rows of config.seq random token ids in [0, vocab) and the targets are the same sequences shifted
// by one (targets[b][t] = tokens[b][t + 1]). Deterministic in (seed, dp_rank): a rank draws its own
// rows of the global batch, so the rows are the same whatever dp_size.
nn::Batch make_synthetic_batch(const nn::ModelConfig& config, int dp_size, int dp_rank, std::uint64_t seed);

}  // namespace meshgrad::data
