#include "meshgrad/tensor/blas.hpp"

#include <cblas.h>
#include <cpuid.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

#include "meshgrad/tensor/error.hpp"
#include "onednn_gemm.hpp"

// Parts of OpenBLAS's pthreads server outside cblas.h (exported by Debian's libopenblas0-pthread
// 0.3.21). Weak: a build without them (the OpenMP or serial variants) leaves the idle wait as it is.
extern "C" {
void openblas_read_env(void) __attribute__((weak));
int blas_thread_shutdown_(void) __attribute__((weak));
void* blas_memory_alloc(int procpos) __attribute__((weak));
void blas_memory_free(void* buffer) __attribute__((weak));
extern int blas_num_threads __attribute__((weak));    // the pool's size: its workers are this - 1
}

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

// Kernel tables of OpenBLAS that use AVX2 and FMA or wider (names as openblas_get_corename() prints
// them; Zen and Excavator run the Haswell kernels).
bool is_avx2_kernel(std::string_view core) {
  return is_avx512_kernel(core) || core == "Haswell" || core == "Zen" || core == "Excavator";
}

bool cpu_has_avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

}  // namespace

std::string unrecognised_cpu_hint(const std::string& core, bool avx2_fma, bool avx512) {
  if (is_avx2_kernel(core) || !(avx2_fma || avx512)) return "";
  if (avx512) {
    return fmt::format("; this CPU has AVX-512, which OpenBLAS's detection did not recognise: set OPENBLAS_CORETYPE="
                       "SkylakeX or Haswell for kernels that use it, several times faster than {}'s", core);
  }
  return fmt::format("; this CPU has AVX2 and FMA, which OpenBLAS's detection did not recognise: set "
                     "OPENBLAS_CORETYPE=Haswell for kernels that use them, several times faster than {}'s", core);
}

std::string kernel_core() { return openblas_get_corename(); }

std::string kernel_description() {
  const std::string core = kernel_core();
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  if (forced == nullptr || *forced == '\0') {
    return fmt::format("OpenBLAS {} kernels (OpenBLAS's choice for this CPU{})", core,
                       unrecognised_cpu_hint(core, cpu_has_avx2_fma(), cpu_has_avx512()));
  }
  if (cpu_has_avx512() && !is_avx512_kernel(core))
    return fmt::format("OpenBLAS {} kernels (OPENBLAS_CORETYPE={} in the environment; this CPU has AVX-512, which they do "
                       "not use: unset it to let OpenBLAS choose, which can be faster or slower, see "
                       "bench/compare_train.sh)",
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
std::string policy_text;        // set by the live ThreadsPerRank; empty outside one
int scope_ranks_in_process = 0; // the live ThreadsPerRank's; 0 outside one
std::string scope_automatic;    // its automatic count and why: "2 = 2 usable cores / 1 rank on this node"
}  // namespace

namespace {

std::once_flag idle_wait_once;
std::string idle_wait_text;   // what idle_wait_policy() returns; set once

// After a call, OpenBLAS's worker threads spin on sched_yield for 2^OPENBLAS_THREAD_TIMEOUT cycles
// (default 2^28, about 0.1 s) before they sleep: between a rank's GEMMs, that is nearly always. When
// the rank's cores have other work (the elementwise kernels split over the same cores, the comm
// progress threads), the spinning takes cycles from it: at tp=1 on the nanoGPT shape, a fifth of
// the perf samples were yields. Unless the user set the variable, meshgrad shortens the spin to
// 2^kIdleSpinLog2 cycles (tens of microseconds: still enough to catch the next GEMM of the same
// layer) and restarts OpenBLAS's thread pool so the workers read it: the pool re-creates itself at
// the next call, the path OpenBLAS takes after fork(). Runs once, at the first launch, before any
// rank runs a GEMM.
constexpr int kIdleSpinLog2 = 18;

void shorten_idle_spin() {
  if (const char* user = std::getenv("OPENBLAS_THREAD_TIMEOUT")) {
    idle_wait_text = fmt::format("idle BLAS threads spin 2^{} cycles (OPENBLAS_THREAD_TIMEOUT from the environment)", user);
    return;
  }
  if (openblas_read_env == nullptr || blas_thread_shutdown_ == nullptr) {
    idle_wait_text = "idle BLAS threads spin OpenBLAS's default 2^28 cycles (this OpenBLAS build cannot restart its pool)";
    return;
  }
  setenv("OPENBLAS_THREAD_TIMEOUT", std::to_string(kIdleSpinLog2).c_str(), /*overwrite=*/0);
  openblas_read_env();      // OpenBLAS versions that cache their environment
  blas_thread_shutdown_();  // the workers come back at the next call with the new timeout
  idle_wait_text = fmt::format("idle BLAS threads sleep after 2^{} cycles", kIdleSpinLog2);
}

}  // namespace

std::string idle_wait_policy() {
  std::call_once(idle_wait_once, shorten_idle_spin);
  if (!onednn::built()) return idle_wait_text;
  // oneDNN's OpenMP threads: libgomp read its policy at load (the CLI sets passive, tools/main.cpp).
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  const char* spin = std::getenv("GOMP_SPINCOUNT");
  const std::string omp = policy != nullptr ? fmt::format("OpenMP threads OMP_WAIT_POLICY={}", policy)
                          : spin != nullptr ? fmt::format("OpenMP threads GOMP_SPINCOUNT={}", spin)
                                            : std::string("OpenMP threads spin libgomp's default");
  return idle_wait_text + ", " + omp;
}

ThreadsPerRank::ThreadsPerRank(int ranks_on_node, int ranks_in_process) {
  if (ranks_on_node < 1 || ranks_in_process < 1 || ranks_in_process > ranks_on_node)
    throw InvalidArgument(fmt::format("blas::ThreadsPerRank: need 1 <= ranks_in_process <= ranks_on_node, got {} and {}",
                                      ranks_in_process, ranks_on_node));
  idle_wait_policy();
  const int cores = available_cores();
  threads_ = std::max(1, cores / ranks_on_node);
  previous_threads_ = num_threads();
  previous_library_ = float32_gemm_library();
  set_num_threads(threads_);
  const std::string why = fmt::format("{} usable core{} / {} rank{} on this node", cores, cores == 1 ? "" : "s",
                                      ranks_on_node, ranks_on_node == 1 ? "" : "s");
  std::lock_guard lock(policy_m);
  previous_policy_ = policy_text;
  previous_ranks_in_process_ = scope_ranks_in_process;
  previous_automatic_ = scope_automatic;
  policy_text = fmt::format("{} BLAS thread{} per rank ({})", threads_, threads_ == 1 ? "" : "s", why);
  scope_ranks_in_process = ranks_in_process;
  scope_automatic = fmt::format("{} = {}", threads_, why);
}

ThreadsPerRank::~ThreadsPerRank() {
  set_num_threads(previous_threads_);
  set_float32_gemm_library(previous_library_);
  std::lock_guard lock(policy_m);
  policy_text = previous_policy_;
  scope_ranks_in_process = previous_ranks_in_process_;
  scope_automatic = previous_automatic_;
}

namespace {
std::mutex work_buffer_m;   // one reservation at a time

// Maps `count` work buffers and unmaps them again: whether the process has the room, without
// touching OpenBLAS (which would spin where this fails cleanly).
bool room_for_work_buffers(int count) {
  std::vector<void*> probes;
  bool fits = true;
  for (int i = 0; i < count && fits; ++i) {
    void* p = ::mmap(nullptr, kWorkBufferBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0);
    if (p == MAP_FAILED) fits = false;
    else probes.push_back(p);
  }
  for (void* p : probes) ::munmap(p, kWorkBufferBytes);
  return fits;
}

[[noreturn]] void throw_no_room(int callers, int missing) {
  struct rlimit limit {};
  const bool limited = ::getrlimit(RLIMIT_AS, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY;
  throw InvalidArgument(fmt::format(
      "out of memory: OpenBLAS needs a {} MiB work buffer for each of the {} BLAS callers of this process (ranks x "
      "BLAS threads, and its pool's workers), and the process cannot map {} more of them{}: raise the limit or run "
      "fewer ranks per process (OpenBLAS would otherwise retry the allocation for ever)",
      kWorkBufferBytes >> 20, callers, missing,
      limited ? fmt::format(" (its address-space limit, ulimit -v, is {} KiB)", limit.rlim_cur / 1024) : ""));
}

bool is_openblas() { return blas_memory_alloc != nullptr && blas_memory_free != nullptr; }
}  // namespace

void reserve_work_buffers(int callers) {
  if (!is_openblas() || callers < 1) return;
  const std::lock_guard<std::mutex> lock(work_buffer_m);
  static int reserved = 0;   // buffers this process already made OpenBLAS map
  // Each worker of OpenBLAS's pool holds a buffer of its own while it runs, and the pool restarts
  // with all its workers at the first call after it was stopped (idle_wait_policy stops it), however
  // few threads a call then uses: count them whether they run now or not.
  const int pool = std::max({&blas_num_threads != nullptr ? blas_num_threads : 1, static_cast<int>(std::thread::hardware_concurrency()), 1});
  const int needed = callers + pool - 1;
  if (needed <= reserved) return;
  // Those reserved before stay mapped in the pool: only the missing ones need room.
  if (!room_for_work_buffers(needed - reserved)) throw_no_room(needed, needed - reserved);
  // Taken together (each call returns another buffer while the others are held), then handed back:
  // the pool is the process's, and they stay mapped in it for the ranks' GEMMs.
  std::vector<void*> buffers;
  for (int i = 0; i < needed; ++i) buffers.push_back(blas_memory_alloc(0));
  for (void* b : buffers) blas_memory_free(b);
  reserved = needed;
}

void set_threads_per_rank(int n, const std::string& source) {
  if (n < 1 || n > kMaxThreadsPerRank)
    throw InvalidArgument(fmt::format("{}: BLAS threads per rank must be 1 to {}, got {}", source, kMaxThreadsPerRank, n));
  int ranks_in_process = 0;
  {
    std::lock_guard lock(policy_m);
    ranks_in_process = scope_ranks_in_process;
  }
  // Room for the callers' work buffers before any of them runs with the new count (OpenBLAS would
  // otherwise retry a failed mapping for ever).
  if (ranks_in_process > 0) reserve_work_buffers(ranks_in_process * n);
  {
    // The first rank thread sets the count, the others find it set: OpenBLAS is not asked to resize
    // its pool while another rank may already run a GEMM.
    static std::mutex set_m;
    std::lock_guard set_lock(set_m);
    if (num_threads() != n) set_num_threads(n);
    if (num_threads() != n)
      throw InvalidArgument(fmt::format("{}: this OpenBLAS runs at most {} threads, not {}", source, num_threads(), n));
  }
  std::lock_guard lock(policy_m);
  if (ranks_in_process > 0)
    policy_text = fmt::format("{} BLAS thread{} per rank ({}; automatic: {})", n, n == 1 ? "" : "s", source,
                              scope_automatic);
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

namespace {
thread_local bool split_work = false;   // the thread runs one range of split work
}  // namespace

SplitWorkScope::SplitWorkScope() : outer_(split_work) { split_work = true; }
SplitWorkScope::~SplitWorkScope() { split_work = outer_; }
bool in_split_work() { return split_work; }

namespace {

GemmLibrary library_from_environment() {
  const char* env = std::getenv("MESHGRAD_GEMM");
  const std::string value = env == nullptr ? "" : env;
  if (value.empty()) return onednn::built() ? GemmLibrary::OneDnn : GemmLibrary::OpenBlas;
  if (value == "openblas") return GemmLibrary::OpenBlas;
  MG_CHECK(value == "onednn", "MESHGRAD_GEMM={}: the float32 product library must be 'openblas' or 'onednn'", value);
  MG_CHECK(onednn::built(), "MESHGRAD_GEMM=onednn: this build has no oneDNN (configure with -DMESHGRAD_ONEDNN=ON and "
           "install libdnnl-dev)");
  return GemmLibrary::OneDnn;
}

std::atomic<int>& chosen_library() {
  static std::atomic<int> library{static_cast<int>(library_from_environment())};
  return library;
}

}  // namespace

bool onednn_built() { return onednn::built(); }

GemmLibrary float32_gemm_library() { return static_cast<GemmLibrary>(chosen_library().load(std::memory_order_relaxed)); }

void set_float32_gemm_library(GemmLibrary library) {
  MG_CHECK(library == GemmLibrary::OpenBlas || onednn::built(), "set_float32_gemm_library: this build has no oneDNN "
           "(configure with -DMESHGRAD_ONEDNN=ON and install libdnnl-dev)");
  chosen_library().store(static_cast<int>(library), std::memory_order_relaxed);
}

std::string gemm_description() {
  if (float32_gemm_library() == GemmLibrary::OpenBlas) return kernel_description();
  int log2_min = 0;
  while ((std::int64_t{1} << log2_min) < kOneDnnMinProduct) ++log2_min;
  return fmt::format("{} for float32 products of >= 2^{} multiply-adds; {} below that and for float64",
                     onednn::description(), log2_min, kernel_description());
}

std::string gemm_core() {
  const std::string openblas = "openblas " + kernel_core();
  if (float32_gemm_library() == GemmLibrary::OpenBlas) return openblas;
  std::string onednn = onednn::description();   // "oneDNN 2.6.3 brg:avx512_core"
  onednn.replace(0, 6, "onednn");
  return onednn + " + " + openblas;
}

void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
          std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  if (float32_gemm_library() == GemmLibrary::OneDnn && m * n * k >= kOneDnnMinProduct && !in_split_work()) {
    onednn::sgemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, num_threads());
    return;
  }
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

// ---- bf16 products -------------------------------------------------------------------------------

Bf16Instructions cpu_bf16_instructions() {
  Bf16Instructions found;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) != 0) {
    const unsigned max_subleaf = eax;
    found.amx_bf16 = ((edx >> 22) & 1u) != 0;
    if (max_subleaf >= 1 && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) != 0)
      found.avx512_bf16 = ((eax >> 5) & 1u) != 0;
  }
  return found;
}

std::string bf16_fallback_reason(const Bf16Instructions& cpu, bool onednn_built, GemmLibrary float32_library) {
  if (!onednn_built) return "this build has no oneDNN (configure with -DMESHGRAD_ONEDNN=ON and install libdnnl-dev)";
  if (float32_library == GemmLibrary::OpenBlas)
    return "float32 products run on OpenBLAS here (MESHGRAD_GEMM=openblas, or an invariant mode, whose products "
           "must not depend on oneDNN's stride-dependent kernel choice)";
  if (!cpu.avx512_bf16 && !cpu.amx_bf16) return "this CPU has neither AVX512_BF16 nor AMX-BF16";
  return "";
}

std::string bf16_fallback_reason() {
  static const Bf16Instructions cpu = cpu_bf16_instructions();
  return bf16_fallback_reason(cpu, onednn::built(), float32_gemm_library());
}

Bf16Route bf16_route() { return bf16_fallback_reason().empty() ? Bf16Route::OneDnn : Bf16Route::Float32Kernels; }

std::string bf16_description() {
  const std::string reason = bf16_fallback_reason();
  if (!reason.empty()) return "float32 kernels on bf16 operands (" + reason + ")";
  const Bf16Instructions cpu = cpu_bf16_instructions();
  int log2_min = 0;
  while ((std::int64_t{1} << log2_min) < kOneDnnMinProduct) ++log2_min;
  return fmt::format("oneDNN {} {} ({}) for bf16 products of >= 2^{} multiply-adds; float32 kernels on bf16 operands "
                     "below that",
                     onednn::version(), onednn::bf16_kernel(), cpu.amx_bf16 ? "AMX-BF16" : "AVX512_BF16", log2_min);
}

namespace {

// A stored rows x cols matrix with row stride ld, widened into a thread's scratch buffer (row
// stride cols). Each thread keeps two buffers (A and B), grown as needed.
const float* widen(const bfloat16* p, std::int64_t rows, std::int64_t cols, std::int64_t ld, int which) {
  thread_local std::vector<float> scratch[2];
  std::vector<float>& out = scratch[which];
  const auto need = static_cast<std::size_t>(rows * cols);
  if (out.size() < need) out.resize(need);
  for (std::int64_t r = 0; r < rows; ++r) {
    const bfloat16* row = p + r * ld;
    float* o = out.data() + r * cols;
    for (std::int64_t c = 0; c < cols; ++c) o[c] = float_from_bf16_bits(row[c].bits);
  }
  return out.data();
}

}  // namespace

void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const bfloat16* a,
          std::int64_t lda, const bfloat16* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (bf16_route() == Bf16Route::OneDnn && m * n * k >= kOneDnnMinProduct && !in_split_work()) {
    onednn::bf16gemm(trans_a, trans_b, m, n, k, alpha, &a->bits, lda, &b->bits, ldb, beta, c, ldc, num_threads());
    return;
  }
  // Stored shapes: A is m x k (k x m when transposed), B is k x n (n x k when transposed).
  const std::int64_t a_rows = trans_a ? k : m, a_cols = trans_a ? m : k;
  const std::int64_t b_rows = trans_b ? n : k, b_cols = trans_b ? k : n;
  const float* wa = widen(a, a_rows, a_cols, lda, 0);
  const float* wb = widen(b, b_rows, b_cols, ldb, 1);
  gemm(trans_a, trans_b, m, n, k, alpha, wa, std::max<std::int64_t>(a_cols, 1), wb, std::max<std::int64_t>(b_cols, 1),
       beta, c, ldc);
}

// ---- the machine's product peak -----------------------------------------------------------------

double product_peak_gflops(DType operands, std::int64_t n, int reps, GemmLibrary float32_library) {
  MG_CHECK(n >= 1 && reps >= 1, "product peak: n and reps must be >= 1, got n {} and reps {}", n, reps);
  MG_CHECK(float32_library == GemmLibrary::OpenBlas || onednn::built(), "product peak: this build has no oneDNN");
  const auto size = static_cast<std::size_t>(n * n);
  const auto time_products = [&](auto a_value, auto out_value) {
    using In = decltype(a_value);
    using Out = decltype(out_value);
    std::vector<In> a(size, a_value), b(size, a_value);
    std::vector<Out> c(size, Out(0));
    double best = 1e300;
    for (int r = 0; r <= reps; ++r) {   // the first warms the threads, caches and primitives
      const auto t0 = std::chrono::steady_clock::now();
      if constexpr (std::is_same_v<In, float>) {
        if (float32_library == GemmLibrary::OneDnn) {
          onednn::sgemm(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n, num_threads());
        } else {
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<blasint>(n), static_cast<blasint>(n),
                      static_cast<blasint>(n), 1.0f, a.data(), static_cast<blasint>(n), b.data(),
                      static_cast<blasint>(n), 0.0f, c.data(), static_cast<blasint>(n));
        }
      } else {
        gemm(false, false, n, n, n, Out(1), a.data(), n, b.data(), n, Out(0), c.data(), n);
      }
      const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r > 0) best = std::min(best, t);
    }
    return 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) / best * 1e-9;
  };
  switch (operands) {
    case DType::Float32: return time_products(0.5f, 0.0f);
    case DType::Float64: return time_products(0.5, 0.0);
    case DType::BFloat16: return time_products(bfloat16(0.5f), 0.0f);
    default: break;
  }
  throw InvalidArgument(fmt::format("product peak: operands must be float32, float64 or bfloat16, got {}", operands));
}

}  // namespace meshgrad::blas
