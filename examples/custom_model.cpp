// A model of one's own in the full trainer: GPT-J's "parallel" transformer block, written with the
// library's public layers and a tensor-parallel plan, registered as model kind "parallel-block" and
// trained by the job `meshgrad train` runs (checkpoints, resume, metrics), at fsdp=2 and then resumed
// at tp=2 from its checkpoint.
//
//   x + attention(norm(x)) + mlp(norm(x))     one LayerNorm; attention and a GELU MLP side by side
//
// The block never branches on the mesh: the plan names its column and row layers, and the runner
// (nn::make_decoder_lm through nn::gpt2_family_with_blocks) adds FSDP units, pipeline stages,
// activation checkpointing and the tied embedding from outside.
// Exit status 0 when the loss fell and the resumed run ended where the uninterrupted one did.
#include <fmt/core.h>

#include <cmath>
#include <filesystem>

#include "meshgrad/checkpoint/directory.hpp"
#include "meshgrad/launch/jobs.hpp"
#include "meshgrad/launch/launch.hpp"
#include "meshgrad/nn/context_parallel.hpp"
#include "meshgrad/nn/decoder_lm.hpp"
#include "meshgrad/ops/ops.hpp"

using namespace meshgrad;

namespace {

const nn::TensorParallelPlan& parallel_block_plan() {
  static const nn::TensorParallelPlan plan{"parallel-block",
                                           {{"h.*.attn.qkv", nn::LinearStyle::Column},   // whole heads per rank
                                            {"h.*.attn.out", nn::LinearStyle::Row},      // summed over tp
                                            {"h.*.mlp.up", nn::LinearStyle::Column},
                                            {"h.*.mlp.down", nn::LinearStyle::Row}}};
  return plan;
}

class ParallelBlock final : public nn::DecoderBlock {
 public:
  ParallelBlock(const std::string& name, const nn::ModelConfig& cfg, const nn::ParallelContextPtr& ctx,
                std::uint64_t seed)
      : name_(name), ctx_(ctx), head_dim_(cfg.hidden / cfg.heads),
        norm_(name + ".norm", cfg.hidden, cfg.layer_norm_epsilon, ctx, cfg.dtype) {
    const nn::TensorParallelPlan& plan = parallel_block_plan();
    const double out_std = 0.02 / std::sqrt(2.0 * cfg.layers);
    qkv_ = plan.linear(name + ".attn.qkv", {.in = cfg.hidden, .out = 3 * cfg.hidden, .blocks = 3, .out_unit = head_dim_},
                       ctx, seed, cfg.dtype);
    out_ = plan.linear(name + ".attn.out", {.in = cfg.hidden, .out = cfg.hidden, .in_unit = head_dim_, .init_std = out_std},
                       ctx, seed, cfg.dtype);
    up_ = plan.linear(name + ".mlp.up", {.in = cfg.hidden, .out = cfg.ffn_size()}, ctx, seed, cfg.dtype);
    down_ = plan.linear(name + ".mlp.down", {.in = cfg.ffn_size(), .out = cfg.hidden, .init_std = out_std}, ctx, seed,
                        cfg.dtype);
  }
  const std::string& name() const override { return name_; }
  // x [T(_local), B, C] -> the same; one dropout draw.
  Tensor forward(const Tensor& x, std::int64_t seq, const nn::Dropout& dropout) const override {
    const Tensor h = norm_.forward(x, seq);
    return add(x, dropout(add(attention(h, seq), down_->forward(gelu(up_->forward(h, seq)), seq))));
  }
  Tensor forward_cached(const Tensor&, const Tensor&, const Tensor&, std::int64_t, std::int64_t&) const override {
    throw InvalidArgument("parallel-block: this example does not decode");
  }
  Shape cache_shape(std::int64_t, std::int64_t) const override {
    throw InvalidArgument("parallel-block: this example does not decode");
  }
  void collect(std::vector<nn::Parameter*>& out) override {
    out.insert(out.end(), {&norm_.weight, &norm_.bias});
    for (const auto* layer : {&qkv_, &out_, &up_, &down_}) (*layer)->collect(out);
  }

 private:
  Tensor attention(const Tensor& h, std::int64_t seq) const {
    const Tensor qkv = qkv_->forward(h, seq);   // [T, B, 3 * H_local * D]: the whole sequence
    const std::int64_t b = qkv.size(1), local = qkv.size(2) / 3, heads = local / head_dim_;
    const TensorList parts = split(qkv, 2, {local, local, local});
    auto heads_first = [&](const Tensor& t) {   // [T, B, H * D] -> [B, H, T, D]
      return contiguous(permute(reshape(t, {seq, b, heads, head_dim_}), {1, 2, 0, 3}));
    };
    const Tensor y = nn::attention(heads_first(parts[0]), heads_first(parts[1]), heads_first(parts[2]), 0, ctx_);
    return out_->forward(reshape(contiguous(permute(y, {2, 0, 1, 3})), {seq, b, local}), seq);
  }

  std::string name_;
  nn::ParallelContextPtr ctx_;
  std::int64_t head_dim_;
  nn::LayerNorm norm_;
  std::unique_ptr<nn::ParallelLinear> qkv_, out_, up_, down_;
};

}  // namespace

int main() {
  try {
    nn::register_decoder_family(
        "parallel-block",
        nn::gpt2_family_with_blocks(
            [](const std::string& name, int, const nn::ModelConfig& cfg, const nn::ParallelContextPtr& ctx,
               std::uint64_t seed) { return std::make_shared<ParallelBlock>(name, cfg, ctx, seed); },
            /*block_dropout_draws=*/1),
        "gpt", /*decodes=*/false);

    const std::filesystem::path dir = std::filesystem::temp_directory_path() / "meshgrad-custom-model-example";
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    train::TrainOptions options;
    options.model = nn::ModelConfig::gpt(/*layers=*/2, /*hidden=*/64, /*heads=*/4, /*vocab=*/256, /*seq=*/32, /*batch=*/8);
    options.model.kind = "parallel-block";
    options.steps = 30;
    options.decay_steps = 20;   // given, the schedule does not depend on --steps: the first half's is the whole's
    options.progress = false;

    // The whole run at fsdp=2; then the first half with checkpoints, resumed at tp=2.
    const train::TrainResult whole = launch::run_train_job(options, launch::mesh_runner("threads", "fsdp=2"));
    train::TrainOptions first = options;
    first.steps = 15;
    first.checkpoint_dir = (dir / "checkpoints").string();
    launch::run_train_job(first, launch::mesh_runner("threads", "fsdp=2"));
    train::TrainOptions second = options;
    second.resume_dir = checkpoint::resolve_checkpoint(first.checkpoint_dir);
    const train::TrainResult resumed = launch::run_train_job(second, launch::mesh_runner("threads", "tp=2"));
    std::filesystem::remove_all(dir);

    const double end = resumed.losses.back(), want = whole.losses.back();
    fmt::print("parallel-block: {} parameters; fsdp=2 loss {:.4f} -> {:.4f}; resumed at tp=2 from step {}: {:.4f} "
               "(uninterrupted {:.4f})\n", whole.parameters, whole.losses.front(), want, resumed.first_step, end, want);
    // Another mesh adds in another order: float32 rounding, not a different run.
    const bool ok = whole.end_loss() < whole.start_loss() - 0.5 && resumed.first_step == 15 &&
                    std::abs(end - want) <= 1e-3 * want;
    fmt::print("{}\n", ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "custom_model: error: {}\n", e.what());
    return 1;
  }
}
