#include "meshgrad/tensor/blas.hpp"

#include <cblas.h>
#include <sched.h>

#include <algorithm>
#include <thread>

namespace meshgrad::blas {

void set_num_threads(int n) { openblas_set_num_threads(std::max(1, n)); }
int num_threads() { return openblas_get_num_threads(); }

int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
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
