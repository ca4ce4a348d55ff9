// Context parallelism: the chunk layout, the keys' gather and the chunked attention
// (contracts and the picture in include/meshgrad/nn/context_parallel.hpp).
#include "meshgrad/nn/context_parallel.hpp"

#include <algorithm>

#include <cmath>
#include <limits>

#include "meshgrad/autograd/function.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/p2p.hpp"
#include "meshgrad/distributed/rule.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/ops/tree_reduce.hpp"
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

std::vector<PositionRun> context_runs(std::int64_t seq, int size, int rank, int blocks) {
  if (blocks <= 1) return context_chunks(seq, size, rank);
  MG_CHECK(blocks % (2 * size) == 0 && seq % blocks == 0, "context_runs: a sequence of {} positions in {} blocks over "
           "cp = {} (the blocks must cut the sequence and each of the 2 x cp chunks evenly)", seq, blocks, size);
  const std::int64_t block = seq / blocks;
  const int half = blocks / (2 * size), local = blocks / size;
  // The piece's blocks: chunk `rank`'s in position order, then its mirror's (local index j).
  const auto first_block = [&](int j) {
    return j < half ? rank * half + j : (2 * size - 1 - rank) * half + (j - half);
  };
  std::vector<PositionRun> runs;
  for (int i = 0; i < local; ++i) {
    const int j = i % 2 == 0 ? i / 2 : local - 1 - i / 2;   // leaf order 0, L-1, 1, L-2, ...
    runs.push_back({i * block, first_block(j) * block, block});
  }
  return runs;
}

std::vector<PositionRun> local_chunks(const ParallelContext& ctx, std::int64_t local_seq) {
  return context_runs(local_seq * ctx.cp_size(), ctx.cp_size(), ctx.cp_rank(), ctx.sequence_blocks());
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
  if (ctx.sequence_blocked()) {
    const int n = ctx.sequence_blocks();
    MG_CHECK(seq % n == 0, "{}: --mesh-invariant --sequence-blocks {} cuts every sequence into {} blocks of equal "
             "positions, and a sequence of {} positions does not cut into {}; use a --seq that is a multiple of {}",
             what, n, n, seq, n, n);
    return;
  }
  if (!ctx.context_parallel()) return;
  const int cp = ctx.cp_size();
  MG_CHECK(seq % (2 * cp) == 0, "{}: the mesh {} splits every sequence over cp = {} into 2 x cp = {} chunks (two per "
           "rank, balanced under the causal mask), and a sequence of {} positions does not cut into {} equal "
           "chunks; use a --seq that is a multiple of {}", what, ctx.mesh->str(), cp, 2 * cp, seq, 2 * cp, 2 * cp);
}

Tensor take_local_chunks(const Tensor& x, const ParallelContext& ctx) {
  const std::int64_t seq = x.size(0);
  const std::vector<PositionRun> runs =
      context_runs(seq, ctx.cp_size(), ctx.cp_rank(), ctx.sequence_blocks());
  if (runs.size() == 1) return x;
  Shape shape = x.shape();
  shape[0] = seq / ctx.cp_size();
  Tensor out = Tensor::empty(shape, x.dtype());
  for (const PositionRun& c : runs) out.narrow(0, c.local, c.size).copy_from(x.narrow(0, c.global, c.size));
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

// [B, H, T, D] along dim 2 between the ranks' order of the runs after an all-gather (rank j's piece,
// its runs in local order, in turn) and position order. No graph.
Tensor reorder_runs(const Tensor& x, int cp, int blocks, bool to_positions) {
  const std::int64_t seq = x.size(2), piece = seq / cp;
  Tensor out = Tensor::empty(x.shape(), x.dtype());
  for (int j = 0; j < cp; ++j) {
    for (const PositionRun& r : context_runs(seq, cp, j, blocks)) {
      const std::int64_t gathered = j * piece + r.local;
      out.narrow(2, to_positions ? r.global : gathered, r.size)
          .copy_from(x.narrow(2, to_positions ? gathered : r.global, r.size));
    }
  }
  return out;
}

// [B, H_kv, T, D] -> [B, H_kv * groups, T, D]: each key/value head repeated for its query heads.
Tensor repeat_heads(const Tensor& x, std::int64_t groups) {
  if (groups == 1) return x;
  const std::int64_t b = x.size(0), h = x.size(1), t = x.size(2), d = x.size(3);
  return x.contiguous().view({b, h, 1, t, d}).expand({b, h, groups, t, d}).contiguous().view({b, h * groups, t, d});
}

// repeat_heads' gradient: [B, H_kv * groups, T, D] -> [B, H_kv, T, D], each key/value head's repeats summed.
Tensor sum_repeats(const Tensor& grad, std::int64_t groups) {
  if (groups == 1) return grad;
  const std::int64_t b = grad.size(0), h = grad.size(1) / groups, t = grad.size(2), d = grad.size(3);
  return kernels::sum(grad.contiguous().view({b, h, groups, t, d}), {2}, /*keepdim=*/false);
}

// The inputs of the two attentions: q [B, H, P, D] and k, v [B, H_kv, P, D], H a multiple of H_kv
// (a rank's piece of P positions; two_chunks: P even, the ring's two chunks).
void check_piece(const Tensor& q, const Tensor& k, const Tensor& v, const char* op, bool two_chunks) {
  MG_CHECK(q.dim() == 4 && k.dim() == 4 && v.shape() == k.shape() && q.size(0) == k.size(0) &&
               q.size(2) == k.size(2) && q.size(3) == k.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0 &&
               (!two_chunks || q.size(2) % 2 == 0),
           "{}: q must be [B, H, P, D] and k, v [B, H_kv, P, D] with H a multiple of H_kv (this rank's piece of P "
           "positions{}), got q {} k {} v {}", op, two_chunks ? ", two chunks" : "", q.str(), k.str(), v.str());
}

// Causal attention of this rank's query runs against the whole sequence's keys and values, which
// are all-gathered over cp in forward and again in backward (so no rank keeps the whole sequence's
// keys between the two: what a block saves is its own runs', and activation memory per rank falls as
// 1 / cp). The step and its dual are the rule's: forward S(2) -> R, an all-gather; the keys'
// gradients computed from this rank's queries are partial sums over cp, and backward asks the rule
// for them: a reduce-scatter, so each owner receives the sum of every rank's part.
//   inputs  q [B, H, P, D], k, v [B, H_kv, P, D]: the rank's piece of P positions, its runs in local
//           order (H a multiple of H_kv: grouped-query attention repeats each key/value head for its
//           H / H_kv query heads after the gather, so the fewer heads travel)
//   output  [B, H, P, D]
// Each run's queries meet the keys up to the run's end in one kernel call. Under the sequence blocks
// (--mesh-invariant) the runs are the blocks, the same calls on every cp, and the keys' gradients of
// the runs (each summed over its repeated heads) are added in the blocks' tree, whose leaves are the
// runs in local order, before the cp reduction (also in the tree) adds the ranks' subtrees.
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
    check_piece(q, k, v, "context_attention", false);
    scale_ = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    groups_ = q.size(1) / k.size(1);
    // Under bf16 products the tiles see bf16 values, as ops::causal_attention's (nn_ops.cpp).
    const bool bf16 = kernels::product_precision() == kernels::ProductPrecision::BFloat16 && q.dtype() == DType::Float32;
    const Tensor qr = bf16 ? kernels::round_to_bfloat16(q) : q;
    const Tensor kr = bf16 ? kernels::round_to_bfloat16(k) : k;
    const Tensor vr = bf16 ? kernels::round_to_bfloat16(v) : v;
    const Tensor keys = whole_sequence(kr), values = whole_sequence(vr);
    Tensor out = Tensor::empty(q.shape(), q.dtype());
    TensorList keep{qr, kr, vr, out};
    for (const PositionRun& c : runs(keys.size(2))) {
      const std::int64_t end = c.global + c.size;   // the run's queries are the last of keys [0, end)
      kernels::AttentionForward f = kernels::causal_attention_forward(
          qr.narrow(2, c.local, c.size), keys.narrow(2, 0, end), values.narrow(2, 0, end), scale_, window_);
      out.narrow(2, c.local, c.size).copy_from(f.out);
      keep.push_back(f.lse);
    }
    if (needs_input_grad(0) || needs_input_grad(1) || needs_input_grad(2)) save_for_backward(keep);
    return {out};
  }

  TensorList backward(const TensorList& g) override {
    dist::CommLabelScope label(label_);
    const TensorList& s = saved();
    const Tensor &q = s[0], &out = s[3];
    const Tensor dout = g[0];
    const Tensor keys = whole_sequence(s[1]), values = whole_sequence(s[2]);
    const std::int64_t seq = keys.size(2);
    Tensor dq = Tensor::zeros(q.shape(), q.dtype());
    Shape kv_shape = keys.shape();
    kv_shape[1] = s[1].size(1);   // the key/value heads, before they repeat
    // The normal mode adds the runs' parts into one buffer; the sequence blocks add them in the tree.
    const bool tree = ctx_->sequence_blocked();
    Tensor dkeys = tree ? Tensor() : Tensor::zeros(kv_shape, keys.dtype());
    Tensor dvalues = tree ? Tensor() : Tensor::zeros(kv_shape, values.dtype());
    tree::PairwiseSum<Tensor, AddTensors> dk_tree, dv_tree;
    const std::vector<PositionRun> rs = runs(seq);
    for (std::size_t i = 0; i < rs.size(); ++i) {
      const PositionRun& c = rs[i];
      const std::int64_t end = c.global + c.size;
      const kernels::AttentionGrads d = kernels::causal_attention_backward(
          dout.narrow(2, c.local, c.size), q.narrow(2, c.local, c.size), keys.narrow(2, 0, end),
          values.narrow(2, 0, end), {out.narrow(2, c.local, c.size), s[4 + i]}, scale_, true, true, true, window_);
      dq.narrow(2, c.local, c.size).copy_from(d.dq);
      const Tensor dk = sum_repeats(d.dk, groups_), dv = sum_repeats(d.dv, groups_);
      if (tree) {
        dk_tree.push(padded(dk, kv_shape));
        dv_tree.push(padded(dv, kv_shape));
      } else {
        Tensor dk_rows = dkeys.narrow(2, 0, end), dv_rows = dvalues.narrow(2, 0, end);
        kernels::axpy_(dk_rows, 1.0, dk);
        kernels::axpy_(dv_rows, 1.0, dv);
      }
    }
    if (tree) {
      dkeys = dk_tree.root();
      dvalues = dv_tree.root();
    }
    return {dq, to_owners(dkeys), to_owners(dvalues)};
  }

 private:
  struct AddTensors {
    Tensor operator()(const Tensor& a, const Tensor& b) const { return kernels::binary(kernels::Binary::Add, a, b); }
  };

  std::vector<PositionRun> runs(std::int64_t seq) const {
    return context_runs(seq, ctx_->cp_size(), ctx_->cp_rank(), ctx_->sequence_blocks());
  }

  // This rank's piece [B, H_kv, P, D] -> the whole sequence [B, H, T, D] in position order.
  Tensor whole_sequence(const Tensor& local) const {
    const int cp = ctx_->cp_size();
    Tensor all = local;
    if (cp > 1) {
      const dist::ProcessGroup& group = ctx_->context_group();
      dist::StepArgs args;
      args.dim = 2;
      args.sizes.assign(static_cast<std::size_t>(group.size()), local.size(2));
      all = dist::run_primitive(dist::forward_primitive(dist::Shard(2), dist::Replicate()), local, group, args);
    }
    return repeat_heads(reorder_runs(all, cp, ctx_->sequence_blocks(), /*to_positions=*/true), groups_);
  }

  // [B, H_kv, end, D] -> [B, H_kv, T, D], zeros after `end`: a leaf of the blocks' tree, the shape of
  // the cp reduction's operand, so that the tree adds the same operands on every cp.
  static Tensor padded(const Tensor& part, const Shape& shape) {
    Tensor whole = Tensor::zeros(shape, part.dtype());
    whole.narrow(2, 0, part.size(2)).copy_from(part);
    return whole;
  }

  // The whole sequence's key gradient [B, H_kv, T, D] this rank's queries gave -> its own piece's
  // sum over cp [B, H_kv, P, D]: the rule's dual of the gather for a partial gradient, in the order
  // of the policy (the fixed tree under --mesh-invariant).
  Tensor to_owners(const Tensor& grad) const {
    const int cp = ctx_->cp_size();
    const Tensor pieces = reorder_runs(grad, cp, ctx_->sequence_blocks(), /*to_positions=*/false);
    if (cp == 1) return pieces;
    const dist::ProcessGroup& group = ctx_->context_group();
    dist::StepArgs args;
    args.dim = 2;
    args.sizes.assign(static_cast<std::size_t>(group.size()), grad.size(2) / group.size());
    args.order = ctx_->reduce_order();
    const dist::BackwardStep step = dist::backward_step(dist::Shard(2), dist::Replicate(), dist::Partial());
    return dist::run_primitive(step.op, pieces, group, args);
  }

  ParallelContextPtr ctx_;
  std::int64_t window_;
  std::string label_;
  double scale_ = 1.0;
  std::int64_t groups_ = 1;
};

// ---- the ring ------------------------------------------------------------------------------------

// Tags of the ring's transfers on the cp group (reserved: no micro-batch's transfer can match them).
constexpr int kTagRingKeys = dist::kFirstReservedTag + 2;    // a rank's keys and values, [2, B, H_kv, P, D]
constexpr int kTagRingGrads = dist::kFirstReservedTag + 3;   // their gradients' partial sums, the same shape

// One causal piece product: query run qr of this rank against key run kr of the piece at hand. Empty
// when the keys all come after the queries, or (window > 0) all lie before every query's window.
bool meets(const PositionRun& qr, const PositionRun& kr, std::int64_t window) {
  if (kr.global > qr.global) return false;
  return window <= 0 || kr.global + kr.size - 1 >= qr.global - window + 1;
}

// The parts of one attention merged exactly: a part (out_p, lse_p) over some keys and the running
// (out, lse) over others give the attention over both (out = sum_i exp(lse_i - lse) out_i,
// lse = log sum_i exp(lse_i)). A part of lse -inf (no key visible) weighs nothing. In place in
// out [B, H, L, D] and lse [B, H, L] (contiguous).
void merge_part(Tensor& out, Tensor& lse, const Tensor& out_part, const Tensor& lse_part) {
  const Tensor po = out_part.contiguous(), pl = lse_part.contiguous();
  const std::int64_t rows = lse.numel(), dim = out.size(-1);
  dispatch_floating(out.dtype(), "ring attention merge", [&]<class T>() {
    T* o = out.data<T>();
    T* l = lse.data<T>();
    const T* op = po.data<T>();
    const T* lp = pl.data<T>();
    for (std::int64_t i = 0; i < rows; ++i) {
      const T a = l[i], b = lp[i];
      const T m = std::max(a, b);
      if (m == -std::numeric_limits<T>::infinity()) continue;   // neither part sees a key yet
      const T wa = std::exp(a - m), wb = std::exp(b - m);
      const T total = wa + wb;
      const T ca = wa / total, cb = wb / total;
      T* orow = o + i * dim;
      const T* prow = op + i * dim;
      for (std::int64_t d = 0; d < dim; ++d) orow[d] = orow[d] * ca + prow[d] * cb;
      l[i] = m + std::log(total);
    }
  });
}

// Ring attention (normal mode, cp > 1): the same function as ContextAttentionFn, with the keys and
// values passed rank to rank instead of gathered, each transfer in flight while the piece at hand
// is computed. At step s (0 .. cp - 1) rank r holds the piece of rank r - s (its two chunks of keys
// and values, the fewer key/value heads) and sends it on to r + 1 as it starts computing its query
// chunks against it; the parts are merged exactly (merge_part). Backward passes the pieces around
// again, each with the partial sum of its gradients: rank r adds its queries' part for the piece at
// hand and sends the sum on; after cp steps every piece's sum is back with its owner (one last hop).
// Nothing of the whole sequence is held: a rank keeps its own piece, the one at hand and the one
// arriving. Inputs and output as ContextAttentionFn's.
class RingAttentionFn final : public autograd::Function {
 public:
  RingAttentionFn(ParallelContextPtr ctx, std::int64_t window)
      : ctx_(std::move(ctx)), window_(window), label_(dist::current_comm_label()) {}
  std::string_view name() const override { return "ring_attention"; }

  TensorList forward(const TensorList& in) override {
    const Tensor &q = in[0], &k = in[1], &v = in[2];
    check_piece(q, k, v, "ring_attention", true);
    scale_ = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    groups_ = q.size(1) / k.size(1);
    const bool bf16 = kernels::product_precision() == kernels::ProductPrecision::BFloat16 && q.dtype() == DType::Float32;
    const Tensor qr = bf16 ? kernels::round_to_bfloat16(q) : q;
    const Tensor piece = stack_pieces(bf16 ? kernels::round_to_bfloat16(k) : k, bf16 ? kernels::round_to_bfloat16(v) : v);
    const std::int64_t seq = q.size(2) * ctx_->cp_size();
    const std::vector<PositionRun> queries = context_chunks(seq, ctx_->cp_size(), ctx_->cp_rank());
    Tensor out = Tensor::zeros(q.shape(), q.dtype());
    Tensor lse = Tensor::full({q.size(0), q.size(1), q.size(2)}, -std::numeric_limits<double>::infinity(), q.dtype());
    ring(piece, [&](const Tensor& at_hand, int owner) {
      for (const PositionRun& kr : context_chunks(seq, ctx_->cp_size(), owner)) {
        const Tensor keys = repeat_heads(at_hand.select(0, 0).narrow(2, kr.local, kr.size), groups_);
        const Tensor values = repeat_heads(at_hand.select(0, 1).narrow(2, kr.local, kr.size), groups_);
        for (const PositionRun& qc : queries) {
          if (!meets(qc, kr, window_)) continue;
          const kernels::AttentionForward f = kernels::causal_attention_forward(
              qr.narrow(2, qc.local, qc.size), keys, values, scale_, window_, qc.global - kr.global);
          Tensor o = out.narrow(2, qc.local, qc.size).contiguous(), l = lse.narrow(2, qc.local, qc.size).contiguous();
          merge_part(o, l, f.out, f.lse);
          out.narrow(2, qc.local, qc.size).copy_from(o);
          lse.narrow(2, qc.local, qc.size).copy_from(l);
        }
      }
    });
    if (needs_input_grad(0) || needs_input_grad(1) || needs_input_grad(2)) save_for_backward({qr, piece, out, lse});
    return {out};
  }

  TensorList backward(const TensorList& g) override {
    dist::CommLabelScope label(label_);
    const TensorList& s = saved();
    const Tensor &q = s[0], &piece = s[1], &out = s[2], &lse = s[3];
    const Tensor dout = g[0].contiguous();
    const std::int64_t seq = q.size(2) * ctx_->cp_size();
    const std::vector<PositionRun> queries = context_chunks(seq, ctx_->cp_size(), ctx_->cp_rank());
    const dist::ProcessGroup& group = ctx_->context_group();
    const int cp = group.size(), rank = group.rank(), next = (rank + 1) % cp, prev = (rank + cp - 1) % cp;
    Tensor dq = Tensor::zeros(q.shape(), q.dtype());
    std::vector<dist::PendingTensor> grad_sends;
    int step = 0;
    ring(piece, [&](const Tensor& at_hand, int owner) {
      // This rank's queries' part of the piece's gradients, then the sum so far from the ranks before.
      Tensor mine = Tensor::zeros(piece.shape(), piece.dtype());
      for (const PositionRun& kr : context_chunks(seq, cp, owner)) {
        const Tensor keys = repeat_heads(at_hand.select(0, 0).narrow(2, kr.local, kr.size), groups_);
        const Tensor values = repeat_heads(at_hand.select(0, 1).narrow(2, kr.local, kr.size), groups_);
        for (const PositionRun& qc : queries) {
          if (!meets(qc, kr, window_)) continue;
          const kernels::AttentionForward whole{out.narrow(2, qc.local, qc.size).contiguous(),
                                                lse.narrow(2, qc.local, qc.size).contiguous()};
          const kernels::AttentionGrads d = kernels::causal_attention_backward(
              dout.narrow(2, qc.local, qc.size), q.narrow(2, qc.local, qc.size), keys, values, whole, scale_, true, true,
              true, window_, qc.global - kr.global);
          Tensor dq_rows = dq.narrow(2, qc.local, qc.size);
          kernels::axpy_(dq_rows, 1.0, d.dq);
          Tensor dk_rows = mine.select(0, 0).narrow(2, kr.local, kr.size);
          Tensor dv_rows = mine.select(0, 1).narrow(2, kr.local, kr.size);
          kernels::axpy_(dk_rows, 1.0, sum_repeats(d.dk, groups_));
          kernels::axpy_(dv_rows, 1.0, sum_repeats(d.dv, groups_));
        }
      }
      Tensor sum = mine;
      if (step > 0) {
        const Tensor before = dist::recv(piece.shape(), piece.dtype(), group, prev, kTagRingGrads);
        sum = kernels::binary(kernels::Binary::Add, before, mine);
      }
      grad_sends.push_back(dist::send_async(sum, group, next, kTagRingGrads));   // on to the piece's next holder
      ++step;
    });
    // The last hop: every rank's part of this rank's piece, from the rank that held it last.
    const Tensor total = dist::recv(piece.shape(), piece.dtype(), group, prev, kTagRingGrads);
    for (dist::PendingTensor& p : grad_sends) p.wait();
    return {dq, total.select(0, 0).contiguous(), total.select(0, 1).contiguous()};
  }

 private:
  static Tensor stack_pieces(const Tensor& k, const Tensor& v) {
    Shape shape = k.shape();
    shape.insert(shape.begin(), 2);
    Tensor both = Tensor::empty(shape, k.dtype());
    both.select(0, 0).copy_from(k);
    both.select(0, 1).copy_from(v);
    return both;
  }

  // Calls visit(piece at hand, its owner) for the pieces of ranks r, r - 1, ..., r - cp + 1 in turn;
  // the next piece's transfer (send to r + 1, receive from r - 1) is in flight while visit runs.
  template <class Visit>
  void ring(const Tensor& own, Visit&& visit) const {
    const dist::ProcessGroup& group = ctx_->context_group();
    const int cp = group.size(), rank = group.rank(), next = (rank + 1) % cp, prev = (rank + cp - 1) % cp;
    Tensor at_hand = own;
    for (int s = 0; s < cp; ++s) {
      dist::PendingTensor sending;
      if (s + 1 < cp) sending = dist::send_async(at_hand, group, next, kTagRingKeys);
      visit(at_hand, (rank - s + cp) % cp);
      if (s + 1 < cp) {
        at_hand = dist::recv(own.shape(), own.dtype(), group, prev, kTagRingKeys);
        sending.wait();
      }
    }
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
  MG_CHECK(ctx != nullptr && ctx->attention_per_run(), "context_attention: the mesh has no cp axis of more than one "
           "rank and no --sequence-blocks (use causal_attention)");
  MG_CHECK(window >= 0, "context_attention: the sliding window must be >= 0 (0: none), got {}", window);
  // The ring in the normal mode (unless --cp-schedule all-gather); the sequence blocks' tree needs the
  // gathered keys (each block's key gradients whole before the tree adds them).
  if (ctx->context_parallel() && !ctx->sequence_blocked() && ctx->config.cp_ring) {
    return autograd::apply<RingAttentionFn>({q, k, v}, ctx, window)[0];
  }
  return autograd::apply<ContextAttentionFn>({q, k, v}, ctx, window)[0];
}

Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t window, const ParallelContextPtr& ctx) {
  MG_CHECK(ctx != nullptr, "attention: no parallel context");
  return ctx->attention_per_run() ? context_attention(q, k, v, window, ctx) : causal_attention(q, k, v, window);
}

}  // namespace meshgrad::nn
