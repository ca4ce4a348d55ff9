// The Llama family's module tree (Llama 2/3, TinyLlama, SmolLM, Qwen2, Mistral) and its
// tensor-parallel plan, with Hugging Face's semantics and parameter names (LlamaForCausalLM):
//
//   h = embed_tokens(ids)
//   per layer:  h = h + o_proj(attn(rope(q_proj(n)), rope(k_proj(n)), v_proj(n))),  n = input_layernorm(h)
//               h = h + down_proj(silu(gate_proj(m)) * up_proj(m)),               m = post_attention_layernorm(h)
//   logits = lm_head(norm(h))      (lm_head = embed_tokens^T with tie_word_embeddings)
//
// RMSNorm with rms_norm_eps; RoPE in the rotate-half layout (rotate_half(x) = [-x2, x1]) over the
// whole head, inverse frequencies theta^(-2i/D) with rope_scaling "linear" or "llama3"; grouped-query
// attention: query head h reads key/value head h / (heads / kv_heads) (repeat_kv). Tables are
// computed in double and rounded once to the model's dtype (float64 runs are float64 throughout).
// Weights are [in, out] here (y = x W), Hugging Face's nn.Linear [out, in]: interop transposes.
#include <cmath>
#include <numbers>

#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/mappings.hpp"
#include "meshgrad/nn/decoder_lm.hpp"
#include "meshgrad/nn/invariant.hpp"
#include "meshgrad/nn/moe.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/trace.hpp"
#include "pre_norm_block.hpp"

namespace meshgrad::nn {

namespace {

// Sizes the split must respect, and what the family does not do yet, refused by name before any
// layer is built.
void check_llama(const ModelConfig& cfg, const ParallelContext& ctx) {
  const int kv = cfg.kv_head_count();
  MG_CHECK(cfg.head_size() >= 2 && cfg.head_size() % 2 == 0, "llama: head_dim {} must be even and at least 2 (RoPE "
           "rotates pairs of features; hidden {} / heads {} unless head_dim is given)", cfg.head_size(), cfg.hidden,
           cfg.heads);
  MG_CHECK(kv >= 1 && cfg.heads % kv == 0, "llama: {} attention heads are not a multiple of {} key/value heads "
           "(num_key_value_heads)", cfg.heads, kv);
  const int head_split = ctx.two_d ? ctx.col().size() : ctx.tp_size();
  // Fewer key/value heads than ranks: each is replicated over tp / kv ranks (1-D, Megatron's way),
  // and every rank's query heads must then read the one key/value head it holds.
  const bool replicated = !ctx.two_d && kv < head_split && head_split % kv == 0 && cfg.heads % head_split == 0;
  MG_CHECK(kv % head_split == 0 || replicated, "llama: {} ranks split the attention heads ({}), and the {} key/value "
           "heads (num_key_value_heads) neither split evenly over them nor divide them{}: use a degree that divides {} "
           "or a multiple of it that divides the {} heads", head_split, ctx.two_d ? "tp_col, the C of tp=RxC" : "tp",
           kv, ctx.two_d ? " (a 2-D grid does not replicate key/value heads)" : "", kv, cfg.heads);
  if (ctx.two_d) {
    MG_CHECK(ctx.row().size() <= cfg.hidden, "llama: tp_row = {} ranks split hidden {} features", ctx.row().size(),
             cfg.hidden);
  }
  MG_CHECK(cfg.dropout == 0, "llama: the Llama family has no dropout (attention_dropout is 0 in every released "
           "config); --dropout {} is refused", cfg.dropout);
  MG_CHECK(cfg.sliding_window >= 0 && cfg.max_window_layers >= 0, "llama: sliding_window {} and max_window_layers {} "
           "must be >= 0", cfg.sliding_window, cfg.max_window_layers);
  MG_CHECK(cfg.rope_scaling.empty() || cfg.rope_scaling == "linear" || cfg.rope_scaling == "llama3" ||
               cfg.rope_scaling == "default",
           "llama: rope_scaling type '{}' is not supported (default, linear and llama3 are)", cfg.rope_scaling);
}

// The inverse frequencies of RoPE, D / 2 of them, as Hugging Face's rope_init_fn computes them.
std::vector<double> inverse_frequencies(const ModelConfig& cfg) {
  const int d = cfg.head_size();
  std::vector<double> inv(static_cast<std::size_t>(d / 2));
  for (int i = 0; i < d / 2; ++i) inv[static_cast<std::size_t>(i)] = 1.0 / std::pow(cfg.rope_theta, 2.0 * i / d);
  if (cfg.rope_scaling == "linear") {
    for (double& f : inv) f /= cfg.rope_factor;
  } else if (cfg.rope_scaling == "llama3") {
    const double old_len = cfg.rope_original_positions;
    const double low_wavelen = old_len / cfg.rope_low_freq_factor, high_wavelen = old_len / cfg.rope_high_freq_factor;
    for (double& f : inv) {
      const double wavelen = 2 * std::numbers::pi / f;
      const double scaled = wavelen > low_wavelen ? f / cfg.rope_factor : f;
      const double smooth = (old_len / wavelen - cfg.rope_low_freq_factor) /
                            (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor);
      const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
      f = medium ? (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled : scaled;
    }
  }
  return inv;
}

// cos and sin of positions [start, start + count): [count, D] each, emb = [freqs, freqs].
struct RopeTables {
  Tensor cos, sin;
};
// The tables of the runs' positions, row after row in run order ([sum of sizes, D]).
RopeTables rope_tables(const std::vector<double>& inv, const std::vector<PositionRun>& runs, DType dtype) {
  const auto half = static_cast<std::int64_t>(inv.size()), d = 2 * half;
  std::int64_t count = 0;
  for (const PositionRun& r : runs) count += r.size;
  std::vector<double> c(static_cast<std::size_t>(count * d)), s(c.size());
  std::int64_t t = 0;
  for (const PositionRun& r : runs) {
    for (std::int64_t p = r.global; p < r.global + r.size; ++p, ++t) {
      for (std::int64_t i = 0; i < d; ++i) {
        const double angle = static_cast<double>(p) * inv[static_cast<std::size_t>(i % half)];
        c[static_cast<std::size_t>(t * d + i)] = std::cos(angle);
        s[static_cast<std::size_t>(t * d + i)] = std::sin(angle);
      }
    }
  }
  return {Tensor::from_values(c, {count, d}, dtype), Tensor::from_values(s, {count, d}, dtype)};
}

// x [B, H, T, D] -> x * cos + rotate_half(x) * sin (the tables [T, D] broadcast over B and H), in
// one fused pass each way (ops::rotary).
Tensor apply_rope(const Tensor& x, const RopeTables& rope) { return rotary(x, rope.cos, rope.sin); }

// [B, H_kv, T, D] -> [B, H_kv * groups, T, D]: each key/value head repeated for its query heads.
Tensor repeat_kv(const Tensor& x, std::int64_t groups) {
  if (groups == 1) return x;
  const std::int64_t b = x.size(0), h = x.size(1), t = x.size(2), d = x.size(3);
  return reshape(contiguous(expand(reshape(contiguous(x), {b, h, 1, t, d}), {b, h, groups, t, d})), {b, h * groups, t, d});
}

const TensorParallelPlan& llama_plan() {
  static const TensorParallelPlan plan{"llama",
                                       {{"model.layers.*.self_attn.q_proj", LinearStyle::Column},
                                        {"model.layers.*.self_attn.k_proj", LinearStyle::Column},
                                        {"model.layers.*.self_attn.v_proj", LinearStyle::Column},
                                        {"model.layers.*.self_attn.o_proj", LinearStyle::Row},
                                        {"model.layers.*.mlp.gate_proj", LinearStyle::Column},
                                        {"model.layers.*.mlp.up_proj", LinearStyle::Column},
                                        {"model.layers.*.mlp.down_proj", LinearStyle::Row},
                                        {"model.layers.*.mlp.shared_expert.gate_proj", LinearStyle::Column},
                                        {"model.layers.*.mlp.shared_expert.up_proj", LinearStyle::Column},
                                        {"model.layers.*.mlp.shared_expert.down_proj", LinearStyle::Row}}};
  return plan;
}

class LlamaAttention {
 public:
  LlamaAttention(const std::string& name, const ModelConfig& cfg, const ParallelContextPtr& ctx, std::uint64_t seed)
      : name_(name), head_dim_(cfg.head_size()), window_(cfg.sliding_window),
        inv_freq_(inverse_frequencies(cfg)), dtype_(cfg.dtype), ctx_(ctx) {
    const TensorParallelPlan& plan = llama_plan();
    const std::int64_t q_out = std::int64_t{cfg.heads} * head_dim_, kv_out = std::int64_t{cfg.kv_head_count()} * head_dim_;
    const bool bias = cfg.attention_bias;
    q_proj_ = plan.linear(name + ".q_proj", {.in = cfg.hidden, .out = q_out, .bias = bias, .out_unit = head_dim_}, ctx,
                          seed, cfg.dtype);
    // Key/value heads fewer than tp ranks are replicated (LinearSpec::replicate_units).
    const LinearSpec kv_spec{.in = cfg.hidden, .out = kv_out, .bias = bias, .out_unit = head_dim_, .replicate_units = true};
    k_proj_ = plan.linear(name + ".k_proj", kv_spec, ctx, seed, cfg.dtype);
    v_proj_ = plan.linear(name + ".v_proj", kv_spec, ctx, seed, cfg.dtype);
    o_proj_ = plan.linear(name + ".o_proj", {.in = q_out, .out = cfg.hidden, .bias = false, .in_unit = head_dim_}, ctx,
                          seed, cfg.dtype);
  }

  // x: [T(_local), B, C] -> same; positions 0 .. seq - 1, or this rank's chunks of them under cp
  // (whose keys and values are gathered before they repeat: the fewer heads travel). cfg.sliding_window
  // is this layer's window (the family gives each block its ModelConfig::attention_window).
  Tensor forward(const Tensor& x, std::int64_t seq) const {
    trace::Scope scope(name_);
    const Heads h = project_heads(x, seq, local_chunks(*ctx_, seq));
    const std::int64_t groups = h.q.size(1) / h.k.size(1);   // this rank's query heads per key/value head
    const Tensor y = ctx_->attention_per_run()
                         ? context_attention(h.q, h.k, h.v, window_, ctx_)
                         : causal_attention(h.q, repeat_kv(h.k, groups), repeat_kv(h.v, groups), window_);
    return project_output(y, seq);
  }

  // DecoderBlock::forward_cached's attention: x [T_new, B, C] at positions start ..; the cache holds
  // the keys after RoPE.
  Tensor forward_cached(const Tensor& x, const Tensor& keys, const Tensor& values, std::int64_t start,
                        std::int64_t& scores) const {
    const std::int64_t t_new = x.size(0);
    const Heads h = project_heads(x, t_new, {{0, start, t_new}});
    Tensor k_new = keys.narrow(2, start, t_new), v_new = values.narrow(2, start, t_new);
    k_new.copy_from(h.k);
    v_new.copy_from(h.v);
    const std::int64_t groups = h.q.size(1) / h.k.size(1);
    const kernels::AttentionForward y = kernels::causal_attention_forward(
        h.q, repeat_kv(keys.narrow(2, 0, start + t_new), groups), repeat_kv(values.narrow(2, 0, start + t_new), groups),
        1.0 / std::sqrt(static_cast<double>(head_dim_)), window_);
    scores += y.scores;
    return project_output(y.out, t_new);
  }
  std::int64_t local_kv_heads() const { return k_proj_->output_features() / head_dim_; }
  std::int64_t head_dim() const { return head_dim_; }
  void collect(std::vector<Parameter*>& out) {
    q_proj_->collect(out);
    k_proj_->collect(out);
    v_proj_->collect(out);
    o_proj_->collect(out);
  }

 private:
  struct Heads {
    Tensor q, k, v;   // q [B, H_local, T, D], k and v [B, H_kv_local, T, D]; q and k rotated
  };
  // positions: the global positions of the sequence's seq rows.
  Heads project_heads(const Tensor& x, std::int64_t seq, const std::vector<PositionRun>& positions) const {
    auto heads_first = [&](const Tensor& t) {   // [T, B, H_l * D] -> [B, H_l, T, D]
      return contiguous(permute(reshape(t, {seq, t.size(1), t.size(2) / head_dim_, head_dim_}), {1, 2, 0, 3}));
    };
    const RopeTables rope = rope_for(positions);
    return {apply_rope(heads_first(q_proj_->forward(x, seq)), rope), apply_rope(heads_first(k_proj_->forward(x, seq)), rope),
            heads_first(v_proj_->forward(x, seq))};
  }
  // The tables of the positions: computed once for a training shape (every step asks the same),
  // again when the positions change (decoding). Constants: a graph that saved them keeps them, and
  // they are never written.
  RopeTables rope_for(const std::vector<PositionRun>& positions) const {
    if (positions != rope_positions_) {
      rope_ = rope_tables(inv_freq_, positions, dtype_);
      rope_positions_ = positions;
    }
    return rope_;
  }
  // y [B, H_local, T, D] -> o_proj: [T(_local), B, C].
  Tensor project_output(const Tensor& y, std::int64_t seq) const {
    const std::int64_t b = y.size(0), local = y.size(1) * head_dim_;
    return o_proj_->forward(reshape(contiguous(permute(y, {2, 0, 1, 3})), {seq, b, local}), seq);
  }

  std::string name_;
  std::int64_t head_dim_;
  std::int64_t window_;   // sliding window of this layer; 0: plain causal attention
  std::vector<double> inv_freq_;
  DType dtype_;
  ParallelContextPtr ctx_;
  mutable RopeTables rope_;   // rope_for's (one model per rank: no lock)
  mutable std::vector<PositionRun> rope_positions_;
  std::unique_ptr<ParallelLinear> q_proj_, k_proj_, v_proj_, o_proj_;
};

// down_proj(silu(gate_proj(x)) * up_proj(x)).
class SwiGluMlp {
 public:
  SwiGluMlp(const std::string& name, const ModelConfig& cfg, const ParallelContextPtr& ctx, std::uint64_t seed)
      : name_(name) {
    const TensorParallelPlan& plan = llama_plan();
    gate_proj_ = plan.linear(name + ".gate_proj", {.in = cfg.hidden, .out = cfg.ffn_size(), .bias = false}, ctx, seed,
                             cfg.dtype);
    up_proj_ = plan.linear(name + ".up_proj", {.in = cfg.hidden, .out = cfg.ffn_size(), .bias = false}, ctx, seed,
                           cfg.dtype);
    down_proj_ = plan.linear(name + ".down_proj", {.in = cfg.ffn_size(), .out = cfg.hidden, .bias = false}, ctx, seed,
                             cfg.dtype);
  }
  Tensor forward(const Tensor& x, std::int64_t seq) const {
    trace::Scope scope(name_);
    return down_proj_->forward(mul(silu(gate_proj_->forward(x, seq)), up_proj_->forward(x, seq)), seq);
  }
  void collect(std::vector<Parameter*>& out) {
    gate_proj_->collect(out);
    up_proj_->collect(out);
    down_proj_->collect(out);
  }

 private:
  std::string name_;
  std::unique_ptr<ParallelLinear> gate_proj_, up_proj_, down_proj_;
};

// input_layernorm, self_attn, post_attention_layernorm, mlp: the pre-norm block with RMSNorm.
using LlamaBlock = PreNormBlock<RmsNorm, LlamaAttention, SwiGluMlp>;
constexpr PreNormNames kLlamaBlock{"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"};
// A sparse block's MLP: the routed experts (nn/moe.hpp), and with a shared expert (Qwen2-MoE) that
// SwiGLU MLP on every token, gated: out = moe(x) + sigmoid(x g) * shared_expert(x). The shared
// expert is split over tp by the family's plan (mlp.shared_expert.*), the gate [C, 1] replicated.
class SparseMlp {
 public:
  SparseMlp(const std::string& name, const ModelConfig& cfg, const ParallelContextPtr& ctx, std::uint64_t seed,
            std::shared_ptr<RouterLog> log)
      : name_(name), ctx_(ctx), routed_(name, cfg, ctx, seed, std::move(log)) {
    if (cfg.shared_expert_ffn > 0) {
      ModelConfig shared = cfg;
      shared.ffn = cfg.shared_expert_ffn;
      shared_ = std::make_unique<SwiGluMlp>(name + ".shared_expert", shared, ctx, seed);
      shared_gate_ = make_parameter(name + ".shared_expert_gate.weight", {cfg.hidden, 1}, ctx->replicated(), *ctx, seed,
                                    0.02, 0.0, cfg.dtype);
    }
  }
  Tensor forward(const Tensor& x, std::int64_t seq) const {
    const Tensor routed = routed_.forward(x, seq);
    if (!shared_) return routed;
    trace::Scope scope(name_ + ".shared_expert_gate");
    // sigmoid(z) = (1 + tanh(z / 2)) / 2
    const Tensor z = matmul(x, ctx_->replicated_on_sequence_shard(shared_gate_.operand()));   // [T, B, 1]
    const Tensor gate = scale(add_scalar(tanh(scale(z, 0.5)), 1.0), 0.5);
    return add(routed, mul(gate, shared_->forward(x, seq)));
  }
  void collect(std::vector<Parameter*>& out) {
    routed_.collect(out);
    if (shared_) {
      shared_->collect(out);
      out.push_back(&shared_gate_);
    }
  }

 private:
  std::string name_;
  ParallelContextPtr ctx_;
  SparseMoe routed_;
  std::unique_ptr<SwiGluMlp> shared_;
  Parameter shared_gate_;
};

// Mixtral: the MLP is a sparse mixture of experts (nn/moe.hpp), block_sparse_moe. Qwen2-MoE: the
// same (with its shared expert) in place of the dense MLP, mlp, on its sparse layers.
using SparseBlock = PreNormBlock<RmsNorm, LlamaAttention, SparseMlp>;
constexpr PreNormNames kMixtralBlock{"input_layernorm", "self_attn", "post_attention_layernorm", "block_sparse_moe"};

// What a mixture of experts cannot be combined with yet, refused by name before any layer is built.
void check_sparse(const ModelConfig& cfg, const ParallelContext& ctx) {
  const char* type = cfg.model_type.c_str();
  const ParallelConfig& p = ctx.config;
  const std::string mesh = ctx.mesh->str();
  if (cfg.output_router_logits) {
    MG_CHECK(ctx.pp_size() == 1, "{}: the load-balancing loss (output_router_logits true) sums every layer's "
             "router counts before any layer's gradient, and a pipeline (--mesh {}) runs a stage's backward before the "
             "next stage's forward: use a mesh without pp, or set output_router_logits false", type, mesh);
    MG_CHECK(!p.checkpoint_blocks, "{}: --checkpoint-blocks with the load-balancing loss (output_router_logits "
             "true) is not supported: the loss needs the router probabilities of the first forward, which a "
             "checkpointed block does not keep", type);
  }
  MG_CHECK(!(ctx.config.tp_invariant() && ctx.sequence_parallel()), "{}: --{} with --sequence-parallel is not "
           "supported: the experts would sum each sequence shard's tokens apart", type, invariance_option(p.invariance));
}

class Llama final : public DecoderFamily {
 public:
  Llama(const ModelConfig& cfg, const ParallelContextPtr& ctx, const StagePieces& pieces, std::uint64_t seed)
      : cfg_(cfg), ctx_(ctx), norm_("model.norm", cfg.hidden, cfg.layer_norm_epsilon, ctx, cfg.dtype) {
    check_llama(cfg, *ctx);
    if (cfg.moe()) {
      check_sparse(cfg, *ctx);
      router_log_ = std::make_shared<RouterLog>(cfg, ctx);
    }
    invariant::check_model(cfg, *ctx);
    if (pieces.embedding || (pieces.head && cfg.tie_word_embeddings)) {
      embed_tokens_ = std::make_unique<VocabParallelEmbedding>("model.embed_tokens", cfg.vocab, cfg.hidden, ctx, seed,
                                                               cfg.dtype);
    }
    for (int i = pieces.first_block; i < pieces.end_block; ++i) {
      ModelConfig layer = cfg;   // the block's attention sees its own window
      layer.sliding_window = cfg.attention_window(i);
      layer.max_window_layers = 0;
      const std::string name = fmt::format("model.layers.{}", i);
      if (cfg.sparse_layer(i)) {
        const PreNormNames& parts = cfg.model_type == "qwen2_moe" ? kLlamaBlock : kMixtralBlock;
        blocks_.push_back(std::make_shared<SparseBlock>(name, parts, layer, ctx, seed, router_log_));
      } else {
        blocks_.push_back(std::make_shared<LlamaBlock>(name, kLlamaBlock, layer, ctx, seed));
      }
    }
    // Column-parallel over the vocabulary (logits stay split); its own weight unless tied.
    lm_head_ = std::make_unique<ColumnParallelLinear>(
        "lm_head", cfg.hidden, cfg.vocab,
        ColumnParallelLinear::Options{.bias = false, .owns_weight = !cfg.tie_word_embeddings && pieces.head}, ctx, seed,
        cfg.dtype);
    vocab_offset_ = shard_range(cfg.vocab, ctx->tp_size(), ctx->tp_rank()).offset;
  }

  int embedding_dropout_draws() const override { return 0; }
  int block_dropout_draws() const override { return 0; }
  VocabParallelEmbedding* token_embedding() override { return embed_tokens_.get(); }
  bool tied_output() const override { return cfg_.tie_word_embeddings; }

  Tensor embed(const Tensor& ids, const Tensor& table, const std::vector<PositionRun>&, const Dropout&) const override {
    dist::CommLabelScope label("model.embed_tokens");
    trace::Scope scope("model.embed_tokens");
    return embed_tokens_->forward(ids, table);   // [T(_local), B, C]
  }
  const std::vector<std::shared_ptr<DecoderBlock>>& blocks() const override { return blocks_; }
  Tensor final_norm(const Tensor& h, std::int64_t seq) const override { return norm_.forward(h, seq); }
  Tensor output_logits(const Tensor& h, std::int64_t seq, const Tensor& tied_weight) const override {
    if (cfg_.tie_word_embeddings) return lm_head_->forward_with(h, seq, transpose(tied_weight, 0, 1), Tensor());
    return lm_head_->forward(h, seq);   // [T, B, V_local]
  }
  std::int64_t vocab_offset() const override { return vocab_offset_; }
  const tree::SplitPlan& output_plan() const override { return lm_head_->plan(); }
  std::vector<Parameter*> embedding_parameters() override { return {&embed_tokens_->weight}; }
  void begin_forward(bool training) override {
    if (router_log_) router_log_->begin_forward(training);
  }
  Tensor auxiliary_loss(int forwards) override { return router_log_ ? router_log_->auxiliary_loss(forwards) : Tensor(); }
  ExpertLoad take_expert_load() override { return router_log_ ? router_log_->take_load() : ExpertLoad{}; }
  std::vector<Parameter*> head_parameters() override {
    std::vector<Parameter*> out{&norm_.weight};
    if (!cfg_.tie_word_embeddings) out.push_back(&lm_head_->weight);
    return out;
  }

 private:
  ModelConfig cfg_;
  ParallelContextPtr ctx_;
  std::unique_ptr<VocabParallelEmbedding> embed_tokens_;
  std::vector<std::shared_ptr<DecoderBlock>> blocks_;
  std::shared_ptr<RouterLog> router_log_;   // a mixture of experts only
  RmsNorm norm_;
  std::unique_ptr<ColumnParallelLinear> lm_head_;
  std::int64_t vocab_offset_ = 0;
};

}  // namespace

const TensorParallelPlan& llama_tp_plan() { return llama_plan(); }

std::unique_ptr<DecoderFamily> make_llama_family(const ModelConfig& config, const ParallelContextPtr& ctx,
                                                 const StagePieces& pieces, std::uint64_t seed) {
  return std::make_unique<Llama>(config, ctx, pieces, seed);
}

}  // namespace meshgrad::nn
