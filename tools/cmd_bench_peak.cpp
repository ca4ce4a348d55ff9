// meshgrad bench peak: the machine's product peaks in each precision, by the probe MFU uses
// (blas::product_peak_gflops), so a benchmark's "% of peak" and a run's MFU share one denominator.
//   meshgrad bench peak [--sizes 1024,2048] [--reps 10] [--threads N]
// One line per library, precision and size, "<precision> <library>: n=<n>: <GFLOP/s> GFLOP/s", then
// "best float32: <GFLOP/s>" and "best bf16: <GFLOP/s>" (the best of each precision over sizes and
// libraries: what bench/precision_train.sh divides by).
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "command.hpp"
#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad::tools::cmd_bench_peak {
namespace {

struct BenchPeakArgs {
  std::vector<std::int64_t> sizes = {1024, 2048};
  int reps = 10;
  int threads = 0;   // 0: every available core
};

int run_bench_peak(const BenchPeakArgs& a) {
  const int threads = a.threads > 0 ? a.threads : blas::available_cores();
  blas::set_num_threads(threads);
  fmt::print("meshgrad bench peak: square products, best of {} after one untimed call, {} thread{}\n", a.reps,
             threads, threads == 1 ? "" : "s");
  double best_f32 = 0, best_bf16 = 0;
  // float32 on OpenBLAS, then on oneDNN where the build has it; bf16 on its route (oneDNN's bf16
  // kernels, or the float32 kernels on widened operands: the description says which and why).
  std::vector<std::pair<blas::GemmLibrary, const char*>> libraries{{blas::GemmLibrary::OpenBlas, "OpenBLAS"}};
  if (blas::onednn_built()) libraries.emplace_back(blas::GemmLibrary::OneDnn, "oneDNN");
  for (const auto& [library, name] : libraries) {
    for (const std::int64_t n : a.sizes) {
      const double g = blas::product_peak_gflops(DType::Float32, n, a.reps, library);
      best_f32 = std::max(best_f32, g);
      fmt::print("float32 {}: n={}: {:.1f} GFLOP/s\n", name, n, g);
    }
  }
  fmt::print("bf16 products: {}\n", blas::bf16_description());
  for (const std::int64_t n : a.sizes) {
    const double g = blas::product_peak_gflops(DType::BFloat16, n, a.reps, blas::float32_gemm_library());
    best_bf16 = std::max(best_bf16, g);
    fmt::print("bf16 {}: n={}: {:.1f} GFLOP/s\n", blas::bf16_route() == blas::Bf16Route::OneDnn ? "oneDNN" : "float32 kernels",
               n, g);
  }
  fmt::print("best float32: {:.1f} GFLOP/s\nbest bf16: {:.1f} GFLOP/s\n", best_f32, best_bf16);
  return 0;
}

}  // namespace

MESHGRAD_REGISTER_COMMAND(
    bench_peak,
    {"bench", "peak", "The machine's float32 and bf16 product peaks, by the probe behind MFU",
     [](CLI::App& app) -> std::function<int()> {
       auto args = std::make_shared<BenchPeakArgs>();
       app.add_option("--sizes", args->sizes, "Matrix sizes n (n x n x n), comma-separated")
           ->delimiter(',')
           ->check(CLI::PositiveNumber)
           ->capture_default_str();
       app.add_option("--reps", args->reps, "Timed products per size; the best is reported")
           ->check(CLI::PositiveNumber)
           ->capture_default_str();
       app.add_option("--threads", args->threads, "Threads (default: every available core)")->check(CLI::NonNegativeNumber);
       return [args] { return run_bench_peak(*args); };
     }});

}  // namespace meshgrad::tools::cmd_bench_peak
