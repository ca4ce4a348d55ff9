#include "meshgrad/nn/invariant.hpp"

#include <cmath>

#include "meshgrad/autograd/function.hpp"
#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/placement.hpp"
#include "meshgrad/distributed/tree_collectives.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/kernels.hpp"

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
    if (!model_nests(cfg, parallel, tp, nullptr)) continue;
    out += out.empty() ? fmt::format("{}", tp) : fmt::format(", {}", tp);
  }
  return out.empty() ? "none" : out;
}

void check_model(const ModelConfig& cfg, const ParallelContext& ctx) {
  if (!ctx.config.tp_invariant) return;
  const ParallelConfig& p = ctx.config;
  MG_CHECK(tree::is_power_of_two(p.invariant_blocks), "--tp-invariant: --invariant-blocks {} must be a power of two "
           "(1, 2, 4, 8, ...)", p.invariant_blocks);
  std::string failing;
  const int tp = ctx.tp_size();
  if (!tree::is_power_of_two(tp) || !model_nests(cfg, p, tp, &failing)) {
    throw InvalidArgument(fmt::format(
        "--tp-invariant: tp={} cannot keep the fixed tree of {} blocks for this model ({}{}). Degrees that work for "
        "this model: tp = {} (a power of two dividing --invariant-blocks, and every split dimension cut in whole "
        "blocks)", tp, p.invariant_blocks, failing.empty() ? "tp is not a power of two" : failing,
        failing.empty() ? "" : " does not split into blocks that nest in the tp shards", working_degrees(cfg, p)));
  }
}

tree::SplitPlan token_plan(const ParallelContext& ctx, std::int64_t seq) {
  const bool sp = ctx.sequence_parallel();
  return tree::plan_split(fmt::format("the sequence (length {})", seq), seq, 1, 1, ctx.config.invariant_blocks,
                          sp ? ctx.tp_size() : 1, sp ? ctx.tp_rank() : 0);
}

namespace {

Tensor cols(const Tensor& m, const tree::Segment& s) { return m.narrow(1, s.local_offset, s.size); }

// ---- column-parallel ---------------------------------------------------------------------------
// Inputs {x, W, b}: x [T(_local), B, in], W [in, out_local], b [out_local] or undefined.
//   forward:  X = x or all-gather(x) along the sequence (exact copies); Y[:, s] = X W[:, s] per
//             output segment s (+ b)
//   backward: dX = tree over local blocks i of sum over parts of dY[:, s] W[:, s]^T, then the tree
//             all-reduce (or tree reduce-scatter under SP); dW[:, s] = X^T dY[:, s]; db[s] = column
//             sums of dY[:, s]
class InvariantColumnFn final : public autograd::Function {
 public:
  InvariantColumnFn(ParallelContextPtr ctx, tree::SplitPlan plan, std::int64_t seq_len, std::string label)
      : ctx_(std::move(ctx)), plan_(std::move(plan)), seq_len_(seq_len), label_(std::move(label)) {}
  std::string_view name() const override { return "column_parallel_linear (tp-invariant)"; }
  bool decides_gradient_placement() const override { return true; }

  TensorList forward(const TensorList& in) override {
    const Tensor& x = in[0];
    const Tensor& w = in[1];
    const Tensor& b = in[2];
    MG_CHECK(x.dim() == 3 && w.dim() == 2 && x.size(2) == w.size(0), "{}: input {} and weight {} do not match", label_,
             shape_str(x.shape()), shape_str(w.shape()));
    const Tensor x_full = gather(x);
    const std::int64_t in_f = w.size(0), n = w.size(1);
    const Tensor x2 = x_full.contiguous().view({-1, in_f});
    Tensor y = Tensor::empty({x2.size(0), n}, x.dtype());
    // With a bias, y starts as the bias rows and each GEMM adds into it (the normal mode's linear
    // does the same): the K = in features are never split over tp, so every rank computes the
    // same GEMM per segment, and the bits are the same at every tp.
    if (b.defined()) y.copy_from(b);
    for (const tree::Segment& s : plan_.segments) {
      Tensor ys = cols(y, s);
      tree::gemm_into(ys, x2, cols(w, s), b.defined());
    }
    const bool keep_local = regather();
    save_for_backward({keep_local ? x : x2, w});
    x_shape_ = x.shape();
    Shape out_shape = x_full.shape();
    out_shape.back() = n;
    return {y.view(out_shape)};
  }

  TensorList backward(const TensorList& grads) override {
    dist::CommLabelScope label(label_);
    const Tensor& w = saved()[1];
    const std::int64_t in_f = w.size(0), n = w.size(1);
    const Tensor dy = grads[0].contiguous().view({-1, n});
    const dist::AxisMask incoming = dist::partial_axes(grads[0]);
    const dist::ProcessGroup& tp = ctx_->tp;
    Tensor dx, dw, db;
    dist::PendingTensor dx_pending;
    if (needs_input_grad(0)) {
      std::vector<Tensor> leaves;
      for (int i = 0; i < plan_.local_blocks(); ++i) {
        Tensor leaf = Tensor::empty({dy.size(0), in_f}, dy.dtype());
        bool first = true;
        for (const tree::Segment& s : plan_.block_segments(i)) {
          tree::gemm_into(leaf, cols(dy, s), cols(w, s).transpose(0, 1), !first);
          first = false;
        }
        leaves.push_back(leaf);
      }
      Shape full_shape = x_shape_;
      if (ctx_->sequence_parallel()) full_shape[0] = seq_len_;
      const Tensor root = tree::sum(leaves).view(full_shape);
      if (ctx_->sequence_parallel()) {
        dx_pending = dist::PendingTensor::ready(dist::tree_reduce_scatter(root, tp));
      } else {
        dx_pending = dist::tree_all_reduce_async(root, tp);
        if (!ctx_->config.overlap) dx_pending = dist::PendingTensor::ready(dx_pending.wait());
      }
    }
    if (needs_input_grad(1)) {
      const Tensor x2 = regather() ? gather(saved()[0]).contiguous().view({-1, in_f}) : saved()[0];
      if (is_transposed_matrix(w)) {
        // The tied LM head's wte^T: each segment's gradient is computed in wte's own row-major
        // layout (dW^T[s, :] = dY[:, s]^T X), so it reaches wte with no transposed copy.
        Tensor dwt = Tensor::empty({n, in_f}, dy.dtype());
        for (const tree::Segment& s : plan_.segments) {
          Tensor ws = dwt.narrow(0, s.local_offset, s.size);
          tree::gemm_into(ws, cols(dy, s).transpose(0, 1), x2, false);
        }
        dw = dwt.transpose(0, 1);
      } else {
        dw = Tensor::empty({in_f, n}, dy.dtype());
        for (const tree::Segment& s : plan_.segments) {
          Tensor ws = cols(dw, s);
          tree::gemm_into(ws, x2.transpose(0, 1), cols(dy, s), false);
        }
      }
    }
    if (needs_input_grad(2)) {
      std::vector<Tensor> parts;
      for (const tree::Segment& s : plan_.segments) parts.push_back(kernels::sum(cols(dy, s), {0}, false));
      db = kernels::cat(parts, 0);
    }
    if (dx_pending.valid()) {
      dx = dx_pending.wait();
      if (dx.storage() == dy.storage()) dx = dx.contiguous();
      dist::set_partial_axes(dx, incoming & ~tp.axes);
    }
    for (Tensor* g : {&dw, &db}) {
      if (g->defined()) dist::set_partial_axes(*g, incoming);
    }
    return {dx, dw, db};
  }

 private:
  bool regather() const { return ctx_->sequence_parallel() && ctx_->config.recompute_allgather; }
  Tensor gather(const Tensor& x) const {
    if (!ctx_->sequence_parallel()) return x;
    return dist::all_gather(x.contiguous(), ctx_->tp, 0, shard_sizes(seq_len_, ctx_->tp_size()));
  }

  ParallelContextPtr ctx_;
  tree::SplitPlan plan_;
  std::int64_t seq_len_;
  std::string label_;
  Shape x_shape_;
};

// ---- row-parallel ------------------------------------------------------------------------------
// Inputs {x [T, B, in_local], W [in_local, out]} -> the local subtree root [T, B, out] (partial over tp).
//   forward:  tree over local blocks of X[:, s] W[s, :]
//   backward: dX[:, s] = dY W[s, :]^T; dW[s, :] = X[:, s]^T dY (per block: the same GEMMs at every tp)
class InvariantRowFn final : public autograd::Function {
 public:
  InvariantRowFn(tree::SplitPlan plan, std::string label) : plan_(std::move(plan)), label_(std::move(label)) {}
  std::string_view name() const override { return "row_parallel_linear (tp-invariant)"; }

  TensorList forward(const TensorList& in) override {
    const Tensor& x = in[0];
    const Tensor& w = in[1];
    MG_CHECK(x.dim() == 3 && w.dim() == 2 && x.size(2) == w.size(0), "{}: input {} and weight {} do not match", label_,
             shape_str(x.shape()), shape_str(w.shape()));
    const std::int64_t out = w.size(1);
    const Tensor x2 = x.contiguous().view({-1, w.size(0)});
    std::vector<Tensor> leaves;
    for (const tree::Segment& s : plan_.segments) {
      Tensor leaf = Tensor::empty({x2.size(0), out}, x.dtype());
      tree::gemm_into(leaf, cols(x2, s), w.narrow(0, s.local_offset, s.size), false);
      leaves.push_back(leaf);
    }
    save_for_backward({x2, w});
    Shape out_shape = x.shape();
    out_shape.back() = out;
    return {tree::sum(leaves).view(out_shape)};
  }

  TensorList backward(const TensorList& g) override {
    const Tensor& x2 = saved()[0];
    const Tensor& w = saved()[1];
    const Tensor dy = g[0].contiguous().view({-1, w.size(1)});
    Tensor dx, dw;
    if (needs_input_grad(0)) {
      dx = Tensor::empty({dy.size(0), w.size(0)}, dy.dtype());
      for (const tree::Segment& s : plan_.segments) {
        Tensor d = cols(dx, s);
        tree::gemm_into(d, dy, w.narrow(0, s.local_offset, s.size).transpose(0, 1), false);
      }
      Shape shape = g[0].shape();
      shape.back() = w.size(0);
      dx = dx.view(shape);
    }
    if (needs_input_grad(1)) {
      dw = Tensor::empty(w.shape(), dy.dtype());
      for (const tree::Segment& s : plan_.segments) {
        Tensor d = dw.narrow(0, s.local_offset, s.size);
        tree::gemm_into(d, cols(x2, s).transpose(0, 1), dy, false);
      }
    }
    return {dx, dw};
  }

 private:
  tree::SplitPlan plan_;
  std::string label_;
};

// ---- bias over token blocks --------------------------------------------------------------------
// Inputs {y [T_l, B, C], b [C]}: y + b; db = tree over the token blocks of column sums.
class InvariantBiasFn final : public autograd::Function {
 public:
  explicit InvariantBiasFn(tree::SplitPlan tokens) : tokens_(std::move(tokens)) {}
  std::string_view name() const override { return "add_bias (tp-invariant)"; }
  TensorList forward(const TensorList& in) override {
    MG_CHECK(in[0].dim() == 3 && in[1].dim() == 1 && in[0].size(2) == in[1].size(0),
             "add_bias: activation {} and bias {} must be [T, B, C] and [C]", shape_str(in[0].shape()),
             shape_str(in[1].shape()));
    return {kernels::binary(kernels::Binary::Add, in[0], in[1])};
  }
  TensorList backward(const TensorList& g) override {
    Tensor db;
    if (needs_input_grad(1)) {
      const Tensor dy = g[0].contiguous();
      const std::int64_t b = dy.size(1), c = dy.size(2);
      const Tensor rows = dy.view({-1, c});
      std::vector<Tensor> leaves;
      for (const tree::Segment& s : tokens_.segments) {
        leaves.push_back(kernels::sum(rows.narrow(0, s.local_offset * b, s.size * b), {0}, false));
      }
      db = tree::sum(leaves);
    }
    return {needs_input_grad(0) ? g[0] : Tensor(), db};
  }

 private:
  tree::SplitPlan tokens_;
};

// ---- LayerNorm over token blocks ---------------------------------------------------------------
// Inputs {x [T_l, B, C], w [C], b [C]}: the plain LayerNorm, row by row (no sum over rows in
// forward or in dx); dw and db = the tree over the token blocks of each block's column sums
// (kernels::layer_norm_backward's row blocks): the same blocks and tree at every tp, without
// splitting x into blocks and concatenating the outputs.
class InvariantLayerNormFn final : public autograd::Function {
 public:
  InvariantLayerNormFn(double eps, tree::SplitPlan tokens) : eps_(eps), tokens_(std::move(tokens)) {}
  std::string_view name() const override { return "layer_norm (tp-invariant)"; }
  TensorList forward(const TensorList& in) override {
    const Tensor x = in[0].contiguous();
    const Tensor& w = in[1];
    const Tensor& b = in[2];
    MG_CHECK(w.defined() && b.defined() && x.dim() == 3 && w.dim() == 1 && b.dim() == 1 && w.size(0) == x.size(2) && b.size(0) == x.size(2) &&
                 w.dtype() == x.dtype() && b.dtype() == x.dtype(),
             "layer_norm: input {} ({}) with weight {} and bias {}: expected [T, B, C] and [C] of one dtype",
             shape_str(x.shape()), x.dtype(), w.defined() ? shape_str(w.shape()) : "none",
             b.defined() ? shape_str(b.shape()) : "none");
    MG_CHECK(std::isfinite(eps_) && eps_ >= 0, "layer_norm: eps must be finite and >= 0, got {}", eps_);
    kernels::LayerNormForward f = kernels::layer_norm_forward(x, w.contiguous(), b.contiguous(), eps_);
    save_for_backward({x, w.contiguous(), f.mean, f.rstd});
    return {f.y};
  }
  TensorList backward(const TensorList& g) override {
    const TensorList& s = saved();
    const std::int64_t rows_per_token = s[0].size(1);
    std::vector<std::int64_t> row_blocks;
    for (const tree::Segment& seg : tokens_.segments) row_blocks.push_back(seg.size * rows_per_token);
    const bool want_w = needs_input_grad(1), want_b = needs_input_grad(2);
    kernels::LayerNormGrads grads =
        kernels::layer_norm_backward(g[0], s[0], s[1], s[2], s[3], needs_input_grad(0), want_w, want_b, row_blocks);
    return {grads.dx, want_w ? tree_over_rows(grads.dweight) : Tensor(), want_b ? tree_over_rows(grads.dbias) : Tensor()};
  }

 private:
  // [blocks, C] -> the tree sum of the rows [C].
  static Tensor tree_over_rows(const Tensor& per_block) {
    std::vector<Tensor> leaves;
    for (std::int64_t i = 0; i < per_block.size(0); ++i) leaves.push_back(per_block.select(0, i));
    return tree::sum(leaves);
  }
  double eps_;
  tree::SplitPlan tokens_;
};

std::vector<std::int64_t> segment_sizes(const tree::SplitPlan& plan) {
  std::vector<std::int64_t> sizes;
  for (const tree::Segment& s : plan.segments) sizes.push_back(s.size);
  return sizes;
}

// A replicated parameter used on this rank's token blocks: its gradient is tree-reduced over tp
// under sequence parallelism.
Tensor replicated_use(const Tensor& p, const ParallelContext& ctx) {
  return ctx.sequence_parallel() ? dist::tree_reduce_grad(p, ctx.tp) : p;
}

}  // namespace

Tensor column_linear(const Tensor& x, const Tensor& w, const Tensor& b, const ParallelContextPtr& ctx,
                     const tree::SplitPlan& out_plan, std::int64_t seq_len, const std::string& label) {
  return autograd::apply<InvariantColumnFn>({x, w, b}, ctx, out_plan, seq_len, label)[0];
}

Tensor row_linear(const Tensor& x, const Tensor& w, const ParallelContext& ctx, const tree::SplitPlan& in_plan,
                  const std::string& label) {
  const Tensor root = autograd::apply<InvariantRowFn>({x, w}, in_plan, label)[0];
  return ctx.sequence_parallel() ? dist::tree_reduce_scatter_to_sequence(root, ctx.tp)
                                 : dist::tree_reduce_from_region(root, ctx.tp);
}

Tensor add_bias(const Tensor& y, const Tensor& bias, const ParallelContext& ctx, std::int64_t seq) {
  return autograd::apply<InvariantBiasFn>({y, replicated_use(bias, ctx)}, token_plan(ctx, seq))[0];
}

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, const ParallelContext& ctx,
                  std::int64_t seq) {
  const tree::SplitPlan tokens = token_plan(ctx, seq);
  MG_CHECK(x.dim() >= 1 && x.size(0) == tokens.segments.back().local_offset + tokens.segments.back().size,
           "layer_norm: input {} does not hold the {} tokens of its sequence shard", shape_str(x.shape()),
           tokens.segments.back().local_offset + tokens.segments.back().size);
  return autograd::apply<InvariantLayerNormFn>({x, replicated_use(weight, ctx), replicated_use(bias, ctx)}, eps,
                                               tokens)[0];
}

Tensor token_sum(const Tensor& x, const ParallelContext& ctx, std::int64_t seq) {
  const tree::SplitPlan tokens = token_plan(ctx, seq);
  const TensorList pieces = meshgrad::split(x, 0, segment_sizes(tokens));
  std::vector<Tensor> leaves;
  for (const Tensor& p : pieces) leaves.push_back(meshgrad::sum(p));
  const Tensor root = tree::sum_op(leaves);
  return ctx.sequence_parallel() ? dist::tree_reduce_from_region(root, ctx.tp) : root;
}

}  // namespace meshgrad::nn::invariant
