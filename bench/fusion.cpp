// The MLP's c_fc + bias + GELU, forward and backward through autograd, on the nanoGPT shape at tp=1
// ([T * B, C] = [2048, 384] -> [2048, 1536]): the bias added by the GEMM (bias rows, beta = 1)
// and a separate GELU, whose backward is a GELU-backward pass plus a column-sum pass for the bias,
// against the fused bias_gelu (GEMM without bias, one pass forward, one pass backward). Both run
// the same three GEMMs. Interleave the two (--benchmark_repetitions) on a quiet machine.
//
//   build/bench/bench_fusion            (MESHGRAD_BENCH_THREADS sets the BLAS threads; default 2)
#include <benchmark/benchmark.h>

#include <cstdlib>

#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/random.hpp"

namespace {

using namespace meshgrad;

struct Mlp {
  Tensor x, w, b, g;
  Mlp()
      : x(random::randn({256, 8, 384}, 1, DType::Float32)),
        w(random::randn({384, 1536}, 2, DType::Float32, 0.0, 0.02)),
        b(random::randn({1536}, 3, DType::Float32, 0.0, 0.02)),
        g(random::randn({256, 8, 1536}, 4, DType::Float32)) {
    const char* env = std::getenv("MESHGRAD_BENCH_THREADS");
    blas::set_num_threads(env != nullptr ? std::atoi(env) : 2);
    for (Tensor* t : {&x, &w, &b}) t->set_requires_grad();
  }
  void zero() {
    for (Tensor* t : {&x, &w, &b}) t->zero_grad();
  }
};

void BM_LinearBiasThenGelu(benchmark::State& state) {
  Mlp m;
  for (auto _ : state) {
    m.zero();
    backward(sum(mul(gelu(linear(m.x, m.w, m.b)), m.g)));
    benchmark::DoNotOptimize(m.b.grad().data<float>());
  }
}
BENCHMARK(BM_LinearBiasThenGelu)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_LinearThenFusedBiasGelu(benchmark::State& state) {
  Mlp m;
  for (auto _ : state) {
    m.zero();
    backward(sum(mul(bias_gelu(linear(m.x, m.w, Tensor()), m.b), m.g)));
    benchmark::DoNotOptimize(m.b.grad().data<float>());
  }
}
BENCHMARK(BM_LinearThenFusedBiasGelu)->Unit(benchmark::kMillisecond)->UseRealTime();

// The same without GEMMs or autograd: only the passes that differ (the bias rows the unfused
// GEMM starts from, GELU, GELU backward, the bias gradient's column sums; against the two fused
// passes).
void BM_ElementwiseUnfused(benchmark::State& state) {
  Mlp m;
  const Tensor y = random::randn({256, 8, 1536}, 5, DType::Float32);
  Tensor start = Tensor::empty({2048, 1536}, DType::Float32);
  for (auto _ : state) {
    start.copy_from(m.b);
    const Tensor out = kernels::unary(kernels::Unary::Gelu, y);
    const Tensor dy = kernels::gelu_backward(m.g, y);
    const Tensor db = kernels::sum(dy.view({-1, 1536}), {0}, false);
    benchmark::DoNotOptimize(out.data<float>());
    benchmark::DoNotOptimize(db.data<float>());
  }
}
BENCHMARK(BM_ElementwiseUnfused)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_ElementwiseFused(benchmark::State& state) {
  Mlp m;
  const Tensor y = random::randn({256, 8, 1536}, 5, DType::Float32);
  for (auto _ : state) {
    const Tensor out = kernels::bias_gelu(y, m.b);
    const kernels::BiasGeluGrads g = kernels::bias_gelu_backward(m.g, y, m.b, true);
    benchmark::DoNotOptimize(out.data<float>());
    benchmark::DoNotOptimize(g.dbias.data<float>());
  }
}
BENCHMARK(BM_ElementwiseFused)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
