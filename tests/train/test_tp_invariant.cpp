// TP-invariant mode (--tp-invariant): loss, every gradient and every optimizer step bitwise the
// same at tp = 1, 2 and 4, with and without sequence parallelism and overlap, float32 and float64.
// The comparisons are of bytes, never of tolerances.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "meshgrad/comm/threads.hpp"
#include "meshgrad/tensor/random.hpp"
#include "meshgrad/train/trainer.hpp"

namespace meshgrad::train {
namespace {

void run_mesh(int dp, int tp, const std::function<void(const dist::DeviceMeshPtr&)>& fn) {
  comm::ThreadsOptions options;
  options.timeout = std::chrono::milliseconds(60000);
  const std::vector<dist::MeshAxis> axes{{"dp", dp}, {"tp", tp}};
  comm::run_ranks(dp * tp, [&](const comm::CommunicatorPtr& world) {
    fn(std::make_shared<const dist::DeviceMesh>(world, axes));
  }, options);
}

nn::ModelConfig small_gpt(DType dtype) {
  nn::ModelConfig c;
  c.kind = "gpt";
  c.layers = 2;
  c.hidden = 32;
  c.heads = 4;
  c.vocab = 61;
  c.seq = 8;
  c.batch = 4;
  c.dtype = dtype;
  return c;
}

struct Case {
  int tp;
  bool sp = false, overlap = false, invariant = false;
};

GradientDump dump_on(const Case& m, const nn::ModelConfig& cfg, const nn::Batch& batch) {
  GradientDump result;
  run_mesh(1, m.tp, [&](const dist::DeviceMeshPtr& mesh) {
    nn::ParallelConfig parallel;
    parallel.sequence_parallel = m.sp;
    parallel.overlap = m.overlap;
    parallel.tp_invariant = m.invariant;
    auto model = nn::make_model(cfg, parallel, mesh, 5);
    model->set_training(false);
    GradientDump d = compute_gradients(*model, batch, mesh);
    if (mesh->rank() == 0) result = std::move(d);
  });
  return result;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const Tensor x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.raw_data(), y.raw_data(), static_cast<std::size_t>(x.numel()) * dtype_size(x.dtype())) == 0;
}

TEST(TpInvariant, Explore) {
  for (DType dt : {DType::Float32, DType::Float64}) {
    const nn::ModelConfig cfg = small_gpt(dt);
    const nn::Batch batch{random::randint({4, 8}, 11, 61), random::randint({4, 8}, 12, 61)};
    const GradientDump ref = dump_on({1, false, false, true}, cfg, batch);
    for (Case c : {Case{1, true, false, true}, Case{2, false, false, true}, Case{4, false, false, true}, Case{2, true, false, true}, Case{4, true, true, true}}) {
      const GradientDump got = dump_on(c, cfg, batch);
      fmt::print("dtype {} tp {} sp {}: loss {}\n", dtype_name(dt), c.tp, c.sp, got.loss == ref.loss ? "same" : "DIFF");
      for (std::size_t i = 0; i < ref.gradients.size(); ++i) {
        if (!same_bytes(got.gradients[i].second, ref.gradients[i].second)) fmt::print("  differs: {}\n", ref.gradients[i].first);
      }
    }
  }
}

}  // namespace
}  // namespace meshgrad::train
