#include "meshgrad/data/synthetic.hpp"

#include "meshgrad/tensor/error.hpp"
#include "meshgrad/tensor/random.hpp"

namespace meshgrad::data {

nn::Batch make_synthetic_batch(const nn::ModelConfig& config, int dp_size, int dp_rank, std::uint64_t seed) {
  MG_CHECK(dp_size >= 1 && dp_rank >= 0 && dp_rank < dp_size, "synthetic batch: dp rank {} of {} is out of range",
           dp_rank, dp_size);
  MG_CHECK(config.batch >= 1 && config.seq >= 1 && config.vocab >= 1,
           "synthetic batch: need batch, seq and vocab >= 1, got batch {} seq {} vocab {}", config.batch, config.seq,
           config.vocab);
  MG_CHECK(config.batch % dp_size == 0,
           "synthetic batch: the global batch {} does not split over dp = {} ranks (make --batch a multiple of dp)",
           config.batch, dp_size);
  const std::int64_t rows = config.batch / dp_size;
  const std::int64_t seq = config.seq;
  // One sequence of seq + 1 tokens per row of the global batch; this rank draws its rows only.
  const random::Box box = {{dp_rank * rows, rows}, {0, seq + 1}};
  const Tensor tokens = random::randint({config.batch, seq + 1}, seed, config.vocab, box);
  return {tokens.narrow(1, 0, seq).contiguous(), tokens.narrow(1, 1, seq).contiguous()};
}

}  // namespace meshgrad::data
