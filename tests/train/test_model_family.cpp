// A model family is its module tree plus its tensor-parallel plan (nn/decoder_lm.hpp, nn/tp_plan.hpp):
// a family written here, outside the library, with nothing but the public layers, gets tensor and
// sequence parallelism, 2-D grids, dp, fsdp, pipelines and activation checkpointing from the runner,
// and its gradients on every mesh are the one-rank model's (float64, 1e-12 relative: the meshes add
// the same terms in other orders, so agreement is to rounding, about 1e-16 per addition).
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <mutex>

#include "meshgrad/data/synthetic.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/mappings.hpp"
#include "meshgrad/nn/decoder_lm.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/train/step.hpp"
#include "run_on_spec.hpp"

namespace test_model_family {

using namespace meshgrad;

namespace {

// The toy's plan; a test drops a rule to see the refusal.
nn::TensorParallelPlan toy_plan() {
  return {"toy", {{"layers.*.up", nn::LinearStyle::Column}, {"layers.*.down", nn::LinearStyle::Row}}};
}

// h + down(gelu(up(norm(h)))): one dropout-free residual MLP block.
class ToyBlock final : public nn::DecoderBlock {
 public:
  ToyBlock(int index, const nn::ModelConfig& cfg, const nn::TensorParallelPlan& plan, const nn::ParallelContextPtr& ctx)
      : name_("layers." + std::to_string(index)), norm_(name_ + ".norm", cfg.hidden, 1e-5, ctx, cfg.dtype) {
    up_ = plan.linear(name_ + ".up", {.in = cfg.hidden, .out = cfg.ffn_size()}, ctx, 11, cfg.dtype);
    down_ = plan.linear(name_ + ".down", {.in = cfg.ffn_size(), .out = cfg.hidden, .bias = false}, ctx, 11, cfg.dtype);
  }
  const std::string& name() const override { return name_; }
  Tensor forward(const Tensor& x, std::int64_t seq, const nn::Dropout&) const override {
    return add(x, down_->forward(gelu(up_->forward(norm_.forward(x, seq), seq)), seq));
  }
  Tensor forward_cached(const Tensor&, const Tensor&, const Tensor&, std::int64_t, std::int64_t&) const override {
    throw InvalidArgument("toy: no attention, no decoding");
  }
  Shape cache_shape(std::int64_t, std::int64_t) const override { return {0}; }
  void collect(std::vector<nn::Parameter*>& out) override {
    out.push_back(&norm_.weight);
    out.push_back(&norm_.bias);
    up_->collect(out);
    down_->collect(out);
  }

 private:
  std::string name_;
  nn::LayerNorm norm_;
  std::unique_ptr<nn::ParallelLinear> up_, down_;
};

// A token table "embed" tied to the output layer, the blocks, a final norm.
class ToyFamily final : public nn::DecoderFamily {
 public:
  ToyFamily(const nn::ModelConfig& cfg, const nn::ParallelContextPtr& ctx, const nn::StagePieces& pieces,
            const nn::TensorParallelPlan& plan)
      : ctx_(ctx), norm_("norm", cfg.hidden, 1e-5, ctx, cfg.dtype) {
    if (pieces.embedding || pieces.head) {
      embed_ = std::make_unique<nn::VocabParallelEmbedding>("embed", cfg.vocab, cfg.hidden, ctx, 5, cfg.dtype);
    }
    for (int i = pieces.first_block; i < pieces.end_block; ++i) blocks_.push_back(std::make_shared<ToyBlock>(i, cfg, plan, ctx));
    head_ = std::make_unique<nn::ColumnParallelLinear>(
        "head", cfg.hidden, cfg.vocab, nn::ColumnParallelLinear::Options{.bias = false, .owns_weight = false}, ctx, 0,
        cfg.dtype);
  }
  int embedding_dropout_draws() const override { return 0; }
  int block_dropout_draws() const override { return 0; }
  nn::VocabParallelEmbedding* token_embedding() override { return embed_.get(); }
  bool tied_output() const override { return true; }
  Tensor embed(const Tensor& ids, const Tensor& table, const std::vector<nn::PositionRun>&, const nn::Dropout&) const override {
    return embed_->forward(ids, table);
  }
  const std::vector<std::shared_ptr<nn::DecoderBlock>>& blocks() const override { return blocks_; }
  Tensor final_norm(const Tensor& h, std::int64_t seq) const override { return norm_.forward(h, seq); }
  Tensor output_logits(const Tensor& h, std::int64_t seq, const Tensor& tied) const override {
    return head_->forward_with(h, seq, transpose(tied, 0, 1), Tensor());
  }
  std::int64_t vocab_offset() const override { return embed_->vocab_offset(); }
  const tree::SplitPlan& output_plan() const override { return head_->plan(); }
  std::vector<nn::Parameter*> embedding_parameters() override { return {&embed_->weight}; }
  std::vector<nn::Parameter*> head_parameters() override { return {&norm_.weight, &norm_.bias}; }

 private:
  nn::ParallelContextPtr ctx_;
  std::unique_ptr<nn::VocabParallelEmbedding> embed_;
  std::vector<std::shared_ptr<nn::DecoderBlock>> blocks_;
  nn::LayerNorm norm_;
  std::unique_ptr<nn::ColumnParallelLinear> head_;
};

nn::ModelConfig toy_config() {
  nn::ModelConfig cfg = nn::ModelConfig::gpt(/*layers=*/4, /*hidden=*/16, /*heads=*/1, /*vocab=*/37, /*seq=*/8,
                                             /*batch=*/4, DType::Float64);
  cfg.kind = "toy";
  cfg.ffn = 24;
  return cfg;
}

struct Gradients {
  double loss = 0;
  std::map<std::string, Tensor> by_name;
};

Gradients gradients_on(const std::string& spec, const nn::ParallelConfig& parallel,
                       const nn::TensorParallelPlan& plan = toy_plan()) {
  Gradients out;
  std::mutex mu;
  const nn::ModelConfig cfg = toy_config();
  train::run_on(spec, [&](const dist::DeviceMeshPtr& mesh) {
    auto model = nn::make_decoder_lm(
        cfg, parallel, mesh, 3,
        [&plan](const nn::ModelConfig& c, const nn::ParallelContextPtr& ctx, const nn::StagePieces& pieces, std::uint64_t) {
          return std::make_unique<ToyFamily>(c, ctx, pieces, plan);
        });
    const train::GradientDump dump = train::compute_gradients(*model, data::make_synthetic_batch(cfg, 1, 0, 9), mesh);
    const std::lock_guard<std::mutex> lock(mu);
    out.loss = dump.loss;
    for (const auto& [name, g] : dump.gradients) out.by_name.emplace(name, g);
  });
  return out;
}

double relative_difference(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_vector(), y = b.to_vector();
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    diff = std::max(diff, std::abs(x[i] - y[i]));
    scale = std::max(scale, std::abs(y[i]));
  }
  return x.size() == y.size() ? diff / std::max(scale, 1e-300) : INFINITY;
}

TEST(ModelFamily, AFamilyOutsideTheLibraryGetsEveryParallelismFromTheRunner) {
  const Gradients reference = gradients_on("tp=1", {});
  // embed, 4 blocks x (norm weight, bias, up weight, bias, down weight), the final norm's two.
  ASSERT_EQ(reference.by_name.size(), 1u + 4 * 5 + 2);
  struct Case {
    std::string mesh;
    nn::ParallelConfig parallel;
  };
  const std::vector<Case> cases = {
      {"tp=2", {}},
      {"tp=3", {.sequence_parallel = true}},
      {"tp=2", {.sequence_parallel = true, .overlap = true, .checkpoint_blocks = true}},
      {"tp=2x2", {}},
      {"dp=2,tp=2", {}},
      {"fsdp=2,tp=2", {}},
      {"pp=2", {}},
      {"pp=2,tp=2", {.sequence_parallel = true}},
      {"pp=3,fsdp=2", {}},
  };
  for (const Case& c : cases) {
    const Gradients got = gradients_on(c.mesh, c.parallel);
    EXPECT_NEAR(got.loss, reference.loss, 1e-12 * std::abs(reference.loss)) << c.mesh;
    ASSERT_EQ(got.by_name.size(), reference.by_name.size()) << c.mesh;
    for (const auto& [name, g] : reference.by_name) {
      ASSERT_TRUE(got.by_name.count(name)) << c.mesh << " lacks " << name;
      EXPECT_LT(relative_difference(got.by_name.at(name), g), 1e-12) << c.mesh << " " << name;
    }
  }
}

TEST(ModelFamily, APlanWithoutARuleForALinearIsRefusedNamingTheLayer) {
  nn::TensorParallelPlan plan = toy_plan();
  plan.rules.pop_back();   // "layers.*.down"
  try {
    gradients_on("tp=2", {}, plan);
    FAIL() << "a linear no rule names was built";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("tensor-parallel plan of toy: no rule names the linear layer 'layers.0.down'"),
              std::string::npos)
        << e.what();
  }
}

TEST(ModelFamily, PlanPatternsMatchWholeComponents) {
  EXPECT_TRUE(nn::plan_pattern_matches("h.*.attn.c_attn", "h.11.attn.c_attn"));
  EXPECT_FALSE(nn::plan_pattern_matches("h.*.attn.c_attn", "h.1.attn.c_attn.x"));
  EXPECT_FALSE(nn::plan_pattern_matches("h.*.attn", "h.1.2.attn"));
  EXPECT_FALSE(nn::plan_pattern_matches("h.*.mlp.c_fc", "h.1.mlp.c_fc2"));
  EXPECT_TRUE(nn::plan_pattern_matches("lm_head", "lm_head"));
  // The first matching rule decides.
  const nn::TensorParallelPlan plan{"t", {{"a.b", nn::LinearStyle::Row}, {"a.*", nn::LinearStyle::Column}}};
  EXPECT_EQ(plan.style_of("a.b"), nn::LinearStyle::Row);
  EXPECT_EQ(plan.style_of("a.c"), nn::LinearStyle::Column);
  EXPECT_THROW(plan.style_of("b.c"), InvalidArgument);
}

}  // namespace

}  // namespace test_model_family
