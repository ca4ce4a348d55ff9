// Google Benchmark version of `meshgrad bench matmul` (see tools/cmd_bench_matmul.cpp for the
// definitions): matmul forward+backward through autograd vs the same three bare GEMMs, and a chain
// of tiny recorded ops vs the same kernels by hand (graph overhead per op = the difference).
//
//   build-*/bench/bench_matmul --benchmark_filter=1024
//
// FLOP/s counters count 6 n^3 flops per iteration (3 GEMMs); "ops" counts 2 * chain per iteration.
// BLAS uses all available cores (MESHGRAD_BENCH_THREADS overrides).
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <vector>

#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/random.hpp"

namespace {

using namespace meshgrad;

void set_threads() {
  const char* env = std::getenv("MESHGRAD_BENCH_THREADS");
  blas::set_num_threads(env != nullptr ? std::atoi(env) : blas::available_cores());
}

Tensor leaf(Tensor t) {
  t.set_requires_grad(true);
  return t;
}

void set_gemm_counters(benchmark::State& state, std::int64_t n) {
  const double flops = 6.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n);
  state.counters["FLOP/s"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["blas_threads"] = blas::num_threads();
}

// y = a @ b, backward with a fixed dy: 3 GEMMs through the graph.
void BM_MeshgradMatmulForwardBackward(benchmark::State& state) {
  set_threads();
  const std::int64_t n = state.range(0);
  Tensor a = leaf(random::randn({n, n}, 1));
  Tensor b = leaf(random::randn({n, n}, 2));
  const Tensor dy = random::randn({n, n}, 3);
  for (auto _ : state) {
    Tensor y = matmul(a, b);
    backward(y, dy);
    a.zero_grad();
    b.zero_grad();
  }
  set_gemm_counters(state, n);
}

// The same three GEMMs called directly on preallocated buffers.
void BM_BareSgemmForwardBackward(benchmark::State& state) {
  set_threads();
  const std::int64_t n = state.range(0);
  const std::size_t nn = static_cast<std::size_t>(n * n);
  const Tensor a = random::randn({n, n}, 1);
  const Tensor b = random::randn({n, n}, 2);
  const Tensor dy = random::randn({n, n}, 3);
  std::vector<float> y(nn), da(nn), db(nn);
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
  const float* pdy = dy.data<float>();
  for (auto _ : state) {
    blas::gemm(false, false, n, n, n, 1.0f, pa, n, pb, n, 0.0f, y.data(), n);    // y  = a @ b
    blas::gemm(false, true, n, n, n, 1.0f, pdy, n, pb, n, 0.0f, da.data(), n);   // da = dy @ b^T
    blas::gemm(true, false, n, n, n, 1.0f, pa, n, pdy, n, 0.0f, db.data(), n);   // db = a^T @ dy
    benchmark::DoNotOptimize(db.data());
  }
  set_gemm_counters(state, n);
}

constexpr int kChain = 64;   // steps of y = y * w + x: 2 ops each

void BM_GraphChainRecordedForwardBackward(benchmark::State& state) {
  Tensor x = leaf(random::randn({4}, 4));
  Tensor w = leaf(random::randn({4}, 5, DType::Float32, 0.0, 0.5));
  const Tensor dy = Tensor::ones({4});
  for (auto _ : state) {
    Tensor y = x;
    for (int s = 0; s < kChain; ++s) y = add(mul(y, w), x);
    backward(y, dy);
    x.zero_grad();
    w.zero_grad();
  }
  state.counters["ops"] = benchmark::Counter(2.0 * kChain, benchmark::Counter::kIsIterationInvariantRate |
                                                               benchmark::Counter::kInvert);
}

// The same forward and backward arithmetic with kernels only (no graph).
void BM_GraphChainKernelsByHand(benchmark::State& state) {
  const Tensor x = random::randn({4}, 4);
  const Tensor w = random::randn({4}, 5, DType::Float32, 0.0, 0.5);
  const Tensor dy = Tensor::ones({4});
  std::vector<Tensor> ys(kChain);
  for (auto _ : state) {
    Tensor y = x;
    for (int s = 0; s < kChain; ++s) {
      ys[static_cast<std::size_t>(s)] = y;
      y = kernels::binary(kernels::Binary::Add, kernels::binary(kernels::Binary::Mul, y, w), x);
    }
    Tensor g = dy;
    Tensor gx = Tensor::zeros({4});
    Tensor gw = Tensor::zeros({4});
    for (int s = kChain - 1; s >= 0; --s) {
      kernels::axpy_(gx, 1.0, g);
      kernels::axpy_(gw, 1.0, kernels::binary(kernels::Binary::Mul, g, ys[static_cast<std::size_t>(s)]));
      g = kernels::binary(kernels::Binary::Mul, g, w);
    }
    kernels::axpy_(gx, 1.0, g);
    benchmark::DoNotOptimize(gx.raw_data());
  }
  state.counters["ops"] = benchmark::Counter(2.0 * kChain, benchmark::Counter::kIsIterationInvariantRate |
                                                               benchmark::Counter::kInvert);
}

}  // namespace

BENCHMARK(BM_MeshgradMatmulForwardBackward)->Arg(256)->Arg(512)->Arg(1024)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_BareSgemmForwardBackward)->Arg(256)->Arg(512)->Arg(1024)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_GraphChainRecordedForwardBackward)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_GraphChainKernelsByHand)->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
