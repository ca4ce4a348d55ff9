// Float32 matrix products through oneDNN's matmul primitive (internal to the tensor layer; blas.hpp
// is the public face). oneDNN (Intel's, the library PyTorch's CPU path uses) runs its brgemm kernels
// in the CPU's widest instructions (AVX-512 here), about 1.8x OpenBLAS's Haswell kernels that this
// environment pins (bench/gemm_peaks.sh). Built when MESHGRAD_ONEDNN is on (CMake).
#pragma once

#include <cstdint>
#include <string>

namespace meshgrad::blas::onednn {

// True when this build has oneDNN.
bool built();
// "2.6.3"; "" when not built.
std::string version();
// oneDNN's version and the kernel it picks for a 1024-cube float32 product, e.g.
// "oneDNN 2.6.3 brg:avx512_core"; "" when not built.
std::string description();

// C = alpha op(A) op(B) + beta C, row-major with row strides lda, ldb, ldc (blas::gemm's contract),
// on `threads` OpenMP threads of the calling thread. One primitive per distinct shape, strides,
// alpha and beta, created on first use and kept per calling thread (a rank's products repeat every
// step). The same inputs, shape and thread count give the same bits, call after call. Throws
// InvalidArgument naming the shape when oneDNN has no implementation for it.
void sgemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
           std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc, int threads);
// The same with bfloat16 operands (bf16 bits, as meshgrad::bfloat16 stores them); float32
// accumulation and output, as oneDNN's bf16 matmul computes.
void bf16gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
              const std::uint16_t* a, std::int64_t lda, const std::uint16_t* b, std::int64_t ldb, float beta, float* c,
              std::int64_t ldc, int threads);

// The kernel oneDNN picks for a 1024-cube bf16 product, e.g. "brg:avx512_core_amx" or
// "brg:avx512_core_bf16"; "" when not built or when it has none.
std::string bf16_kernel();

}  // namespace meshgrad::blas::onednn
