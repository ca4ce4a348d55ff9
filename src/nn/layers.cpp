#include "meshgrad/nn/layers.hpp"

#include <algorithm>
#include <cmath>
#include <functional>

#include "meshgrad/autograd/function.hpp"
#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/mappings.hpp"
#include "meshgrad/distributed/placement.hpp"
#include "meshgrad/distributed/rule.hpp"
#include "meshgrad/ops/tree_reduce.hpp"
#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/trace.hpp"

namespace meshgrad::nn {

using autograd::Function;
using dist::Placement;

Parameter make_parameter(const std::string& name, const Shape& full_shape, dist::Placements placements,
                         const ParallelContext& ctx, std::uint64_t seed, double std, double constant, DType dtype) {
  Parameter p;
  p.name = name;
  p.full_shape = full_shape;
  p.placements = std::move(placements);
  p.mesh = ctx.mesh;
  const dist::PieceLayout layout = p.layout();
  p.value = std > 0 ? init_normal_piece(name, full_shape, layout, seed, std, dtype)
                    : Tensor::full(layout.local_shape, constant, dtype);
  p.value.set_requires_grad();
  p.value.set_name(name);
  return p;
}

namespace {

// ---- column-parallel linear: one Function, both modes, optional overlap and regather ------------
//
// Inputs {x, W, b}: x [T(_local), B, in], W [in, out_local], b [out_local] or undefined; plan: the
// blocks of the local output features (SplitPlan::whole in the normal mode: one block, one GEMM).
//   forward:  X = x (all-reduce mode: the step R -> R on tp) or all_gather_seq(x) (sequence
//             parallel: the step S(0) -> R); Y[:, s] = X W[:, s] + b[s] per plan segment s
//   backward: dX = dY W^T is partial over tp (W is split by output features): per local block the
//             sum over its segments of dY[:, s] W[:, s]^T, the blocks added in the tree, and the one
//             rule answers for the input's step in the context's order: all-reduce (R -> R) or
//             reduce-scatter along the sequence (S(0) -> R); dW[:, s] = X^T dY[:, s];
//             db[s] = column sums of dY[:, s].
// With overlap the backward issues its communication asynchronously and computes meanwhile:
//
//   regather:   [all-gather x ......]                 (re-gather the input, SP only)
//               [dX = dY W^T][reduce-scatter/all-reduce dX ......]
//                            wait gather -> [dW = X^T dY][db]  wait dX
//
// Without overlap the same operations run one after the other. Either way each value is computed
// by the same kernels from the same operands, so results are bit-identical.
struct ColumnConfig {
  dist::ProcessGroup tp;
  bool sequence_parallel = false;
  bool overlap = false;
  bool regather = false;
  std::int64_t seq_len = 0;
  std::string label;
  tree::SplitPlan plan;
  dist::ReduceOrder order = dist::ReduceOrder::RankOrder;
};

Tensor columns(const Tensor& m, const tree::Segment& s) { return m.narrow(1, s.local_offset, s.size); }

// Rows of an activation [T, B..., C] per token: the product of the dims between the first and last.
std::int64_t rows_per_token(const Tensor& x) {
  std::int64_t n = 1;
  for (int d = 1; d + 1 < x.dim(); ++d) n *= x.size(d);
  return n;
}

class ColumnLinearFn final : public Function {
 public:
  ColumnLinearFn(ColumnConfig config, ParallelContextPtr ctx) : c_(std::move(config)), ctx_(std::move(ctx)) {}
  std::string_view name() const override { return "column_parallel_linear"; }
  bool decides_gradient_placement() const override { return true; }

  TensorList forward(const TensorList& in) override {
    const Tensor& x = in[0];
    const Tensor& w = in[1];
    const Tensor& b = in[2];
    MG_CHECK(x.dim() == 3 && w.dim() == 2 && x.size(2) == w.size(0) && w.size(1) == c_.plan.local_extent(),
             "{}: input {} and weight {} do not match ([T, B, in] and [in, out_local = {}])", c_.label,
             shape_str(x.shape()), shape_str(w.shape()), c_.plan.local_extent());
    const Tensor x_full = keep_gathered(gather_input(x).wait());
    const std::int64_t in_f = w.size(0), n = w.size(1);
    // Under bf16 products: rounded once for every segment's product, and kept so for backward.
    const Tensor x_rows = kernels::product_operand(x_full.contiguous().view({-1, in_f}));
    // --mesh-invariant's sequence blocks: every product runs per block of the rank's piece.
    row_blocks_ = ctx_->sequence_row_blocks(x_full.size(0), x_full.size(0), rows_per_token(x_full));
    Tensor y = Tensor::empty({x_rows.size(0), n}, x.dtype());
    // The weight too, once for the segments (backward rounds it again rather than keep a bf16 copy
    // of every weight alive from forward to backward).
    const Tensor w_operand = kernels::product_operand(w);
    // With a bias, y starts as the bias rows and each GEMM adds into it (as ops' linear does).
    if (b.defined()) y.copy_from(b);
    std::int64_t row = 0;
    for (const std::int64_t rows : row_blocks_) {
      for (const tree::Segment& s : c_.plan.segments) {
        Tensor ys = columns(y.narrow(0, row, rows), s);
        kernels::matmul_into(ys, x_rows.narrow(0, row, rows), columns(w_operand, s), b.defined());
      }
      row += rows;
    }
    const bool keep_local = c_.sequence_parallel && c_.regather;
    save_for_backward({keep_local ? x : x_rows, w});
    Shape out_shape = x_full.shape();
    out_shape.back() = n;
    return {y.view(out_shape)};
  }

  TensorList backward(const TensorList& grads) override {
    dist::CommLabelScope label(c_.label);
    const TensorList& s = saved();
    const Tensor& w = s[1];
    const Tensor dy = grads[0].contiguous();
    const std::int64_t out = dy.size(-1), in = w.size(0);
    const Tensor dy_rows = kernels::product_operand(dy.view({-1, out}));   // rounded once under bf16 products
    const bool regather = c_.sequence_parallel && c_.regather;
    const dist::AxisMask incoming = dist::partial_axes(grads[0]);

    dist::PendingTensor x_full_pending;
    if (regather && needs_input_grad(1)) x_full_pending = launch(gather_input(s[0]));
    dist::PendingTensor dx_pending;
    if (needs_input_grad(0)) {
      Shape full_shape = dy.shape();
      full_shape.back() = in;
      Tensor dx_full;
      if (row_blocks_.size() == 1) {
        dx_full = input_gradient(dy_rows, w).view(full_shape);
      } else {
        dx_full = Tensor::empty({dy_rows.size(0), in}, w.dtype());
        std::int64_t row = 0;
        for (const std::int64_t rows : row_blocks_) {
          dx_full.narrow(0, row, rows).copy_from(input_gradient(dy_rows.narrow(0, row, rows), w));
          row += rows;
        }
        dx_full = dx_full.view(full_shape);
      }
      // dX is partial over tp: the rule decides how this layer's input step is undone.
      const dist::BackwardStep step =
          dist::backward_step(input_placement(), Placement::replicate(), Placement::partial());
      dist::StepArgs args{0, 0, seq_sizes(), c_.order};
      // dx_full is ours alone: an all-reduce may reduce it in place (no buffer per call).
      dx_pending = launch(dist::run_primitive_async(step.op, dx_full, c_.tp, args, /*in_place=*/true));
    }
    Tensor dw, db;
    if (needs_input_grad(1)) {
      const Tensor x_rows = regather ? kernels::product_operand(keep_gathered(x_full_pending.wait()).reshape({-1, in}))
                                     : s[0];
      dw = over_row_blocks(dy_rows, x_rows, w);
    }
    if (needs_input_grad(2)) {
      const Tensor dy_all = dy.view({-1, out});
      tree::PairwiseSum<Tensor, AddTensors> sums;
      std::int64_t row = 0;
      for (const std::int64_t rows : row_blocks_) {
        sums.push(bias_gradient(dy_all.narrow(0, row, rows)));
        row += rows;
      }
      db = sums.root();
    }
    Tensor dx;
    if (dx_pending.valid()) {
      dx = dx_pending.wait();
      if (dx.storage() == dy.storage()) dx = dx.contiguous();
      dist::set_partial_axes(dx, incoming & ~c_.tp.axes);   // reduced over tp; other marks pass through
    }
    for (Tensor* g : {&dw, &db}) {
      if (g->defined()) dist::set_partial_axes(*g, incoming);
    }
    return {dx, dw, db};
  }

 private:
  // dY W^T, this rank's root of the tree over its local blocks (each block: the sum over its
  // segments, one per fused part). One block in the normal mode: one GEMM.
  Tensor input_gradient(const Tensor& dy_rows, const Tensor& w) const {
    const Tensor w_operand = kernels::product_operand(w);   // rounded once for every segment
    tree::PairwiseSum<Tensor, AddTensors> blocks;
    for (int i = 0; i < c_.plan.local_blocks; ++i) {
      Tensor leaf = Tensor::empty({dy_rows.size(0), w.size(0)}, w.dtype());
      bool first = true;
      for (const tree::Segment& s : c_.plan.block_segments(i)) {
        kernels::matmul_into(leaf, columns(dy_rows, s), columns(w_operand, s).transpose(0, 1), !first);
        first = false;
      }
      blocks.push(leaf);
    }
    return blocks.root();
  }

  // The weight gradient, the tree over the row blocks of theirs (one block: weight_gradient). The
  // tree adds the blocks' gradients in the layout weight_gradient computes them in.
  Tensor over_row_blocks(const Tensor& dy_rows, const Tensor& x_rows, const Tensor& w) const {
    if (row_blocks_.size() == 1) return weight_gradient(dy_rows, x_rows, w);
    const bool transposed = is_transposed_matrix(w);
    tree::PairwiseSum<Tensor, AddTensors> sums;
    std::int64_t row = 0;
    for (const std::int64_t rows : row_blocks_) {
      const Tensor g = weight_gradient(dy_rows.narrow(0, row, rows), x_rows.narrow(0, row, rows), w);
      sums.push(transposed ? g.transpose(0, 1) : g);   // [out_local, in] as computed
      row += rows;
    }
    return transposed ? sums.root().transpose(0, 1) : sums.root();
  }

  // X^T dY per segment. For the tied LM head's wte^T (w is the transpose of a row-major matrix)
  // each segment's gradient is computed in that matrix's own layout, dW^T[s, :] = dY[:, s]^T X, so
  // it reaches wte contiguous, with no [in, out_local] -> [out_local, in] transposed copy.
  Tensor weight_gradient(const Tensor& dy_rows, const Tensor& x_rows, const Tensor& w) const {
    const std::int64_t in = w.size(0), n = w.size(1);
    if (is_transposed_matrix(w)) {
      Tensor dwt = Tensor::empty({n, in}, w.dtype());
      for (const tree::Segment& s : c_.plan.segments) {
        Tensor ws = dwt.narrow(0, s.local_offset, s.size);
        kernels::matmul_into(ws, columns(dy_rows, s).transpose(0, 1), x_rows, false);
      }
      return dwt.transpose(0, 1);
    }
    Tensor dw = Tensor::empty({in, n}, w.dtype());
    for (const tree::Segment& s : c_.plan.segments) {
      Tensor ws = columns(dw, s);
      kernels::matmul_into(ws, x_rows.transpose(0, 1), columns(dy_rows, s), false);
    }
    return dw;
  }

  // Column sums of dY per segment.
  Tensor bias_gradient(const Tensor& dy_rows) const {
    if (c_.plan.segments.size() == 1) return kernels::sum(dy_rows, {0}, false);
    std::vector<Tensor> parts;
    for (const tree::Segment& s : c_.plan.segments) parts.push_back(kernels::sum(columns(dy_rows, s), {0}, false));
    return kernels::cat(parts, 0);
  }

  Placement input_placement() const {
    return c_.sequence_parallel ? Placement::shard(0) : Placement::replicate();
  }
  std::vector<std::int64_t> seq_sizes() const { return shard_sizes(c_.seq_len, c_.tp.size()); }

  // Without overlap a launched operation is waited for at once (same result, no concurrency).
  dist::PendingTensor launch(dist::PendingTensor pending) const {
    if (c_.overlap) return pending;
    return dist::PendingTensor::ready(pending.wait());
  }

  // The full input: x itself in all-reduce mode; the sequence all-gather under SP (in regather
  // mode into the model's shared buffer, which is free again once this layer's forward is done).
  dist::PendingTensor gather_input(const Tensor& x) {
    if (!c_.sequence_parallel || c_.tp.size() == 1) return dist::PendingTensor::ready(x);
    Tensor reuse;
    Shape full_shape = x.shape();
    full_shape[0] = c_.seq_len;
    if (c_.regather) reuse = ctx_->gather_buffers.reusable(full_shape, x.dtype());
    return dist::all_gather_async(x, c_.tp, 0, seq_sizes(), reuse);
  }

  // Regather mode: a buffer the gather had to allocate is kept for the model's next gathers.
  Tensor keep_gathered(const Tensor& full) const {
    if (c_.regather && c_.sequence_parallel && c_.tp.size() > 1) ctx_->gather_buffers.keep(full);
    return full;
  }

  struct AddTensors {
    Tensor operator()(const Tensor& a, const Tensor& b) const { return kernels::binary(kernels::Binary::Add, a, b); }
  };

  ColumnConfig c_;
  ParallelContextPtr ctx_;
  std::vector<std::int64_t> row_blocks_;   // of the full input's rows: the sequence blocks, or one
};

}  // namespace

bool is_transposed_matrix(const Tensor& w) {
  return w.dim() == 2 && w.size(0) > 1 && w.size(1) > 1 && w.strides()[0] == 1 && w.strides()[1] == w.size(0);
}

ColumnParallelLinear::ColumnParallelLinear(const std::string& name, std::int64_t in, std::int64_t out,
                                           const Options& options, ParallelContextPtr ctx, std::uint64_t seed,
                                           DType dtype)
    : name_(name), options_(options), out_(out), ctx_(std::move(ctx)) {
  MG_CHECK(!(options.gather_output && options.blocks > 1), "{}: gather_output with fused blocks is not supported",
           name);
  const auto w_spec = ctx_->on_tp(Placement::shard(1, options.blocks, options.unit));
  const auto b_spec = ctx_->on_tp(Placement::shard(0, options.blocks, options.unit));
  if (options.owns_weight) weight = make_parameter(name + ".weight", {in, out}, w_spec, *ctx_, seed, options.init_std, 0.0, dtype);
  if (options.bias) bias = make_parameter(name + ".bias", {out}, b_spec, *ctx_, seed, 0.0, 0.0, dtype);
  auto out_spec = b_spec;   // the output features this rank computes: its tp piece (gathered over fsdp)
  if (ctx_->fsdp_axis >= 0) out_spec[static_cast<std::size_t>(ctx_->fsdp_axis)] = Placement::replicate();
  const std::int64_t local_out =
      dist::piece_layout({out}, *ctx_->mesh, out_spec, ctx_->mesh->coordinates()).local_shape[0];
  plan_ = ctx_->feature_plan(name + " output features", out, options.blocks, options.unit, local_out);
}

Tensor ColumnParallelLinear::forward(const Tensor& x, std::int64_t seq_len) const {
  MG_CHECK(weight.operand().defined(), "{}: the layer was built without its own weight; use forward_with", name_);
  return forward_with(x, seq_len, weight.operand(), bias.operand());
}

Tensor ColumnParallelLinear::forward_with(const Tensor& x, std::int64_t seq_len, const Tensor& w,
                                          const Tensor& b) const {
  dist::CommLabelScope label(name_);
  trace::Scope scope(name_);
  ColumnConfig config{ctx_->tp,   ctx_->sequence_parallel(), ctx_->config.overlap, ctx_->config.recompute_allgather,
                      seq_len,    name_,                     plan_,                ctx_->reduce_order()};
  Tensor y = autograd::apply<ColumnLinearFn>({x, w, b}, std::move(config), ctx_)[0];
  if (options_.gather_output) y = dist::gather_from_region(y, ctx_->tp, -1, out_);
  return y;
}

RowParallelLinear::RowParallelLinear(const std::string& name, std::int64_t in, std::int64_t out,
                                     const Options& options, ParallelContextPtr ctx, std::uint64_t seed,
                                     DType dtype)
    : name_(name), options_(options), ctx_(std::move(ctx)) {
  weight = make_parameter(name + ".weight", {in, out}, ctx_->on_tp(Placement::shard(0, 1, options.unit)), *ctx_, seed,
                          options.init_std, 0.0, dtype);
  if (options.bias) bias = make_parameter(name + ".bias", {out}, ctx_->replicated(), *ctx_, seed, 0.0, 0.0, dtype);
  const std::int64_t local_in = weight.operand_shape()[0];
  plan_ = ctx_->feature_plan(name + " input features", in, 1, options.unit, local_in);
}

Tensor RowParallelLinear::forward(const Tensor& x) const {
  dist::CommLabelScope label(name_);
  trace::Scope scope(name_);
  const Tensor x_local = options_.input_is_parallel ? x : dist::scatter_to_region(x, ctx_->tp, -1);
  // This rank's share of Y, summed over its input blocks: partial over tp (P), made replicated by
  // an all-reduce, or sequence-sharded by a reduce-scatter under SP, in the context's order.
  const Tensor partial = tree::linear_over_input_blocks(
      x_local, weight.operand(), plan_, ctx_->sequence_row_blocks(x_local.size(0), x_local.size(0), rows_per_token(x_local)));
  const dist::ReduceOrder order = ctx_->reduce_order();
  Tensor y = ctx_->sequence_parallel() ? dist::reduce_scatter_to_sequence(partial, ctx_->tp, 0, order)
                                       : dist::reduce_from_region(partial, ctx_->tp, order);
  if (bias.operand().defined()) {
    // Added once, after the reduction. Under SP each rank adds it to its own tokens only: its
    // gradient is a partial sum over tp. x holds the whole sequence (the column layer gathered it).
    const std::int64_t seq = x_local.size(0);
    y = tree::add_bias(y, ctx_->replicated_on_sequence_shard(bias.operand()),
                       ctx_->token_row_blocks(seq, y.size(0), rows_per_token(y)));
  }
  return y;
}

GridLinear::GridLinear(const std::string& name, std::int64_t in, std::int64_t out, bool in_on_rows,
                       const Options& options, ParallelContextPtr ctx, std::uint64_t seed, DType dtype)
    : name_(name), options_(options), in_(in), out_(out), in_on_rows_(in_on_rows), ctx_(std::move(ctx)) {
  MG_CHECK(ctx_->two_d, "{}: GridLinear needs a 2-D tensor-parallel mesh, got {}", name, ctx_->mesh->str());
  in_axis_ = in_on_rows ? ctx_->row_axis : ctx_->col_axis;
  out_axis_ = in_on_rows ? ctx_->col_axis : ctx_->row_axis;
  const Placement w_in = Placement::shard(0, 1, options.in_unit);
  const Placement w_out = Placement::shard(1, options.blocks, options.out_unit);
  const Placement b_out = Placement::shard(0, options.blocks, options.out_unit);
  auto w_spec = ctx_->replicated(), b_spec = ctx_->replicated();
  w_spec[static_cast<std::size_t>(in_axis_)] = w_in;
  w_spec[static_cast<std::size_t>(out_axis_)] = w_out;
  b_spec[static_cast<std::size_t>(out_axis_)] = b_out;
  weight = make_parameter(name + ".weight", {in, out}, w_spec, *ctx_, seed, options.init_std, 0.0, dtype);
  if (options.bias) bias = make_parameter(name + ".bias", {out}, b_spec, *ctx_, seed, 0.0, 0.0, dtype);
  if (ctx_->tp_invariant()) {
    // The 1-D layer's blocks at tp = C: the column layer's output features, the row layer's input.
    const dist::ProcessGroup& col = ctx_->col();
    plan_ = in_on_rows ? tree::plan_split(name + " output features", out, options.blocks, options.out_unit,
                                          ctx_->config.invariant_blocks, col.size(), col.rank())
                       : tree::plan_split(name + " input features", in, 1, options.in_unit,
                                          ctx_->config.invariant_blocks, col.size(), col.rank());
  }
}

// The column layer of tp = C on the whole input, with the weight's columns gathered over tp_row.
Tensor GridLinear::forward_invariant_column(const Tensor& x) const {
  MG_CHECK(!options_.input_is_split && x.size(-1) == in_, "{}: input {} must hold all {} features", name_,
           shape_str(x.shape()), in_);
  const Tensor w = dist::gather_from_region(weight.operand(), ctx_->row(), 0, in_);   // [in, out_local]
  ColumnConfig config{ctx_->col(), false, false, false, x.size(0), name_, plan_, ctx_->reduce_order()};
  return autograd::apply<ColumnLinearFn>({x, w, bias.operand()}, std::move(config), ctx_)[0];
}

Tensor GridLinear::forward_gathered(const Tensor& x) const {
  if (!ctx_->tp_invariant()) return dist::gather_from_region(forward(x), ctx_->mesh->group(out_axis_), -1, out_);
  MG_CHECK(!in_on_rows_, "{}: forward_gathered is for the layers whose output is split over tp_row", name_);
  dist::CommLabelScope label(name_);
  trace::Scope scope(name_);
  // The row layer of tp = C: this column's input features, the whole output, the weight's and the
  // bias's output features gathered over tp_row.
  const Tensor w = dist::gather_from_region(weight.operand(), ctx_->row(), 1, out_);   // [in_local, out]
  const Tensor partial = tree::linear_over_input_blocks(x, w, plan_);
  const Tensor y = dist::reduce_from_region(partial, ctx_->col(), ctx_->reduce_order());
  if (!bias.operand().defined()) return y;
  const Tensor b = dist::gather_from_region(bias.operand(), ctx_->row(), 0, out_);
  return tree::add_bias(y, b, ctx_->token_row_blocks(x.size(0), y.size(0), rows_per_token(y)));
}

Tensor GridLinear::forward(const Tensor& x) const {
  dist::CommLabelScope label(name_);
  trace::Scope scope(name_);
  if (ctx_->tp_invariant()) {
    MG_CHECK(in_on_rows_, "{}: in the invariant modes this layer's output is whole (forward_gathered)", name_);
    return forward_invariant_column(x);
  }
  const dist::ProcessGroup& in_group = ctx_->mesh->group(in_axis_);
  const dist::ProcessGroup& out_group = ctx_->mesh->group(out_axis_);
  // Own feature slice on in_axis (R -> S(-1)): whole units, as the weight's rows are split.
  Tensor x_split = x;
  if (!options_.input_is_split && in_group.size() > 1) {
    MG_CHECK(x.size(-1) == in_, "{}: input {} has {} features, expected {}", name_, shape_str(x.shape()), x.size(-1), in_);
    MG_CHECK(options_.in_unit == 1, "{}: a replicated input is split in plain features (in_unit 1)", name_);
    x_split = dist::scatter_to_region(x, in_group, -1);
  }
  // The same X enters sharded compute on out_axis: its gradient comes back partial there (W is
  // split by output features), and the rule's R -> R step reduces it.
  const Tensor x_in = dist::mark_partial_grad(dist::copy_to_region(x_split, out_group),
                                              out_group.size() > 1 ? out_group.axes : 0);
  const Tensor partial = meshgrad::linear(x_in, weight.operand());             // partial over in_axis
  const Tensor y = dist::reduce_from_region(partial, in_group);            // P -> R on in_axis
  return bias.operand().defined() ? meshgrad::add(y, bias.operand()) : y;
}

LayerNorm::LayerNorm(const std::string& name, std::int64_t features, double eps, ParallelContextPtr ctx, DType dtype)
    : name_(name), eps_(eps), ctx_(std::move(ctx)) {
  weight = make_parameter(name + ".weight", {features}, ctx_->replicated(), *ctx_, 0, 0.0, 1.0, dtype);
  bias = make_parameter(name + ".bias", {features}, ctx_->replicated(), *ctx_, 0, 0.0, 0.0, dtype);
}

Tensor LayerNorm::forward(const Tensor& x, std::int64_t seq) const {
  trace::Scope scope(name_);
  MG_CHECK(x.dim() >= 2, "{}: input {} must be [T, ..., C]", name_, shape_str(x.shape()));
  MG_CHECK(seq > 0 || !ctx_->sequence_parallel(), "{}: under sequence parallelism the input holds one shard of the "
           "sequence, so the global sequence length must be given", name_);
  // Replicated parameters on this rank's rows: their gradients are summed over the token blocks,
  // and over tp under SP (ParallelContext::replicated_on_sequence_shard).
  return meshgrad::layer_norm(x, ctx_->replicated_on_sequence_shard(weight.operand()),
                              ctx_->replicated_on_sequence_shard(bias.operand()), eps_,
                              ctx_->token_row_blocks(seq > 0 ? seq : x.size(0), x.size(0), rows_per_token(x)));
}

RmsNorm::RmsNorm(const std::string& name, std::int64_t features, double eps, ParallelContextPtr ctx, DType dtype)
    : name_(name), eps_(eps), ctx_(std::move(ctx)) {
  weight = make_parameter(name + ".weight", {features}, ctx_->replicated(), *ctx_, 0, 0.0, 1.0, dtype);
}

Tensor RmsNorm::forward(const Tensor& x, std::int64_t seq) const {
  trace::Scope scope(name_);
  MG_CHECK(x.dim() >= 2, "{}: input {} must be [T, ..., C]", name_, shape_str(x.shape()));
  MG_CHECK(seq > 0 || !ctx_->sequence_parallel(), "{}: under sequence parallelism the input holds one shard of the "
           "sequence, so the global sequence length must be given", name_);
  return meshgrad::rms_norm(x, ctx_->replicated_on_sequence_shard(weight.operand()), eps_,
                            ctx_->token_row_blocks(seq > 0 ? seq : x.size(0), x.size(0), rows_per_token(x)));
}

VocabParallelEmbedding::VocabParallelEmbedding(const std::string& name, std::int64_t vocab, std::int64_t features,
                                               ParallelContextPtr ctx, std::uint64_t seed, DType dtype)
    : vocab_(vocab), ctx_(std::move(ctx)) {
  // Split over the whole tp group (both grid axes on a 2-D mesh: layout.hpp's nested rule is the
  // grid group's rank order, so the offset below is this rank's piece).
  weight = make_parameter(name + ".weight", {vocab, features}, ctx_->on_tp(Placement::shard(0)), *ctx_, seed, 0.02,
                          0.0, dtype);
  offset_ = shard_range(vocab, ctx_->tp_size(), ctx_->tp_rank()).offset;
}

Tensor VocabParallelEmbedding::forward(const Tensor& ids, const Tensor& table) const {
  const Tensor partial = forward_partial(ids, table);
  return ctx_->sequence_parallel() ? dist::reduce_scatter_to_sequence(partial, ctx_->tp, 0)
                                   : dist::reduce_from_region(partial, ctx_->tp);
}

Tensor VocabParallelEmbedding::forward_partial(const Tensor& ids, const Tensor& table) const {
  check_dtype(ids, DType::Int64, "vocab_parallel_embedding", "ids");
  MG_CHECK(table.defined() && table.shape() == weight.operand_shape(), "vocab_parallel_embedding: the table {} is not "
           "this rank's rows of '{}' ({})", table.defined() ? shape_str(table.shape()) : "(undefined)", weight.name,
           shape_str(weight.operand_shape()));
  const std::int64_t local_vocab = table.size(0);
  // Ids outside this rank's rows look up row 0 and are multiplied by 0: they contribute nothing.
  const auto values = ids.to_int64_vector();
  std::vector<std::int64_t> local_ids(values.size());
  std::vector<double> keep(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    MG_CHECK(values[i] >= 0 && values[i] < vocab_, "vocab_parallel_embedding: token id {} at position {} is outside "
             "the vocabulary [0, {})", values[i], i, vocab_);
    const bool mine = values[i] >= offset_ && values[i] < offset_ + local_vocab;
    local_ids[i] = mine ? values[i] - offset_ : 0;
    keep[i] = mine ? 1.0 : 0.0;
  }
  // Under --mesh-invariant's sequence blocks each row's gradient adds the blocks in the tree.
  const std::vector<std::int64_t> blocks =
      ids.dim() == 2 ? ctx_->sequence_row_blocks(ids.size(0), ids.size(0), ids.size(1)) : std::vector<std::int64_t>{};
  Tensor rows = meshgrad::embedding(table, Tensor::from_int64(local_ids, ids.shape()), blocks);
  if (ctx_->tp_size() == 1) return rows;
  Shape mask_shape = ids.shape();
  mask_shape.push_back(1);
  return meshgrad::mul(rows, Tensor::from_values(keep, mask_shape, table.dtype()));
}

// ---- vocab-parallel cross-entropy -----------------------------------------------------------------

namespace {

// Inputs {logits_local [N, V_local]}; targets are a member (no gradient).
class VocabParallelCrossEntropyFn final : public Function {
 public:
  VocabParallelCrossEntropyFn(Tensor targets, std::int64_t offset, std::int64_t vocab, dist::ProcessGroup tp,
                              double divisor, std::int64_t ignore_index, const tree::SplitPlan* blocks,
                              dist::ReduceOrder order, std::vector<std::int64_t> row_blocks)
      : targets_(std::move(targets)), offset_(offset), vocab_(vocab), tp_(std::move(tp)), divisor_(divisor),
        ignore_(ignore_index), order_(order), row_blocks_(std::move(row_blocks)) {
    if (blocks != nullptr) blocks_ = *blocks;
  }
  std::string_view name() const override { return "vocab_parallel_cross_entropy"; }

  TensorList forward(const TensorList& in) override {
    const Tensor logits = in[0].contiguous();
    const std::int64_t n = logits.size(0), vl = logits.size(1);
    // Row max over the whole vocabulary (for stability only; it cancels in the gradient).
    const Tensor row_max = dist::all_reduce(kernels::max_last(logits), tp_, comm::ReduceOp::Max);   // [N, 1]
    Tensor sum_exp = Tensor::empty({n, 1}, logits.dtype());
    Tensor target_logit = Tensor::zeros({n, 1}, logits.dtype());
    const auto t = targets_.to_int64_vector();
    dispatch_floating(logits.dtype(), name(), [&]<class T>() {
      const T* l = logits.data<T>();
      const T* m = row_max.data<T>();
      T* se = sum_exp.data<T>();
      T* tl = target_logit.data<T>();
      for (std::int64_t i = 0; i < n; ++i) {
        if (blocks_) {
          // Per vocabulary block of the plan, added in the tree (each rank holds whole subtrees).
          tree::PairwiseSum<T, std::plus<T>> sums;
          for (const tree::Segment& seg : blocks_->segments) {
            sums.push(static_cast<T>(kernels::sum_exp_shifted(l + i * vl + seg.local_offset, seg.size, m[i])));
          }
          se[i] = sums.root();
        } else {
          se[i] = static_cast<T>(kernels::sum_exp_shifted(l + i * vl, vl, m[i]));
        }
        const std::int64_t target = t[static_cast<std::size_t>(i)];
        if (target == ignore_) continue;
        MG_CHECK(target >= 0 && target < vocab_, "vocab_parallel_cross_entropy: target {} at position {} is outside "
                 "the vocabulary [0, {})", target, i, vocab_);
        if (target >= offset_ && target < offset_ + vl) tl[i] = l[i * vl + (target - offset_)] - m[i];
      }
    });
    const Tensor total_exp = dist::sum_over(sum_exp, tp_, order_);
    const Tensor shifted_target = dist::all_reduce(target_logit, tp_);
    // loss = sum over kept rows of log(sum exp) - (target logit - max), / divisor: per row block
    // (--mesh-invariant's sequence blocks; else one) in double, divided and rounded to T, the blocks
    // added in the tree.
    if (row_blocks_.empty()) row_blocks_ = {n};
    std::int64_t covered = 0;
    for (const std::int64_t r : row_blocks_) covered += r;
    MG_CHECK(covered == n && tree::is_power_of_two(static_cast<std::int64_t>(row_blocks_.size())),
             "vocab_parallel_cross_entropy: {} row blocks cover {} rows of {}", row_blocks_.size(), covered, n);
    Tensor lse = Tensor::empty({n, 1}, logits.dtype());
    Tensor loss;
    dispatch_floating(logits.dtype(), name(), [&]<class T>() {
      const T* se = total_exp.data<T>();
      const T* st = shifted_target.data<T>();
      const T* m = row_max.data<T>();
      T* out = lse.data<T>();
      tree::PairwiseSum<T, std::plus<T>> blocks;
      std::int64_t i = 0;
      for (const std::int64_t rows : row_blocks_) {
        double block = 0;
        for (const std::int64_t end = i + rows; i < end; ++i) {
          const double log_sum = std::log(static_cast<double>(se[i]));
          out[i] = static_cast<T>(log_sum + static_cast<double>(m[i]));
          if (t[static_cast<std::size_t>(i)] != ignore_) block += log_sum - static_cast<double>(st[i]);
        }
        blocks.push(static_cast<T>(block / divisor_));
      }
      loss = Tensor::scalar(static_cast<double>(blocks.root()), logits.dtype());
    });
    save_for_backward({logits, lse});
    return {loss};
  }

  // d loss / d logits[i, j] = (softmax[i, j] - [j is target]) / divisor, 0 for ignored rows. Local.
  TensorList backward(const TensorList& g) override {
    const Tensor& logits = saved()[0];
    const Tensor& lse = saved()[1];
    const std::int64_t n = logits.size(0), vl = logits.size(1);
    const double scale = g[0].item() / divisor_;
    const auto t = targets_.to_int64_vector();
    Tensor grad = Tensor::empty(logits.shape(), logits.dtype());
    dispatch_floating(logits.dtype(), name(), [&]<class T>() {
      const T* l = logits.data<T>();
      const T* s = lse.data<T>();
      T* d = grad.data<T>();
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t target = t[static_cast<std::size_t>(i)];
        if (target == ignore_) {
          std::fill(d + i * vl, d + (i + 1) * vl, T(0));
          continue;
        }
        kernels::exp_shifted_scaled(l + i * vl, vl, s[i], static_cast<T>(scale), d + i * vl);
        if (target >= offset_ && target < offset_ + vl) d[i * vl + (target - offset_)] -= static_cast<T>(scale);
      }
    });
    return {grad};
  }

 private:
  Tensor targets_;
  std::int64_t offset_, vocab_;
  dist::ProcessGroup tp_;
  double divisor_;
  std::int64_t ignore_;
  dist::ReduceOrder order_;
  std::optional<tree::SplitPlan> blocks_;
  std::vector<std::int64_t> row_blocks_;   // of the rows, for the loss's sum (empty: one)
};

// y = x * mask, mask[i] = 0 or 1/(1-p) from the global index of element i.
class GlobalDropoutFn final : public Function {
 public:
  explicit GlobalDropoutFn(Tensor mask) : mask_(std::move(mask)) {}
  std::string_view name() const override { return "dropout"; }
  TensorList forward(const TensorList& x) override { return {kernels::binary(kernels::Binary::Mul, x[0], mask_)}; }
  TensorList backward(const TensorList& g) override { return {kernels::binary(kernels::Binary::Mul, g[0], mask_)}; }

 private:
  Tensor mask_;
};

}  // namespace

Tensor vocab_parallel_cross_entropy(const Tensor& logits_local, const Tensor& targets, std::int64_t vocab_offset,
                                    std::int64_t vocab, const dist::ProcessGroup& tp, double divisor,
                                    std::int64_t ignore_index, const tree::SplitPlan* vocab_blocks,
                                    dist::ReduceOrder order, const std::vector<std::int64_t>& row_blocks) {
  check_floating(logits_local, "vocab_parallel_cross_entropy");
  check_dtype(targets, DType::Int64, "vocab_parallel_cross_entropy", "targets");
  MG_CHECK(logits_local.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits_local.size(0),
           "vocab_parallel_cross_entropy: logits {} and targets {} must be [N, V_local] and [N]",
           shape_str(logits_local.shape()), shape_str(targets.shape()));
  MG_CHECK(divisor > 0, "vocab_parallel_cross_entropy: divisor must be positive, got {}", divisor);
  dist::CommLabelScope label("loss");
  trace::Scope scope("loss");
  return autograd::apply<VocabParallelCrossEntropyFn>({logits_local}, targets.contiguous(), vocab_offset, vocab, tp,
                                                      divisor, ignore_index, vocab_blocks, order, row_blocks)[0];
}

Tensor dropout_global(const Tensor& x, double p, std::uint64_t seed, const Shape& global_shape,
                      const std::vector<std::int64_t>& offsets) {
  MG_CHECK(p >= 0 && p < 1, "dropout: p must be in [0, 1), got {}", p);
  if (p == 0) return x;
  MG_CHECK(offsets.size() == global_shape.size() && x.dim() == static_cast<int>(global_shape.size()),
           "dropout: piece {} with offsets of {} dims in a global tensor {}", shape_str(x.shape()), offsets.size(),
           shape_str(global_shape));
  random::Box box;
  for (std::size_t d = 0; d < offsets.size(); ++d) box.push_back({offsets[d], x.shape()[d]});
  Tensor u = random::rand(global_shape, seed, DType::Float64, 0.0, 1.0, box);
  std::vector<double> keep = u.to_vector();
  const double scale = 1.0 / (1.0 - p);
  for (double& v : keep) v = v < p ? 0.0 : scale;
  return autograd::apply<GlobalDropoutFn>({x}, Tensor::from_values(keep, x.shape(), x.dtype()))[0];
}

}  // namespace meshgrad::nn
