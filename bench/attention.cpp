// Causal attention forward + backward on one rank's share of the nanoGPT shape ([B, H, T, D] =
// [8, 3, 256, 64], i.e. 6 heads at tp=2): the blocked kernel (kernels::causal_attention_*) against
// the full-matrix path it replaced (q k^T, softmax over [T, T], P v, and the four backward GEMMs
// with the softmax backward), both built from the same kernels.
//
//   build/bench/bench_attention            (MESHGRAD_BENCH_THREADS sets the threads; default 1)
#include <benchmark/benchmark.h>

#include <cstdlib>

#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/random.hpp"

namespace {

using namespace meshgrad;

struct Inputs {
  Tensor q, k, v, dout;
  Inputs()
      : q(random::randn({8, 3, 256, 64}, 1, DType::Float32)),
        k(random::randn({8, 3, 256, 64}, 2, DType::Float32)),
        v(random::randn({8, 3, 256, 64}, 3, DType::Float32)),
        dout(random::randn({8, 3, 256, 64}, 4, DType::Float32)) {
    const char* env = std::getenv("MESHGRAD_BENCH_THREADS");
    blas::set_num_threads(env != nullptr ? std::atoi(env) : 1);
  }
};

constexpr double kScale = 0.125;   // 1 / sqrt(64)

void BM_AttentionTiled(benchmark::State& state) {
  Inputs in;
  for (auto _ : state) {
    kernels::AttentionForward f = kernels::causal_attention_forward(in.q, in.k, in.v, kScale);
    kernels::AttentionGrads g =
        kernels::causal_attention_backward(in.dout, in.q, in.k, in.v, f, kScale, true, true, true);
    benchmark::DoNotOptimize(g.dq.data<float>());
  }
}
BENCHMARK(BM_AttentionTiled)->Unit(benchmark::kMillisecond);

// The full [T, T] path (without the causal mask, which only adds work to it): a lower bound on
// what the replaced implementation cost.
void BM_AttentionFullMatrix(benchmark::State& state) {
  Inputs in;
  for (auto _ : state) {
    Tensor p = kernels::softmax_last(kernels::scale(kernels::matmul(in.q, in.k.transpose(-2, -1)), kScale));
    Tensor out = kernels::matmul(p, in.v);
    Tensor dv = kernels::matmul(p.transpose(-2, -1), in.dout);
    Tensor ds = kernels::softmax_backward_last(kernels::matmul(in.dout, in.v.transpose(-2, -1)), p);
    Tensor dq = kernels::matmul(ds, in.k), dk = kernels::matmul(ds.transpose(-2, -1), in.q);
    benchmark::DoNotOptimize(dq.data<float>());
    benchmark::DoNotOptimize(out.data<float>());
  }
}
BENCHMARK(BM_AttentionFullMatrix)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
