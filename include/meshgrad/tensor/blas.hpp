// Thin, typed wrappers over OpenBLAS, and control of its thread count.
#pragma once

#include <cstdint>

namespace meshgrad::blas {

// Sets the number of threads OpenBLAS uses for each call. Process-wide: rank threads of the threads
// backend share it, so run_ranks sets it to cores / ranks.
void set_num_threads(int n);
int num_threads();
// Number of cores this process may run on (sched_getaffinity), at least 1.
int available_cores();

// C = alpha * op(A) op(B) + beta * C, row-major. op(X) = X^T when trans_x. lda/ldb/ldc are the
// row strides (in elements) of A, B, C as stored.
void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
          std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc);
void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, double alpha, const double* a,
          std::int64_t lda, const double* b, std::int64_t ldb, double beta, double* c, std::int64_t ldc);

}  // namespace meshgrad::blas
