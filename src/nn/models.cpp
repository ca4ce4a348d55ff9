// The models: a GPT-2 (pre-LN, learned positions, GELU tanh, tied embedding and output) and a
// stack of Megatron MLPs, both tensor-parallel on the mesh's tp axis.
#include <cmath>

#include "meshgrad/autograd/checkpoint.hpp"
#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/mappings.hpp"
#include "meshgrad/nn/fsdp.hpp"
#include "meshgrad/nn/invariant.hpp"
#include "meshgrad/nn/layers.hpp"
#include "meshgrad/nn/tied_weight.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/trace.hpp"

namespace meshgrad::nn {

namespace {

// Offsets of this rank's piece of a [T, B, C] activation: sharded along T under SP.
std::vector<std::int64_t> activation_offsets(const ParallelContext& ctx, std::int64_t seq) {
  // 1-D under SP only; a 2-D grid keeps activations replicated.
  const std::int64_t t0 = ctx.sequence_parallel() ? shard_range(seq, ctx.tp_size(), ctx.tp_rank()).offset : 0;
  return {t0, 0, 0};
}

// ---- GPT ------------------------------------------------------------------------------------------

// Sizes the tensor-parallel split must respect, checked before any layer is built so the message
// says what is wrong (not a shard extent deep inside a layer).
void check_split(const ModelConfig& cfg, const ParallelContext& ctx) {
  MG_CHECK(cfg.hidden % cfg.heads == 0, "gpt: --hidden {} is not divisible by --heads {} (each head needs a whole "
           "number of features)", cfg.hidden, cfg.heads);
  const int head_split = ctx.two_d ? ctx.col().size() : ctx.tp_size();
  MG_CHECK(head_split <= cfg.heads, "gpt: {} ranks split the attention heads but there are only {} heads (--heads): "
           "use at most {} ranks on that axis ({})", head_split, cfg.heads, cfg.heads,
           ctx.two_d ? "tp_col, the C of tp=RxC" : "tp");
  if (ctx.two_d) {
    MG_CHECK(ctx.row().size() <= cfg.hidden, "gpt: tp_row = {} ranks split --hidden {} features", ctx.row().size(),
             cfg.hidden);
  }
}

// 1-D: column-parallel c_attn (heads split over tp) and row-parallel c_proj.
// 2-D: c_attn splits C over tp_row and the heads over tp_col; c_proj takes the heads over tp_col
// and splits its output over tp_row, then the output is all-gathered over tp_row. The attention
// itself runs on this column's heads (the same on every row of the grid).
class Attention {
 public:
  Attention(const std::string& name, const ModelConfig& cfg, const ParallelContextPtr& ctx, std::uint64_t seed)
      : name_(name), head_dim_(cfg.hidden / cfg.heads), ctx_(ctx) {
    const double proj_std = 0.02 / std::sqrt(2.0 * cfg.layers);
    if (ctx->two_d) {
      grid_attn_ = std::make_unique<GridLinear>(name + ".c_attn", cfg.hidden, 3 * cfg.hidden, /*in_on_rows=*/true,
                                                GridLinear::Options{.blocks = 3, .out_unit = head_dim_}, ctx, seed,
                                                cfg.dtype);
      grid_proj_ = std::make_unique<GridLinear>(name + ".c_proj", cfg.hidden, cfg.hidden, /*in_on_rows=*/false,
                                                GridLinear::Options{.input_is_split = true, .in_unit = head_dim_,
                                                                    .init_std = proj_std},
                                                ctx, seed, cfg.dtype);
    } else {
      c_attn_ = std::make_unique<ColumnParallelLinear>(
          name + ".c_attn", cfg.hidden, 3 * cfg.hidden,
          ColumnParallelLinear::Options{.bias = true, .gather_output = false, .blocks = 3, .unit = head_dim_, .init_std = 0.02},
          ctx, seed, cfg.dtype);
      c_proj_ = std::make_unique<RowParallelLinear>(
          name + ".c_proj", cfg.hidden, cfg.hidden,
          RowParallelLinear::Options{.bias = true, .input_is_parallel = true, .unit = head_dim_, .init_std = proj_std},
          ctx, seed, cfg.dtype);
    }
  }

  // x: [T(_local), B, C] -> same.
  Tensor forward(const Tensor& x, std::int64_t seq) const {
    trace::Scope scope(name_);
    const Heads h = project_heads(x, seq);
    return project_output(causal_attention(h.q, h.k, h.v), seq);
  }

  // Inference with a key/value cache (Model::decode; no graph, no sequence parallelism).
  // x: [T_new, B, C], the positions start .. start + T_new - 1. This rank's heads' keys and values
  // are written into the cache buffers keys, values [B, H_local, capacity, D] at those positions;
  // the queries attend to positions 0 .. their own. scores += the q . k products computed.
  Tensor forward_cached(const Tensor& x, const Tensor& keys, const Tensor& values, std::int64_t start,
                        std::int64_t& scores) const {
    const std::int64_t t_new = x.size(0);
    const Heads h = project_heads(x, t_new);
    Tensor k_new = keys.narrow(2, start, t_new), v_new = values.narrow(2, start, t_new);
    k_new.copy_from(h.k);
    v_new.copy_from(h.v);
    const kernels::AttentionForward y =
        kernels::causal_attention_forward(h.q, keys.narrow(2, 0, start + t_new), values.narrow(2, 0, start + t_new),
                                          1.0 / std::sqrt(static_cast<double>(head_dim_)));
    scores += y.scores;
    return project_output(y.out, t_new);
  }
  // Heads this rank computes (c_attn's output columns are split in whole heads per q, k, v block).
  std::int64_t local_heads() const {
    const Parameter& bias = ctx_->two_d ? grid_attn_->bias : c_attn_->bias;
    return bias.operand_shape()[0] / 3 / head_dim_;
  }
  std::int64_t head_dim() const { return head_dim_; }
  void collect(std::vector<Parameter*>& out) {
    if (ctx_->two_d) {
      for (Parameter* p : {&grid_attn_->weight, &grid_attn_->bias, &grid_proj_->weight, &grid_proj_->bias}) out.push_back(p);
    } else {
      for (Parameter* p : {&c_attn_->weight, &c_attn_->bias, &c_proj_->weight, &c_proj_->bias}) out.push_back(p);
    }
  }

 private:
  struct Heads {
    Tensor q, k, v;   // [B, H_local, T, D], contiguous
  };
  // c_attn and the split into this rank's heads: x [T(_local), B, C] -> q, k, v.
  Heads project_heads(const Tensor& x, std::int64_t seq) const {
    const Tensor qkv = ctx_->two_d ? grid_attn_->forward(x) : c_attn_->forward(x, seq);   // [T, B, 3 * H_local * D]
    const std::int64_t b = qkv.size(1);
    const std::int64_t local = qkv.size(2) / 3;
    const std::int64_t heads = local / head_dim_;
    auto heads_first = [&](const Tensor& t) {          // [T, B, H_l * D] -> [B, H_l, T, D]
      return contiguous(permute(reshape(t, {seq, b, heads, head_dim_}), {1, 2, 0, 3}));
    };
    const TensorList parts = split(qkv, 2, {local, local, local});
    return {heads_first(parts[0]), heads_first(parts[1]), heads_first(parts[2])};
  }
  // The heads' outputs merged and c_proj: y [B, H_local, T, D] -> [T(_local), B, C].
  Tensor project_output(const Tensor& y, std::int64_t seq) const {
    const std::int64_t b = y.size(0), local = y.size(1) * head_dim_;
    const Tensor merged = reshape(contiguous(permute(y, {2, 0, 1, 3})), {seq, b, local});
    if (!ctx_->two_d) return c_proj_->forward(merged);
    // [T, B, C over tp_row] -> the whole [T, B, C] on every rank.
    return grid_proj_->forward_gathered(merged);
  }

  std::string name_;   // its trace scope
  std::int64_t head_dim_;
  ParallelContextPtr ctx_;
  std::unique_ptr<ColumnParallelLinear> c_attn_;
  std::unique_ptr<RowParallelLinear> c_proj_;
  std::unique_ptr<GridLinear> grid_attn_, grid_proj_;
};

// 1-D: Megatron's column (h -> f) + GELU + row (f -> h).
// 2-D: c_fc splits h over tp_row and f over tp_col; c_proj takes f over tp_col and splits h over
// tp_row; the output is all-gathered over tp_row.
class Mlp {
 public:
  Mlp(const std::string& name, std::int64_t hidden, std::int64_t ffn, int layers, const ParallelContextPtr& ctx,
      std::uint64_t seed, DType dtype)
      : name_(name), ctx_(ctx) {
    const double proj_std = 0.02 / std::sqrt(2.0 * layers);
    if (ctx->two_d) {
      grid_fc_ = std::make_unique<GridLinear>(name + ".c_fc", hidden, ffn, true, GridLinear::Options{}, ctx, seed, dtype);
      grid_proj_ = std::make_unique<GridLinear>(name + ".c_proj", ffn, hidden, false,
                                                GridLinear::Options{.input_is_split = true, .init_std = proj_std}, ctx,
                                                seed, dtype);
    } else {
      c_fc_ = std::make_unique<ColumnParallelLinear>(name + ".c_fc", hidden, ffn, ColumnParallelLinear::Options{}, ctx,
                                                     seed, dtype);
      c_proj_ = std::make_unique<RowParallelLinear>(name + ".c_proj", ffn, hidden,
                                                    RowParallelLinear::Options{.init_std = proj_std}, ctx, seed, dtype);
    }
  }
  Tensor forward(const Tensor& x, std::int64_t seq) const {
    trace::Scope scope(name_);
    if (!ctx_->two_d) return c_proj_->forward(gelu(c_fc_->forward(x, seq)));
    return grid_proj_->forward_gathered(gelu(grid_fc_->forward(x)));
  }
  void collect(std::vector<Parameter*>& out) {
    if (ctx_->two_d) {
      for (Parameter* p : {&grid_fc_->weight, &grid_fc_->bias, &grid_proj_->weight, &grid_proj_->bias}) out.push_back(p);
    } else {
      for (Parameter* p : {&c_fc_->weight, &c_fc_->bias, &c_proj_->weight, &c_proj_->bias}) out.push_back(p);
    }
  }

 private:
  std::string name_;   // its trace scope
  ParallelContextPtr ctx_;
  std::unique_ptr<ColumnParallelLinear> c_fc_;
  std::unique_ptr<RowParallelLinear> c_proj_;
  std::unique_ptr<GridLinear> grid_fc_, grid_proj_;
};

class Block {
 public:
  // reductions: the model's FSDP units share it (FsdpUnit).
  // last_in_backward: the first block of a pipeline stage without the model's own unit (a middle
  // stage): its backward ends the stage's, so its FSDP unit delivers every reduction.
  Block(int index, const ModelConfig& cfg, const ParallelContextPtr& ctx, std::uint64_t seed,
        const std::shared_ptr<FsdpReductions>& reductions = nullptr, bool last_in_backward = false)
      : prefix_(fmt::format("h.{}", index)),
        ln_1_(prefix_ + ".ln_1", cfg.hidden, cfg.layer_norm_epsilon, ctx, cfg.dtype),
        attn_(prefix_ + ".attn", cfg, ctx, seed),
        ln_2_(prefix_ + ".ln_2", cfg.hidden, cfg.layer_norm_epsilon, ctx, cfg.dtype),
        mlp_(prefix_ + ".mlp", cfg.hidden, cfg.ffn_size(), cfg.layers, ctx, seed, cfg.dtype), ctx_(ctx) {
    if (ctx->fsdp_active()) {
      std::vector<Parameter*> params;
      collect(params);
      fsdp_ = std::make_unique<FsdpUnit>(prefix_, std::move(params), ctx, reductions, last_in_backward);
    }
  }

  // The block's FSDP unit (nullptr without FSDP).
  FsdpUnit* fsdp() const { return fsdp_.get(); }

  // x: [T(_local), B, C]; dropout_seed(): the next dropout seed (same sequence on every rank).
  Tensor forward(const Tensor& x, std::int64_t seq, const std::function<Tensor(const Tensor&)>& dropout) const {
    dist::CommLabelScope label(prefix_);
    trace::Scope scope(prefix_);
    // Its parameters gathered for this forward; given back after it unless a graph will read them
    // before a regather (see ParallelContext::reshard_after_forward).
    const FsdpForwardScope gathered(fsdp_.get(), !autograd::GradMode::is_enabled() || ctx_->reshard_after_forward());
    const Tensor h = add(x, dropout(attn_.forward(ln_1_.forward(x, seq), seq)));
    return add(h, dropout(mlp_.forward(ln_2_.forward(h, seq), seq)));
  }
  // Inference (Model::decode): x [T_new, B, C] at positions start ..; keys, values: this block's cache.
  Tensor forward_cached(const Tensor& x, const Tensor& keys, const Tensor& values, std::int64_t start,
                        std::int64_t& scores) const {
    dist::CommLabelScope label(prefix_);
    const FsdpForwardScope gathered(fsdp_.get(), /*release=*/true);
    const Tensor h = add(x, attn_.forward_cached(ln_1_.forward(x), keys, values, start, scores));
    return add(h, mlp_.forward(ln_2_.forward(h), x.size(0)));
  }
  const Attention& attention() const { return attn_; }
  void collect(std::vector<Parameter*>& out) {
    out.push_back(&ln_1_.weight);
    out.push_back(&ln_1_.bias);
    attn_.collect(out);
    out.push_back(&ln_2_.weight);
    out.push_back(&ln_2_.bias);
    mlp_.collect(out);
  }

 private:
  std::string prefix_;
  LayerNorm ln_1_;
  Attention attn_;
  LayerNorm ln_2_;
  Mlp mlp_;
  ParallelContextPtr ctx_;
  std::unique_ptr<FsdpUnit> fsdp_;
};

// What the dropout of a GPT needs, owned jointly by the model and by the closures a checkpointed
// block keeps for its recomputation (so a node never points into a model that moved or died).
struct DropoutState {
  double p = 0;
  bool training = true;
  ParallelContextPtr ctx;
  random::Generator gen;
};

class Gpt final : public Model {
 public:
  Gpt(const ModelConfig& cfg, const ParallelConfig& parallel, dist::DeviceMeshPtr mesh, std::uint64_t seed)
      : cfg_(cfg), ctx_(ParallelContext::on(std::move(mesh), parallel)),
        ln_f_("ln_f", cfg.hidden, cfg.layer_norm_epsilon, ctx_, cfg.dtype),
        dropout_(std::make_shared<DropoutState>(DropoutState{cfg.dropout, true, ctx_, random::Generator(seed ^ 0xD50F)})) {
    check_split(cfg, *ctx_);
    invariant::check_model(cfg, *ctx_);
    const std::vector<int> counts = stage_layer_counts(cfg.layers, ctx_->pp_size(), parallel.pp_layers);
    stage_.index = ctx_->pp_rank();
    stage_.count = ctx_->pp_size();
    for (int s = 0; s < stage_.index; ++s) stage_.first_block += counts[static_cast<std::size_t>(s)];
    stage_.end_block = stage_.first_block + counts[static_cast<std::size_t>(stage_.index)];
    // Every parameter is built with its global name and seed, so a stage's are the one-rank model's.
    // The first stage holds wte (a parameter) and wpe; the last holds ln_f and a copy of wte for the
    // tied output layer (a parameter only when it is also the first).
    if (stage_.is_first() || stage_.is_last()) {
      wte_ = std::make_unique<VocabParallelEmbedding>("wte", cfg.vocab, cfg.hidden, ctx_, seed, cfg.dtype);
    }
    if (stage_.is_first()) {
      wpe_ = make_parameter("wpe.weight", {cfg.n_positions(), cfg.hidden}, ctx_->replicated(), *ctx_, seed, 0.02, 0.0,
                            cfg.dtype);
    }
    tied_ = std::make_unique<TiedWeight>("wte", ctx_, stage_);
    const std::shared_ptr<FsdpReductions> reductions = ctx_->fsdp_active() ? FsdpUnit::new_reductions() : nullptr;
    // The unit gathered first in a stage's forward comes last in its backward and delivers every
    // reduction: the model's own (below) where the stage has one, else the stage's first block.
    const bool has_own_unit = stage_.is_first() || stage_.is_last();
    for (int i = stage_.first_block; i < stage_.end_block; ++i) {
      const bool last_in_backward = !has_own_unit && i == stage_.first_block;
      blocks_.push_back(std::make_shared<Block>(i, cfg_, ctx_, seed, reductions, last_in_backward));
    }
    ColumnParallelLinear::Options o;
    o.bias = false;
    o.owns_weight = false;   // the LM head's weight is wte^T
    lm_head_ = std::make_unique<ColumnParallelLinear>("lm_head", cfg_.hidden, cfg_.vocab, o, ctx_, 0, cfg_.dtype);
    if (ctx_->fsdp_active()) {
      // The model's own parameters are one unit, gathered for the whole forward and backward: the
      // tied wte is used at both ends, and its two gradients must meet unsharded (dp's sum). In a
      // pipeline each end has its own: the first stage's (wte, wpe), the last stage's (ln_f); each is
      // gathered first in its stage's forward (forward_stage), so it comes last in backward.
      std::vector<Parameter*> own;
      if (stage_.is_first()) own = {&wte_->weight, &wpe_};
      if (stage_.is_last()) {
        own.push_back(&ln_f_.weight);
        own.push_back(&ln_f_.bias);
      }
      if (!own.empty()) {
        root_unit_ = std::make_unique<FsdpUnit>("gpt", std::move(own), ctx_, reductions, /*last_in_backward=*/true);
      }
    }
  }
  Gpt(const Gpt&) = delete;
  Gpt& operator=(const Gpt&) = delete;

  Tensor loss(const Batch& batch, std::int64_t global_tokens) override {
    // loss() runs the whole model on this rank. A pipeline's stages run through
    // pipeline/executor.hpp (train, evaluate, grads, check and explain all do), never through here.
    MG_CHECK(stage_.count == 1, "gpt: the mesh {} is a pipeline of {} stages (this rank holds blocks {}..{}): "
             "loss() runs the whole model; run a pipeline's step through pipeline::run_step",
             ctx_->mesh->str(), stage_.count, stage_.first_block, stage_.end_block - 1);
    return forward_stage(batch, Tensor(), global_tokens);
  }

  PipelineStage stage() const override { return stage_; }

  Shape stage_input_shape(const Batch& batch) const override {
    const std::int64_t b = batch.inputs.size(0), seq = batch.inputs.size(1);
    const ParallelContext& ctx = *ctx_;
    const std::int64_t t_local = ctx.sequence_parallel() ? shard_range(seq, ctx.tp_size(), ctx.tp_rank()).size : seq;
    return {t_local, b, cfg_.hidden};
  }

  void refresh_stage_copies() override {
    if (stage_.count == 1) return;
    tied_->refresh_copy(stage_.is_first() ? wte_->weight.value : Tensor(),
                        stage_.is_last() ? wte_->weight.value : Tensor());
  }

  Tensor forward_stage(const Batch& batch, const Tensor& input, std::int64_t global_tokens) override {
    check_dtype(batch.inputs, DType::Int64, "gpt", "inputs");
    check_dtype(batch.targets, DType::Int64, "gpt", "targets");
    MG_CHECK(batch.inputs.dim() == 2 && batch.targets.shape() == batch.inputs.shape(),
             "gpt: inputs {} and targets {} must both be [B, T]", shape_str(batch.inputs.shape()),
             shape_str(batch.targets.shape()));
    const std::int64_t b = batch.inputs.size(0), seq = batch.inputs.size(1), c = cfg_.hidden;
    MG_CHECK(seq >= 1 && b >= 1, "gpt: a batch needs at least one row and one position, got [B, T] = [{}, {}]", b, seq);
    MG_CHECK(seq <= cfg_.n_positions(), "gpt: sequence length {} exceeds n_positions {}", seq, cfg_.n_positions());
    if (stage_.is_first()) check_tokens(batch.inputs, "input", /*ignore_allowed=*/false);
    if (stage_.is_last()) check_tokens(batch.targets, "target", /*ignore_allowed=*/true);
    MG_CHECK(stage_.is_first() != input.defined(), "gpt stage {} of {}: {}", stage_.index, stage_.count,
             stage_.is_first() ? "the first stage embeds the tokens and takes no input activation"
                               : "a later stage needs the activation of the stage before it");
    if (input.defined()) {
      MG_CHECK(input.shape() == stage_input_shape(batch) && input.dtype() == cfg_.dtype, "gpt stage {}: the input "
               "activation is {} {}, expected {} {}", stage_.index, shape_str(input.shape()), dtype_name(input.dtype()),
               shape_str(stage_input_shape(batch)), dtype_name(cfg_.dtype));
    }
    const ParallelContext& ctx = *ctx_;
    trace::Scope model_scope("gpt");   // ops between the layers (positions, dropout) belong to it
    const bool recording = autograd::GradMode::is_enabled();
    const FsdpForwardScope root_gathered(root_unit_.get(), /*release=*/!recording);

    // Holds the shared state, not the model: a checkpointed block calls it again during backward.
    const std::shared_ptr<DropoutState> state = dropout_;
    // Masks by global index: the row offset and row count of the global batch (dp replicas and
    // micro-batches hold slices of it), the sequence offset under SP.
    const std::int64_t rows = batch.global_rows > 0 ? batch.global_rows : b;
    const std::int64_t row0 = batch.global_rows > 0 ? batch.row_offset : 0;
    MG_CHECK(row0 >= 0 && row0 + b <= rows, "gpt: batch rows [{}, {}) lie outside its global batch of {} rows", row0, row0 + b, rows);
    const std::function<Tensor(const Tensor&)> dropout = [state, seq, rows, row0, c](const Tensor& x) {
      if (!state->training || state->p == 0) return x;
      std::vector<std::int64_t> offsets = activation_offsets(*state->ctx, seq);
      offsets[1] = row0;
      return dropout_global(x, state->p, state->gen.next_seed(), {seq, rows, c}, offsets);
    };
    // A stage draws the dropout seeds the whole model draws for its layers: one for the embedding,
    // two per block (dropout_draws), and leaves the stream where the whole model's forward does.
    const bool draws = state->training && state->p > 0;
    const std::uint64_t stream_start = state->gen.counter();
    if (draws) state->gen.set_counter(stream_start + (stage_.is_first() ? 0 : dropout_draws(stage_.first_block)));

    Tensor h = stage_.is_first() ? embed(batch, dropout) : input;
    if (!blocks_.empty() && blocks_[0]->fsdp()) blocks_[0]->fsdp()->prefetch();
    for (std::size_t i = 0; i < blocks_.size(); ++i) {
      const std::shared_ptr<const Block> block = blocks_[i];
      // FSDP: the next block's gathers run while this one computes.
      if (i + 1 < blocks_.size() && blocks_[i + 1]->fsdp()) blocks_[i + 1]->fsdp()->prefetch();
      if (ctx.config.checkpoint_blocks) {
        h = autograd::checkpoint(
            [block, seq, dropout](const TensorList& in) { return TensorList{block->forward(in[0], seq, dropout)}; },
            {h}, {&state->gen})[0];
      } else {
        h = block->forward(h, seq, dropout);
        if (block->fsdp() && recording && ctx.reshard_after_forward()) {
          // Its backward finds the block's parameters gathered again, and the previous block's on the way.
          h = block->fsdp()->regather_before_backward(h, i > 0 ? blocks_[i - 1]->fsdp() : nullptr);
        }
      }
    }
    if (draws) state->gen.set_counter(stream_start + dropout_draws(cfg_.layers));
    if (!stage_.is_last()) return h;
    h = ln_f_.forward(h, seq);

    // Tied output layer: column-parallel over the vocabulary with wte^T; logits stay sharded.
    Tensor head;
    {
      dist::CommLabelScope label("lm_head");   // a pipeline's tied gradient goes to the first stage from here
      head = tied_->output_use(stage_.is_first() ? wte_->weight.operand() : tied_copy());
    }
    const Tensor logits = lm_head_->forward_with(h, seq, transpose(head, 0, 1), Tensor());   // [T, B, V_local]
    const Tensor targets = batch.targets.transpose(0, 1).contiguous().view({-1});
    const Tensor loss = vocab_parallel_cross_entropy(reshape(logits, {-1, logits.size(2)}), targets,
                                                     wte_->vocab_offset(), cfg_.vocab, ctx.tp,
                                                     static_cast<double>(global_tokens), -100, &lm_head_->plan(),
                                                     ctx.reduce_order());
    return ctx.loss_partial_over_dp(loss);
  }

  // The last stage's copy of wte, as the output layer uses it: this rank's tp piece. With parameters
  // sharded over fsdp (or dp under --shard-optimizer) the copy holds this rank's rows like the first
  // stage's shard it is refreshed from, and is gathered here (not differentiable: the gradient goes
  // to the first stage, nn/tied_weight.hpp).
  Tensor tied_copy() const {
    const Tensor& shard = wte_->weight.value;
    if (ctx_->fsdp_axis < 0 || ctx_->mesh->axis_size(ctx_->fsdp_axis) == 1) return shard;
    const dist::ProcessGroup& group = ctx_->mesh->group(ctx_->fsdp_axis);
    const Shape piece = wte_->weight.operand_shape();
    Tensor gathered;
    {
      autograd::NoGradGuard no_grad;
      gathered = dist::all_gather(shard.detach(), group, 0, shard_sizes(piece[0], group.size()));
    }
    gathered.set_requires_grad(true);
    return gathered;
  }

  // Dropout seeds the forward draws before block `block` (the embedding's one, two per block).
  static std::uint64_t dropout_draws(int block) { return 1 + 2 * static_cast<std::uint64_t>(block); }

  // The first stage's layers before the blocks: [T(_local), B, C], dropout applied.
  Tensor embed(const Batch& batch, const std::function<Tensor(const Tensor&)>& dropout) const {
    const ParallelContext& ctx = *ctx_;
    const bool sp = ctx.sequence_parallel();
    const std::int64_t seq = batch.inputs.size(1), c = cfg_.hidden;
    const Tensor ids = batch.inputs.transpose(0, 1).contiguous();    // [T, B]
    // Embedding: vocab-parallel partial sums, reduced over tp (all-reduce, or reduce-scatter along
    // the sequence under SP), plus positions.
    Tensor h;
    {
      dist::CommLabelScope label("wte");
      trace::Scope scope("wte");
      const Tensor partial = wte_->forward_partial(ids, tied_->embedding_use(wte_->weight.operand()));   // [T, B, C]
      h = sp ? dist::reduce_scatter_to_sequence(partial, ctx.tp, 0) : dist::reduce_from_region(partial, ctx.tp);
    }
    const std::int64_t t0 = activation_offsets(ctx, seq)[0];
    const std::int64_t t_local = h.size(0);
    Tensor pos = reshape(narrow(wpe_.operand(), 0, t0, t_local), {t_local, 1, c});
    h = add(h, sp ? ctx.partial_over_tp(pos) : pos);
    return dropout(h);
  }

  // Every token of a [B, T] batch tensor in [0, vocab) (a target may be the ignore index -100), or an
  // error naming the row and position of the first that is not (the layers see [T, B] and would
  // name a flat index of that).
  void check_tokens(const Tensor& t, const char* what, bool ignore_allowed) const {
    const std::vector<std::int64_t> v = t.to_int64_vector();
    const std::int64_t cols = t.size(1);
    for (std::size_t i = 0; i < v.size(); ++i) {
      if ((v[i] >= 0 && v[i] < cfg_.vocab) || (ignore_allowed && v[i] == -100)) continue;
      throw InvalidArgument(fmt::format("gpt: {} token {} at batch row {}, position {} is outside the vocabulary [0, {})",
                                        what, v[i], static_cast<std::int64_t>(i) / cols,
                                        static_cast<std::int64_t>(i) % cols, cfg_.vocab));
    }
  }

  // This stage's parameters, in the one-rank model's order (a pipeline's stages, concatenated in
  // stage order, list every parameter once: the last stage's wte copy is not one).
  std::vector<Parameter*> parameters() override {
    std::vector<Parameter*> out;
    if (stage_.is_first()) {
      out.push_back(&wte_->weight);
      out.push_back(&wpe_);
    }
    for (auto& b : blocks_) b->collect(out);
    if (stage_.is_last()) {
      out.push_back(&ln_f_.weight);
      out.push_back(&ln_f_.bias);
    }
    return out;
  }
  const ModelConfig& config() const override { return cfg_; }
  void set_training(bool training) override { dropout_->training = training; }
  std::uint64_t random_state() const override { return dropout_->gen.counter(); }
  dist::ReduceOrder reduce_order() const override { return ctx_->reduce_order(); }
  void set_random_state(std::uint64_t state) override { dropout_->gen.set_counter(state); }
  void set_accumulating(bool on) override {
    tied_->set_accumulating(on);
    if (root_unit_) root_unit_->set_accumulating(on);
    for (const auto& b : blocks_) {
      if (b->fsdp()) b->fsdp()->set_accumulating(on);
    }
  }

  KvCache new_cache(std::int64_t batch) override {
    check_one_stage("new_cache");
    MG_CHECK(batch >= 1, "gpt: a key/value cache needs at least one sequence, got batch {}", batch);
    KvCache cache;
    cache.batch = batch;
    cache.capacity = cfg_.n_positions();
    for (const auto& block : blocks_) {
      const Attention& attn = block->attention();
      const Shape shape{batch, attn.local_heads(), cache.capacity, attn.head_dim()};
      cache.keys.push_back(Tensor::empty(shape, cfg_.dtype));     // positions >= length are never read
      cache.values.push_back(Tensor::empty(shape, cfg_.dtype));
    }
    return cache;
  }

  // The forward of loss() on the new positions only, every block reading the earlier positions'
  // keys and values from the cache instead of recomputing them.
  Tensor decode(const Tensor& ids, KvCache& cache, bool all_positions) override {
    check_one_stage("decode");
    check_dtype(ids, DType::Int64, "gpt decode", "ids");
    MG_CHECK(cache.keys.size() == blocks_.size() && cache.values.size() == blocks_.size() &&
                 cache.capacity == cfg_.n_positions() && cache.length >= 0 && cache.length <= cache.capacity,
             "gpt decode: the cache ({} blocks, capacity {}) was not made by this model's new_cache ({} blocks, "
             "n_positions {})", cache.keys.size(), cache.capacity, blocks_.size(), cfg_.n_positions());
    MG_CHECK(ids.dim() == 2 && ids.size(0) == cache.batch && ids.size(1) >= 1,
             "gpt decode: ids must be int64 [B, T_new] with B = {} (the cache's) and T_new >= 1, got {}", cache.batch,
             shape_str(ids.shape()));
    const ParallelContext& ctx = *ctx_;
    MG_CHECK(!ctx.sequence_parallel(), "gpt decode: the model was built with sequence parallelism, a training "
             "layout; build it without (ParallelConfig::sequence_parallel = false) to decode");
    const std::int64_t b = ids.size(0), t_new = ids.size(1), start = cache.length, c = cfg_.hidden;
    MG_CHECK(start + t_new <= cfg_.n_positions(), "gpt decode: positions {} .. {} do not fit in n_positions = {} "
             "(the cache holds {})", start, start + t_new - 1, cfg_.n_positions(), start);
    autograd::NoGradGuard no_grad;
    const FsdpForwardScope root_gathered(root_unit_.get(), /*release=*/true);
    const Tensor tids = ids.transpose(0, 1).contiguous();   // [T_new, B]
    Tensor h;
    {
      dist::CommLabelScope label("wte");
      h = dist::reduce_from_region(wte_->forward_partial(tids), ctx.tp);   // [T_new, B, C]
    }
    h = add(h, reshape(narrow(wpe_.operand(), 0, start, t_new), {t_new, 1, c}));
    for (std::size_t l = 0; l < blocks_.size(); ++l) {
      h = blocks_[l]->forward_cached(h, cache.keys[l], cache.values[l], start, cache.attention_scores);
    }
    if (!all_positions) h = narrow(h, 0, t_new - 1, 1);   // only the last position's logits are wanted
    h = ln_f_.forward(h);
    const std::int64_t rows = h.size(0);
    const Tensor local = lm_head_->forward_with(h, rows, transpose(wte_->weight.operand(), 0, 1), Tensor());   // [T', B, V_local]
    Tensor logits;
    {
      dist::CommLabelScope label("lm_head");
      logits = dist::gather_from_region(local, ctx.tp, -1, cfg_.vocab);   // [T', B, V] on every rank
    }
    cache.length = start + t_new;
    logits = permute(logits, {1, 0, 2}).contiguous();   // [B, T', V]
    return all_positions ? logits : logits.view({b, cfg_.vocab});
  }

 private:
  void check_one_stage(const char* what) const {
    MG_CHECK(stage_.count == 1, "gpt {}: incremental decoding runs the whole model on one stage, and this mesh has a "
             "pipeline of {} stages (sample and generate on a mesh without pp)", what, stage_.count);
  }

  ModelConfig cfg_;
  ParallelContextPtr ctx_;
  PipelineStage stage_;
  std::unique_ptr<VocabParallelEmbedding> wte_;   // the first and the last stage (a copy there)
  Parameter wpe_;                                  // the first stage
  std::unique_ptr<TiedWeight> tied_;
  std::vector<std::shared_ptr<Block>> blocks_;   // shared with checkpointed regions' closures
  LayerNorm ln_f_;
  std::unique_ptr<ColumnParallelLinear> lm_head_;      // no weight of its own
  std::shared_ptr<DropoutState> dropout_;
  std::unique_ptr<FsdpUnit> root_unit_;   // FSDP: wte, wpe, ln_f (the blocks have their own)
};

// ---- MLP stack --------------------------------------------------------------------------------------

// `layers` MLPs (1-D: column h -> f, GELU, row f -> h; 2-D: two grid linears) on a fixed random
// input [T, B, H] (sequence-sharded under SP); loss = sum of squares of the output /
// (global_tokens * H) (the mean square, as the peer benchmark torch_tp_mlp.py uses).
class MlpModel final : public Model {
 public:
  MlpModel(const ModelConfig& cfg, const ParallelConfig& parallel, dist::DeviceMeshPtr mesh, std::uint64_t seed)
      : cfg_(cfg), ctx_(ParallelContext::on(std::move(mesh), parallel)), seed_(seed) {
    invariant::check_model(cfg, *ctx_);
    MG_CHECK(ctx_->pp_size() == 1, "mlp: the MLP stack has no pipeline stages ({}): use a mesh without pp",
             ctx_->mesh->str());
    for (int i = 0; i < cfg.layers; ++i) {
      mlps_.push_back(std::make_unique<Mlp>(fmt::format("h.{}.mlp", i), cfg.hidden, cfg.ffn_size(), cfg.layers, ctx_,
                                            seed, cfg.dtype));
    }
    if (ctx_->fsdp_active()) unit_ = std::make_unique<FsdpUnit>("mlp_stack", parameters(), ctx_);   // one unit
  }
  MlpModel(const MlpModel&) = delete;
  MlpModel& operator=(const MlpModel&) = delete;

  Tensor loss(const Batch& batch, std::int64_t global_tokens) override {
    const ParallelContext& ctx = *ctx_;
    const std::int64_t b = batch.inputs.size(0), seq = batch.inputs.size(1), hdim = cfg_.hidden;
    // This rank's rows of the global batch (a dp or fsdp replica, a micro-batch hold a slice of it):
    // its piece of the one global input, so every mesh computes the same function.
    const std::int64_t rows = batch.global_rows > 0 ? batch.global_rows : b;
    const std::int64_t row0 = batch.global_rows > 0 ? batch.row_offset : 0;
    MG_CHECK(row0 >= 0 && row0 + b <= rows, "mlp: batch rows [{}, {}) lie outside its global batch of {} rows", row0,
             row0 + b, rows);
    random::Box box{{0, seq}, {row0, b}, {0, hdim}};
    if (ctx.sequence_parallel()) box[0] = shard_range(seq, ctx.tp_size(), ctx.tp_rank());
    // The input is drawn once per piece; each call uses a fresh leaf over it that requires grad
    // (as in the PyTorch peer benchmark), so backward computes and communicates dX of the first
    // layer too.
    const Shape key{seq, rows, hdim, row0, b};
    if (!input_.defined() || input_shape_ != key) {
      input_ = random::randn({seq, rows, hdim}, seed_ ^ 0x1A9u, cfg_.dtype, 0.0, 1.0, box);
      input_shape_ = key;
    }
    Tensor h = input_.detach();
    h.set_requires_grad();
    trace::Scope model_scope("mlp_stack");
    const FsdpForwardScope gathered(unit_.get(), /*release=*/!autograd::GradMode::is_enabled());
    for (std::size_t i = 0; i < mlps_.size(); ++i) {
      const std::string name = fmt::format("h.{}", i);
      dist::CommLabelScope label(name);
      trace::Scope scope(name);
      h = mlps_[i]->forward(h, seq);
    }
    // Per token block, the blocks added in the tree (one block normally).
    Tensor sq = tree::sum_over_blocks(mul(h, h), ctx.token_row_blocks(seq, h.size(0), 1));
    if (ctx.sequence_parallel()) {
      // Each rank holds its own tokens: the loss is the sum over tp of the local sums.
      dist::CommLabelScope label("loss");
      trace::Scope scope("loss");
      sq = dist::reduce_from_region(sq, ctx.tp, ctx.reduce_order());
    }
    return ctx.loss_partial_over_dp(scale(sq, 1.0 / static_cast<double>(global_tokens * hdim)));
  }
  std::vector<Parameter*> parameters() override {
    std::vector<Parameter*> out;
    for (auto& m : mlps_) m->collect(out);
    return out;
  }
  const ModelConfig& config() const override { return cfg_; }
  void set_training(bool) override {}
  dist::ReduceOrder reduce_order() const override { return ctx_->reduce_order(); }
  void set_accumulating(bool on) override {
    if (unit_) unit_->set_accumulating(on);
  }

 private:
  ModelConfig cfg_;
  ParallelContextPtr ctx_;
  std::uint64_t seed_;
  std::vector<std::unique_ptr<Mlp>> mlps_;
  std::unique_ptr<FsdpUnit> unit_;   // FSDP: every parameter, one unit
  Tensor input_;        // this rank's piece of the fixed input
  Shape input_shape_;   // what it was drawn for: the global shape, then the rows' offset and count
};

}  // namespace

ModelConfig ModelConfig::gpt(int layers, int hidden, int heads, int vocab, int seq, int batch, DType dtype) {
  ModelConfig c;
  c.kind = "gpt";
  c.layers = layers;
  c.hidden = hidden;
  c.heads = heads;
  c.vocab = vocab;
  c.seq = seq;
  c.batch = batch;
  c.dtype = dtype;
  return c;
}

ModelConfig ModelConfig::with_shape_of(const ModelConfig& shape) const {
  ModelConfig c = *this;
  c.kind = "gpt";
  c.layers = shape.layers;
  c.hidden = shape.hidden;
  c.ffn = shape.ffn;
  c.heads = shape.heads;
  c.vocab = shape.vocab;
  c.positions = shape.positions;
  c.layer_norm_epsilon = shape.layer_norm_epsilon;
  return c;
}

std::vector<int> stage_layer_counts(int layers, int stages, const std::vector<int>& requested) {
  MG_CHECK(stages >= 1, "pipeline: {} stages", stages);
  MG_CHECK(stages <= layers, "--mesh pp={}: a pipeline of {} stages needs at least {} transformer blocks, and the model "
           "has {} (--layers): use pp <= {}", stages, stages, stages, layers, layers);
  if (requested.empty()) {
    std::vector<int> counts;
    for (int s = 0; s < stages; ++s) counts.push_back(static_cast<int>(shard_range(layers, stages, s).size));
    return counts;
  }
  const std::string given = fmt::format("{}", fmt::join(requested, ","));
  MG_CHECK(static_cast<int>(requested.size()) == stages, "--pp-layers {}: {} counts for a pipeline of {} stages (pp={})",
           given, requested.size(), stages, stages);
  std::int64_t sum = 0;   // of up to kMaxMeshRanks ints: no overflow in 64 bits
  for (const int n : requested) {
    MG_CHECK(n >= 1, "--pp-layers {}: every stage needs at least one transformer block", given);
    sum += n;
  }
  MG_CHECK(sum == layers, "--pp-layers {}: the counts add up to {} blocks, and the model has {} (--layers)", given, sum,
           layers);
  return requested;
}

Tensor Model::forward_stage(const Batch& batch, const Tensor& input, std::int64_t global_tokens) {
  // A model without pipeline stages is one stage: its forward is its loss.
  MG_CHECK(!input.defined() && stage().count == 1, "model '{}' has no pipeline stages: only gpt has", config().kind);
  return loss(batch, global_tokens);
}

Shape Model::stage_input_shape(const Batch&) const {
  throw InvalidArgument(fmt::format("model '{}' has no pipeline stages: only gpt has", config().kind));
}

KvCache Model::new_cache(std::int64_t) {
  throw InvalidArgument(fmt::format("model '{}' has no incremental decoding (new_cache): only gpt has", config().kind));
}

Tensor Model::decode(const Tensor&, KvCache&, bool) {
  throw InvalidArgument(fmt::format("model '{}' has no incremental decoding (decode): only gpt has", config().kind));
}

std::unique_ptr<Model> make_model(const ModelConfig& config, const ParallelConfig& parallel,
                                  dist::DeviceMeshPtr mesh, std::uint64_t seed) {
  MG_CHECK(config.layers >= 1 && config.hidden >= 1 && config.heads >= 1 && config.vocab >= 1,
           "model: layers, hidden, heads and vocab must be positive (got {}, {}, {}, {})", config.layers, config.hidden,
           config.heads, config.vocab);
  if (config.kind == "gpt") return std::make_unique<Gpt>(config, parallel, std::move(mesh), seed);
  if (config.kind == "mlp") return std::make_unique<MlpModel>(config, parallel, std::move(mesh), seed);
  throw InvalidArgument(fmt::format("model: unknown kind '{}' (expected gpt or mlp)", config.kind));
}

}  // namespace meshgrad::nn
