// The micro-batches of a step are added in the order of the summation policy (micro_batches.hpp):
// left to right through .grad in rank order, in the fixed tree otherwise; the synchroniser reduces
// once per step either way, and a dp mesh with the tree adds the micro-batches' totals in the same
// tree over dp.
//
// Micro-batch k contributes the gradient 1e16, 1, -1e16, 1 (k = 0..3), float64: left to right gives
// 1 (1e16 + 1 rounds to 1e16), the tree (g0 + g1) + (g2 + g3) gives 0.
#include <gtest/gtest.h>

#include <chrono>
#include <vector>

#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/comm/threads.hpp"
#include "meshgrad/distributed/placement.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/optim/micro_batches.hpp"

namespace meshgrad::optim::test_micro_batches {
namespace {

constexpr double kTerms[] = {1e16, 1.0, -1e16, 1.0};

void run_mesh(int dp, const std::function<void(const dist::DeviceMeshPtr&)>& fn) {
  comm::ThreadsOptions options;
  options.timeout = std::chrono::milliseconds(20000);
  comm::run_ranks(
      dp,
      [&](const comm::CommunicatorPtr& world) {
        fn(std::make_shared<const dist::DeviceMesh>(world, std::vector<dist::MeshAxis>{{"dp", dp}, {"tp", 1}}));
      },
      options);
}

nn::Parameter make_param(const dist::DeviceMeshPtr& mesh) {
  nn::Parameter p;
  p.name = "w";
  p.value = Tensor::zeros({1}, DType::Float64);
  p.value.set_requires_grad(true);
  p.full_shape = {1};
  p.mesh = mesh;
  p.placements = {dist::Replicate(), dist::Replicate()};
  return p;
}

// Runs `micro` micro-batches per rank on dp ranks; micro-batch k of rank r has the gradient
// kTerms[r * micro + k]. Returns every rank's final gradient and summed loss.
struct Outcome {
  std::vector<double> grads, losses;
  int launched = -1;
};
Outcome step(int dp, int micro, dist::ReduceOrder order) {
  Outcome out;
  out.grads.assign(static_cast<std::size_t>(dp), -7);
  out.losses.assign(static_cast<std::size_t>(dp), -7);
  run_mesh(dp, [&](const dist::DeviceMeshPtr& mesh) {
    nn::Parameter w = make_param(mesh);
    GradientSynchronizer sync({&w}, mesh, {.order = order});
    MicroBatchGradients grads({&w}, sync, order, micro);
    MicroBatchLosses losses(order);
    const int r = mesh->rank();
    for (int k = 0; k < micro; ++k) {
      const Tensor x = Tensor::from_values({kTerms[r * micro + k]}, {1}, DType::Float64);
      grads.before_backward(k);
      Tensor loss = sum(mul(w.value, x));
      if (dp > 1) loss = dist::mark_partial_grad(loss, dist::axis_bit(0));
      backward(loss);
      grads.after_backward(k);
      losses.push(Tensor::from_values({kTerms[r * micro + k]}, {1}, DType::Float64));
    }
    grads.finish();
    if (r == 0) out.launched = sync.launched();
    sync.finish();
    out.grads[static_cast<std::size_t>(r)] = w.value.grad().item();
    out.losses[static_cast<std::size_t>(r)] = losses.total().item();
  });
  return out;
}

TEST(MicroBatches, FourMicroBatchesAddInTheOrderOfThePolicy) {
  const Outcome rank = step(1, 4, dist::ReduceOrder::RankOrder);
  EXPECT_EQ(rank.grads[0], 1.0);
  EXPECT_EQ(rank.losses[0], 1.0);
  const Outcome tree = step(1, 4, dist::ReduceOrder::FixedTree);
  EXPECT_EQ(tree.grads[0], 0.0);
  EXPECT_EQ(tree.losses[0], 0.0);
}

// dp=2 with two micro-batches each is the same tree as one rank with four: the replicas' roots
// (g0 + g1) and (g2 + g3) are added over dp in the tree, so the bits do not depend on the mesh. In
// rank order they do: dp=2 happens to pair the terms like the tree (0), one rank adds them left to
// right (1). One dp reduction per step either way.
TEST(MicroBatches, AcrossDpTheTreeContinues) {
  const Outcome tree = step(2, 2, dist::ReduceOrder::FixedTree);
  for (double g : tree.grads) EXPECT_EQ(g, step(1, 4, dist::ReduceOrder::FixedTree).grads[0]);
  EXPECT_EQ(tree.launched, 1);
  const Outcome rank = step(2, 2, dist::ReduceOrder::RankOrder);
  EXPECT_EQ(rank.launched, 1);
  for (double g : rank.grads) EXPECT_EQ(g, 0.0);
  EXPECT_NE(rank.grads[0], step(1, 4, dist::ReduceOrder::RankOrder).grads[0]);
}

TEST(MicroBatches, RefusesATreeOfThreeAndOutOfOrderCalls) {
  run_mesh(1, [](const dist::DeviceMeshPtr& mesh) {
    nn::Parameter w = make_param(mesh);
    GradientSynchronizer sync({&w}, mesh);
    EXPECT_THROW(MicroBatchGradients({&w}, sync, dist::ReduceOrder::FixedTree, 3), InvalidArgument);
    MicroBatchGradients grads({&w}, sync, dist::ReduceOrder::RankOrder, 2);
    EXPECT_THROW(grads.before_backward(1), InvalidArgument);
    EXPECT_THROW(grads.finish(), InvalidArgument);
  });
}

// A model whose only state is what MicroBatchGradients tells it.
class AccumulationRecorder final : public nn::Model {
 public:
  explicit AccumulationRecorder(nn::Parameter* w) : w_(w) {}
  Tensor loss(const nn::Batch&, std::int64_t) override { return Tensor(); }
  std::vector<nn::Parameter*> parameters() override { return {w_}; }
  const nn::ModelConfig& config() const override { return config_; }
  void set_training(bool) override {}
  void set_accumulating(bool on) override { calls.push_back(on); }
  std::vector<bool> calls;

 private:
  nn::Parameter* w_;
  nn::ModelConfig config_;
};

// MicroBatchGradients is the one object that knows which backward is the last: it tells the model
// (fsdp units and the tied weight hold their sums until then) in the same call that arms the
// synchroniser, and releases it in finish(), so no caller keeps the two in step (issue 36).
TEST(MicroBatches, TheModelIsToldWhichBackwardIsTheLast) {
  run_mesh(1, [](const dist::DeviceMeshPtr& mesh) {
    nn::Parameter w = make_param(mesh);
    GradientSynchronizer sync({&w}, mesh);
    AccumulationRecorder model(&w);
    MicroBatchGradients grads(model, sync, 3);
    for (int k = 0; k < 3; ++k) {
      grads.before_backward(k);
      backward(sum(mul(w.value, Tensor::from_values({1.0}, {1}, DType::Float64))));
      grads.after_backward(k);
    }
    grads.finish();
    sync.finish();
    EXPECT_EQ(model.calls, (std::vector<bool>{true, true, false, false}));
    EXPECT_EQ(w.value.grad().item(), 3.0);
  });
}

}  // namespace
}  // namespace meshgrad::optim::test_micro_batches
