// GPT-2's module tree (pre-LN blocks, learned positions, GELU tanh, the output layer tied to the
// token table) and its tensor-parallel plan. Nothing here knows of pipelines, FSDP, activation
// checkpointing or dropout streams: decoder_lm.cpp applies those to any family.
#include <cmath>

#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/mappings.hpp"
#include "meshgrad/nn/decoder_lm.hpp"
#include "gelu_mlp.hpp"
#include "pre_norm_block.hpp"
#include "meshgrad/nn/invariant.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/trace.hpp"

namespace meshgrad::nn {

namespace {

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

// c_attn (q, k, v fused, the heads split whole) and c_proj, as the plan splits them.
class Attention {
 public:
  Attention(const std::string& name, const ModelConfig& cfg, const ParallelContextPtr& ctx, std::uint64_t seed)
      : name_(name), head_dim_(cfg.hidden / cfg.heads), ctx_(ctx) {
    const TensorParallelPlan& plan = gpt2_tp_plan();
    c_attn_ = plan.linear(name + ".c_attn",
                          {.in = cfg.hidden, .out = 3 * cfg.hidden, .blocks = 3, .out_unit = head_dim_}, ctx, seed,
                          cfg.dtype);
    c_proj_ = plan.linear(name + ".c_proj",
                          {.in = cfg.hidden, .out = cfg.hidden, .in_unit = head_dim_,
                           .init_std = 0.02 / std::sqrt(2.0 * cfg.layers)},
                          ctx, seed, cfg.dtype);
  }

  // x: [T(_local), B, C] -> same.
  Tensor forward(const Tensor& x, std::int64_t seq) const {
    trace::Scope scope(name_);
    const Heads h = project_heads(x, seq);
    // Under cp each query chunk meets the whole sequence's keys up to it (nn/context_parallel.hpp).
    const Tensor y = nn::attention(h.q, h.k, h.v, 0, ctx_);
    return project_output(y, seq);
  }

  // DecoderBlock::forward_cached's attention: x [T_new, B, C] at positions start ..
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
  // Heads this rank computes (c_attn's output features are split in whole heads per q, k, v block).
  std::int64_t local_kv_heads() const { return c_attn_->output_features() / 3 / head_dim_; }
  std::int64_t head_dim() const { return head_dim_; }
  void collect(std::vector<Parameter*>& out) {
    c_attn_->collect(out);
    c_proj_->collect(out);
  }

 private:
  struct Heads {
    Tensor q, k, v;   // [B, H_local, T, D], contiguous
  };
  // c_attn and the split into this rank's heads: x [T(_local), B, C] -> q, k, v.
  Heads project_heads(const Tensor& x, std::int64_t seq) const {
    const Tensor qkv = c_attn_->forward(x, seq);   // [T, B, 3 * H_local * D]
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
    return c_proj_->forward(reshape(contiguous(permute(y, {2, 0, 1, 3})), {seq, b, local}), seq);
  }

  std::string name_;   // its trace scope
  std::int64_t head_dim_;
  ParallelContextPtr ctx_;
  std::unique_ptr<ParallelLinear> c_attn_, c_proj_;
};

// GPT-2's MLP as the block builds it: c_fc, GELU, c_proj, split by GPT-2's plan.
class Gpt2Mlp : public GeluMlp {
 public:
  Gpt2Mlp(const std::string& name, const ModelConfig& cfg, const ParallelContextPtr& ctx, std::uint64_t seed)
      : GeluMlp(name, cfg, gpt2_tp_plan(), ctx, seed) {}
};

// x + drop(attn(ln_1(x))), then h + drop(mlp(ln_2(h))): two dropout draws.
using Block = PreNormBlock<LayerNorm, Attention, Gpt2Mlp>;
constexpr PreNormNames kGpt2Block{"ln_1", "attn", "ln_2", "mlp"};

// wte and wpe (the first stage; wte on the last too, for the tied output layer), the blocks, ln_f
// and the output layer (the last stage) whose weight is wte^T.
class Gpt2 final : public DecoderFamily {
 public:
  // make_block: nullptr builds GPT-2's blocks (checked against the mesh here); a caller's factory
  // checks its own.
  Gpt2(const ModelConfig& cfg, const ParallelContextPtr& ctx, const StagePieces& pieces, std::uint64_t seed,
       const DecoderBlockFactory& make_block = nullptr, int block_dropout_draws = 2)
      : cfg_(cfg), ctx_(ctx), block_dropout_draws_(block_dropout_draws),
        ln_f_("ln_f", cfg.hidden, cfg.layer_norm_epsilon, ctx, cfg.dtype) {
    if (!make_block) check_split(cfg, *ctx);
    invariant::check_model(cfg, *ctx);
    // Every parameter is built with its global name and seed, so a stage's are the one-rank model's.
    if (pieces.embedding || pieces.head) {
      wte_ = std::make_unique<VocabParallelEmbedding>("wte", cfg.vocab, cfg.hidden, ctx, seed, cfg.dtype);
    }
    if (pieces.embedding) {
      wpe_ = make_parameter("wpe.weight", {cfg.n_positions(), cfg.hidden}, ctx->replicated(), *ctx, seed, 0.02, 0.0,
                            cfg.dtype);
    }
    for (int i = pieces.first_block; i < pieces.end_block; ++i) {
      const std::string name = fmt::format("h.{}", i);
      if (make_block) {
        std::shared_ptr<DecoderBlock> block = make_block(name, i, cfg, ctx, seed);
        MG_CHECK(block != nullptr, "{}: the block factory returned no block for '{}'", cfg.kind, name);
        blocks_.push_back(std::move(block));
      } else {
        blocks_.push_back(std::make_shared<Block>(name, kGpt2Block, cfg, ctx, seed));
      }
    }
    // No weight of its own: the output layer's is wte^T.
    lm_head_ = std::make_unique<ColumnParallelLinear>(
        "lm_head", cfg.hidden, cfg.vocab, ColumnParallelLinear::Options{.bias = false, .owns_weight = false}, ctx, 0,
        cfg.dtype);
  }

  int embedding_dropout_draws() const override { return 1; }
  int block_dropout_draws() const override { return block_dropout_draws_; }
  VocabParallelEmbedding* token_embedding() override { return wte_.get(); }
  bool tied_output() const override { return true; }

  // Vocabulary-parallel partial sums reduced over tp (all-reduce, or reduce-scatter along the
  // sequence under SP), plus this rank's positions.
  Tensor embed(const Tensor& ids, const Tensor& table, const std::vector<PositionRun>& positions,
               const Dropout& dropout) const override {
    const ParallelContext& ctx = *ctx_;
    const bool sp = ctx.sequence_parallel();
    const std::int64_t seq = ids.size(0), c = cfg_.hidden;
    Tensor h;
    {
      dist::CommLabelScope label("wte");
      trace::Scope scope("wte");
      h = wte_->forward(ids, table);   // [T(_local), B, C]
    }
    const std::int64_t t_local = h.size(0);
    // The table's rows of this rank's tokens: its SP shard of the ids' positions.
    const std::vector<PositionRun> rows = rows_of(positions, sequence_shard_offset(ctx, seq), t_local);
    const Tensor pos = reshape(rows_at(wpe_.operand(), rows), {t_local, 1, c});
    h = add(h, sp ? ctx.partial_over_tp(pos) : pos);
    return dropout(h);
  }

  const std::vector<std::shared_ptr<DecoderBlock>>& blocks() const override { return blocks_; }
  Tensor final_norm(const Tensor& h, std::int64_t seq) const override { return ln_f_.forward(h, seq); }
  Tensor output_logits(const Tensor& h, std::int64_t seq, const Tensor& tied_weight) const override {
    return lm_head_->forward_with(h, seq, transpose(tied_weight, 0, 1), Tensor());   // [T, B, V_local]
  }
  std::int64_t vocab_offset() const override { return wte_->vocab_offset(); }
  const tree::SplitPlan& output_plan() const override { return lm_head_->plan(); }
  std::vector<Parameter*> embedding_parameters() override { return {&wte_->weight, &wpe_}; }
  std::vector<Parameter*> head_parameters() override { return {&ln_f_.weight, &ln_f_.bias}; }

 private:
  ModelConfig cfg_;
  ParallelContextPtr ctx_;
  int block_dropout_draws_;
  std::unique_ptr<VocabParallelEmbedding> wte_;
  Parameter wpe_;
  std::vector<std::shared_ptr<DecoderBlock>> blocks_;
  LayerNorm ln_f_;
  std::unique_ptr<ColumnParallelLinear> lm_head_;
};

}  // namespace

const TensorParallelPlan& gpt2_tp_plan() {
  static const TensorParallelPlan plan{"gpt2",
                                       {{"h.*.attn.c_attn", LinearStyle::Column},
                                        {"h.*.attn.c_proj", LinearStyle::Row},
                                        {"h.*.mlp.c_fc", LinearStyle::Column},
                                        {"h.*.mlp.c_proj", LinearStyle::Row}}};
  return plan;
}

std::unique_ptr<DecoderFamily> make_gpt2_family(const ModelConfig& config, const ParallelContextPtr& ctx,
                                                const StagePieces& pieces, std::uint64_t seed) {
  return std::make_unique<Gpt2>(config, ctx, pieces, seed);
}

DecoderFamilyFactory gpt2_family_with_blocks(DecoderBlockFactory make_block, int block_dropout_draws) {
  MG_CHECK(static_cast<bool>(make_block), "gpt2_family_with_blocks: no block factory");
  MG_CHECK(block_dropout_draws >= 0, "gpt2_family_with_blocks: block_dropout_draws {} is negative", block_dropout_draws);
  return [make_block = std::move(make_block), block_dropout_draws](const ModelConfig& config, const ParallelContextPtr& ctx,
                                                                  const StagePieces& pieces, std::uint64_t seed) {
    return std::unique_ptr<DecoderFamily>(std::make_unique<Gpt2>(config, ctx, pieces, seed, make_block, block_dropout_draws));
  };
}

void register_decoder_family(const std::string& kind, DecoderFamilyFactory family, const std::string& counts_like,
                             bool decodes) {
  MG_CHECK(static_cast<bool>(family), "register_decoder_family: kind '{}' has no family factory", kind);
  register_model(kind, ModelKind{
                           .build = [family = std::move(family)](const ModelConfig& config, const ParallelConfig& parallel,
                                                                 dist::DeviceMeshPtr mesh, std::uint64_t seed) {
                             return make_decoder_lm(config, parallel, std::move(mesh), seed, family);
                           },
                           .counts_like = counts_like,
                           .decodes = decodes});
}

}  // namespace meshgrad::nn
