#include "meshgrad/nn/invariant.hpp"

#include <algorithm>
#include <vector>

#include "meshgrad/ops/tree_reduce.hpp"

namespace meshgrad::nn::invariant {

namespace {

struct Split {
  std::string what;
  std::int64_t full;
  int parts;
  std::int64_t unit;
};

// Every split dimension of the model at this configuration.
std::vector<Split> model_splits(const ModelConfig& cfg, const ParallelConfig& parallel) {
  std::vector<Split> s;
  if (cfg.kind == "gpt") {
    const std::int64_t head = cfg.heads > 0 && cfg.hidden % cfg.heads == 0 ? cfg.hidden / cfg.heads : 1;
    s.push_back({fmt::format("the attention heads (--heads {})", cfg.heads), cfg.hidden, 1, head});
    s.push_back({fmt::format("the fused q, k, v heads (--heads {})", cfg.heads), 3 * std::int64_t{cfg.hidden}, 3, head});
    s.push_back({fmt::format("the vocabulary ({} tokens)", cfg.vocab), cfg.vocab, 1, 1});
  }
  if (cfg.kind == "llama") {
    const std::int64_t head = std::max(1, cfg.head_size());
    s.push_back({fmt::format("the attention heads (--heads {})", cfg.heads), head * cfg.heads, 1, head});
    s.push_back({fmt::format("the key/value heads ({})", cfg.kv_head_count()), head * cfg.kv_head_count(), 1, head});
    s.push_back({fmt::format("the vocabulary ({} tokens)", cfg.vocab), cfg.vocab, 1, 1});
  }
  s.push_back({fmt::format("the MLP width (--ffn {})", cfg.ffn_size()), cfg.ffn_size(), 1, 1});
  if (parallel.sequence_parallel) s.push_back({fmt::format("the sequence (--seq {})", cfg.seq), cfg.seq, 1, 1});
  return s;
}

bool model_nests(const ModelConfig& cfg, const ParallelConfig& parallel, int tp, std::string* failing) {
  for (const Split& s : model_splits(cfg, parallel)) {
    if (!tree::nests(s.full, s.parts, s.unit, parallel.invariant_blocks, tp)) {
      if (failing != nullptr) *failing = s.what;
      return false;
    }
  }
  return true;
}

}  // namespace

std::string working_degrees(const ModelConfig& cfg, const ParallelConfig& parallel) {
  std::string out;
  for (int tp = 1; tp <= std::max(1, parallel.invariant_blocks); tp *= 2) {
    // Tensor parallelism splits the heads: a degree above their number is refused by the mesh check.
    // The Llama family splits its key/value heads too: a degree must divide them (nn/llama.cpp).
    const bool splits_kv = cfg.kind != "llama" || cfg.kv_head_count() % tp == 0;
    if (tp > std::max(1, cfg.heads) || !splits_kv || !model_nests(cfg, parallel, tp, nullptr)) continue;
    out += out.empty() ? fmt::format("{}", tp) : fmt::format(", {}", tp);
  }
  return out.empty() ? "none" : out;
}

void check_model(const ModelConfig& cfg, const ParallelContext& ctx) {
  if (!ctx.tp_invariant()) return;
  const ParallelConfig& p = ctx.config;
  // Refusals name the mode the user asked for: --mesh-invariant holds --tp-invariant's tree.
  const std::string mode = fmt::format("--{}", invariance_option(p.invariance));
  MG_CHECK(tree::is_power_of_two(p.invariant_blocks), "{}: --invariant-blocks {} must be a power of two "
           "(1, 2, 4, 8, ...)", mode, p.invariant_blocks);
  // A block holds at least one unit of the largest split dimension: more blocks than that cut nothing
  // and would only cost a plan entry each (2^30 blocks exhausted memory, reliability-2 R8).
  const std::vector<Split> splits = model_splits(cfg, p);
  const auto largest = std::max_element(splits.begin(), splits.end(), [](const Split& a, const Split& b) {
    return a.full / (a.parts * a.unit) < b.full / (b.parts * b.unit);
  });
  const std::int64_t most_units = largest->full / (largest->parts * largest->unit);
  MG_CHECK(p.invariant_blocks <= std::max<std::int64_t>(1, most_units), "{}: --invariant-blocks {} is more "
           "than the {} units of this model's largest split dimension ({}): a block must hold at least one; use a "
           "power of two of at most {}", mode, p.invariant_blocks, most_units, largest->what, most_units);
  std::string failing;
  if (ctx.two_d) {
    // A grid computes as tp = C over tp_col (its rows only store: layers.hpp, GridLinear); the
    // vocabulary is split over the whole grid.
    const int c = ctx.col().size(), grid = ctx.tp_size();
    MG_CHECK(tree::is_power_of_two(c) && model_nests(cfg, p, c, &failing),
             "{}: tp_col={} (the C of tp=RxC, which splits the heads and the MLP width) cannot keep the "
             "fixed tree of {} blocks for this model ({}). Degrees that work for this model: {}",
             mode, c, p.invariant_blocks, failing.empty() ? "not a power of two" : failing, working_degrees(cfg, p));
    MG_CHECK(tree::is_power_of_two(grid) && tree::nests(cfg.vocab, 1, 1, p.invariant_blocks, grid),
             "{}: the grid's {} ranks split the vocabulary ({} tokens), which cannot keep the fixed tree "
             "of {} blocks: grids whose R x C is {} work for this model", mode, grid, cfg.vocab, p.invariant_blocks,
             working_degrees(cfg, p));
    return;
  }
  const int tp = ctx.tp_size();
  if (!tree::is_power_of_two(tp) || !model_nests(cfg, p, tp, &failing)) {
    throw InvalidArgument(fmt::format(
        "{}: tp={} cannot keep the fixed tree of {} blocks for this model ({}{}). Degrees that work for "
        "this model: tp = {} (a power of two dividing --invariant-blocks, at most the heads, and every split "
        "dimension cut in whole blocks)", mode, tp, p.invariant_blocks, failing.empty() ? "tp is not a power of two" : failing,
        failing.empty() ? "" : " does not split into blocks that nest in the tp shards", working_degrees(cfg, p)));
  }
}

}  // namespace meshgrad::nn::invariant
