// A model of one's own in the full trainer (nn::register_model, nn::register_decoder_family): a
// program registers a kind, and train::train builds it on any mesh with checkpoints, resume and
// metrics as it builds gpt. The block here is GPT-2's, rewritten outside the library with nothing
// but public headers and run through gpt2_family_with_blocks: it trains bit for bit as --model gpt
// (the same operations in the same order), which holds the registry, the block factory and the
// trainer's handling of a registered kind to exactness, not to a tolerance.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <mutex>

#include "meshgrad/checkpoint/directory.hpp"
#include "meshgrad/nn/context_parallel.hpp"
#include "meshgrad/nn/decoder_lm.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/error.hpp"
#include "meshgrad/train/trainer.hpp"
#include "run_on_spec.hpp"

namespace test_registered_model {

using namespace meshgrad;
namespace fs = std::filesystem;

namespace {

// GPT-2's plan and block (src/nn/gpt2.cpp) with the public layers: the same names, initialisation
// and operations.
const nn::TensorParallelPlan& plan() {
  static const nn::TensorParallelPlan p{"gpt2-outside",
                                        {{"h.*.attn.c_attn", nn::LinearStyle::Column},
                                         {"h.*.attn.c_proj", nn::LinearStyle::Row},
                                         {"h.*.mlp.c_fc", nn::LinearStyle::Column},
                                         {"h.*.mlp.c_proj", nn::LinearStyle::Row}}};
  return p;
}

class OutsideGpt2Block final : public nn::DecoderBlock {
 public:
  OutsideGpt2Block(const std::string& name, const nn::ModelConfig& cfg, const nn::ParallelContextPtr& ctx,
                   std::uint64_t seed)
      : name_(name), ctx_(ctx), head_dim_(cfg.hidden / cfg.heads),
        ln_1_(name + ".ln_1", cfg.hidden, cfg.layer_norm_epsilon, ctx, cfg.dtype),
        ln_2_(name + ".ln_2", cfg.hidden, cfg.layer_norm_epsilon, ctx, cfg.dtype) {
    const double proj_std = 0.02 / std::sqrt(2.0 * cfg.layers);
    c_attn_ = plan().linear(name + ".attn.c_attn", {.in = cfg.hidden, .out = 3 * cfg.hidden, .blocks = 3,
                                                    .out_unit = head_dim_}, ctx, seed, cfg.dtype);
    c_proj_ = plan().linear(name + ".attn.c_proj", {.in = cfg.hidden, .out = cfg.hidden, .in_unit = head_dim_,
                                                    .init_std = proj_std}, ctx, seed, cfg.dtype);
    c_fc_ = plan().linear(name + ".mlp.c_fc", {.in = cfg.hidden, .out = cfg.ffn_size()}, ctx, seed, cfg.dtype);
    mlp_proj_ = plan().linear(name + ".mlp.c_proj", {.in = cfg.ffn_size(), .out = cfg.hidden, .init_std = proj_std},
                              ctx, seed, cfg.dtype);
  }
  const std::string& name() const override { return name_; }
  Tensor forward(const Tensor& x, std::int64_t seq, const nn::Dropout& dropout) const override {
    const Tensor h = add(x, dropout(attention(ln_1_.forward(x, seq), seq)));
    return add(h, dropout(mlp_proj_->forward(gelu(c_fc_->forward(ln_2_.forward(h, seq), seq)), seq)));
  }
  Tensor forward_cached(const Tensor&, const Tensor&, const Tensor&, std::int64_t, std::int64_t&) const override {
    throw InvalidArgument("outside-gpt2: no decoding");
  }
  Shape cache_shape(std::int64_t, std::int64_t) const override { throw InvalidArgument("outside-gpt2: no decoding"); }
  void collect(std::vector<nn::Parameter*>& out) override {
    out.insert(out.end(), {&ln_1_.weight, &ln_1_.bias});
    c_attn_->collect(out);
    c_proj_->collect(out);
    out.insert(out.end(), {&ln_2_.weight, &ln_2_.bias});
    c_fc_->collect(out);
    mlp_proj_->collect(out);
  }

 private:
  Tensor attention(const Tensor& x, std::int64_t seq) const {
    const Tensor qkv = c_attn_->forward(x, seq);   // [T, B, 3 * H_local * D]
    const std::int64_t b = qkv.size(1), local = qkv.size(2) / 3, heads = local / head_dim_;
    const TensorList parts = split(qkv, 2, {local, local, local});
    auto heads_first = [&](const Tensor& t) {
      return contiguous(permute(reshape(t, {seq, b, heads, head_dim_}), {1, 2, 0, 3}));
    };
    const Tensor y = nn::attention(heads_first(parts[0]), heads_first(parts[1]), heads_first(parts[2]), 0, ctx_);
    return c_proj_->forward(reshape(contiguous(permute(y, {2, 0, 1, 3})), {seq, b, local}), seq);
  }

  std::string name_;
  nn::ParallelContextPtr ctx_;
  std::int64_t head_dim_;
  nn::LayerNorm ln_1_, ln_2_;
  std::unique_ptr<nn::ParallelLinear> c_attn_, c_proj_, c_fc_, mlp_proj_;
};

// Registered once for the whole test binary (a registration lasts until unregistered).
const char* outside_kind() {
  static const bool registered = [] {
    nn::register_decoder_family(
        "gpt2-outside", nn::gpt2_family_with_blocks(
                            [](const std::string& name, int, const nn::ModelConfig& cfg, const nn::ParallelContextPtr& ctx,
                               std::uint64_t seed) { return std::make_shared<OutsideGpt2Block>(name, cfg, ctx, seed); },
                            2),
        "gpt", /*decodes=*/false);
    return true;
  }();
  (void)registered;
  return "gpt2-outside";
}

struct TrainedRun {
  train::TrainResult result;   // rank 0's
  std::vector<char> saved;     // --save's bytes
};

std::vector<char> read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TrainedRun train_on(const std::string& mesh, const std::string& kind, const fs::path& dir, int steps,
             const std::function<void(train::TrainOptions&)>& adjust = nullptr) {
  train::TrainOptions o;
  o.model = nn::ModelConfig::gpt(2, 32, 4, 256, 16, 4);
  o.model.kind = kind;
  o.model.dropout = 0.1;
  o.steps = steps;
  o.progress = false;
  o.grad_clip = 1.0;
  o.save_path = (dir / "model.safetensors").string();
  if (adjust) adjust(o);
  TrainedRun run;
  std::mutex mu;
  train::run_on(mesh, [&](const dist::DeviceMeshPtr& m) {
    const train::TrainResult r = train::train(o, m);
    if (m->rank() == 0) {
      const std::lock_guard<std::mutex> lock(mu);
      run.result = r;
    }
  });
  run.saved = read_bytes(o.save_path);
  return run;
}

class RegisteredModel : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / fmt::format("meshgrad-registered-{}", ::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

}  // namespace

TEST_F(RegisteredModel, AGpt2BlockWrittenOutsideTrainsBitForBitAsTheBuiltInGpt) {
  for (const std::string mesh : {"tp=2", "fsdp=2"}) {
    const auto sp = [&](train::TrainOptions& o) { o.parallel.sequence_parallel = mesh == "tp=2"; };
    fs::create_directories(dir_ / "gpt");
    fs::create_directories(dir_ / "outside");
    const TrainedRun want = train_on(mesh, "gpt", dir_ / "gpt", 4, sp);
    const TrainedRun got = train_on(mesh, outside_kind(), dir_ / "outside", 4, sp);
    EXPECT_EQ(got.result.losses, want.result.losses) << mesh;
    EXPECT_EQ(got.result.parameters, want.result.parameters) << mesh;
    // --save's tensors: the same names and bytes (its metadata names the kind, so compare the files' tails).
    ASSERT_GT(want.saved.size(), 1000u);
    const std::size_t n = 200000 < want.saved.size() ? 200000 : want.saved.size() / 2;
    EXPECT_TRUE(std::equal(want.saved.end() - static_cast<std::ptrdiff_t>(n), want.saved.end(),
                           got.saved.end() - static_cast<std::ptrdiff_t>(n)))
        << mesh;
  }
}

TEST_F(RegisteredModel, TheTrainerCheckpointsAndResumesARegisteredKindOnAnotherMesh) {
  const auto with_checkpoints = [&](train::TrainOptions& o) {
    o.checkpoint_dir = (dir_ / "ck").string();
    o.save_every = 2;
  };
  const TrainedRun whole = train_on("fsdp=2", outside_kind(), dir_, 6);
  train_on("fsdp=2", outside_kind(), dir_, 4, with_checkpoints);
  ASSERT_TRUE(fs::is_directory(dir_ / "ck" / "step_00000004"));
  // The same mesh resumes to the uninterrupted run's bits; another mesh to its rounding.
  const TrainedRun same = train_on("fsdp=2", outside_kind(), dir_, 6, [&](train::TrainOptions& o) {
    o.resume_dir = checkpoint::resolve_checkpoint((dir_ / "ck").string());
  });
  ASSERT_EQ(same.result.losses.size(), 2u);
  EXPECT_EQ(same.result.losses[1], whole.result.losses[5]);
  const TrainedRun other = train_on("tp=2", outside_kind(), dir_, 6, [&](train::TrainOptions& o) {
    o.resume_dir = checkpoint::resolve_checkpoint((dir_ / "ck").string());
  });
  ASSERT_EQ(other.result.losses.size(), 2u);
  EXPECT_NEAR(other.result.losses[1], whole.result.losses[5], 1e-4 * whole.result.losses[5]);
}

TEST(ModelRegistry, RefusesBuiltInMalformedAndDuplicateKindsByName) {
  const nn::ModelKind any{.build = [](const nn::ModelConfig&, const nn::ParallelConfig&, dist::DeviceMeshPtr,
                                      std::uint64_t) -> std::unique_ptr<nn::Model> { return nullptr; }};
  const auto message = [&](const std::string& kind, nn::ModelKind k) {
    try {
      nn::register_model(kind, std::move(k));
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("registered");
  };
  EXPECT_NE(message("llama", any).find("'llama' is a built-in model kind"), std::string::npos);
  EXPECT_NE(message("a b", any).find("letters, digits"), std::string::npos);
  EXPECT_NE(message("empty-factory", nn::ModelKind{}).find("has no factory"), std::string::npos);
  EXPECT_NE(message("counts-odd", nn::ModelKind{.build = any.build, .counts_like = "llama"}).find("counts like"),
            std::string::npos);
  ASSERT_EQ(message("null-model", any), "registered");
  EXPECT_NE(message("null-model", any).find("registered already"), std::string::npos);
  const auto kinds = nn::model_kinds();
  EXPECT_NE(std::find(kinds.begin(), kinds.end(), "null-model"), kinds.end());
  // A factory that returns nothing is named, not a crash.
  train::run_on("tp=1", [&](const dist::DeviceMeshPtr& m) {
    nn::ModelConfig c = nn::ModelConfig::gpt(1, 8, 2, 16);
    c.kind = "null-model";
    EXPECT_THROW(
        {
          try {
            nn::make_model(c, {}, m, 1);
          } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("factory of kind 'null-model' returned no model"), std::string::npos);
            throw;
          }
        },
        Error);
    c.kind = "never-registered";
    try {
      nn::make_model(c, {}, m, 1);
      ADD_FAILURE() << "an unknown kind built";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("unknown kind 'never-registered' (expected one of gpt, llama, mlp"),
                std::string::npos)
          << e.what();
    }
  });
  EXPECT_TRUE(nn::unregister_model("null-model"));
  EXPECT_FALSE(nn::unregister_model("null-model"));
}

TEST(ModelRegistry, ARegisteredKindCountsItsFlopsLikeTheKindItNames) {
  nn::ModelConfig gpt = nn::ModelConfig::gpt(2, 32, 4, 256, 16, 4);
  nn::ModelConfig outside = gpt;
  outside.kind = outside_kind();
  EXPECT_EQ(train::model_flops_per_token(outside, 1000), train::model_flops_per_token(gpt, 1000));
  EXPECT_EQ(train::lookup_only_parameters(outside), train::lookup_only_parameters(gpt));
  EXPECT_GT(train::lookup_only_parameters(outside), 0);
}

TEST(ModelRegistry, AFamilyWhoseBlocksDoNotDecodeRefusesDecodingByName) {
  // (Its kind says decodes = false, so `train --sample-every` refuses it before the first step:
  // python/tests/test_training_api.py holds the launch job to that.)
  train::run_on("tp=1", [&](const dist::DeviceMeshPtr& m) {
    nn::ModelConfig c = nn::ModelConfig::gpt(1, 32, 4, 256, 16, 1);
    c.kind = outside_kind();
    auto model = nn::make_model(c, {}, m, 1);
    try {
      model->new_cache(1);
      ADD_FAILURE() << "a block without decoding made a cache";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("no decoding"), std::string::npos) << e.what();
    }
  });
  EXPECT_FALSE(nn::registered_model(outside_kind())->decodes);
}

}  // namespace test_registered_model
