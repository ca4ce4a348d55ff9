#include "meshgrad/tensor/blas.hpp"

#include <cblas.h>
#include <sched.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string_view>
#include <thread>

#include "meshgrad/tensor/error.hpp"

namespace meshgrad::blas {

namespace {

// Kernel tables of OpenBLAS that use 512-bit vectors (names as openblas_get_corename() prints them).
bool is_avx512_kernel(std::string_view core) {
  return core == "SkylakeX" || core == "Cooperlake" || core == "SapphireRapids";
}

// The subset of AVX-512 that OpenBLAS's SkylakeX kernels execute.
bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512cd");
}

}  // namespace

std::string kernel_core() { return openblas_get_corename(); }

std::string kernel_description() {
  const std::string core = kernel_core();
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  if (forced == nullptr || *forced == '\0') return fmt::format("OpenBLAS {} kernels (OpenBLAS's choice for this CPU)", core);
  if (cpu_has_avx512() && !is_avx512_kernel(core))
    return fmt::format("OpenBLAS {} kernels (OPENBLAS_CORETYPE={} in the environment; this CPU has AVX-512, which they do "
                       "not use: unset it for up to twice the GEMM speed)",
                       core, forced);
  return fmt::format("OpenBLAS {} kernels (OPENBLAS_CORETYPE={} in the environment)", core, forced);
}

void set_num_threads(int n) { openblas_set_num_threads(std::max(1, n)); }
int num_threads() { return openblas_get_num_threads(); }

int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

namespace {
std::mutex policy_m;
std::string policy_text;   // set by the live ThreadsPerRank; empty outside one
}  // namespace

ThreadsPerRank::ThreadsPerRank(int ranks_on_node) {
  if (ranks_on_node < 1) throw InvalidArgument(fmt::format("blas::ThreadsPerRank: ranks_on_node must be >= 1, got {}",
                                                           ranks_on_node));
  const int cores = available_cores();
  threads_ = std::max(1, cores / ranks_on_node);
  previous_threads_ = num_threads();
  set_num_threads(threads_);
  std::lock_guard lock(policy_m);
  previous_policy_ = policy_text;
  policy_text = fmt::format("{} BLAS thread{} per rank ({} usable core{} / {} rank{} on this node)", threads_,
                            threads_ == 1 ? "" : "s", cores, cores == 1 ? "" : "s", ranks_on_node,
                            ranks_on_node == 1 ? "" : "s");
}

ThreadsPerRank::~ThreadsPerRank() {
  set_num_threads(previous_threads_);
  std::lock_guard lock(policy_m);
  policy_text = previous_policy_;
}

std::string thread_policy() {
  std::lock_guard lock(policy_m);
  if (!policy_text.empty()) return policy_text;
  const int n = num_threads();
  return fmt::format("{} BLAS thread{} (no launch policy in effect)", n, n == 1 ? "" : "s");
}

namespace {
CBLAS_TRANSPOSE flag(bool t) { return t ? CblasTrans : CblasNoTrans; }
}  // namespace

void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
          std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  cblas_sgemm(CblasRowMajor, flag(trans_a), flag(trans_b), static_cast<blasint>(m), static_cast<blasint>(n),
              static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c,
              static_cast<blasint>(ldc));
}

void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, double alpha, const double* a,
          std::int64_t lda, const double* b, std::int64_t ldb, double beta, double* c, std::int64_t ldc) {
  cblas_dgemm(CblasRowMajor, flag(trans_a), flag(trans_b), static_cast<blasint>(m), static_cast<blasint>(n),
              static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c,
              static_cast<blasint>(ldc));
}

}  // namespace meshgrad::blas
