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
// What crosses ranks is attention's keys and values only. Each rank all-gathers them over cp (the
// Llama 3 paper's choice: with grouped-query attention they are a fraction of the queries' bytes) and
// computes its two query chunks against the keys up to each chunk's end; backward gathers them again
// rather than keeping the whole sequence's between the two (ring attention's memory: a block keeps
// its own chunks only). The gather is the rule's S -> R step, and its dual is the rule's answer:
// every rank's queries give a partial gradient for every key, and a reduce-scatter adds them at the
// key's owner. Everything else a layer does is per
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
// This rank's chunks on ctx's cp axis of a sequence whose local piece has `local_seq` rows (the
// global sequence is cp x local_seq).
std::vector<PositionRun> local_chunks(const ParallelContext& ctx, std::int64_t local_seq);
// The runs of local rows [begin, begin + count) (a sequence-parallel shard of the local piece), with
// `local` counted from `begin`.
std::vector<PositionRun> rows_of(const std::vector<PositionRun>& chunks, std::int64_t begin, std::int64_t count);

// Checks a sequence of `seq` positions can be cut into the chunks (a multiple of 2 cp), naming the
// mesh and the lengths that work. No-op without cp.
void check_context_sequence(const ParallelContext& ctx, std::int64_t seq, const char* what);

// This rank's rows of x [T, ...] (dim 0 the whole sequence): its two chunks, concatenated. For the
// token ids and targets (no graph). x itself without cp.
Tensor take_local_chunks(const Tensor& x, const ParallelContext& ctx);

// The rows of `table` [P, ...] at the runs' global positions, concatenated in run order
// (differentiable: the learned position table's rows of this rank's tokens).
Tensor rows_at(const Tensor& table, const std::vector<PositionRun>& runs);

// Causal attention of this rank's query chunks q [B, H, 2L, D] against the whole sequence's keys and
// values, of which it holds its chunks k, v [B, H_kv, 2L, D] (H a multiple of H_kv: grouped-query
// attention's heads repeat after the gather): each chunk against the keys up to its own end, with
// the sliding window as ops::causal_attention -> [B, H, 2L, D]. The keys and values are all-gathered
// over cp in forward and again in backward (nothing of the whole sequence is kept between), and
// their gradients return to their owners by the rule's dual of the gather, a reduce-scatter. Only on
// a mesh with cp > 1 (without: ops::causal_attention).
Tensor context_attention(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t window,
                         const ParallelContextPtr& ctx);

}  // namespace meshgrad::nn
