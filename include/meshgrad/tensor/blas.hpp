// Thin, typed wrappers over OpenBLAS, and control of its thread count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "meshgrad/tensor/bfloat16.hpp"
#include "meshgrad/tensor/dtype.hpp"

namespace meshgrad::blas {

// The OpenBLAS kernel table GEMMs run on (openblas_get_corename(), e.g. "Cooperlake"), and a line for
// banners that names it and why: OpenBLAS's own choice for the CPU, or OPENBLAS_CORETYPE from the
// environment, with a warning when that forces kernels narrower than the CPU's AVX-512 (the AVX2
// "Haswell" table runs sgemm at about half the speed of the AVX-512 ones on such a CPU). The bits of
// a GEMM depend on the table, so the metrics header records it. When OpenBLAS's own detection does
// not know the CPU (a virtual machine's generic model name) it falls back to the SSE3 "Prescott"
// table: on an AVX-512 Xeon, one thread's sgemm (n=512) ran at 17 GFLOP/s on it, 59 on Haswell's and
// 105 on SkylakeX's. The line then says so and names the OPENBLAS_CORETYPE to set.
std::string kernel_core();
std::string kernel_description();

// The hint kernel_description() appends to OpenBLAS's own choice: "" when the table `core` uses the
// CPU's vector width, else a sentence naming the OPENBLAS_CORETYPE whose kernels do (SkylakeX with
// AVX-512, Haswell with AVX2 and FMA). `avx2_fma` and `avx512` are what the CPU can execute.
std::string unrecognised_cpu_hint(const std::string& core, bool avx2_fma, bool avx512);

// Sets the number of threads OpenBLAS uses for each call. Process-wide: rank threads of the threads
// backend share it, so whoever launches ranks sets it (see ThreadsPerRank).
void set_num_threads(int n);
int num_threads();
// Number of cores this process may run on (sched_getaffinity), at least 1.
int available_cores();

// The launch policy: while alive (and float32_gemm_library() is restored at its end too), OpenBLAS uses max(1, available_cores() / ranks_on_node) threads,
// so ranks x BLAS threads never exceeds the cores (rank threads of one process share the count;
// separate processes on a node each get their share). The previous count comes back at the end of
// the scope. The cores are this process's affinity (available_cores()): under mpirun's default
// binding a rank may see only its own core, so dividing by the node's ranks errs on the safe side
// (never more threads than cores). Process-wide, like the count itself: two concurrent scopes with
// different rank counts would race, so launch one set of ranks at a time. ranks_in_process is how
// many of the node's ranks are threads of this process (the threads backend: all of them; mpi: 1):
// their BLAS callers share its OpenBLAS work buffers (set_threads_per_rank reserves them).
//   blas::ThreadsPerRank policy(world_size);               // threads backend: all ranks in this process
//   blas::ThreadsPerRank policy(ranks_on_this_node, 1);    // mpi: one rank per process
// A run may ask for another count than this automatic one (set_threads_per_rank): the bits of a GEMM
// depend on OpenBLAS's thread count for some kernels, so two runs meant to agree bitwise on meshes
// of different sizes need the same count, which the automatic one is not.
enum class GemmLibrary;

class ThreadsPerRank {
 public:
  explicit ThreadsPerRank(int ranks_on_node) : ThreadsPerRank(ranks_on_node, ranks_on_node) {}
  ThreadsPerRank(int ranks_on_node, int ranks_in_process);
  ~ThreadsPerRank();
  ThreadsPerRank(const ThreadsPerRank&) = delete;
  ThreadsPerRank& operator=(const ThreadsPerRank&) = delete;
  int threads() const { return threads_; }   // the automatic count

 private:
  int threads_;
  int previous_threads_;
  GemmLibrary previous_library_;   // float32_gemm_library() before the scope: restored at its end
  std::string previous_policy_;
  int previous_ranks_in_process_;
  std::string previous_automatic_;
};

// The largest count set_threads_per_rank takes: far above any core count it is meant for, below
// the counts OpenBLAS builds cap their pools at (it would silently run fewer).
inline constexpr int kMaxThreadsPerRank = 256;

// A run's own BLAS thread count per rank, in place of the launch policy's automatic one (the train
// option --blas-threads, and the invariant modes' 1): every rank of the run calls it with the same
// n before its first GEMM. The count is process-wide, shared by the rank threads of a process, so
// ranks that asked for different counts would change each other's counts mid-run: the ranks agree
// on their options first. Within a ThreadsPerRank scope it reserves OpenBLAS's work buffers for the
// scope's ranks in this process x n (reserve_work_buffers: InvalidArgument when they do not fit)
// and thread_policy() then says "n BLAS threads per rank (<source>; automatic: ...)", source naming
// where n comes from (e.g. "--blas-threads 1"); the scope's end restores the count from before it.
// Outside a scope it only sets the count (set_num_threads). Throws InvalidArgument naming source when
// n is outside [1, kMaxThreadsPerRank] or OpenBLAS runs another count than n.
void set_threads_per_rank(int n, const std::string& source);

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
// the cores from a rank's other work. Returns the line for banners, with the wait policy of oneDNN's
// OpenMP threads when the build has oneDNN (OMP_WAIT_POLICY or GOMP_SPINCOUNT as libgomp read them at
// load; the CLI starts itself with OMP_WAIT_POLICY=passive unless one is set: tools/main.cpp).
std::string idle_wait_policy();

// The BLAS thread policy in effect, for banners: e.g. "1 BLAS thread per rank (2 usable cores / 2 ranks on
// this node)" inside a ThreadsPerRank, "1 BLAS thread per rank (--blas-threads 1; automatic: 2 = 2 usable
// cores / 1 rank on this node)" after set_threads_per_rank, else "4 BLAS threads (no launch policy in
// effect)".
std::string thread_policy();

// The library that computes float32 products. OneDnn: oneDNN's matmul (its brgemm kernels in the
// CPU's widest instructions) for products of at least kOneDnnMinProduct multiply-adds, OpenBLAS
// below that (a oneDNN call costs more, and its OpenMP team's fork and join weighs on products of a
// few milliseconds and less, bench/gemm_peaks.sh) and on threads that
// run one range of split work (in_split_work()). OpenBlas: OpenBLAS for every product.
// float64 products are OpenBLAS's always (oneDNN has no float64 matmul).
enum class GemmLibrary { OpenBlas, OneDnn };
// (The invariant modes choose OpenBlas for their run, nn/parallel_context.cpp: oneDNN picks its kernel
// from the operands' row strides, so a block product computed inside a wider matrix on one mesh and
// as a whole matrix on another would round differently.)
inline constexpr std::int64_t kOneDnnMinProduct = std::int64_t{1} << 24;
// The process's choice: MESHGRAD_GEMM=openblas or onednn in the environment (read once; any other
// value throws InvalidArgument naming it, and onednn in a build without oneDNN throws rather than
// running OpenBLAS under its name), else OneDnn when the build has it (CMake MESHGRAD_ONEDNN).
GemmLibrary float32_gemm_library();
// True when this build has oneDNN (CMake MESHGRAD_ONEDNN).
bool onednn_built();
// Sets it for the process (benchmarks and tests comparing the two); OneDnn in a build without
// oneDNN throws InvalidArgument. Call between products, not during them.
void set_float32_gemm_library(GemmLibrary library);
// "oneDNN 2.6.3 brg:avx512_core for float32 products of >= 2^24 multiply-adds; OpenBLAS ... below"
// or kernel_description(): for banners and the metrics header (the bits of a product depend on it).
std::string gemm_description();
// The short form for the metrics header: "onednn 2.6.3 brg:avx512_core + openblas Haswell" or
// "openblas Haswell".
std::string gemm_core();

// While alive, the calling thread runs one range of work split over threads (parallel::for_ranges
// opens one per range): its products stay on this thread (OpenBLAS's, single-threaded for such
// small tiles) rather than start threads of their own. Nests.
class SplitWorkScope {
 public:
  SplitWorkScope();
  ~SplitWorkScope();
  SplitWorkScope(const SplitWorkScope&) = delete;
  SplitWorkScope& operator=(const SplitWorkScope&) = delete;

 private:
  bool outer_;
};
bool in_split_work();

// C = alpha * op(A) op(B) + beta * C, row-major. op(X) = X^T when trans_x. lda/ldb/ldc are the
// row strides (in elements) of A, B, C as stored. Float32 goes to float32_gemm_library()'s choice
// for the shape; the same inputs, shape and thread count give the same bits on every call.
void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
          std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc);
void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, double alpha, const double* a,
          std::int64_t lda, const double* b, std::int64_t ldb, double beta, double* c, std::int64_t ldc);

// ---- bf16 products (--precision bf16) -----------------------------------------------------------
// The bf16 product instructions of this CPU (cpuid): AVX512_BF16 (vdpbf16ps, leaf 7.1 EAX bit 5)
// and AMX-BF16 (tile products, leaf 7.0 EDX bit 22).
struct Bf16Instructions {
  bool avx512_bf16 = false;
  bool amx_bf16 = false;
};
Bf16Instructions cpu_bf16_instructions();

// How this process multiplies bf16 operands:
//   OneDnn          oneDNN's bf16 matmul in the CPU's bf16 instructions (float32 accumulation),
//                   for products of at least kOneDnnMinProduct multiply-adds off split work, as
//                   float32 routes; the float32 route below that.
//   Float32Kernels  every operand widened to float32 (exact) and multiplied by the float32 route:
//                   the same numbers a bf16 product means (bf16 inputs, float32 accumulation), at
//                   float32's speed.
// OneDnn needs all of: a build with oneDNN, float32_gemm_library() == OneDnn (MESHGRAD_GEMM=openblas
// and the invariant modes choose OpenBlas: their products must not depend on oneDNN's
// stride-dependent kernel choice), and a CPU with AVX512_BF16 or AMX-BF16 (without them oneDNN would
// run bf16 slower than float32).
enum class Bf16Route { OneDnn, Float32Kernels };
Bf16Route bf16_route();
// Why bf16_route() is Float32Kernels, for the run's banner ("this CPU has neither AVX512_BF16 nor
// AMX-BF16", ...); "" when it is OneDnn. The pure function of its inputs is exposed for tests.
std::string bf16_fallback_reason();
std::string bf16_fallback_reason(const Bf16Instructions& cpu, bool onednn_built, GemmLibrary float32_library);
// "oneDNN 2.6.3 brg:avx512_core_amx (AMX-BF16) for bf16 products of >= 2^24 multiply-adds; float32
// kernels below that" or "float32 kernels on bf16 operands (<reason>)": for banners and metrics.
std::string bf16_description();

// C = alpha op(A) op(B) + beta C with bfloat16 A and B and float32 C (accumulated in float32);
// blas::gemm's layout contract. Routed by bf16_route(); the same inputs, shape and thread count give
// the same bits on every call.
void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const bfloat16* a,
          std::int64_t lda, const bfloat16* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc);

// ---- the machine's product peak -----------------------------------------------------------------
// GFLOP/s (2 n^3 per product) of the best of `reps` n x n x n products after one untimed call, on
// this thread with the current thread count: float32 operands on `float32_library` (called directly,
// so the process's choice never changes under other threads), bfloat16 operands by bf16_route(),
// float64 on OpenBLAS. The one probe behind MFU (train's peak: the best float32 library, or bf16, in
// the run's precision) and `meshgrad bench peak` (which bench/precision_train.sh prints beside its
// runs). operands: Float32, Float64 or BFloat16; n >= 1, reps >= 1; OneDnn only in a build with it;
// else InvalidArgument.
double product_peak_gflops(DType operands, std::int64_t n, int reps, GemmLibrary float32_library);

}  // namespace meshgrad::blas
