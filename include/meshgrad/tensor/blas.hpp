// Thin, typed wrappers over OpenBLAS, and control of its thread count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace meshgrad::blas {

// The OpenBLAS kernel table GEMMs run on (openblas_get_corename(), e.g. "Cooperlake"), and a line for
// banners that names it and why: OpenBLAS's own choice for the CPU, or OPENBLAS_CORETYPE from the
// environment, with a warning when that forces kernels narrower than the CPU's AVX-512 (the AVX2
// "Haswell" table runs sgemm at about half the speed of the AVX-512 ones on such a CPU). The bits of
// a GEMM depend on the table, so the metrics header records it.
std::string kernel_core();
std::string kernel_description();

// Sets the number of threads OpenBLAS uses for each call. Process-wide: rank threads of the threads
// backend share it, so whoever launches ranks sets it (see ThreadsPerRank).
void set_num_threads(int n);
int num_threads();
// Number of cores this process may run on (sched_getaffinity), at least 1.
int available_cores();

// The launch policy: while alive, OpenBLAS uses max(1, available_cores() / ranks_on_node) threads,
// so ranks x BLAS threads never exceeds the cores (rank threads of one process share the count;
// separate processes on a node each get their share). The previous count comes back at the end of
// the scope. The cores are this process's affinity (available_cores()): under mpirun's default
// binding a rank may see only its own core, so dividing by the node's ranks errs on the safe side
// (never more threads than cores). Process-wide, like the count itself: two concurrent scopes with
// different rank counts would race, so launch one set of ranks at a time.
//   blas::ThreadsPerRank policy(world_size);            // threads backend: all ranks in this process
//   blas::ThreadsPerRank policy(ranks_on_this_node);    // mpi: one rank per process
class ThreadsPerRank {
 public:
  explicit ThreadsPerRank(int ranks_on_node);
  ~ThreadsPerRank();
  ThreadsPerRank(const ThreadsPerRank&) = delete;
  ThreadsPerRank& operator=(const ThreadsPerRank&) = delete;
  int threads() const { return threads_; }

 private:
  int threads_;
  int previous_threads_;
  std::string previous_policy_;
};

// OpenBLAS (Debian's 0.3.21) keeps one pool of work buffers for the process, each kWorkBufferBytes
// of address space: a GEMM takes a free one for its call and maps a new one when none is free, and
// each of its own worker threads holds one while it runs. When that mapping fails (an address-space
// limit, ulimit -v) it retries for ever at 100% CPU while the other ranks wait (its memory.c). So the
// launcher reserves, once before ranks start, the buffers of all concurrent callers: `callers` (ranks
// in this process x BLAS threads per rank) plus the pool's workers, counted whether they run now or
// not (a stopped pool restarts whole). A plain mmap of that many first, which fails cleanly, then
// OpenBLAS's own allocations, all held together and handed back, so they stay mapped in the pool.
// Throws InvalidArgument naming the limit when they do not fit; later calls add only what is missing;
// nothing when the BLAS is not OpenBLAS.
inline constexpr std::size_t kWorkBufferBytes = std::size_t{128} << 20;
void reserve_work_buffers(int callers);

// How OpenBLAS's idle worker threads wait between calls, applied once per process (the first
// ThreadsPerRank does it, before ranks start): unless OPENBLAS_THREAD_TIMEOUT is set, they spin
// about 2^18 cycles instead of OpenBLAS's 2^28 and then sleep, so their spinning does not take
// the cores from a rank's other work. Returns the line for banners.
std::string idle_wait_policy();

// The BLAS thread policy in effect, for banners: e.g. "1 BLAS thread per rank (2 usable cores / 2 ranks on
// this node)" inside a ThreadsPerRank, else "4 BLAS threads (no launch policy in effect)".
std::string thread_policy();

// C = alpha * op(A) op(B) + beta * C, row-major. op(X) = X^T when trans_x. lda/ldb/ldc are the
// row strides (in elements) of A, B, C as stored.
void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
          std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc);
void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, double alpha, const double* a,
          std::int64_t lda, const double* b, std::int64_t ldb, double beta, double* c, std::int64_t ldc);

}  // namespace meshgrad::blas
