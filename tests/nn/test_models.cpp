// The tensor-parallel GPT and MLP against the same model on one rank: tp in {1,2,3,4}, all-reduce
// and sequence-parallel modes, overlap and recompute on and off, uneven sizes (heads, ffn,
// vocabulary and sequence not divisible by tp), in float64; plus the collectives each phase runs.
//
// Tolerance: 1e-9 relative on gradients (the float64 bound). The sharded model sums the
// same products in a different order (partial sums over ranks, then across them), so results
// agree to a few ulps of float64 accumulations over at most a few hundred terms: ~1e-14; 1e-9
// leaves room without hiding a wrong formula (those show up at 1e-2 and above).
#include <gtest/gtest.h>

#include "nn_test_util.hpp"

namespace test_models {

using namespace meshgrad;
using namespace meshgrad::testing;
using dist::Phase;

namespace {

nn::ModelConfig small_gpt() {
  nn::ModelConfig c;
  c.kind = "gpt";
  c.layers = 2;
  c.hidden = 12;
  c.heads = 4;     // 4 heads: 2+2, 2+1+1, 1+1+1+1
  c.ffn = 50;      // uneven over 3 and 4
  c.vocab = 37;    // uneven over every tp > 1
  c.seq = 7;       // uneven over every tp > 1
  c.batch = 2;
  c.dtype = DType::Float64;
  return c;
}

nn::ModelConfig small_mlp() {
  nn::ModelConfig c;
  c.kind = "mlp";
  c.layers = 2;
  c.hidden = 10;
  c.ffn = 22;
  c.seq = 5;
  c.batch = 3;
  c.dtype = DType::Float64;
  return c;
}

struct Variant {
  bool sp, overlap, recompute;
};

std::string variant_name(const Variant& v) {
  return std::string(v.sp ? "sp" : "allreduce") + (v.overlap ? "_overlap" : "") + (v.recompute ? "_recompute" : "");
}

class ModelEquivalence : public ::testing::TestWithParam<std::tuple<std::string, int, int>> {};

TEST_P(ModelEquivalence, LossAndGradientsMatchTheSingleRankModel) {
  const auto& [kind, tp, variant_index] = GetParam();
  const std::vector<Variant> variants = {{false, false, false}, {false, true, false}, {true, false, false},
                                         {true, true, false},   {true, false, true},  {true, true, true}};
  const Variant v = variants[static_cast<std::size_t>(variant_index)];
  const nn::ModelConfig cfg = kind == "gpt" ? small_gpt() : small_mlp();
  const ModelRun reference = run_model(cfg, {}, 1);
  nn::ParallelConfig parallel;
  parallel.sequence_parallel = v.sp;
  parallel.overlap = v.overlap;
  parallel.recompute_allgather = v.recompute;
  const ModelRun sharded = run_model(cfg, parallel, tp);
  EXPECT_NEAR(sharded.loss, reference.loss, 1e-12 * std::abs(reference.loss)) << variant_name(v);
  const auto [err, where] = max_rel_grad_error(sharded, reference);
  EXPECT_LT(err, 1e-9) << kind << " tp=" << tp << " " << variant_name(v) << ": worst parameter " << where;
  for (const auto& [name, p] : reference.params) {
    EXPECT_TRUE(bitwise_equal(sharded.params.at(name), p)) << name << ": shards are not slices of the tp=1 init";
  }
}

std::string sweep_name(const ::testing::TestParamInfo<ModelEquivalence::ParamType>& info) {
  static const std::vector<std::string> names = {"allreduce",    "allreduce_overlap",   "sp",
                                                 "sp_overlap",   "sp_recompute",        "sp_overlap_recompute"};
  return std::get<0>(info.param) + "_tp" + std::to_string(std::get<1>(info.param)) + "_" +
         names[static_cast<std::size_t>(std::get<2>(info.param))];
}

INSTANTIATE_TEST_SUITE_P(TpSweep, ModelEquivalence,
                         ::testing::Combine(::testing::Values("gpt", "mlp"), ::testing::Values(1, 2, 3, 4),
                                            ::testing::Range(0, 6)),
                         sweep_name);

// 2-D tensor parallelism: the attention and MLP weights split over both axes of an R x C grid (the
// vocabulary over the whole grid), uneven everywhere (hidden 12 over 5 rows is not a multiple,
// heads 4 over 3 columns, ffn 50, vocab 37), against the single-rank model with the same bound.
class GridEquivalence : public ::testing::TestWithParam<std::tuple<std::string, int, int>> {};

TEST_P(GridEquivalence, LossAndGradientsMatchTheSingleRankModel) {
  const auto& [kind, rows, cols] = GetParam();
  const nn::ModelConfig cfg = kind == "gpt" ? small_gpt() : small_mlp();
  const ModelRun reference = run_model(cfg, {}, 1);
  const ModelRun grid = run_model(cfg, {}, rows * cols, 7, 99, {{"tp_row", rows}, {"tp_col", cols}});
  EXPECT_NEAR(grid.loss, reference.loss, 1e-12 * std::abs(reference.loss));
  const auto [err, where] = max_rel_grad_error(grid, reference);
  EXPECT_LT(err, 1e-9) << kind << " " << rows << "x" << cols << ": worst parameter " << where;
  for (const auto& [name, p] : reference.params) {
    EXPECT_TRUE(bitwise_equal(grid.params.at(name), p)) << name << ": pieces are not slices of the tp=1 init";
  }
}

INSTANTIATE_TEST_SUITE_P(GridSweep, GridEquivalence,
                         ::testing::Combine(::testing::Values("gpt", "mlp"), ::testing::Values(1, 2, 3),
                                            ::testing::Values(1, 2, 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" + std::to_string(std::get<1>(info.param)) + "x" +
                                  std::to_string(std::get<2>(info.param));
                         });

// Per axis, a 2x2 GPT step runs the collectives the grid layers promise: per block and direction
// two all-reduces over tp_row, two over tp_col and two all-gathers over tp_row forward, and the
// rule's duals backward (the gathers' duals are slices: no communication).
TEST(GridEquivalence, CountsCollectivesPerAxis) {
  nn::ModelConfig cfg = small_gpt();
  const ModelRun grid = run_model(cfg, {}, 4, 7, 99, {{"tp_row", 2}, {"tp_col", 2}});
  const int L = cfg.layers;
  EXPECT_EQ(grid.counter.count(Phase::Forward, "all_gather", "tp_row"), 2 * L);
  EXPECT_EQ(grid.counter.count(Phase::Forward, "all_reduce", "tp_row"), 2 * L);
  EXPECT_EQ(grid.counter.count(Phase::Forward, "all_reduce", "tp_col"), 2 * L);
  EXPECT_EQ(grid.counter.count(Phase::Backward, "all_reduce", "tp_col"), 2 * L);   // c_attn / c_fc inputs
  EXPECT_EQ(grid.counter.count(Phase::Backward, "all_reduce", "tp_row"), 2 * L);   // c_proj inputs
  EXPECT_EQ(grid.counter.count(Phase::Backward, "all_gather", "tp_row"), 2 * L);   // the input slices' duals
  EXPECT_EQ(grid.counter.count(Phase::Backward, "all_gather", "tp_col"), 0);
}

TEST(ModelEquivalence, OverlapAndRecomputeAreBitIdentical) {
  const nn::ModelConfig cfg = small_gpt();
  for (bool sp : {false, true}) {
    nn::ParallelConfig base;
    base.sequence_parallel = sp;
    const ModelRun plain = run_model(cfg, base, 2);
    nn::ParallelConfig fancy = base;
    fancy.overlap = true;
    fancy.recompute_allgather = sp;
    const ModelRun other = run_model(cfg, fancy, 2);
    EXPECT_EQ(plain.loss, other.loss);
    for (const auto& [name, g] : plain.grads) EXPECT_TRUE(bitwise_equal(g, other.grads.at(name))) << name;
  }
}

TEST(ModelEquivalence, ActivationCheckpointingIsBitIdentical) {
  const nn::ModelConfig cfg = small_gpt();
  for (bool sp : {false, true}) {
    nn::ParallelConfig base;
    base.sequence_parallel = sp;
    nn::ParallelConfig ckpt = base;
    ckpt.checkpoint_blocks = true;
    const ModelRun plain = run_model(cfg, base, 2);
    const ModelRun other = run_model(cfg, ckpt, 2);
    EXPECT_EQ(plain.loss, other.loss);
    for (const auto& [name, g] : plain.grads) EXPECT_TRUE(bitwise_equal(g, other.grads.at(name))) << name;
    // The recomputed forward runs the blocks' forward collectives again, during backward.
    EXPECT_EQ(other.counter.count(Phase::Recompute), 2 * cfg.layers * (sp ? 2 : 1)) << (sp ? "sp" : "allreduce");
  }
}

TEST(ModelEquivalence, DropoutMasksFollowTheGlobalTensor) {
  // With dropout on, sharded activations draw their slice of the unsharded mask and replicated
  // ones the same mask on every rank: the tp model equals the tp=1 model exactly as without it.
  nn::ModelConfig cfg = small_gpt();
  cfg.dropout = 0.2;
  const ModelRun reference = run_model(cfg, {}, 1);
  nn::ModelConfig no_dropout = cfg;
  no_dropout.dropout = 0.0;
  EXPECT_NE(reference.loss, run_model(no_dropout, {}, 1).loss);   // dropout does something
  for (bool sp : {false, true}) {
    for (bool ckpt : {false, true}) {
      nn::ParallelConfig parallel;
      parallel.sequence_parallel = sp;
      parallel.checkpoint_blocks = ckpt;
      const ModelRun sharded = run_model(cfg, parallel, 3);
      EXPECT_NEAR(sharded.loss, reference.loss, 1e-12 * std::abs(reference.loss));
      EXPECT_LT(max_rel_grad_error(sharded, reference).first, 1e-9) << (sp ? "sp" : "allreduce")
                                                                     << (ckpt ? " checkpointed" : "");
    }
  }
}

// The collectives of one forward+backward at tp=2, from the DESIGN table:
//  all-reduce mode: forward: embedding all-reduce, per block the two row-parallel all-reduces,
//    the loss' three small all-reduces; backward: per block the two column layers' dX all-reduces,
//    and the LM head's.
//  sequence parallel: forward: embedding reduce-scatter, per block two all-gathers (column inputs)
//    and two reduce-scatters (row outputs), the LM head's all-gather, the loss' all-reduces;
//    backward: the duals (reduce-scatter for each all-gather and all-gather for each reduce-scatter).
TEST(ModelCommunication, GptCollectivesPerPhaseFollowTheDesignTable) {
  const nn::ModelConfig cfg = small_gpt();
  const int L = cfg.layers;
  const ModelRun ar = run_model(cfg, {}, 2);
  EXPECT_EQ(ar.counter.count(Phase::Forward, "all_reduce", "tp"), 1 + 2 * L + 3);
  EXPECT_EQ(ar.counter.count(Phase::Forward), 1 + 2 * L + 3);
  EXPECT_EQ(ar.counter.count(Phase::Backward, "all_reduce", "tp"), 2 * L + 1);
  EXPECT_EQ(ar.counter.count(Phase::Backward), 2 * L + 1);

  nn::ParallelConfig sp;
  sp.sequence_parallel = true;
  const ModelRun s = run_model(cfg, sp, 2);
  EXPECT_EQ(s.counter.count(Phase::Forward, "reduce_scatter"), 1 + 2 * L);
  EXPECT_EQ(s.counter.count(Phase::Forward, "all_gather"), 2 * L + 1);
  EXPECT_EQ(s.counter.count(Phase::Forward, "all_reduce"), 3);
  EXPECT_EQ(s.counter.count(Phase::Backward, "reduce_scatter"), 2 * L + 1);
  EXPECT_EQ(s.counter.count(Phase::Backward, "all_gather"), 2 * L + 1);
  EXPECT_EQ(s.counter.count(Phase::Backward, "all_reduce"), 0);

  sp.recompute_allgather = true;
  const ModelRun r = run_model(cfg, sp, 2);
  EXPECT_EQ(r.counter.count(Phase::Backward, "all_gather"), (2 * L + 1) + (2 * L + 1));   // + re-gathers
  // Bytes: an all-gather of the full [T, B, C] activation per column layer input.
  const std::int64_t activation = cfg.seq * cfg.batch * cfg.hidden * 8;
  for (const auto& rec : s.counter.records()) {
    if (rec.op == "all_gather" && rec.phase == Phase::Forward) {
      EXPECT_EQ(rec.bytes, activation) << rec.label;
    }
  }
}

TEST(ModelCommunication, MlpCollectivesPerPhase) {
  const nn::ModelConfig cfg = small_mlp();
  const ModelRun ar = run_model(cfg, {}, 2);
  EXPECT_EQ(ar.counter.count(Phase::Forward, "all_reduce"), cfg.layers);
  EXPECT_EQ(ar.counter.count(Phase::Backward, "all_reduce"), cfg.layers);
  nn::ParallelConfig sp;
  sp.sequence_parallel = true;
  const ModelRun s = run_model(cfg, sp, 2);
  EXPECT_EQ(s.counter.count(Phase::Forward, "all_gather"), cfg.layers);
  EXPECT_EQ(s.counter.count(Phase::Forward, "reduce_scatter"), cfg.layers);
  EXPECT_EQ(s.counter.count(Phase::Backward, "all_gather"), cfg.layers);
  EXPECT_EQ(s.counter.count(Phase::Backward, "reduce_scatter"), cfg.layers);
}

TEST(ModelErrors, BadInputsNameWhatIsWrong) {
  nn::ModelConfig cfg = small_gpt();
  EXPECT_THROW(run_on_mesh(1,
                           [&](const dist::DeviceMeshPtr& mesh) {
                             auto model = nn::make_model(cfg, {}, mesh, 1);
                             nn::Batch b = make_batch(cfg, 1);
                             b.inputs.set({0, 0}, 999);   // outside the vocabulary
                             model->loss(b, 1);
                           }),
               InvalidArgument);
  cfg.kind = "transformer-xl";
  EXPECT_THROW(run_on_mesh(1, [&](const dist::DeviceMeshPtr& mesh) { nn::make_model(cfg, {}, mesh, 1); }),
               InvalidArgument);
  cfg = small_gpt();
  cfg.heads = 5;   // 12 not divisible by 5
  EXPECT_THROW(run_on_mesh(1, [&](const dist::DeviceMeshPtr& mesh) { nn::make_model(cfg, {}, mesh, 1); }),
               InvalidArgument);
}

}  // namespace

TEST(ModelConfig, GptFactoryAndTheShapeOfAFile) {
  const nn::ModelConfig c = nn::ModelConfig::gpt(3, 48, 6, 101, 17, 5, DType::Float64);
  EXPECT_EQ(c.kind, "gpt");
  EXPECT_EQ(c.layers, 3);
  EXPECT_EQ(c.hidden, 48);
  EXPECT_EQ(c.heads, 6);
  EXPECT_EQ(c.vocab, 101);
  EXPECT_EQ(c.seq, 17);
  EXPECT_EQ(c.batch, 5);
  EXPECT_EQ(c.dtype, DType::Float64);
  EXPECT_EQ(c.ffn_size(), 4 * 48);
  nn::ModelConfig file = nn::ModelConfig::gpt(2, 16, 4, 50257);
  file.ffn = 40;
  file.positions = 1024;
  file.layer_norm_epsilon = 1e-6;
  file.seq = 999;                       // not a size of the parameters: the run's stays
  nn::ModelConfig run = c;
  run.dropout = 0.1;
  const nn::ModelConfig both = run.with_shape_of(file);
  EXPECT_EQ(both.layers, 2);
  EXPECT_EQ(both.hidden, 16);
  EXPECT_EQ(both.heads, 4);
  EXPECT_EQ(both.vocab, 50257);
  EXPECT_EQ(both.ffn, 40);
  EXPECT_EQ(both.positions, 1024);
  EXPECT_EQ(both.layer_norm_epsilon, 1e-6);
  EXPECT_EQ(both.seq, 17);
  EXPECT_EQ(both.batch, 5);
  EXPECT_EQ(both.dropout, 0.1);
  EXPECT_EQ(both.dtype, DType::Float64);
}

namespace {

// Sizes the split cannot take are refused before any layer is built, saying what to change.
TEST(ModelConfigChecks, HeadsAndHiddenMessagesSayWhatIsWrong) {
  nn::ModelConfig c = small_gpt();   // 4 heads
  auto message_of = [&](const nn::ModelConfig& cfg, int tp, const std::vector<dist::MeshAxis>& axes = {}) {
    try {
      run_model(cfg, {}, tp, 7, 99, axes);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message_of(c, 8).find("only 4 heads"), std::string::npos) << message_of(c, 8);
  EXPECT_NE(message_of(c, 8, {{"tp_row", 1}, {"tp_col", 8}}).find("tp_col"), std::string::npos);
  nn::ModelConfig odd = c;
  odd.hidden = 30;
  EXPECT_NE(message_of(odd, 1).find("--hidden 30 is not divisible by --heads 4"), std::string::npos)
      << message_of(odd, 1);
}

// Graph nodes hold what they need (shared context, buffers, blocks), not pointers into the model:
// backward after the model is gone gives the same gradients (regather, checkpointed blocks).
TEST(ModelLifetime, BackwardAfterTheModelIsDestroyed) {
  nn::ModelConfig cfg = small_gpt();
  nn::ParallelConfig parallel;
  parallel.sequence_parallel = true;
  parallel.recompute_allgather = true;
  parallel.checkpoint_blocks = true;
  cfg.dropout = 0.1;
  const nn::Batch batch = make_batch(cfg, 99);
  run_on_mesh(2, [&](const dist::DeviceMeshPtr& mesh) {
    auto reference = nn::make_model(cfg, parallel, mesh, 7);
    backward(reference->loss(batch, cfg.batch * cfg.seq));
    const Tensor expected = reference->parameters()[2]->value.grad();   // h.0.ln_1.weight
    auto model = nn::make_model(cfg, parallel, mesh, 7);
    Tensor leaf = model->parameters()[2]->value;   // keep the parameter, drop the model
    Tensor loss = model->loss(batch, cfg.batch * cfg.seq);
    model.reset();
    backward(loss);
    EXPECT_TRUE(bitwise_equal(leaf.grad(), expected));
  });
}

}  // namespace

}  // namespace test_models
