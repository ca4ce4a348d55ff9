// Mesh-invariant mode (--mesh-invariant, docs/mesh-invariance.md): the same global batch gives the
// same bits on every mesh: tp, dp, fsdp, ZeRO over dp, a pipeline with its micro-batches, sequence
// parallelism and overlap, float32 and float64. Every comparison here is of bytes (losses, gradient
// norms, every gradient of every step, the trained parameters), never of a tolerance; a mutation of
// the tree order (tree::testing::set_left_fold) must make them fail.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <unistd.h>

#include "meshgrad/diag/equivalence.hpp"
#include "meshgrad/launch/launch.hpp"
#include "meshgrad/ops/tree_reduce.hpp"
#include "meshgrad/train/step.hpp"
#include "meshgrad/train/trainer.hpp"
#include "launch/invariant_runs.hpp"

namespace meshgrad::launch::test_mesh_invariant {
namespace {

struct MeshCase {
  std::string mesh = "tp=1";
  bool sp = false, overlap = false, shard_optimizer = false;
  int grad_accum = 1;
  // The mode: mesh-invariant (the default), or for the tests that show what it adds, TP-invariant
  // only (tp_only) or the normal mode (neither).
  bool mesh_mode = true, tp_only = false;
  int blocks = 4;   // --batch-blocks
  int sequence_blocks = 1;   // --sequence-blocks (cp needs a multiple of 2 cp)
  bool llama = false;   // the Llama family (GQA, RoPE, RMSNorm, SwiGLU, untied head) instead of GPT-2
  bool bf16 = false;    // --precision bf16
  std::string str() const {
    return fmt::format("{}{}{}{} grad-accum={} sequence-blocks={}", mesh, sp ? " sp" : "", overlap ? " overlap" : "",
                       shard_optimizer ? " shard-optimizer" : "", grad_accum, sequence_blocks);
  }
};

nn::ParallelConfig mesh_invariant(const MeshCase& m) {
  nn::ParallelConfig p;
  p.invariance = m.mesh_mode ? nn::Invariance::Mesh : m.tp_only ? nn::Invariance::Tp : nn::Invariance::None;
  p.batch_blocks = m.blocks;
  p.sequence_blocks = m.sequence_blocks;
  // The small Llama's 2 key/value heads are 2 units: a tree of 2 feature blocks cuts them whole.
  if (m.llama) p.invariant_blocks = 2;
  p.sequence_parallel = m.sp;
  p.overlap = m.overlap;
  p.shard_optimizer = m.shard_optimizer;
  return p;
}

using testing::read_file;
using testing::RunBits;
using testing::same_doubles;
nn::ModelConfig small_gpt(DType dtype) { return testing::small_gpt(dtype, 8); }

// Llama-shaped: 4 query heads over 2 key/value heads, llama3 RoPE scaling, an untied head.
nn::ModelConfig small_llama(DType dtype) {
  nn::ModelConfig c = small_gpt(dtype);
  c.kind = "llama";
  c.kv_heads = 2;
  c.ffn = 48;
  c.rope_theta = 500000;
  c.rope_scaling = "llama3";
  c.rope_factor = 8;
  c.rope_original_positions = 8;
  return c;
}

constexpr int kSteps = 20;

// 20 training steps with dropout and gradient clipping on the built-in corpus (vocabulary 256).
RunBits train_on(const MeshCase& m, DType dtype, const std::string& tag) {
  train::TrainOptions o;
  o.model = m.llama ? small_llama(dtype) : small_gpt(dtype);
  o.model.vocab = 0;
  o.model.seq = 16;
  o.model.dropout = m.llama ? 0.0 : 0.1;   // the Llama family has none
  o.parallel = mesh_invariant(m);
  o.steps = kSteps;
  o.lr = 3e-3;
  o.grad_clip = 0.5;
  o.grad_accum = m.grad_accum;
  o.precision = m.bf16 ? "bf16" : "float32";
  o.progress = false;
  const std::string path = (std::filesystem::temp_directory_path() /
                            fmt::format("meshgrad_meshinv_{}_{}.safetensors", ::getpid(), tag)).string();
  o.save_path = path;
  RunBits bits;
  o.on_step = [&](const train::StepMetrics& s) { bits.grad_norms.push_back(s.grad_norm); };
  std::vector<double> losses;
  mesh_runner("threads", m.mesh)([&](const dist::DeviceMeshPtr& mesh) {
    train::TrainResult r = train::train(o, mesh);
    if (mesh->rank() == 0) losses = r.losses;
  });
  bits.losses = losses;
  bits.parameters = read_file(path);
  std::filesystem::remove(path);
  return bits;
}

void expect_same_training(DType dtype, const std::vector<MeshCase>& cases) {
  const RunBits ref = train_on(cases.front(), dtype, "ref");
  ASSERT_EQ(ref.losses.size(), static_cast<std::size_t>(kSteps));
  ASSERT_FALSE(ref.parameters.empty());
  EXPECT_LT(ref.losses.back(), ref.losses.front());
  for (std::size_t c = 1; c < cases.size(); ++c) {
    SCOPED_TRACE(cases[c].str() + " against " + cases.front().str() + ", " + std::string(dtype_name(dtype)));
    const RunBits got = train_on(cases[c], dtype, fmt::format("case{}", c));
    EXPECT_TRUE(same_doubles(got.losses, ref.losses)) << "losses differ: last " << got.losses.back() << " vs "
                                                      << ref.losses.back();
    EXPECT_TRUE(same_doubles(got.grad_norms, ref.grad_norms)) << "gradient norms differ";
    EXPECT_TRUE(got.parameters == ref.parameters) << "the trained parameters differ in their bytes";
  }
}

TEST(MeshInvariant, TwentyStepsAreTheSameBytesOnDataAndTensorParallelMeshesFloat32) {
  expect_same_training(DType::Float32, {{"tp=1"},
                                        {"dp=2"},
                                        {"dp=4"},
                                        {"tp=2", true, true},
                                        {"dp=2,tp=2"},
                                        {"dp=2,tp=2", true, true},
                                        {"dp=2", false, false, true},
                                        {"tp=1", false, false, false, 2},
                                        {"tp=2x2"},
                                        {"dp=2,tp=1x2"},
                                        {"tp=2x1"}});
}

TEST(MeshInvariant, TwentyStepsAreTheSameBytesOnShardedAndPipelinedMeshesFloat32) {
  expect_same_training(DType::Float32, {{"tp=1"},
                                        {"fsdp=2"},
                                        {"fsdp=4"},
                                        {"fsdp=2,tp=2", true},
                                        {"fsdp=2,tp=2", false, true},
                                        {"dp=2,fsdp=2"},
                                        {"pp=2"},
                                        {"pp=2,dp=2"},
                                        {"pp=2,tp=2", true, true}});
}

// Eight blocks of one row: four micro-batches per replica at dp=2 or fsdp=2, where a left fold
// ((m0 + m1) + m2) + m3 and the tree (m0 + m1) + (m2 + m3) differ (with two they are one addition).
TEST(MeshInvariant, FourMicroBatchesPerReplicaAreAddedInTheTree) {
  auto eight = [](std::string mesh) {
    MeshCase c{std::move(mesh)};
    c.blocks = 8;
    return c;
  };
  expect_same_training(DType::Float32, {eight("tp=1"), eight("fsdp=2"), eight("dp=2"), eight("pp=2"),
                                        eight("fsdp=2,tp=2"), eight("dp=8")});
}

TEST(MeshInvariant, TwentyStepsAreTheSameBytesOnEveryKindOfMeshFloat64) {
  expect_same_training(DType::Float64,
                       {{"tp=1"}, {"dp=4"}, {"fsdp=2,tp=2", true, true}, {"pp=2,dp=2"}, {"tp=4", true}, {"tp=2x2"}});
}

// The Llama family keeps the promise: the module tree and its plan change nothing of it.
TEST(MeshInvariant, TheLlamaFamilyIsTheSameBytesOnEveryKindOfMeshFloat32) {
  auto llama = [](std::string mesh, bool sp = false) {
    MeshCase c{std::move(mesh), sp};
    c.llama = true;
    return c;
  };
  expect_same_training(DType::Float32, {llama("tp=1"), llama("tp=2", true), llama("dp=2,tp=2"), llama("fsdp=2"),
                                        llama("pp=2"), llama("tp=2x1"), llama("dp=2,tp=1x2")});
}

// Context parallelism keeps the promise with --sequence-blocks: the sequence of 16 positions cut into
// 8 blocks of 2, every product per block and every token sum (weight, norm and bias gradients, the
// embedding's rows, the loss, attention's key gradients) in the blocks' tree, whose leaves put each
// cp rank's chunks in one subtree (nn/context_parallel.hpp). cp=1, 2, 4, with tp, SP and overlap,
// dp, a pipeline, micro-batches (4 per replica at cp=2: each summed over cp before their tree),
// activation checkpointing, and a one-rank fsdp=2 with the blocks.
MeshCase blocked(std::string mesh, bool sp = false, bool overlap = false, bool llama = false) {
  MeshCase c{std::move(mesh), sp, overlap};
  c.sequence_blocks = 8;
  c.llama = llama;
  return c;
}

TEST(MeshInvariant, ContextParallelMeshesAreTheSameBytesUnderSequenceBlocksGpt) {
  MeshCase accum = blocked("cp=2");
  accum.grad_accum = 2;
  expect_same_training(DType::Float32, {blocked("tp=1"), blocked("cp=2"), blocked("cp=4"), blocked("dp=2,cp=2"),
                                        blocked("cp=2,tp=2", true, true), blocked("pp=2,cp=2"), blocked("fsdp=2"),
                                        accum});
}

TEST(MeshInvariant, ContextParallelMeshesAreTheSameBytesUnderSequenceBlocksLlama) {
  expect_same_training(DType::Float32, {blocked("tp=1", false, false, true), blocked("cp=2", false, false, true),
                                        blocked("cp=4", false, false, true), blocked("cp=2,tp=2", true, false, true),
                                        blocked("dp=2,cp=2", false, false, true), blocked("pp=2,cp=2", false, false, true)});
}

TEST(MeshInvariant, ContextParallelMeshesAreTheSameBytesUnderSequenceBlocksFloat64) {
  expect_same_training(DType::Float64, {blocked("tp=1"), blocked("cp=4"), blocked("dp=2,cp=2", false, true)});
}

// Without the blocks' tree the same meshes differ: a left fold of the blocks (the mutation) makes
// one rank and cp=2 add other parentheses, and so do the normal mode's cp sums.
TEST(MeshInvariant, ContextParallelWithoutTheTreeChangesTheBits) {
  {
    struct Restore {
      ~Restore() { tree::testing::set_left_fold(false); }
    } restore;
    tree::testing::set_left_fold(true);
    const RunBits one = train_on(blocked("tp=1"), DType::Float32, "cpfold1");
    const RunBits cp2 = train_on(blocked("cp=2"), DType::Float32, "cpfold2");
    tree::testing::set_left_fold(false);
    EXPECT_FALSE(one.parameters == cp2.parameters);
  }
  MeshCase one = blocked("tp=1"), two = blocked("cp=2");
  one.mesh_mode = two.mesh_mode = false;
  EXPECT_FALSE(train_on(one, DType::Float32, "cpplain1").parameters == train_on(two, DType::Float32, "cpplain2").parameters);
}

// --precision bf16 keeps the promise: its products round their operands elementwise (the same on
// every mesh) and run the float32 kernels in the invariant modes (blas::bf16_route).
TEST(MeshInvariant, Bf16PrecisionIsTheSameBytesOnEveryKindOfMesh) {
  auto bf16 = [](std::string mesh, bool sp = false, bool overlap = false, bool llama = false) {
    MeshCase c{std::move(mesh), sp, overlap};
    c.bf16 = true;
    c.llama = llama;
    return c;
  };
  expect_same_training(DType::Float32, {bf16("tp=1"), bf16("dp=2"), bf16("tp=2", true, true), bf16("fsdp=2,tp=2", true),
                                        bf16("pp=2"), bf16("tp=2x2")});
  expect_same_training(DType::Float32, {bf16("tp=1", false, false, true), bf16("tp=2", true, false, true),
                                        bf16("dp=2,tp=2", false, false, true), bf16("fsdp=2", false, false, true),
                                        bf16("pp=2", false, false, true)});
  // And it is bf16: other bits than the float32 run's.
  const RunBits f32 = train_on({"tp=1"}, DType::Float32, "f32");
  const RunBits b16 = train_on(bf16("tp=1"), DType::Float32, "b16");
  EXPECT_FALSE(same_doubles(f32.losses, b16.losses));
}

// Every gradient of every step, the losses and the weights after 20 steps, against one rank running
// one micro-batch per row block (diag::check_equivalence, as `meshgrad check --mesh-invariant`).
void expect_bitwise_check(const std::string& mesh, DType dtype, bool sp = false, int sequence_blocks = 1) {
  SCOPED_TRACE(mesh + (sp ? " sp " : " ") + std::string(dtype_name(dtype)));
  diag::EquivalenceOptions o;
  o.model = small_gpt(dtype);
  MeshCase c{mesh, sp};
  c.sequence_blocks = sequence_blocks;
  o.parallel = mesh_invariant(c);
  o.mesh = mesh;
  o.steps = kSteps;
  o.lr = 3e-3;
  const diag::EquivalenceReport report = diag::check_equivalence(o, mesh_runner("threads", mesh));
  ASSERT_TRUE(report.compared);
  ASSERT_EQ(report.mesh_losses.size(), static_cast<std::size_t>(kSteps));
  EXPECT_EQ(report.max_loss_difference, 0.0);
  ASSERT_FALSE(report.parameters.empty());
  for (const diag::ParameterDifference& p : report.parameters) {
    EXPECT_EQ(p.init_max_rel, 0.0) << p.name;
    EXPECT_EQ(p.grad_max_abs, 0.0) << p.name << ": some step's gradient differs";
    EXPECT_EQ(p.update_max_rel, 0.0) << p.name << ": the weights after 20 steps differ";
    EXPECT_EQ(p.floor_update_max_rel, 0.0) << p.name;
  }
}

TEST(MeshInvariant, EveryGradientOfEveryStepIsTheSingleRanks) {
  expect_bitwise_check("dp=4", DType::Float32);
  expect_bitwise_check("fsdp=2,tp=2", DType::Float32, true);
  expect_bitwise_check("pp=2", DType::Float32);
  expect_bitwise_check("dp=2,tp=2", DType::Float64, true);
  expect_bitwise_check("tp=2x2", DType::Float32);
  expect_bitwise_check("fsdp=2,tp=1x2", DType::Float32);
  expect_bitwise_check("cp=4", DType::Float32, false, 8);
  expect_bitwise_check("cp=2,tp=2", DType::Float64, true, 8);
}

// The mutation the tests above must catch: with every tree sum turned into a left fold, one rank adds
// its four row blocks as ((b0 + b1) + b2) + b3 and dp=2 as (b0 + b1) + (b2 + b3): other bits. (The
// fold is process-wide, set while no ranks run.)
TEST(MeshInvariant, ALeftFoldInsteadOfTheTreeChangesTheBits) {
  struct Restore {
    ~Restore() { tree::testing::set_left_fold(false); }
  } restore;
  tree::testing::set_left_fold(true);
  const RunBits one = train_on({"tp=1"}, DType::Float32, "fold1");
  const RunBits dp2 = train_on({"dp=2"}, DType::Float32, "fold2");
  const RunBits fsdp2 = train_on({"fsdp=2"}, DType::Float32, "fold3");
  tree::testing::set_left_fold(false);
  ASSERT_EQ(one.losses.size(), dp2.losses.size());
  EXPECT_FALSE(same_doubles(one.losses, dp2.losses));
  EXPECT_FALSE(one.parameters == dp2.parameters);
  EXPECT_FALSE(one.parameters == fsdp2.parameters);
  // The tree itself: the same two meshes agree (so the difference above is the fold's).
  EXPECT_TRUE(train_on({"tp=1"}, DType::Float32, "tree1").parameters == train_on({"dp=2"}, DType::Float32, "tree2").parameters);
}

// The normal mode is not mesh-invariant (the batch is summed in another order when it is split), and
// neither is the TP-invariant mode alone across dp without micro-batches: what this mode adds.
TEST(MeshInvariant, WithoutTheModeDpChangesTheBits) {
  for (const bool tp_only : {false, true}) {
    SCOPED_TRACE(tp_only ? "tp-invariant" : "normal mode");
    MeshCase one{"tp=1"}, two{"dp=2"};
    one.mesh_mode = two.mesh_mode = false;
    one.tp_only = two.tp_only = tp_only;
    const RunBits a = train_on(one, DType::Float32, "plain1"), b = train_on(two, DType::Float32, "plain2");
    EXPECT_FALSE(a.parameters == b.parameters);
  }
}

std::string refusal(std::int64_t rows, int dp, int grad_accum, int blocks) {
  try {
    train::check_mesh_invariant_split(rows, dp, grad_accum, blocks);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(MeshInvariant, RefusesSplitsThatCannotKeepTheTreeNamingTheOnesThatCan) {
  EXPECT_EQ(refusal(8, 4, 1, 4), "");
  EXPECT_EQ(refusal(8, 2, 2, 4), "");
  EXPECT_EQ(refusal(16, 1, 1, 16), "");
  const std::string dp8 = refusal(8, 8, 1, 4);
  EXPECT_NE(dp8.find("dp x fsdp x ep = 8"), std::string::npos) << dp8;
  EXPECT_NE(dp8.find("dp x fsdp x ep is 1, 2, 4 keep the tree"), std::string::npos) << dp8;
  EXPECT_NE(refusal(8, 3, 1, 4).find("dp x fsdp x ep = 3"), std::string::npos);
  EXPECT_NE(refusal(6, 1, 1, 4).find("the global batch of 6 rows must cut into --batch-blocks 4"), std::string::npos);
  EXPECT_NE(refusal(12, 1, 1, 3).find("--batch-blocks 3 must be a power of two"), std::string::npos);
  EXPECT_NE(refusal(8, 2, 4, 4).find("--grad-accum 4 must divide the 2 row blocks"), std::string::npos);
  // Through the trainer, before any step: dp=8 on 8 ranks.
  train::TrainOptions o;
  o.model = small_gpt(DType::Float32);
  o.model.vocab = 0;
  o.steps = 1;
  o.progress = false;
  o.parallel.invariance = nn::Invariance::Mesh;
  EXPECT_THROW(mesh_runner("threads", "dp=8")([&](const dist::DeviceMeshPtr& m) { train::train(o, m); }), Error);
}

// What the sequence blocks cannot keep is refused before any step, naming the numbers or the mesh.
std::string train_refusal(const std::string& mesh, int sequence_blocks, nn::Invariance mode = nn::Invariance::Mesh,
                          bool sp = false) {
  train::TrainOptions o;
  o.model = small_gpt(DType::Float32);
  o.model.vocab = 0;
  o.model.seq = 16;
  o.steps = 1;
  o.progress = false;
  o.parallel.invariance = mode;
  o.parallel.sequence_blocks = sequence_blocks;
  o.parallel.sequence_parallel = sp;
  try {
    mesh_runner("threads", mesh)([&](const dist::DeviceMeshPtr& m) { train::train(o, m); });
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(MeshInvariant, RefusesContextParallelMeshesTheSequenceBlocksCannotKeep) {
  const auto expect_refusal = [](const std::string& got, const std::string& part) {
    EXPECT_NE(got.find(part), std::string::npos) << got;
  };
  expect_refusal(train_refusal("cp=2", 1), "give --sequence-blocks a multiple of 2 x cp = 4 (got 1)");
  expect_refusal(train_refusal("cp=4", 4), "give --sequence-blocks a multiple of 2 x cp = 8 (got 4)");
  expect_refusal(train_refusal("tp=1", 3), "--sequence-blocks 3 must be a power of two");
  expect_refusal(train_refusal("tp=1", 32), "a sequence of 16 positions does not cut into 32");
  expect_refusal(train_refusal("cp=2", 4, nn::Invariance::Tp), "--tp-invariant with context parallelism");
  expect_refusal(train_refusal("fsdp=2,cp=2", 4), "with fsdp on the mesh fsdp=2,cp=2");
  expect_refusal(train_refusal("cp=2,tp=2x1", 4), "on the 2-D tensor-parallel mesh cp=2,tp=2x1");
  EXPECT_EQ(train_refusal("cp=2,tp=2", 4, nn::Invariance::Mesh, true), "");   // a block per SP shard: trains
  expect_refusal(train_refusal("cp=2,tp=4", 4, nn::Invariance::Mesh, true),
                 "give --sequence-blocks a multiple of cp x tp = 8");
}

}  // namespace
}  // namespace meshgrad::launch::test_mesh_invariant
