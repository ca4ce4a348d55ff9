// Context parallelism: the chunk layout, the keys' gather and the chunked attention
// (contracts and the picture in include/meshgrad/nn/context_parallel.hpp).
#include "meshgrad/nn/context_parallel.hpp"

#include <algorithm>

#include <cmath>

#include "meshgrad/autograd/function.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/rule.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/error.hpp"
#include "meshgrad/tensor/kernels.hpp"

namespace meshgrad::nn {

std::vector<PositionRun> context_chunks(std::int64_t seq, int size, int rank) {
  MG_CHECK(size >= 1 && rank >= 0 && rank < size, "context_chunks: rank {} of {}", rank, size);
  if (size == 1) return {{0, 0, seq}};
  MG_CHECK(seq > 0 && seq % (2 * size) == 0, "context parallelism: a sequence of {} positions does not cut into "
           "2 x cp = {} equal chunks (cp = {}); use a sequence length that is a multiple of {}", seq, 2 * size, size,
           2 * size);
  const std::int64_t chunk = seq / (2 * size);
  return {{0, rank * chunk, chunk}, {chunk, (2 * size - 1 - rank) * chunk, chunk}};
}

std::vector<PositionRun> local_chunks(const ParallelContext& ctx, std::int64_t local_seq) {
  return context_chunks(local_seq * ctx.cp_size(), ctx.cp_size(), ctx.cp_rank());
}

std::vector<PositionRun> rows_of(const std::vector<PositionRun>& chunks, std::int64_t begin, std::int64_t count) {
  std::vector<PositionRun> out;
  const std::int64_t end = begin + count;
  for (const PositionRun& c : chunks) {
    const std::int64_t lo = std::max(begin, c.local), hi = std::min(end, c.local + c.size);
    if (lo < hi) out.push_back({lo - begin, c.global + (lo - c.local), hi - lo});
  }
  std::int64_t covered = 0;
  for (const PositionRun& r : out) covered += r.size;
  MG_CHECK(covered == count, "rows_of: local rows [{}, {}) lie outside the chunks held", begin, end);
  return out;
}

void check_context_sequence(const ParallelContext& ctx, std::int64_t seq, const char* what) {
  if (!ctx.context_parallel()) return;
  const int cp = ctx.cp_size();
  MG_CHECK(seq % (2 * cp) == 0, "{}: the mesh {} splits every sequence over cp = {} into 2 x cp = {} chunks (two per "
           "rank, balanced under the causal mask), and a sequence of {} positions does not cut into {} equal "
           "chunks; use a --seq that is a multiple of {}", what, ctx.mesh->str(), cp, 2 * cp, seq, 2 * cp, 2 * cp);
}

Tensor take_local_chunks(const Tensor& x, const ParallelContext& ctx) {
  if (!ctx.context_parallel()) return x;
  const std::int64_t seq = x.size(0);
  const std::vector<PositionRun> chunks = context_chunks(seq, ctx.cp_size(), ctx.cp_rank());
  Shape shape = x.shape();
  shape[0] = seq / ctx.cp_size();
  Tensor out = Tensor::empty(shape, x.dtype());
  for (const PositionRun& c : chunks) out.narrow(0, c.local, c.size).copy_from(x.narrow(0, c.global, c.size));
  return out;
}

Tensor rows_at(const Tensor& table, const std::vector<PositionRun>& runs) {
  MG_CHECK(!runs.empty(), "rows_at: no positions");
  if (runs.size() == 1) return narrow(table, 0, runs[0].global, runs[0].size);
  TensorList parts;
  for (const PositionRun& r : runs) parts.push_back(narrow(table, 0, r.global, r.size));
  return cat(parts, 0);
}

namespace {

// [B, H, T, D] along dim 2 between the ranks' order of the chunks after an all-gather (rank j's
// chunks j and 2 cp - 1 - j, in turn) and position order (chunks 0 .. 2 cp - 1). No graph.
Tensor reorder_chunks(const Tensor& x, int cp, bool to_positions) {
  const std::int64_t chunk = x.size(2) / (2 * cp);
  Tensor out = Tensor::empty(x.shape(), x.dtype());
  for (int c = 0; c < 2 * cp; ++c) {
    const int owner = c < cp ? c : 2 * cp - 1 - c;
    const std::int64_t gathered = (2 * std::int64_t{owner} + (c < cp ? 0 : 1)) * chunk, position = c * chunk;
    out.narrow(2, to_positions ? position : gathered, chunk)
        .copy_from(x.narrow(2, to_positions ? gathered : position, chunk));
  }
  return out;
}

// [B, H_kv, T, D] -> [B, H_kv * groups, T, D]: each key/value head repeated for its query heads.
Tensor repeat_heads(const Tensor& x, std::int64_t groups) {
  if (groups == 1) return x;
  const std::int64_t b = x.size(0), h = x.size(1), t = x.size(2), d = x.size(3);
  return x.contiguous().view({b, h, 1, t, d}).expand({b, h, groups, t, d}).contiguous().view({b, h * groups, t, d});
}

// Causal attention of this rank's two query chunks against the whole sequence's keys and values,
// which are all-gathered over cp in forward and again in backward (so no rank keeps the whole
// sequence's keys between the two: what a block saves is its own chunks', and activation memory
// per rank falls as 1 / cp). The step and its dual are the rule's: forward S(2) -> R, an all-gather;
// the keys' gradients computed from this rank's queries are partial sums over cp, and backward asks
// the rule for them: a reduce-scatter, so each owner receives the sum of every rank's part.
//   inputs  q [B, H, 2L, D], k, v [B, H_kv, 2L, D] (H a multiple of H_kv: grouped-query attention
//           repeats each key/value head for its H / H_kv query heads after the gather, so the
//           fewer heads travel)
//   output  [B, H, 2L, D]
// The gradients it returns carry the marks of the gradient it receives (partial over cp, as every
// gradient of this rank's tokens): the engine's default.
class ContextAttentionFn final : public autograd::Function {
 public:
  // label: the layer's communication label, which backward's collectives carry too.
  ContextAttentionFn(ParallelContextPtr ctx, std::int64_t window)
      : ctx_(std::move(ctx)), window_(window), label_(dist::current_comm_label()) {}
  std::string_view name() const override { return "context_attention"; }

  TensorList forward(const TensorList& in) override {
    const Tensor &q = in[0], &k = in[1], &v = in[2];
    MG_CHECK(q.dim() == 4 && k.dim() == 4 && v.shape() == k.shape() && q.size(0) == k.size(0) &&
                 q.size(2) == k.size(2) && q.size(3) == k.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0 &&
                 q.size(2) % 2 == 0,
             "context_attention: q must be [B, H, 2L, D] and k, v [B, H_kv, 2L, D] with H a multiple of H_kv (this "
             "rank's two chunks of L positions), got q {} k {} v {}", q.str(), k.str(), v.str());
    scale_ = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    groups_ = q.size(1) / k.size(1);
    // Under bf16 products the tiles see bf16 values, as ops::causal_attention's (nn_ops.cpp).
    const bool bf16 = kernels::product_precision() == kernels::ProductPrecision::BFloat16 && q.dtype() == DType::Float32;
    const Tensor qr = bf16 ? kernels::round_to_bfloat16(q) : q;
    const Tensor kr = bf16 ? kernels::round_to_bfloat16(k) : k;
    const Tensor vr = bf16 ? kernels::round_to_bfloat16(v) : v;
    const Tensor keys = whole_sequence(kr), values = whole_sequence(vr);
    Tensor out = Tensor::empty(q.shape(), q.dtype());
    TensorList lse;
    for (const PositionRun& c : chunks(keys.size(2))) {
      const std::int64_t end = c.global + c.size;   // the chunk's queries are the last of keys [0, end)
      kernels::AttentionForward f = kernels::causal_attention_forward(
          qr.narrow(2, c.local, c.size), keys.narrow(2, 0, end), values.narrow(2, 0, end), scale_, window_);
      out.narrow(2, c.local, c.size).copy_from(f.out);
      lse.push_back(f.lse);
    }
    if (needs_input_grad(0) || needs_input_grad(1) || needs_input_grad(2)) {
      save_for_backward({qr, kr, vr, out, lse[0], lse[1]});
    }
    return {out};
  }

  TensorList backward(const TensorList& g) override {
    dist::CommLabelScope label(label_);
    const TensorList& s = saved();
    const Tensor &q = s[0], &out = s[3];
    const Tensor dout = g[0];
    const Tensor keys = whole_sequence(s[1]), values = whole_sequence(s[2]);
    Tensor dq = Tensor::zeros(q.shape(), q.dtype());
    Tensor dkeys = Tensor::zeros(keys.shape(), keys.dtype()), dvalues = Tensor::zeros(values.shape(), values.dtype());
    const std::vector<PositionRun> runs = chunks(keys.size(2));
    for (std::size_t i = 0; i < runs.size(); ++i) {
      const PositionRun& c = runs[i];
      const std::int64_t end = c.global + c.size;
      const kernels::AttentionGrads d = kernels::causal_attention_backward(
          dout.narrow(2, c.local, c.size), q.narrow(2, c.local, c.size), keys.narrow(2, 0, end),
          values.narrow(2, 0, end), {out.narrow(2, c.local, c.size), s[4 + i]}, scale_, true, true, true, window_);
      dq.narrow(2, c.local, c.size).copy_from(d.dq);
      Tensor dk = dkeys.narrow(2, 0, end), dv = dvalues.narrow(2, 0, end);
      kernels::axpy_(dk, 1.0, d.dk);
      kernels::axpy_(dv, 1.0, d.dv);
    }
    return {dq, to_owners(dkeys), to_owners(dvalues)};
  }

 private:
  std::vector<PositionRun> chunks(std::int64_t seq) const {
    return context_chunks(seq, ctx_->cp_size(), ctx_->cp_rank());
  }

  // This rank's chunks [B, H_kv, 2L, D] -> the whole sequence [B, H, T, D] in position order.
  Tensor whole_sequence(const Tensor& local) const {
    const dist::ProcessGroup& group = ctx_->context_group();
    dist::StepArgs args;
    args.dim = 2;
    args.sizes.assign(static_cast<std::size_t>(group.size()), local.size(2));
    const Tensor all = dist::run_primitive(dist::forward_primitive(dist::Shard(2), dist::Replicate()), local, group, args);
    return repeat_heads(reorder_chunks(all, group.size(), /*to_positions=*/true), groups_);
  }

  // The whole sequence's key gradient [B, H, T, D] this rank's queries gave -> its own chunks' sum
  // over cp [B, H_kv, 2L, D]: the repeated heads summed into theirs, then the rule's dual of the
  // gather for a partial gradient.
  Tensor to_owners(const Tensor& grad) const {
    const dist::ProcessGroup& group = ctx_->context_group();
    Tensor g = grad;
    if (groups_ > 1) {
      const std::int64_t b = g.size(0), h = g.size(1) / groups_, t = g.size(2), d = g.size(3);
      g = kernels::sum(g.view({b, h, groups_, t, d}), {2}, /*keepdim=*/false);
    }
    dist::StepArgs args;
    args.dim = 2;
    args.sizes.assign(static_cast<std::size_t>(group.size()), g.size(2) / group.size());
    const dist::BackwardStep step = dist::backward_step(dist::Shard(2), dist::Replicate(), dist::Partial());
    return dist::run_primitive(step.op, reorder_chunks(g, group.size(), /*to_positions=*/false), group, args);
  }

  ParallelContextPtr ctx_;
  std::int64_t window_;
  std::string label_;
  double scale_ = 1.0;
  std::int64_t groups_ = 1;
};

}  // namespace

Tensor context_attention(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t window,
                         const ParallelContextPtr& ctx) {
  MG_CHECK(ctx != nullptr && ctx->context_parallel(), "context_attention: the mesh has no cp axis of more than one "
           "rank (use causal_attention)");
  MG_CHECK(window >= 0, "context_attention: the sliding window must be >= 0 (0: none), got {}", window);
  return autograd::apply<ContextAttentionFn>({q, k, v}, ctx, window)[0];
}

}  // namespace meshgrad::nn
