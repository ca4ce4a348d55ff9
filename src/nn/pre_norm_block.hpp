// The pre-norm transformer block GPT-2 (gpt2.cpp) and the Llama family (llama.cpp) share:
//   h = x + drop(attention(norm_1(x))),   out = h + drop(mlp(norm_2(h)))
// with the family's norm (LayerNorm, RmsNorm), attention and MLP. A family without dropout gets the
// runner's identity (decoder_lm.hpp: no draws when the probability is 0).
#pragma once

#include <string>
#include <vector>

#include "meshgrad/nn/decoder_lm.hpp"
#include "meshgrad/ops/ops.hpp"

namespace meshgrad::nn {

// The names of a block's parts: GPT-2's "ln_1", "attn", "ln_2", "mlp"; Llama's "input_layernorm",
// "self_attn", "post_attention_layernorm", "mlp".
struct PreNormNames {
  const char* norm_1;
  const char* attention;
  const char* norm_2;
  const char* mlp;
};

// Norm(name, features, eps, ctx, dtype) with forward(x, seq) and its parameters in collect_norm;
// Attention(name, cfg, ctx, seed) with forward, forward_cached, local_kv_heads, head_dim, collect;
// Mlp(name, cfg, ctx, seed[, extra...]) with forward(x, seq) and collect.
template <class Norm, class Attention, class Mlp>
class PreNormBlock final : public DecoderBlock {
 public:
  // extra: what the Mlp takes after the seed (a mixture of experts' router log).
  template <class... MlpExtra>
  PreNormBlock(std::string name, const PreNormNames& parts, const ModelConfig& cfg, const ParallelContextPtr& ctx,
               std::uint64_t seed, MlpExtra&&... extra)
      : name_(std::move(name)),
        norm_1_(name_ + "." + parts.norm_1, cfg.hidden, cfg.layer_norm_epsilon, ctx, cfg.dtype),
        attention_(name_ + "." + parts.attention, cfg, ctx, seed),
        norm_2_(name_ + "." + parts.norm_2, cfg.hidden, cfg.layer_norm_epsilon, ctx, cfg.dtype),
        mlp_(name_ + "." + parts.mlp, cfg, ctx, seed, std::forward<MlpExtra>(extra)...) {}

  const std::string& name() const override { return name_; }
  Tensor forward(const Tensor& x, std::int64_t seq, const Dropout& dropout) const override {
    const Tensor h = add(x, dropout(attention_.forward(norm_1_.forward(x, seq), seq)));
    return add(h, dropout(mlp_.forward(norm_2_.forward(h, seq), seq)));
  }
  Tensor forward_cached(const Tensor& x, const Tensor& keys, const Tensor& values, std::int64_t start,
                        std::int64_t& scores) const override {
    const Tensor h = add(x, attention_.forward_cached(norm_1_.forward(x), keys, values, start, scores));
    return add(h, mlp_.forward(norm_2_.forward(h), x.size(0)));
  }
  Shape cache_shape(std::int64_t batch, std::int64_t capacity) const override {
    return {batch, attention_.local_kv_heads(), capacity, attention_.head_dim()};
  }
  void collect(std::vector<Parameter*>& out) override {
    collect_norm(norm_1_, out);
    attention_.collect(out);
    collect_norm(norm_2_, out);
    mlp_.collect(out);
  }

 private:
  static void collect_norm(LayerNorm& norm, std::vector<Parameter*>& out) {
    out.push_back(&norm.weight);
    out.push_back(&norm.bias);
  }
  static void collect_norm(RmsNorm& norm, std::vector<Parameter*>& out) { out.push_back(&norm.weight); }

  std::string name_;
  Norm norm_1_;
  Attention attention_;
  Norm norm_2_;
  Mlp mlp_;
};

}  // namespace meshgrad::nn
