// The training loop and the gradient dump: the loss falls on the built-in corpus, the full
// gradients are the same whatever the mesh (float64, 1e-12 relative), training on a dp x tp mesh
// follows the single-rank run, metrics are one JSON object per step, and config errors name the key.
#include <gtest/gtest.h>
#include <numbers>

#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/comm/threads.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/tensor/random.hpp"
#include "meshgrad/train/trainer.hpp"
#include "meshgrad/optim/grad_norm.hpp"
#include "meshgrad/optim/grad_sync.hpp"
#include "meshgrad/data/dataset.hpp"

namespace meshgrad::train::test_trainer {
namespace {

// Runs fn(mesh) on the ranks of a dp x tp mesh, or dp x (rows x cols) when rows > 0 (rank
// threads, short deadline).
void run_mesh(int dp, int tp, const std::function<void(const dist::DeviceMeshPtr&)>& fn, int rows = 0, int cols = 0) {
  comm::ThreadsOptions options;
  options.timeout = std::chrono::milliseconds(60000);
  const std::vector<dist::MeshAxis> axes = rows > 0 ? std::vector<dist::MeshAxis>{{"dp", dp}, {"tp_row", rows}, {"tp_col", cols}}
                                                    : std::vector<dist::MeshAxis>{{"dp", dp}, {"tp", tp}};
  comm::run_ranks(
      rows > 0 ? dp * rows * cols : dp * tp,
      [&](const comm::CommunicatorPtr& world) { fn(std::make_shared<const dist::DeviceMesh>(world, axes)); },
      options);
}

nn::ModelConfig tiny_gpt(DType dtype) {
  nn::ModelConfig c;
  c.kind = "gpt";
  c.layers = 2;
  c.hidden = 16;
  c.heads = 4;
  c.vocab = 37;   // not divisible by tp: exercises uneven vocabulary shards
  c.seq = 8;
  c.batch = 4;
  c.dtype = dtype;
  return c;
}

struct MeshCase {
  int dp, tp;
  bool sequence_parallel;
  int rows = 0, cols = 0;   // > 0: a 2-D tp grid instead of tp
};

// The full gradients (and loss) of the tiny GPT from seed 5 on a mesh.
GradientDump dump_on(const MeshCase& m, const nn::Batch& batch) {
  GradientDump result;
  run_mesh(m.dp, m.tp, [&](const dist::DeviceMeshPtr& mesh) {
    nn::ParallelConfig parallel;
    parallel.sequence_parallel = m.sequence_parallel;
    auto model = nn::make_model(tiny_gpt(DType::Float64), parallel, mesh, 5);
    model->set_training(false);
    GradientDump d = compute_gradients(*model, batch, mesh);
    if (mesh->rank() == 0) result = std::move(d);
  }, m.rows, m.cols);
  return result;
}

TEST(Trainer, GradientsAreTheSameWhateverTheMesh) {
  const nn::Batch batch{random::randint({4, 8}, 11, 37), random::randint({4, 8}, 12, 37)};
  const GradientDump ref = dump_on({1, 1, false}, batch);
  ASSERT_FALSE(ref.gradients.empty());
  EXPECT_GT(ref.loss, 3.0);   // ~ln(37) at initialisation
  for (const MeshCase& m : {MeshCase{1, 2, false}, MeshCase{2, 2, false}, MeshCase{2, 2, true}, MeshCase{2, 1, false},
                            MeshCase{1, 3, true}, MeshCase{1, 0, false, 2, 2}, MeshCase{2, 0, false, 1, 3}}) {
    SCOPED_TRACE(fmt::format("dp={} tp={} sp={} grid={}x{}", m.dp, m.tp, m.sequence_parallel, m.rows, m.cols));
    const GradientDump got = dump_on(m, batch);
    EXPECT_NEAR(got.loss, ref.loss, 1e-12 * std::abs(ref.loss));
    ASSERT_EQ(got.gradients.size(), ref.gradients.size());
    for (std::size_t i = 0; i < ref.gradients.size(); ++i) {
      const auto& [name, g_ref] = ref.gradients[i];
      EXPECT_EQ(got.gradients[i].first, name);
      ASSERT_EQ(got.gradients[i].second.shape(), g_ref.shape()) << name;
      const auto a = got.gradients[i].second.to_vector();
      const auto b = g_ref.to_vector();
      double scale = 0, err = 0;
      for (std::size_t k = 0; k < b.size(); ++k) {
        scale = std::max(scale, std::abs(b[k]));
        err = std::max(err, std::abs(a[k] - b[k]));
      }
      EXPECT_GT(scale, 0.0) << name << ": the reference gradient is zero, the comparison would prove nothing";
      EXPECT_LE(err, 1e-12 * scale) << name << ": max abs error " << err << " vs max |grad| " << scale;
    }
  }
}

// The global gradient norm counts every parameter's complete gradient once, whatever the mesh:
// equal to the single-rank norm at tp=2, dp=2 x tp=2 (SP), a 2x2 grid and dp=2 x a 1x3 grid; and
// clipping scales the gradients to the requested norm.
TEST(GradNorm, IsTheSingleRankNormOnEveryMeshAndClipsToTheLimit) {
  const nn::Batch batch{random::randint({4, 8}, 11, 37), random::randint({4, 8}, 12, 37)};
  auto norm_on = [&](const MeshCase& m, double clip, double* after) {
    double norm = 0;
    run_mesh(m.dp, m.tp, [&](const dist::DeviceMeshPtr& mesh) {
      nn::ParallelConfig parallel;
      parallel.sequence_parallel = m.sequence_parallel;
      auto model = nn::make_model(tiny_gpt(DType::Float64), parallel, mesh, 5);
      auto params = model->parameters();
      optim::GradientSynchronizer sync(params, mesh);
      const int dp_rank = mesh->coordinate("dp"), dp_size = mesh->axis_size("dp");
      backward(model->loss(data::dp_shard(batch, dp_rank, dp_size), count_loss_targets(batch.targets)));
      sync.finish();
      const double n = clip > 0 ? optim::clip_grad_norm(params, *mesh, clip) : optim::global_grad_norm(params, *mesh);
      const double again = optim::global_grad_norm(params, *mesh);
      if (mesh->rank() == 0) {
        norm = n;
        if (after) *after = again;
      }
    }, m.rows, m.cols);
    return norm;
  };
  const double ref = norm_on({1, 1, false}, 0, nullptr);
  EXPECT_GT(ref, 0.0);
  for (const MeshCase& m : {MeshCase{1, 2, false}, MeshCase{2, 2, true}, MeshCase{1, 0, false, 2, 2},
                            MeshCase{2, 0, false, 1, 3}}) {
    EXPECT_NEAR(norm_on(m, 0, nullptr), ref, 1e-12 * ref) << m.dp << " " << m.tp << " " << m.rows << "x" << m.cols;
  }
  double after = 0;
  EXPECT_NEAR(norm_on({2, 2, true}, ref / 4, &after), ref, 1e-12 * ref);   // reports the norm before clipping
  EXPECT_NEAR(after, ref / 4, 1e-6 * ref);
}

// The exact norm (TP-invariant mode) of float32 gradients takes a fast path (integer sums of m^2
// per float32 exponent). A float32 value's square is exact in float64, so the float64 path, which
// adds every square to the exact accumulator one by one, must give the same bits on the same
// values. The values span the whole float32 range (subnormals, zeros, 2^100), and long runs of
// one exponent at the largest mantissa stress the per-exponent integer words; a second case adds
// an infinity, which the norm must report.
TEST(GradNorm, ExactNormOfFloat32GradientsIsBitwiseTheFloat64ExactSum) {
  std::vector<double> values;
  std::uint64_t state = 12345;
  const auto next = [&] {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return state >> 11;
  };
  for (int i = 0; i < 70000; ++i) {
    const double mantissa = 1.0 + static_cast<double>(next() % (1u << 23)) / (1u << 23);
    const int exponent = static_cast<int>(next() % 250) - 149;   // 2^-149 (subnormal) .. 2^100
    values.push_back((next() % 2 ? -1.0 : 1.0) * static_cast<double>(static_cast<float>(std::ldexp(mantissa, exponent))));
  }
  for (int i = 0; i < 40000; ++i) values.push_back(static_cast<double>(std::nextafter(2.0f, 0.0f)));   // m = 2^24 - 1
  for (int i = 0; i < 100; ++i) values.push_back(0.0);
  const auto norm_of = [&](const std::vector<double>& v, DType dtype) {
    double norm = 0;
    run_mesh(1, 1, [&](const dist::DeviceMeshPtr& mesh) {
      nn::Parameter p;
      p.name = "p";
      p.full_shape = {static_cast<std::int64_t>(v.size())};
      p.placements = dist::Placements(static_cast<std::size_t>(mesh->ndim()), dist::Placement::replicate());
      p.mesh = mesh;
      p.value = Tensor::zeros(p.full_shape, dtype);
      p.value.set_requires_grad();
      p.value.set_grad(Tensor::from_values(v, p.full_shape, dtype));
      norm = optim::global_grad_norm({&p}, *mesh, /*exact=*/true);
    });
    return norm;
  };
  const double fast = norm_of(values, DType::Float32);
  const double reference = norm_of(values, DType::Float64);
  EXPECT_GT(fast, 1e29);
  EXPECT_EQ(std::memcmp(&fast, &reference, sizeof(double)), 0) << fast << " vs " << reference;
  values[777] = std::numeric_limits<double>::infinity();
  EXPECT_TRUE(std::isinf(norm_of(values, DType::Float32)));
}

TrainOptions tiny_training(int steps);

// --grad-accum K: the same losses as K = 1 up to rounding (float64), dropout on (each micro-batch's
// rows get the masks they get in the whole batch), on one rank and on dp=2 x tp=2 with SP, and the
// same number of dp reductions per step (one bucket, after the last micro-batch).
TEST(Trainer, GradientAccumulationMatchesOneBatchWithOneReductionPerStep) {
  for (auto [dp, tp] : {std::pair{1, 1}, std::pair{2, 2}}) {
    std::map<int, std::vector<double>> losses;
    std::map<int, int> dp_reductions;
    for (int k : {1, 2, 4}) {
      TrainOptions o = tiny_training(3);
      o.model.batch = 8;
      o.model.dropout = 0.1;
      o.parallel.sequence_parallel = tp > 1;
      o.grad_accum = k;
      run_mesh(dp, tp, [&](const dist::DeviceMeshPtr& mesh) {
        dist::CommCounter counter;
        dist::CountingScope counting(counter);
        const TrainResult r = train(o, mesh);
        if (mesh->rank() == 0) {
          losses[k] = r.losses;
          dp_reductions[k] = counter.count(dist::Phase::Backward, "all_reduce", "dp");
        }
      });
    }
    for (int k : {2, 4}) {
      ASSERT_EQ(losses[k].size(), losses[1].size());
      for (std::size_t s = 0; s < losses[1].size(); ++s) {
        EXPECT_NEAR(losses[k][s], losses[1][s], 1e-12 * losses[1][s]) << "K=" << k << " step " << s;
      }
      EXPECT_EQ(dp_reductions[k], dp_reductions[1]) << "K=" << k;
    }
    if (dp > 1) {
      EXPECT_EQ(dp_reductions[1], 3);   // one bucket per step
    }
  }
}

TrainOptions tiny_training(int steps) {
  TrainOptions o;
  o.model = tiny_gpt(DType::Float64);
  o.model.vocab = 256;
  o.model.hidden = 32;
  o.model.seq = 16;
  o.steps = steps;
  o.lr = 1e-2;
  o.warmup_steps = 2;
  o.progress = false;
  return o;
}

TEST(Trainer, LossFallsOnTheBuiltInCorpus) {
  TrainOptions o = tiny_training(40);
  o.model.dtype = DType::Float32;
  const auto metrics = std::filesystem::temp_directory_path() / "meshgrad_test_metrics.jsonl";
  o.metrics_path = metrics.string();
  TrainResult result;
  run_mesh(1, 2, [&](const dist::DeviceMeshPtr& mesh) {
    TrainResult r = train(o, mesh);
    if (mesh->rank() == 0) result = std::move(r);
  });
  ASSERT_EQ(result.losses.size(), 40u);
  EXPECT_NEAR(result.losses.front(), std::log(256.0), 0.3);
  EXPECT_LT(result.end_loss(), result.start_loss() - 1.0)
      << "loss " << result.start_loss() << " -> " << result.end_loss();
  // A header object, then one JSON object per step with the documented keys, in step order.
  std::ifstream in(metrics);
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  const auto header = nlohmann::json::parse(line);
  EXPECT_EQ(header.at("type"), "header");
  EXPECT_EQ(header.at("mesh"), "tp=2");
  // The options by their command-line names, as --config and a checkpoint spell them.
  EXPECT_EQ(header.at("config").at("layers"), o.model.layers);
  EXPECT_EQ(header.at("config").at("steps"), 40);
  for (const char* key : {"beta1", "beta2", "eps", "weight-decay", "lr-schedule", "min-lr", "decay-steps",
                          "decay-fraction", "grad-clip", "warmup"}) {
    EXPECT_TRUE(header.at("config").contains(key)) << key;
  }
  EXPECT_GT(header.at("peak_gflops").get<double>(), 0);
  int n = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    ++n;
    EXPECT_EQ(j.at("step").get<int>(), n);
    EXPECT_DOUBLE_EQ(j.at("loss").get<double>(), result.losses[static_cast<std::size_t>(n - 1)]);
    for (const char* key : {"tokens_per_s", "gflops", "elapsed_s", "lr", "grad_norm", "ms_per_step", "mfu"}) {
      EXPECT_GT(j.at(key).get<double>(), 0) << key;
    }
    EXPECT_LT(j.at("mfu").get<double>(), 1.0);
  }
  EXPECT_EQ(n, 40);
  std::filesystem::remove(metrics);
}

// --precision bf16: the same run as float32 up to the products' bf16 rounding (the loss curves stay
// within 3% of each other over 40 steps: bf16 keeps 8 bits, and the loss here falls from 5.5 to ~2.5,
// far more than the rounding moves it), on one rank and split over tp and dp; the header says which
// kernels ran the bf16 products; a float64 model is refused.
TEST(Trainer, Bf16PrecisionTrainsAsFloat32DoesOnEveryMesh) {
  TrainOptions o = tiny_training(40);
  o.model.dtype = DType::Float32;
  std::vector<double> f32;
  run_mesh(1, 1, [&](const dist::DeviceMeshPtr& mesh) { f32 = train(o, mesh).losses; });
  o.precision = "bf16";
  const auto metrics = std::filesystem::temp_directory_path() / "meshgrad_test_bf16_metrics.jsonl";
  for (const auto& [dp, tp] : {std::pair{1, 1}, std::pair{1, 2}, std::pair{2, 1}}) {
    SCOPED_TRACE(fmt::format("dp={} tp={}", dp, tp));
    o.metrics_path = metrics.string();
    std::vector<double> b16;
    run_mesh(dp, tp, [&](const dist::DeviceMeshPtr& mesh) {
      auto losses = train(o, mesh).losses;
      if (mesh->rank() == 0) b16 = losses;
    });
    ASSERT_EQ(b16.size(), f32.size());
    double worst = 0;
    bool differs = false;
    for (std::size_t i = 0; i < f32.size(); ++i) {
      worst = std::max(worst, std::abs(b16[i] - f32[i]) / f32[i]);
      differs = differs || b16[i] != f32[i];
    }
    EXPECT_LT(worst, 0.03);
    EXPECT_TRUE(differs) << "bf16 gave float32's bits: its products did not round";
    EXPECT_LT(b16.back(), b16.front() - 1.0);
    std::ifstream in(metrics);
    std::string line;
    ASSERT_TRUE(std::getline(in, line));
    const auto header = nlohmann::json::parse(line);
    EXPECT_EQ(header.at("config").at("precision"), "bf16");
    EXPECT_NE(header.at("bf16_products").get<std::string>(), "");
  }
  std::filesystem::remove(metrics);
  o.model.dtype = DType::Float64;
  o.metrics_path.clear();
  run_mesh(1, 1, [&](const dist::DeviceMeshPtr& mesh) {
    try {
      train(o, mesh);
      ADD_FAILURE() << "bf16 with a float64 model trained";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("--precision bf16 needs --dtype float32"), std::string::npos) << e.what();
    }
  });
}

TEST(Trainer, DataParallelTensorParallelTrainingFollowsSingleRank) {
  // Same seed and data: the per-step global losses of dp=2 x tp=2 (sequence-parallel) match the
  // single-rank run to float64 rounding, so gradients, synchronisation and AdamW agree step by step.
  const TrainOptions o = tiny_training(4);
  std::vector<double> ref, got;
  run_mesh(1, 1, [&](const dist::DeviceMeshPtr& mesh) { ref = train(o, mesh).losses; });
  TrainOptions sp = o;
  sp.parallel.sequence_parallel = true;
  run_mesh(2, 2, [&](const dist::DeviceMeshPtr& mesh) {
    auto losses = train(sp, mesh).losses;
    if (mesh->rank() == 0) got = losses;
  });
  ASSERT_EQ(got.size(), ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(got[i], ref[i], 1e-10 * ref[i]) << "step " << i + 1;
  EXPECT_LT(ref.back(), ref.front());
}

TEST(Trainer, AdamWOptionsReachTheOptimizer) {
  // Each of beta1, beta2, eps and weight decay changes the second step's loss (the first update is
  // the first that uses them); the defaults give the defaults' bits.
  const auto losses = [](const std::function<void(TrainOptions&)>& set) {
    TrainOptions o = tiny_training(3);
    o.warmup_steps = 0;
    set(o);
    std::vector<double> out;
    run_mesh(1, 1, [&](const dist::DeviceMeshPtr& mesh) { out = train(o, mesh).losses; });
    return out;
  };
  const std::vector<double> base = losses([](TrainOptions&) {});
  EXPECT_EQ(losses([](TrainOptions& o) { o.beta1 = 0.9; o.beta2 = 0.95; o.eps = 1e-8; }), base);
  for (const auto& [name, set] : std::vector<std::pair<std::string, std::function<void(TrainOptions&)>>>{
           {"beta1", [](TrainOptions& o) { o.beta1 = 0.5; }},
           {"beta2", [](TrainOptions& o) { o.beta2 = 0.5; }},
           {"eps", [](TrainOptions& o) { o.eps = 1e-2; }},
           {"weight-decay", [](TrainOptions& o) { o.weight_decay = 10.0; }}}) {
    const std::vector<double> got = losses(set);
    EXPECT_EQ(got[0], base[0]) << name;
    EXPECT_NE(got[2], base[2]) << name << " did not reach AdamW";
  }
}

TEST(Trainer, LearningRateWarmsUpThenDecays) {
  TrainOptions o;
  o.steps = 101;
  o.lr = 1.0;
  o.warmup_steps = 10;   // min_lr left at -1: lr / 10
  EXPECT_DOUBLE_EQ(learning_rate(o, 0), 0.1);
  EXPECT_DOUBLE_EQ(learning_rate(o, 9), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(o, 10), 1.0);
  EXPECT_NEAR(learning_rate(o, 55), 0.55, 1e-12);   // half-way through the cosine
  EXPECT_DOUBLE_EQ(learning_rate(o, 100), 0.1);
}

TEST(Trainer, LearningRateSchedulesFollowTheirFormulas) {
  TrainOptions o;
  o.steps = 1000;   // longer than the decay: --decay-steps does not depend on --steps
  o.lr = 1.0;
  o.warmup_steps = 4;
  o.min_lr = 0.2;
  o.decay_steps = 100;
  o.lr_schedule = "linear";
  EXPECT_DOUBLE_EQ(learning_rate(o, 1), 0.5);
  EXPECT_DOUBLE_EQ(learning_rate(o, 4), 1.0);
  EXPECT_NEAR(learning_rate(o, 54), 0.6, 1e-12);    // half-way from 1 to 0.2
  EXPECT_DOUBLE_EQ(learning_rate(o, 104), 0.2);
  EXPECT_DOUBLE_EQ(learning_rate(o, 999), 0.2);     // min_lr after the decay
  o.lr_schedule = "cosine";
  EXPECT_NEAR(learning_rate(o, 54), 0.6, 1e-12);
  EXPECT_NEAR(learning_rate(o, 29), 0.2 + 0.4 * (1 + std::cos(std::numbers::pi / 4)), 1e-12);
  EXPECT_DOUBLE_EQ(learning_rate(o, 500), 0.2);
  o.lr_schedule = "constant";
  EXPECT_DOUBLE_EQ(learning_rate(o, 2), 0.75);      // warmup still applies
  EXPECT_DOUBLE_EQ(learning_rate(o, 999), 1.0);
  o.lr_schedule = "wsd";
  o.decay_fraction = 0.25;   // stable for 75 steps after warmup, then linear to 0.2 over 25
  EXPECT_DOUBLE_EQ(learning_rate(o, 79), 1.0);
  EXPECT_NEAR(learning_rate(o, 4 + 75 + 10), 1.0 - 0.8 * 10 / 25.0, 1e-12);
  EXPECT_DOUBLE_EQ(learning_rate(o, 104), 0.2);
  // Without --decay-steps the decay ends at the last step, as before these options existed.
  o.decay_steps = -1;
  o.steps = 105;
  EXPECT_DOUBLE_EQ(learning_rate(o, 104), 0.2);
  EXPECT_DOUBLE_EQ(learning_rate(o, 50), 1.0);
}

TEST(Trainer, OptimizerOptionsOutOfRangeAreRefusedByName) {
  const auto refused = [](auto set, const std::string& name) {
    TrainOptions o;
    set(o);
    try {
      check_optimizer_options(o);
      ADD_FAILURE() << name << " was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  };
  refused([](TrainOptions& o) { o.lr_schedule = "step"; }, "--lr-schedule");
  refused([](TrainOptions& o) { o.min_lr = 1.0; }, "--min-lr");
  refused([](TrainOptions& o) { o.decay_steps = 0; }, "--decay-steps");
  refused([](TrainOptions& o) { o.decay_fraction = 0; }, "--decay-fraction");
  refused([](TrainOptions& o) { o.beta1 = 1.0; }, "--beta1");
  refused([](TrainOptions& o) { o.beta2 = -0.1; }, "--beta2");
  refused([](TrainOptions& o) { o.eps = 0; }, "--eps");
  refused([](TrainOptions& o) { o.weight_decay = -1; }, "--weight-decay");
  TrainOptions fine;
  EXPECT_NO_THROW(check_optimizer_options(fine));
}


}  // namespace
}  // namespace meshgrad::train::test_trainer
