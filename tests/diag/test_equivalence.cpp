// The equivalence checker behind `meshgrad check`: it passes for a correct mesh model and names the
// first diverging parameter when the mesh model differs.
#include <gtest/gtest.h>

#include "meshgrad/comm/threads.hpp"
#include "meshgrad/diag/equivalence.hpp"

using namespace meshgrad;

namespace {

diag::EquivalenceOptions small_check(const std::string& mesh) {
  diag::EquivalenceOptions o;
  o.model.kind = "gpt";
  o.model.layers = 1;
  o.model.hidden = 12;
  o.model.heads = 3;
  o.model.vocab = 29;
  o.model.seq = 5;
  o.model.batch = 4;
  o.model.dtype = DType::Float64;
  o.mesh = mesh;
  o.steps = 2;
  return o;
}

// Runs fn(mesh) on dp x tp rank threads (dp outer).
dist::RunOnMesh threads_mesh(int dp, int tp) {
  return [dp, tp](const std::function<void(const dist::DeviceMeshPtr&)>& fn) {
    comm::run_ranks(dp * tp, [&](const comm::CommunicatorPtr& world) {
      fn(std::make_shared<const dist::DeviceMesh>(world, std::vector<dist::MeshAxis>{{"dp", dp}, {"tp", tp}}));
    });
  };
}

TEST(Equivalence, MeshModelMatchesTheSingleRankModel) {
  for (bool sp : {false, true}) {
    auto o = small_check("dp=2,tp=2");
    o.parallel.sequence_parallel = sp;
    o.parallel.overlap = sp;
    const auto report = diag::check_equivalence(o, threads_mesh(2, 2));
    EXPECT_TRUE(report.passed) << (sp ? "sp" : "allreduce") << ": first divergence " << report.first_divergence;
    EXPECT_TRUE(report.first_divergence.empty());
    ASSERT_EQ(report.mesh_losses.size(), 2u);
    EXPECT_LT(report.max_loss_difference, 1e-12);
    for (const auto& p : report.parameters) EXPECT_LT(p.grad_max_rel, 1e-9) << p.name;
    // One step's collectives were counted: tp in forward and backward, dp in backward.
    EXPECT_GT(report.collectives.at("forward").size(), 0u);
    EXPECT_GT(report.collectives.at("backward").count("all_reduce[dp]"), 0u);
  }
}

TEST(Equivalence, ADifferentMeshModelIsCaughtAndNamed) {
  auto o = small_check("tp=2");
  o.mesh_seed = o.seed + 1;   // the mesh model starts from other weights
  const auto report = diag::check_equivalence(o, threads_mesh(1, 2));
  EXPECT_FALSE(report.passed);
  EXPECT_EQ(report.first_divergence, "wte.weight");   // forward order: the first parameter
  EXPECT_GT(report.max_loss_difference, 1e-6);
}

}  // namespace
