// Context parallelism (the cp mesh axis): every layer's activations split along the sequence over cp,
// attention included, so the longest sequence a run trains is no longer bounded by one rank holding
// all of it.
//
// The layout (load-balanced causal chunks, as Megatron-Core and torchtitan cut them): a sequence of T
// positions is cut into 2 cp chunks of L = T / (2 cp); cp rank r holds chunks r and 2 cp - 1 - r, in
// that order, as its local sequence of 2 L rows:
//
//   T = 8 L, cp = 4:   chunk  0   1   2   3   4   5   6   7
//                      rank   0   1   2   3   3   2   1   0
//
// Under causal attention chunk c's queries meet c + 1 chunks of keys, so every rank computes
// (r + 1) + (2 cp - r) = 2 cp + 1 chunk products: none idles on the masked half.
//
// What crosses ranks is attention's keys and values only (the key/value heads, before they repeat).
// By default they go around a ring (ParallelConfig::cp_ring, --cp-schedule ring): at step s rank r
// computes its query chunks against rank r - s's piece while that piece travels on to r + 1, and the
// parts of each softmax are merged exactly; backward passes the pieces around again with their
// gradients' partial sums, each rank adding its queries' part. With --cp-schedule all-gather (and
// under --mesh-invariant's sequence blocks) each rank all-gathers them over cp (the Llama 3 paper's
// choice) and computes each query run against the keys up to its end; backward gathers them again
// rather than keeping the whole sequence's between the two. The gather is the rule's S -> R step,
// and its dual is the rule's answer: every rank's queries give a partial gradient for every key, and
// a reduce-scatter adds them at the key's owner. Either way a block keeps its own chunks only. Everything else a layer does is per
// token, and runs on the local rows as on a shorter sequence; only positions (learned tables, RoPE)
// and dropout masks ask where the local rows lie in the sequence (PositionRun).
//
// The loss is each rank's share of the global mean (its tokens over the global count), partial over
// cp like over dp, so the parameters' gradients (replicated over cp, used on this rank's tokens) are
// summed over cp by the gradient synchroniser.
#pragma once

#include <cstdint>
#include <vector>

#include "meshgrad/nn/parallel_context.hpp"
#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::nn {

// A run of consecutive positions: local rows [local, local + size) of a rank's piece of the
// sequence are global positions [global, global + size).
struct PositionRun {
  std::int64_t local = 0;
  std::int64_t global = 0;
  std::int64_t size = 0;
  bool operator==(const PositionRun&) const = default;
};

// The chunks a cp rank holds of a sequence of `seq` positions, in local order: chunks `rank` and
// 2 size - 1 - rank of 2 size (one run of the whole sequence when size is 1). Throws naming the
// sizes when seq is not a multiple of 2 size.
std::vector<PositionRun> context_chunks(std::int64_t seq, int size, int rank);
// Under --mesh-invariant's sequence blocks (blocks = N > 1, a multiple of 2 size dividing seq):
// the rank's N / size blocks of seq / N positions, chunk `rank`'s and its mirror's, laid out in the
// leaf order of the blocks' fixed tree. With L = N / size local blocks, the piece's blocks in
// position order l_0 .. l_{L-1} (chunk rank's, then the mirror's) are laid out as
// l_0, l_{L-1}, l_1, l_{L-2}, ...: the global tree's leaves are the blocks 0, N-1, 1, N-2, ..., and
// rank r's leaves are its [r L, (r + 1) L) of them, so every cp rank's piece (and every
// sequence-parallel shard of it: consecutive local blocks) is a subtree, and "each rank adds its
// blocks in the tree, the cp reduction adds the ranks' roots in the tree" is one sum at every cp:
//
//   N = 8     blocks 0 7 1 6 2 5 3 4     cp=1: one rank, the whole tree
//                    \/  \/  \/  \/     cp=2: rank 0 holds 0 7 1 6 (chunks 0 and 3 of 4)
//                    07  16  25  34     cp=4: rank r one pair (chunks r and 7 - r of 8)
//                      \/     \/
//                     ...     ...
// blocks <= 1: context_chunks(seq, size, rank).
std::vector<PositionRun> context_runs(std::int64_t seq, int size, int rank, int blocks);
// This rank's runs on ctx's cp axis of a sequence whose local piece has `local_seq` rows (the
// global sequence is cp x local_seq): context_runs with ctx's sequence blocks.
std::vector<PositionRun> local_chunks(const ParallelContext& ctx, std::int64_t local_seq);
// The runs of local rows [begin, begin + count) (a sequence-parallel shard of the local piece), with
// `local` counted from `begin`.
std::vector<PositionRun> rows_of(const std::vector<PositionRun>& chunks, std::int64_t begin, std::int64_t count);

// Checks a sequence of `seq` positions can be cut into the chunks (a multiple of 2 cp), naming the
// mesh and the lengths that work. No-op without cp.
void check_context_sequence(const ParallelContext& ctx, std::int64_t seq, const char* what);

// This rank's rows of x [T, ...] (dim 0 the whole sequence): its runs, concatenated in local order.
// For the token ids and targets (no graph). x itself when the piece is one run (no cp, no blocks).
Tensor take_local_chunks(const Tensor& x, const ParallelContext& ctx);

// The rows of `table` [P, ...] at the runs' global positions, concatenated in run order
// (differentiable: the learned position table's rows of this rank's tokens).
Tensor rows_at(const Tensor& table, const std::vector<PositionRun>& runs);

// Causal attention of this rank's query runs q [B, H, P, D] against the whole sequence's keys and
// values, of which it holds its piece k, v [B, H_kv, P, D] (H a multiple of H_kv: grouped-query
// attention's heads repeat after the gather): each run against the keys up to its own end, with
// the sliding window as ops::causal_attention -> [B, H, P, D]. The keys and values are all-gathered
// over cp in forward and again in backward (nothing of the whole sequence is kept between), and
// their gradients return to their owners by the rule's dual of the gather, a reduce-scatter (under
// the sequence blocks, the runs' parts added in the blocks' tree first). Only where
// ctx->attention_per_run() (cp > 1, or --sequence-blocks; else ops::causal_attention).
Tensor context_attention(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t window,
                         const ParallelContextPtr& ctx);

// Causal attention of this rank's queries whatever the mesh: context_attention where
// ctx->attention_per_run(), else ops::causal_attention; q, k, v [B, H, P, D] with the same heads
// (a grouped-query block repeats its key/value heads first, or calls context_attention itself as
// Llama's does). What GPT-2's block and a block written outside the library call, so a block
// written once is right under cp and the sequence blocks.
Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t window, const ParallelContextPtr& ctx);

}  // namespace meshgrad::nn
