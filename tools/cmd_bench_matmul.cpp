// meshgrad bench matmul: how close meshgrad's matmul forward+backward through the autograd graph
// comes to bare BLAS, and what the graph costs per op on tiny tensors.
//
// 1. Per size n (n x n x n): one training step of y = a @ b is three GEMMs,
//        forward   y  = a  @ b      2 n^3 flops
//        backward  da = dy @ b^T    2 n^3
//                  db = a^T @ dy    2 n^3
//    run through autograd (leaves with requires_grad, matmul, backward with a fixed dy), next to the
//    same three GEMMs called directly (blas::gemm -> cblas_sgemm / cblas_dgemm) on preallocated
//    buffers. The two are timed alternately in the same run; best of --repeats. Target: meshgrad
//    within 10% of bare BLAS at 1024.
// 2. Graph overhead per op: a chain of 2K tiny ops on [4] tensors, y <- y * w + x, recorded and
//    backpropagated, minus the same forward and backward kernels called by hand (the arithmetic
//    autograd also has to do). What remains is node creation, edges, the engine's scheduling and
//    gradient accumulation. Target: <= 3 us per op.
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "command.hpp"
#include "options.hpp"
#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/dtype.hpp"
#include "meshgrad/tensor/error.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/random.hpp"

namespace meshgrad::tools::cmd_bench_matmul {
namespace {

using Clock = std::chrono::steady_clock;

struct BenchMatmulArgs {
  std::vector<std::int64_t> sizes{256, 512, 1024};
  int repeats = 5;
  std::string dtype = "float32";
  int threads = 0;       // 0: all available cores
  int chain = 64;        // overhead chain: 2 * chain ops
  double min_seconds = 0.1;   // each timed repeat runs at least this long (iterations calibrated once)
};

// Seconds per call of fn, timed over `iters` calls.
template <class F>
double seconds_per_iter(F&& fn, int iters) {
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) fn();
  return std::chrono::duration<double>(Clock::now() - t0).count() / iters;
}

// Iterations so that one timed repeat lasts about min_seconds (after one warm-up call).
template <class F>
int calibrate(F&& fn, double min_seconds) {
  fn();   // warm-up: first-touch of buffers, BLAS thread start
  const double once = std::max(seconds_per_iter(fn, 1), 1e-9);
  return static_cast<int>(std::clamp(std::ceil(min_seconds / once), 1.0, 1e7));
}

// Best-of-repeats seconds per iteration of two functions timed alternately (so a noisy neighbour or a
// clock change affects both alike).
template <class F, class G>
std::pair<double, double> best_of_alternating(F&& f, G&& g, int repeats, double min_seconds) {
  const int iters_f = calibrate(f, min_seconds);
  const int iters_g = calibrate(g, min_seconds);
  double best_f = std::numeric_limits<double>::infinity();
  double best_g = best_f;
  for (int r = 0; r < repeats; ++r) {
    best_f = std::min(best_f, seconds_per_iter(f, iters_f));
    best_g = std::min(best_g, seconds_per_iter(g, iters_g));
  }
  return {best_f, best_g};
}

Tensor leaf(Tensor t) {
  t.set_requires_grad(true);
  return t;
}

template <class T>
void bench_gemm_sizes(const BenchMatmulArgs& args, DType dtype) {
  fmt::print("matmul forward+backward (3 GEMMs, 6 n^3 flops) vs bare BLAS, same shapes, same run\n");
  fmt::print("{:>6}  {:>12} {:>10}  {:>12} {:>10}  {:>7}\n", "n", "meshgrad ms", "GFLOP/s", "BLAS ms", "GFLOP/s",
             "ratio");
  for (std::int64_t n : args.sizes) {
    MG_CHECK(n > 0, "bench matmul: sizes must be positive, got {}", n);
    Tensor a = leaf(random::randn({n, n}, 1, dtype));
    Tensor b = leaf(random::randn({n, n}, 2, dtype));
    const Tensor dy = random::randn({n, n}, 3, dtype);   // fixed upstream gradient

    // meshgrad: recorded matmul, backward into the leaves' .grad (reset each step, as an optimizer
    // step with zero_grad would).
    auto meshgrad_step = [&] {
      Tensor y = matmul(a, b);
      backward(y, dy);
      a.zero_grad();
      b.zero_grad();
    };

    // Bare BLAS on the same inputs into preallocated outputs (row-major, lda = n).
    const std::size_t nn = static_cast<std::size_t>(n * n);
    std::vector<T> y(nn), da(nn), db(nn);
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    const T* pdy = dy.data<T>();
    auto blas_step = [&] {
      blas::gemm(false, false, n, n, n, T(1), pa, n, pb, n, T(0), y.data(), n);     // y  = a @ b
      blas::gemm(false, true, n, n, n, T(1), pdy, n, pb, n, T(0), da.data(), n);    // da = dy @ b^T
      blas::gemm(true, false, n, n, n, T(1), pa, n, pdy, n, T(0), db.data(), n);    // db = a^T @ dy
    };

    const auto [t_meshgrad, t_blas] = best_of_alternating(meshgrad_step, blas_step, args.repeats, args.min_seconds);
    const double flops = 6.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n);
    const double g_meshgrad = flops / t_meshgrad / 1e9;
    const double g_blas = flops / t_blas / 1e9;
    fmt::print("{:>6}  {:>12.3f} {:>10.1f}  {:>12.3f} {:>10.1f}  {:>7.3f}\n", n, t_meshgrad * 1e3, g_meshgrad,
               t_blas * 1e3, g_blas, g_meshgrad / g_blas);
    std::fflush(stdout);
  }
  fmt::print("ratio = meshgrad GFLOP/s / BLAS GFLOP/s (target >= 0.90 at n = 1024)\n\n");
}

void bench_graph_overhead(const BenchMatmulArgs& args, DType dtype) {
  MG_CHECK(args.chain > 0, "bench matmul: --chain must be positive, got {}", args.chain);
  const int steps = args.chain;
  const int ops = 2 * steps;
  Tensor x = leaf(random::randn({4}, 4, dtype));
  Tensor w = leaf(random::randn({4}, 5, dtype, 0.0, 0.5));
  const Tensor dy = Tensor::ones({4}, dtype);

  // Autograd: record y <- y * w + x (2 ops per step), backward, reset the leaves' grads.
  auto recorded = [&] {
    Tensor y = x;
    for (int s = 0; s < steps; ++s) y = add(mul(y, w), x);
    backward(y, dy);
    x.zero_grad();
    w.zero_grad();
  };

  // The same arithmetic by hand with the kernels autograd's nodes call: forward keeps the inputs
  // of each mul; backward: dx += dy; dw += dy * y_s; dy <- dy * w.
  const Tensor xd = x.detach();
  const Tensor wd = w.detach();
  std::vector<Tensor> ys(static_cast<std::size_t>(steps));
  auto by_hand = [&] {
    Tensor y = xd;
    for (int s = 0; s < steps; ++s) {
      ys[static_cast<std::size_t>(s)] = y;
      y = kernels::binary(kernels::Binary::Add, kernels::binary(kernels::Binary::Mul, y, wd), xd);
    }
    Tensor g = dy;
    Tensor gx = Tensor::zeros({4}, dtype);
    Tensor gw = Tensor::zeros({4}, dtype);
    for (int s = steps - 1; s >= 0; --s) {
      kernels::axpy_(gx, 1.0, g);
      kernels::axpy_(gw, 1.0, kernels::binary(kernels::Binary::Mul, g, ys[static_cast<std::size_t>(s)]));
      g = kernels::binary(kernels::Binary::Mul, g, wd);
    }
    kernels::axpy_(gx, 1.0, g);
  };

  const auto [t_recorded, t_by_hand] = best_of_alternating(recorded, by_hand, args.repeats, args.min_seconds);
  const double us_recorded = t_recorded / ops * 1e6;
  const double us_by_hand = t_by_hand / ops * 1e6;
  fmt::print("graph overhead: chain of {} ops (y = y * w + x on [4] tensors), forward + backward\n", ops);
  fmt::print("  autograd (record + backward)     {:8.3f} us/op\n", us_recorded);
  fmt::print("  same kernels by hand, no graph   {:8.3f} us/op\n", us_by_hand);
  fmt::print("  graph overhead                   {:8.3f} us/op  (target <= 3)\n", us_recorded - us_by_hand);
}

int run_bench_matmul(const BenchMatmulArgs& args) {
  MG_CHECK(args.repeats >= 1, "bench matmul: --repeats must be >= 1, got {}", args.repeats);
  const DType dtype = parse_dtype(args.dtype);
  const int threads = args.threads > 0 ? args.threads : blas::available_cores();
  blas::set_num_threads(threads);
  fmt::print("meshgrad bench matmul: {}, BLAS threads {} (available cores {}), best of {} repeats of >= {:g} s\n\n",
             dtype, blas::num_threads(), blas::available_cores(), args.repeats, args.min_seconds);
  dispatch_floating(dtype, "bench matmul", [&]<class T>() { bench_gemm_sizes<T>(args, dtype); });
  bench_graph_overhead(args, dtype);
  return 0;
}

}  // namespace

MESHGRAD_REGISTER_COMMAND(
    bench_matmul,
    {"bench", "matmul", "GFLOP/s of matmul forward+backward vs bare BLAS, and graph overhead per op",
     [](CLI::App& app) -> std::function<int()> {
       auto args = std::make_shared<BenchMatmulArgs>();
       app.add_option("--sizes", args->sizes, "Matrix sizes n (n x n x n), comma-separated")
           ->delimiter(',')
           ->capture_default_str();
       app.add_option("--repeats", args->repeats, "Timed repeats; the best is reported")
           ->check(at_least(1))
           ->capture_default_str();
       app.add_option("--dtype", args->dtype, "float32 or float64")
           ->check(CLI::IsMember({"float32", "float64"}))
           ->capture_default_str();
       app.add_option("--threads", args->threads, "BLAS threads (default: all available cores)")->check(at_least(0));
       app.add_option("--chain", args->chain, "Overhead benchmark: steps of y = y * w + x (2 ops each)")
           ->check(at_least(1))
           ->capture_default_str();
       app.add_option("--min-time", args->min_seconds, "Minimum seconds per timed repeat")->capture_default_str();
       return [args] { return run_bench_matmul(*args); };
     }});

}  // namespace meshgrad::tools::cmd_bench_matmul
