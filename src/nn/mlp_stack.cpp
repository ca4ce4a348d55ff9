// The MLP stack: `layers` Megatron MLPs on a fixed random input, the model the MLP benchmarks and
// the peer comparison (torch_tp_mlp.py) run.
#include "mlp_stack.hpp"

#include "gelu_mlp.hpp"
#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/mappings.hpp"
#include "meshgrad/nn/decoder_lm.hpp"
#include "meshgrad/nn/fsdp.hpp"
#include "meshgrad/nn/invariant.hpp"
#include "meshgrad/nn/tp_plan.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/ops/tree_reduce.hpp"
#include "meshgrad/tensor/random.hpp"
#include "meshgrad/tensor/trace.hpp"

namespace meshgrad::nn {

namespace {

// `layers` of GPT-2's MLPs (split by its plan: c_fc column, c_proj row) on a fixed random
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
      mlps_.push_back(std::make_unique<GeluMlp>(fmt::format("h.{}.mlp", i), cfg, gpt2_tp_plan(), ctx_, seed));
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
  std::vector<std::unique_ptr<GeluMlp>> mlps_;   // GPT-2's MLPs, split by its plan
  std::unique_ptr<FsdpUnit> unit_;   // FSDP: every parameter, one unit
  Tensor input_;        // this rank's piece of the fixed input
  Shape input_shape_;   // what it was drawn for: the global shape, then the rows' offset and count
};

}  // namespace

std::unique_ptr<Model> make_mlp_stack(const ModelConfig& config, const ParallelConfig& parallel,
                                      dist::DeviceMeshPtr mesh, std::uint64_t seed) {
  return std::make_unique<MlpModel>(config, parallel, std::move(mesh), seed);
}

}  // namespace meshgrad::nn
