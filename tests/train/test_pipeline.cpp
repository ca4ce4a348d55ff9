// Pipeline parallelism (pipeline/): a mesh with pp=P stages and M micro-batches trains bitwise as
// the same mesh without pp and --grad-accum M: every loss, every gradient norm, every gradient and
// every parameter after 20 steps, with either schedule, with tp (SP, overlap), dp, dropout, block
// checkpointing, uneven stages and float64.
//
// Why bits and not a tolerance: a pipeline moves where the layers run, not the order of any sum
// (each stage adds micro-batch k's gradient after k - 1's, the tied wte's two gradients meet once
// in the order one rank adds them, nn/tied_weight.hpp), so any changed bit is a bug: a lost or
// doubled micro-batch, a gradient sent to the wrong stage, a dropout seed drawn out of turn.
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "meshgrad/comm/threads.hpp"
#include "run_on_spec.hpp"
#include "meshgrad/data/synthetic.hpp"
#include "meshgrad/nn/parameter.hpp"
#include "meshgrad/optim/grad_norm.hpp"
#include "meshgrad/train/step.hpp"

namespace meshgrad::train::test_pipeline {
namespace {

struct Options {
  bool sp = false, overlap = false, checkpoint_blocks = false, tree = false, shard_optimizer = false;
  bool reshard = true;
  int layers = 4;
  int micro = 4;
  double dropout = 0.1;
  std::vector<int> pp_layers = {};
  pipeline::ScheduleKind schedule = pipeline::ScheduleKind::OneFOneB;
  DType dtype = DType::Float32;
};

nn::ModelConfig model_for(const Options& x) {
  nn::ModelConfig c = nn::ModelConfig::gpt(x.layers, 32, 4, 256, 16, 8, x.dtype);
  c.dropout = x.dropout;
  return c;
}

nn::ParallelConfig parallel_for(const Options& x, const dist::DeviceMesh& mesh) {
  nn::ParallelConfig p;
  p.sequence_parallel = x.sp;
  p.overlap = x.overlap;
  p.checkpoint_blocks = x.checkpoint_blocks;
  p.invariance = x.tree ? nn::Invariance::Tp : nn::Invariance::None;
  p.shard_optimizer = x.shard_optimizer;
  p.reshard_after_forward = x.reshard;
  if (mesh.has_axis("pp")) p.pp_layers = x.pp_layers;
  return p;
}

// What a run leaves that must agree.
struct Outcome {
  std::vector<double> losses, grad_norms;
  std::map<std::string, Tensor> parameters, gradients;   // full tensors by name, every stage's
};

// Whether this rank is coordinate 0 on every axis but pp: one rank per stage reports.
bool reports(const dist::DeviceMesh& mesh) {
  for (int a = 0; a < mesh.ndim(); ++a) {
    if (mesh.axes()[static_cast<std::size_t>(a)].name != "pp" && mesh.coordinate(a) != 0) return false;
  }
  return true;
}

Outcome train_on(const std::string& spec, const Options& x, int steps) {
  Outcome out;
  std::mutex mu;
  run_on(spec, [&](const dist::DeviceMeshPtr& mesh) {
    const nn::ModelConfig cfg = model_for(x);
    auto model = nn::make_model(cfg, parallel_for(x, *mesh), mesh, 7);
    const std::vector<nn::Parameter*> params = model->parameters();
    optim::GradientSynchronizer sync(params, mesh, {.order = model->reduce_order()});
    optim::AdamW adamw(params, mesh, {.lr = 1e-2});
    std::vector<double> losses, norms;
    for (int step = 0; step < steps; ++step) {
      const StepOutcome r = train_step(*model, data::make_synthetic_batch(cfg, 1, 0, 100 + step % 2), *mesh, sync, adamw,
                                       0.5, x.micro, x.schedule);
      losses.push_back(global_loss(r.loss, *mesh, *model));
      norms.push_back(r.grad_norm);
    }
    std::map<std::string, Tensor> values, grads;
    for (const nn::Parameter* p : params) {
      values[p->name] = nn::gather_full(p->value, *p);
      grads[p->name] = nn::gather_full(p->value.grad(), *p);
    }
    if (!reports(*mesh)) return;
    const std::lock_guard<std::mutex> lock(mu);
    if (mesh->rank() == 0) {
      out.losses = losses;
      out.grad_norms = norms;
    } else {
      EXPECT_EQ(losses, out.losses.empty() ? losses : out.losses) << "stage losses disagree";
    }
    for (auto& [name, t] : values) {
      EXPECT_TRUE(out.parameters.emplace(name, t).second) << name << " is held by two stages";
    }
    for (auto& [name, t] : grads) out.gradients.emplace(name, t);
  });
  return out;
}

struct PipelineCase {
  std::string name, reference_mesh, pipeline_mesh;
  Options options;
};
void PrintTo(const PipelineCase& c, std::ostream* os) { *os << c.name; }

class PipelineBitwise : public ::testing::TestWithParam<PipelineCase> {};

TEST_P(PipelineBitwise, LossesNormsGradientsAndParametersAfter20StepsEqualGradientAccumulation) {
  const PipelineCase& c = GetParam();
  const Outcome ref = train_on(c.reference_mesh, c.options, 20);
  const Outcome got = train_on(c.pipeline_mesh, c.options, 20);
  ASSERT_EQ(ref.losses.size(), 20u);
  EXPECT_EQ(got.losses, ref.losses) << c.pipeline_mesh << " against " << c.reference_mesh;
  EXPECT_EQ(got.grad_norms, ref.grad_norms);
  ASSERT_EQ(got.parameters.size(), ref.parameters.size()) << "every parameter lives on exactly one stage";
  for (const auto& [name, value] : ref.parameters) {
    ASSERT_TRUE(got.parameters.count(name)) << name;
    EXPECT_TRUE(bitwise_equal(got.parameters.at(name), value)) << "parameter " << name;
    EXPECT_TRUE(bitwise_equal(got.gradients.at(name), ref.gradients.at(name))) << "gradient " << name;
  }
  // The run moved, so equal bits are not a coincidence.
  EXPECT_LT(ref.losses.back(), ref.losses.front());
}

using pipeline::ScheduleKind;
INSTANTIATE_TEST_SUITE_P(
    Meshes, PipelineBitwise,
    ::testing::Values(
        PipelineCase{"pp2_1f1b", "tp=1", "pp=2", {}},
        PipelineCase{"pp2_gpipe", "tp=1", "pp=2", {.schedule = ScheduleKind::GPipe}},
        PipelineCase{"pp2_one_micro_batch", "tp=1", "pp=2", {.micro = 1}},
        PipelineCase{"pp4_1f1b_8_micro", "tp=1", "pp=4", {.micro = 8}},
        PipelineCase{"pp3_uneven_stages", "tp=1", "pp=3", {.layers = 5, .micro = 2, .pp_layers = {1, 3, 1}}},
        PipelineCase{"pp2_tp2_sp_overlap", "tp=2", "pp=2,tp=2", {.sp = true, .overlap = true, .micro = 2}},
        PipelineCase{"pp2_dp2", "dp=2", "pp=2,dp=2", {.micro = 2}},
        PipelineCase{"pp2_tp1x2", "tp=1x2", "pp=2,tp=1x2", {.micro = 2}},
        PipelineCase{"pp2_checkpointed_blocks", "tp=1", "pp=2", {.checkpoint_blocks = true}},
        PipelineCase{"pp2_float64_no_dropout", "tp=1", "pp=2", {.dropout = 0.0, .dtype = DType::Float64}},
        // TP-invariant: the micro-batches meet in the fixed tree on every stage, and the bits do not
        // depend on tp either: pp=2,tp=2 against one rank.
        PipelineCase{"pp2_tp_invariant", "tp=1", "pp=2", {.tree = true}},
        PipelineCase{"pp2_tp2_sp_tp_invariant_against_one_rank", "tp=1", "pp=2,tp=2", {.sp = true, .tree = true}},
        PipelineCase{"pp2_dp2_tp_invariant_gpipe", "dp=2", "pp=2,dp=2",
                     {.tree = true, .micro = 2, .schedule = ScheduleKind::GPipe}},
        // Sharded data parallelism on every stage: fsdp's own units per stage, the last stage's wte
        // copy gathered over fsdp.
        PipelineCase{"pp2_fsdp2", "fsdp=2", "pp=2,fsdp=2", {.micro = 2}},
        PipelineCase{"pp2_fsdp2_tp2_sp_gpipe", "fsdp=2,tp=2", "pp=2,fsdp=2,tp=2",
                     {.sp = true, .micro = 2, .schedule = ScheduleKind::GPipe}},
        PipelineCase{"pp2_fsdp2_no_reshard_4_micro", "fsdp=2", "pp=2,fsdp=2", {.reshard = false}},
        PipelineCase{"pp3_fsdp2_a_middle_stage", "fsdp=2", "pp=3,fsdp=2", {.micro = 2}},
        PipelineCase{"pp2_dp2_shard_optimizer", "dp=2", "pp=2,dp=2", {.shard_optimizer = true, .micro = 2}}),
    [](const ::testing::TestParamInfo<PipelineCase>& info) { return info.param.name; });

}  // namespace
}  // namespace meshgrad::train::test_pipeline
