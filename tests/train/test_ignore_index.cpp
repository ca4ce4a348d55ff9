// Targets of -100 (PyTorch's ignore_index): the mean cross-entropy is over the other targets, as in
// PyTorch and Hugging Face, so a gradient dump compares with theirs (reliability.md probe #66).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/comm/threads.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/random.hpp"
#include "meshgrad/train/trainer.hpp"

namespace meshgrad::train::test_ignore_index {
namespace {

nn::ModelConfig tiny(int batch) {
  nn::ModelConfig c;
  c.kind = "gpt";
  c.layers = 1;
  c.hidden = 16;
  c.heads = 4;
  c.vocab = 37;
  c.seq = 6;
  c.batch = batch;
  c.dtype = DType::Float64;
  return c;
}

// The gradient dump of the tiny GPT (seed 5) on a dp x tp mesh; all parameters zero when `zero`.
GradientDump dump(const nn::Batch& batch, int dp, int tp, bool zero) {
  GradientDump result;
  comm::ThreadsOptions options;
  options.timeout = std::chrono::milliseconds(60000);
  comm::run_ranks(
      dp * tp,
      [&](const comm::CommunicatorPtr& world) {
        const auto mesh =
            std::make_shared<const dist::DeviceMesh>(world, std::vector<dist::MeshAxis>{{"dp", dp}, {"tp", tp}});
        auto model = nn::make_model(tiny(static_cast<int>(batch.inputs.size(0))), {}, mesh, 5);
        model->set_training(false);
        if (zero) {
          autograd::NoGradGuard no_grad;
          for (nn::Parameter* p : model->parameters())
            p->value.detach().copy_from(Tensor::zeros(p->value.shape(), p->value.dtype()));
        }
        GradientDump d = compute_gradients(*model, batch, mesh);
        if (mesh->rank() == 0) result = d;
      },
      options);
  return result;
}

Tensor int64(const std::vector<std::int64_t>& values, Shape shape) { return Tensor::from_int64(values, std::move(shape)); }

// With every parameter zero the logits are all 0 (the final layer norm outputs its zero bias), so
// every non-ignored token's loss is ln(V) exactly and so is their mean, however many are ignored.
// Dividing by B * T instead would give ln(V) * (non-ignored / all).
TEST(IgnoreIndex, MeanIsOverNonIgnoredTargetsClosedForm) {
  const Tensor inputs = int64({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, {2, 6});
  for (const auto& targets : {std::vector<std::int64_t>{2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13},
                              std::vector<std::int64_t>{2, -100, 4, -100, 6, 7, -100, -100, -100, -100, -100, 13},
                              std::vector<std::int64_t>{-100, -100, -100, -100, -100, -100, -100, -100, -100, -100,
                                                        -100, 36}}) {
    for (const auto& [dp, tp] : {std::pair{1, 1}, std::pair{2, 2}}) {
      const GradientDump d = dump({inputs, int64(targets, {2, 6})}, dp, tp, /*zero=*/true);
      EXPECT_NEAR(d.loss, std::log(37.0), 1e-12) << "dp=" << dp << " tp=" << tp << " targets[1]=" << targets[1];
    }
  }
}

// A row whose targets are all -100 changes nothing: the dump equals that of the other row alone
// (the probe: half the batch ignored gave exactly half the loss).
TEST(IgnoreIndex, AnIgnoredRowIsAsIfAbsent) {
  const Tensor row0_inputs = random::randint({1, 6}, 11, 37);
  const Tensor row0_targets = random::randint({1, 6}, 12, 37);
  const Tensor both_inputs = kernels::cat({row0_inputs, random::randint({1, 6}, 13, 37)}, 0);
  const Tensor both_targets = kernels::cat({row0_targets, int64(std::vector<std::int64_t>(6, -100), {1, 6})}, 0);
  const GradientDump alone = dump({row0_inputs, row0_targets}, 1, 2, false);
  const GradientDump with_ignored = dump({both_inputs, both_targets}, 1, 2, false);
  EXPECT_NEAR(with_ignored.loss, alone.loss, 1e-12 * alone.loss);
  ASSERT_EQ(with_ignored.gradients.size(), alone.gradients.size());
  for (std::size_t i = 0; i < alone.gradients.size(); ++i) {
    const auto a = alone.gradients[i].second.to_vector();
    const auto b = with_ignored.gradients[i].second.to_vector();
    double diff = 0, scale = 0;
    for (std::size_t k = 0; k < a.size(); ++k) {
      diff = std::max(diff, std::abs(a[k] - b[k]));
      scale = std::max(scale, std::abs(a[k]));
    }
    EXPECT_LE(diff, 1e-12 * scale) << alone.gradients[i].first;
  }
}

TEST(IgnoreIndex, EveryTargetIgnoredIsAnError) {
  EXPECT_EQ(count_loss_targets(int64({-100, 3, -100, 0}, {2, 2})), 2);
  try {
    (void)count_loss_targets(int64({-100, -100}, {1, 2}));
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("every one of the 2 targets is -100"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace meshgrad::train::test_ignore_index
