// The models: a GPT-2 (pre-LN, learned positions, GELU tanh, tied embedding and output) and a
// stack of Megatron MLPs, both tensor-parallel on the mesh's tp axis.
#include <cmath>

#include "meshgrad/autograd/checkpoint.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/mappings.hpp"
#include "meshgrad/nn/layers.hpp"
#include "meshgrad/ops/ops.hpp"

namespace meshgrad::nn {

namespace {

// Offsets of this rank's piece of a [T, B, C] activation: sharded along T under SP.
std::vector<std::int64_t> activation_offsets(const ParallelContext& ctx, std::int64_t seq) {
  const std::int64_t t0 = ctx.sequence_parallel() ? shard_range(seq, ctx.tp_size(), ctx.tp_rank()).offset : 0;
  return {t0, 0, 0};
}

// ---- GPT ------------------------------------------------------------------------------------------

class Attention {
 public:
  Attention(const std::string& name, const ModelConfig& cfg, const ParallelContext& ctx, std::uint64_t seed)
      : head_dim_(cfg.hidden / cfg.heads), ctx_(&ctx),
        c_attn_(name + ".c_attn", cfg.hidden, 3 * cfg.hidden,
                {.bias = true, .gather_output = false, .blocks = 3, .unit = cfg.hidden / cfg.heads, .init_std = 0.02},
                ctx, seed, cfg.dtype),
        c_proj_(name + ".c_proj", cfg.hidden, cfg.hidden,
                {.bias = true, .input_is_parallel = true, .unit = cfg.hidden / cfg.heads,
                 .init_std = 0.02 / std::sqrt(2.0 * cfg.layers)},
                ctx, seed, cfg.dtype) {
    MG_CHECK(cfg.hidden % cfg.heads == 0, "gpt: n_embd {} is not divisible by n_head {}", cfg.hidden, cfg.heads);
  }

  // x: [T(_local), B, C] -> same.
  Tensor forward(const Tensor& x, std::int64_t seq) const {
    const Tensor qkv = c_attn_.forward(x, seq);          // [T, B, 3 * H_local * D]
    const std::int64_t b = qkv.size(1);
    const std::int64_t local = qkv.size(2) / 3;
    const std::int64_t heads = local / head_dim_;
    auto heads_first = [&](const Tensor& t) {          // [T, B, H_l * D] -> [B, H_l, T, D]
      return contiguous(permute(reshape(t, {seq, b, heads, head_dim_}), {1, 2, 0, 3}));
    };
    const TensorList parts = split(qkv, 2, {local, local, local});
    const Tensor y = causal_attention(heads_first(parts[0]), heads_first(parts[1]), heads_first(parts[2]));
    const Tensor merged = reshape(contiguous(permute(y, {2, 0, 1, 3})), {seq, b, local});
    return c_proj_.forward(merged);
  }
  void collect(std::vector<Parameter*>& out) {
    for (Parameter* p : {&c_attn_.weight, &c_attn_.bias, &c_proj_.weight, &c_proj_.bias}) out.push_back(p);
  }

 private:
  std::int64_t head_dim_;
  const ParallelContext* ctx_;
  ColumnParallelLinear c_attn_;
  RowParallelLinear c_proj_;
};

class Mlp {
 public:
  Mlp(const std::string& name, std::int64_t hidden, std::int64_t ffn, int layers, const ParallelContext& ctx,
      std::uint64_t seed, DType dtype)
      : c_fc_(name + ".c_fc", hidden, ffn, {}, ctx, seed, dtype),
        c_proj_(name + ".c_proj", ffn, hidden, {.init_std = 0.02 / std::sqrt(2.0 * layers)}, ctx, seed, dtype) {}
  Tensor forward(const Tensor& x, std::int64_t seq) const { return c_proj_.forward(gelu(c_fc_.forward(x, seq))); }
  void collect(std::vector<Parameter*>& out) {
    for (Parameter* p : {&c_fc_.weight, &c_fc_.bias, &c_proj_.weight, &c_proj_.bias}) out.push_back(p);
  }

 private:
  ColumnParallelLinear c_fc_;
  RowParallelLinear c_proj_;
};

class Block {
 public:
  Block(int index, const ModelConfig& cfg, const ParallelContext& ctx, std::uint64_t seed)
      : prefix_(fmt::format("h.{}", index)),
        ln_1_(prefix_ + ".ln_1", cfg.hidden, cfg.layer_norm_epsilon, ctx, cfg.dtype),
        attn_(prefix_ + ".attn", cfg, ctx, seed),
        ln_2_(prefix_ + ".ln_2", cfg.hidden, cfg.layer_norm_epsilon, ctx, cfg.dtype),
        mlp_(prefix_ + ".mlp", cfg.hidden, cfg.ffn_size(), cfg.layers, ctx, seed, cfg.dtype) {}

  // x: [T(_local), B, C]; dropout_seed(): the next dropout seed (same sequence on every rank).
  Tensor forward(const Tensor& x, std::int64_t seq, const std::function<Tensor(const Tensor&)>& dropout) const {
    dist::CommLabelScope label(prefix_);
    const Tensor h = add(x, dropout(attn_.forward(ln_1_.forward(x), seq)));
    return add(h, dropout(mlp_.forward(ln_2_.forward(h), seq)));
  }
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
};

class Gpt final : public Model {
 public:
  Gpt(const ModelConfig& cfg, const ParallelConfig& parallel, dist::DeviceMeshPtr mesh, std::uint64_t seed)
      : cfg_(cfg), ctx_(ParallelContext::on(std::move(mesh), parallel)),
        wte_("wte", cfg.vocab, cfg.hidden, ctx_, seed, cfg.dtype),
        ln_f_("ln_f", cfg.hidden, cfg.layer_norm_epsilon, ctx_, cfg.dtype), dropout_gen_(seed ^ 0xD50F) {
    wpe_ = make_parameter("wpe.weight", {cfg.n_positions(), cfg.hidden}, ShardSpec{}, ctx_, seed, 0.02, 0.0, cfg.dtype);
    for (int i = 0; i < cfg.layers; ++i) blocks_.push_back(std::make_unique<Block>(i, cfg_, ctx_, seed));
  }

  Tensor loss(const Batch& batch, std::int64_t global_tokens) override {
    check_dtype(batch.inputs, DType::Int64, "gpt", "inputs");
    check_dtype(batch.targets, DType::Int64, "gpt", "targets");
    MG_CHECK(batch.inputs.dim() == 2 && batch.targets.shape() == batch.inputs.shape(),
             "gpt: inputs {} and targets {} must both be [B, T]", shape_str(batch.inputs.shape()),
             shape_str(batch.targets.shape()));
    const std::int64_t b = batch.inputs.size(0), seq = batch.inputs.size(1), c = cfg_.hidden;
    MG_CHECK(seq <= cfg_.n_positions(), "gpt: sequence length {} exceeds n_positions {}", seq, cfg_.n_positions());
    const bool sp = ctx_.sequence_parallel();
    const Tensor ids = batch.inputs.transpose(0, 1).contiguous();    // [T, B]

    // Embedding: vocab-parallel partial sums, reduced over tp (all-reduce, or reduce-scatter along
    // the sequence under SP), plus positions.
    Tensor h;
    {
      dist::CommLabelScope label("wte");
      const Tensor partial = wte_.forward_partial(ids);               // [T, B, C], partial over tp
      h = sp ? dist::reduce_scatter_to_sequence(partial, ctx_.tp, 0) : dist::reduce_from_region(partial, ctx_.tp);
    }
    const std::int64_t t0 = activation_offsets(ctx_, seq)[0];
    const std::int64_t t_local = h.size(0);
    Tensor pos = reshape(narrow(wpe_.value, 0, t0, t_local), {t_local, 1, c});
    h = add(h, sp ? ctx_.partial_over_tp(pos) : pos);

    // Captures by value: a checkpointed block calls it again during backward, after loss() returned.
    const std::function<Tensor(const Tensor&)> dropout = [this, seq, b, c](const Tensor& x) {
      if (!training_ || cfg_.dropout == 0) return x;
      return dropout_global(x, cfg_.dropout, dropout_gen_.next_seed(), {seq, b, c}, activation_offsets(ctx_, seq));
    };
    h = dropout(h);
    for (const auto& block : blocks_) {
      if (ctx_.config.checkpoint_blocks) {
        const Block* blk = block.get();
        h = autograd::checkpoint(
            [blk, seq, dropout](const TensorList& in) { return TensorList{blk->forward(in[0], seq, dropout)}; }, {h},
            {&dropout_gen_})[0];
      } else {
        h = block->forward(h, seq, dropout);
      }
    }
    h = ln_f_.forward(h);

    // Tied output layer: column-parallel over the vocabulary with wte^T; logits stay sharded.
    const Tensor logits = lm_head_forward(h, seq);                   // [T, B, V_local]
    const Tensor targets = batch.targets.transpose(0, 1).contiguous().view({-1});
    return vocab_parallel_cross_entropy(reshape(logits, {-1, logits.size(2)}), targets, wte_.vocab_offset(),
                                        cfg_.vocab, ctx_.tp, static_cast<double>(global_tokens));
  }

  std::vector<Parameter*> parameters() override {
    std::vector<Parameter*> out{&wte_.weight, &wpe_};
    for (auto& b : blocks_) b->collect(out);
    out.push_back(&ln_f_.weight);
    out.push_back(&ln_f_.bias);
    return out;
  }
  const ModelConfig& config() const override { return cfg_; }
  void set_training(bool training) override { training_ = training; }

 private:
  // The LM head is a column-parallel linear whose weight is wte^T ([C, V_local], a view).
  Tensor lm_head_forward(const Tensor& h, std::int64_t seq) {
    if (!lm_head_) {
      ColumnParallelLinear::Options o;
      o.bias = false;
      o.owns_weight = false;   // the weight is wte's
      lm_head_ = std::make_unique<ColumnParallelLinear>("lm_head", cfg_.hidden, cfg_.vocab, o, ctx_, 0, cfg_.dtype);
    }
    return lm_head_->forward_with(h, seq, transpose(wte_.weight.value, 0, 1), Tensor());
  }

  ModelConfig cfg_;
  ParallelContext ctx_;
  VocabParallelEmbedding wte_;
  Parameter wpe_;
  std::vector<std::unique_ptr<Block>> blocks_;
  LayerNorm ln_f_;
  std::unique_ptr<ColumnParallelLinear> lm_head_;   // no weight of its own: holds its communication buffer
  random::Generator dropout_gen_;
  bool training_ = true;
};

// ---- MLP stack --------------------------------------------------------------------------------------

// `layers` Megatron MLPs (column h -> f, GELU, row f -> h) on a fixed random input [T, B, H]
// (sequence-sharded under SP);
// loss = sum of squares of the output / (global_tokens * H) (the mean square, as the peer
// benchmark torch_tp_mlp.py uses).
class MlpModel final : public Model {
 public:
  MlpModel(const ModelConfig& cfg, const ParallelConfig& parallel, dist::DeviceMeshPtr mesh, std::uint64_t seed)
      : cfg_(cfg), ctx_(ParallelContext::on(std::move(mesh), parallel)), seed_(seed) {
    for (int i = 0; i < cfg.layers; ++i) {
      mlps_.push_back(std::make_unique<Mlp>(fmt::format("h.{}.mlp", i), cfg.hidden, cfg.ffn_size(), cfg.layers, ctx_,
                                            seed, cfg.dtype));
    }
  }

  Tensor loss(const Batch& batch, std::int64_t global_tokens) override {
    const std::int64_t b = batch.inputs.size(0), seq = batch.inputs.size(1), hdim = cfg_.hidden;
    random::Box box{{0, seq}, {0, b}, {0, hdim}};
    if (ctx_.sequence_parallel()) box[0] = shard_range(seq, ctx_.tp_size(), ctx_.tp_rank());
    // The input is drawn once per shape; each call uses a fresh leaf over it that requires grad
    // (as in the PyTorch peer benchmark), so backward computes and communicates dX of the first
    // layer too.
    if (!input_.defined() || input_shape_ != Shape{seq, b, hdim}) {
      input_ = random::randn({seq, b, hdim}, seed_ ^ 0x1A9u, cfg_.dtype, 0.0, 1.0, box);
      input_shape_ = {seq, b, hdim};
    }
    Tensor h = input_.detach();
    h.set_requires_grad();
    for (std::size_t i = 0; i < mlps_.size(); ++i) {
      dist::CommLabelScope label(fmt::format("h.{}", i));
      h = mlps_[i]->forward(h, seq);
    }
    Tensor sq = sum(mul(h, h));
    if (ctx_.sequence_parallel()) {
      // Each rank holds its own tokens: the loss is the sum over tp of the local sums.
      dist::CommLabelScope label("loss");
      sq = dist::reduce_from_region(sq, ctx_.tp);
    }
    return scale(sq, 1.0 / static_cast<double>(global_tokens * hdim));
  }
  std::vector<Parameter*> parameters() override {
    std::vector<Parameter*> out;
    for (auto& m : mlps_) m->collect(out);
    return out;
  }
  const ModelConfig& config() const override { return cfg_; }
  void set_training(bool) override {}

 private:
  ModelConfig cfg_;
  ParallelContext ctx_;
  std::uint64_t seed_;
  std::vector<std::unique_ptr<Mlp>> mlps_;
  Tensor input_;        // this rank's piece of the fixed input
  Shape input_shape_;   // the global shape it was drawn for
};

}  // namespace

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
