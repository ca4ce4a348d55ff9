// What every backend shares: environment defaults, names, call descriptors and their cross-rank
// check, the misuse checks, the rank-order reduction kernel, and the executor / Work handle.
#include "meshgrad/comm/communicator.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <system_error>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "comm/detail.hpp"
#include "meshgrad/comm/errors.hpp"

namespace meshgrad::comm {

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
  }
  return "?";
}

Milliseconds default_timeout_from_env() {
  const char* text = std::getenv("MESHGRAD_COMM_TIMEOUT_MS");
  if (text == nullptr || *text == '\0') return std::chrono::minutes(5);
  errno = 0;
  char* end = nullptr;
  const long long ms = std::strtoll(text, &end, 10);
  MG_CHECK(errno == 0 && end != text && *end == '\0' && ms > 0,
           "MESHGRAD_COMM_TIMEOUT_MS must be a positive integer (milliseconds), got '{}'", text);
  return Milliseconds(ms);
}

bool debug_checks_from_env() {
  const char* text = std::getenv("MESHGRAD_COMM_DEBUG");
  if (text == nullptr || *text == '\0') return false;
  const std::string_view v(text);
  if (v == "1" || v == "true" || v == "on" || v == "yes") return true;
  if (v == "0" || v == "false" || v == "off" || v == "no") return false;
  throw InvalidArgument(fmt::format("MESHGRAD_COMM_DEBUG must be 0 or 1, got '{}'", v));
}

namespace detail {

std::string_view op_name(OpKind op) {
  switch (op) {
    case OpKind::AllReduce: return "all_reduce";
    case OpKind::AllGather: return "all_gather";
    case OpKind::ReduceScatter: return "reduce_scatter";
    case OpKind::Broadcast: return "broadcast";
    case OpKind::AllToAll: return "all_to_all";
    case OpKind::Barrier: return "barrier";
    case OpKind::Split: return "split";
    case OpKind::Send: return "send";
    case OpKind::Recv: return "recv";
  }
  return "?";
}

namespace {
std::uint64_t hash_counts(Counts counts) {
  if (counts.empty()) return 0;
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a over the values
  for (std::size_t c : counts) {
    h ^= static_cast<std::uint64_t>(c) + 0x9e3779b97f4a7c15ull;
    h *= 1099511628211ull;
  }
  return h == 0 ? 1 : h;
}
}  // namespace

CallDesc make_desc(OpKind op, std::uint64_t seq, DType dtype, std::size_t in_count, std::size_t out_count, int root,
                   int reduce_op, Counts counts) {
  CallDesc d;
  d.seq = seq;
  d.in_count = in_count;
  d.out_count = out_count;
  d.counts_hash = hash_counts(counts);
  d.root = root;
  d.op = static_cast<std::uint8_t>(op);
  d.dtype = static_cast<std::uint8_t>(dtype);
  d.reduce_op = reduce_op < 0 ? 0xff : static_cast<std::uint8_t>(reduce_op);
  return d;
}

std::string describe(const CallDesc& d) {
  const auto op = static_cast<OpKind>(d.op);
  std::string s = fmt::format("{}(seq {}", op_name(op), d.seq);
  if (op != OpKind::Barrier && op != OpKind::Split) {
    s += fmt::format(", {}, in {}, out {}", dtype_name(static_cast<DType>(d.dtype)), d.in_count, d.out_count);
  }
  if (d.counts_hash != 0) s += fmt::format(", counts #{:016x}", d.counts_hash);
  if (op == OpKind::Broadcast) s += fmt::format(", root {}", d.root);
  if (d.reduce_op != 0xff) s += fmt::format(", op {}", reduce_op_name(static_cast<ReduceOp>(d.reduce_op)));
  return s + ")";
}

bool same_call(const CallDesc& a, const CallDesc& b) {
  if (a.op != b.op || a.seq != b.seq) return false;
  const auto op = static_cast<OpKind>(a.op);
  switch (op) {
    case OpKind::Barrier:
    case OpKind::Split: return true;
    case OpKind::AllToAll: return a.dtype == b.dtype;  // counts differ per rank; checked pairwise
    case OpKind::AllGather:  // in counts differ with uneven shards; out and counts must agree
      return a.dtype == b.dtype && a.out_count == b.out_count && a.counts_hash == b.counts_hash;
    case OpKind::ReduceScatter:
      return a.dtype == b.dtype && a.in_count == b.in_count && a.counts_hash == b.counts_hash &&
             a.reduce_op == b.reduce_op;
    default:
      return a.dtype == b.dtype && a.in_count == b.in_count && a.out_count == b.out_count && a.root == b.root &&
             a.reduce_op == b.reduce_op && a.counts_hash == b.counts_hash;
  }
}

void check_same_calls(const std::vector<CallDesc>& descs, std::string_view backend, int this_rank) {
  for (std::size_t r = 1; r < descs.size(); ++r) {
    if (!same_call(descs[0], descs[r])) {
      throw CollectiveMismatch(
          fmt::format("{}: collective mismatch (debug check, seen on rank {}): rank 0 called {} but rank {} called {}",
                      backend, this_rank, describe(descs[0]), r, describe(descs[r])),
          std::string(backend), std::string(op_name(static_cast<OpKind>(descs[0].op))), descs[0].seq, this_rank);
    }
  }
}

// ---- misuse checks --------------------------------------------------------------------------------

std::string counts_text(Counts counts) { return fmt::format("[{}]", fmt::join(counts, ", ")); }

void check_reduction_dtype(std::string_view op, DType dtype) {
  MG_CHECK(dtype == DType::Float32 || dtype == DType::Float64 || dtype == DType::BFloat16,
           "{}: reductions take float32, float64 or bfloat16 buffers, got {}", op, dtype_name(dtype));
}

void check_same_dtype(std::string_view op, DType in, DType out) {
  MG_CHECK(in == out, "{}: input dtype {} and output dtype {} differ", op, dtype_name(in), dtype_name(out));
}

void check_data(std::string_view op, std::string_view which, const void* data, std::size_t count) {
  MG_CHECK(data != nullptr || count == 0, "{}: {} buffer is null but has {} elements", op, which, count);
}

void check_no_overlap(std::string_view op, ConstBuffer in, ConstBuffer out) {
  if (in.count == 0 || out.count == 0) return;
  const auto* a = static_cast<const char*>(in.data);
  const auto* b = static_cast<const char*>(out.data);
  const std::size_t na = in.count * dtype_size(in.dtype), nb = out.count * dtype_size(out.dtype);
  MG_CHECK(a + na <= b || b + nb <= a, "{}: input and output buffers overlap ({} and {} elements); only "
           "all_reduce and broadcast work in place", op, in.count, out.count);
}

void check_rank(std::string_view op, std::string_view what, int r, int size) {
  MG_CHECK(r >= 0 && r < size, "{}: {} {} is out of range for a communicator of size {}", op, what, r, size);
}

std::vector<std::size_t> resolve_counts(std::string_view op, std::string_view what, Counts counts, std::size_t total,
                                        int size) {
  const auto p = static_cast<std::size_t>(size);
  if (counts.empty()) {
    MG_CHECK(total % p == 0,
             "{}: {} has {} elements, not divisible by the communicator size {} (pass per-rank counts for "
             "uneven shards)", op, what, total, size);
    return std::vector<std::size_t>(p, total / p);
  }
  MG_CHECK(counts.size() == p, "{}: counts {} has {} entries, expected one per rank ({})", op,
           counts_text(counts), counts.size(), size);
  const std::size_t sum = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
  MG_CHECK(sum == total, "{}: counts {} sum to {} but {} has {} elements", op, counts_text(counts), sum, what,
           total);
  return {counts.begin(), counts.end()};
}

std::vector<std::size_t> offsets_of(const std::vector<std::size_t>& counts) {
  std::vector<std::size_t> off(counts.size(), 0);
  for (std::size_t i = 1; i < counts.size(); ++i) off[i] = off[i - 1] + counts[i - 1];
  return off;
}

// ---- per-op argument validation ---------------------------------------------------------------------

namespace {
// What every collective with an input and an output buffer checks, in this order: in and out have
// the same dtype, neither is null with elements, and unless the op works in place (in_place_ok),
// they do not overlap.
void check_in_out(std::string_view name, ConstBuffer in, ConstBuffer out, bool in_place_ok) {
  check_same_dtype(name, in.dtype, out.dtype);
  check_data(name, "input", in.data, in.count);
  check_data(name, "output", out.data, out.count);
  if (!in_place_ok) check_no_overlap(name, in, out);
}
}  // namespace

void check_all_reduce_args(ConstBuffer in, ConstBuffer out, int rank) {
  check_reduction_dtype("all_reduce", in.dtype);
  check_in_out("all_reduce", in, out, /*in_place_ok=*/true);
  MG_CHECK(in.count == out.count, "all_reduce: input has {} elements but output has {} (on rank {})", in.count,
           out.count, rank);
}

std::vector<std::size_t> check_all_gather_args(ConstBuffer in, ConstBuffer out, Counts counts, int size, int rank) {
  check_in_out("all_gather", in, out, /*in_place_ok=*/false);
  auto resolved = resolve_counts("all_gather", "the output", counts, out.count, size);
  MG_CHECK(in.count == resolved[rank], "all_gather: rank {} passes {} input elements but its count is {} "
           "(counts {})", rank, in.count, resolved[rank], counts_text(resolved));
  return resolved;
}

std::vector<std::size_t> check_reduce_scatter_args(ConstBuffer in, ConstBuffer out, Counts counts, int size,
                                                   int rank) {
  check_reduction_dtype("reduce_scatter", in.dtype);
  check_in_out("reduce_scatter", in, out, /*in_place_ok=*/false);
  auto resolved = resolve_counts("reduce_scatter", "the input", counts, in.count, size);
  MG_CHECK(out.count == resolved[rank], "reduce_scatter: rank {} passes {} output elements but its count is {} "
           "(counts {})", rank, out.count, resolved[rank], counts_text(resolved));
  return resolved;
}

void check_broadcast_args(ConstBuffer buf, int root, int size) {
  constexpr std::string_view name = "broadcast";
  check_rank(name, "root", root, size);
  check_data(name, "the", buf.data, buf.count);
}

AllToAllCounts check_all_to_all_args(ConstBuffer in, ConstBuffer out, Counts send_counts, Counts recv_counts,
                                     int size) {
  check_in_out("all_to_all", in, out, /*in_place_ok=*/false);
  AllToAllCounts c;
  c.send = resolve_counts("all_to_all", "the input (send counts)", send_counts, in.count, size);
  c.recv = resolve_counts("all_to_all", "the output (recv counts)", recv_counts, out.count, size);
  return c;
}

void check_point_to_point_args(OpKind op, const void* data, std::size_t count, int peer, int tag, int rank,
                               int size) {
  const bool is_send = op == OpKind::Send;
  const std::string_view name = op_name(op);
  check_rank(name, "peer", peer, size);
  if (is_send) {
    MG_CHECK(peer != rank, "send: rank {} sends to itself (peer must be another rank)", rank);
  } else {
    MG_CHECK(peer != rank, "recv: rank {} receives from itself (peer must be another rank)", rank);
  }
  MG_CHECK(tag >= 0, "{}: tag must be >= 0, got {}", name, tag);
  check_data(name, is_send ? "input" : "output", data, count);
}

// ---- rank-order reduction ---------------------------------------------------------------------------

namespace {

// One vector of 64 bytes (GCC vector extension; the compiler maps it to AVX-512 / AVX2 / SSE). Each
// lane is its own chain in rank order, so the bits equal the scalar loop's: no reassociation across
// ranks ever happens, only across lanes, which are independent.
template <class T>
struct VecOf;
template <>
struct VecOf<float> {
  typedef float type __attribute__((vector_size(64)));
};
template <>
struct VecOf<double> {
  typedef double type __attribute__((vector_size(64)));
};
template <class T>
using Vec = typename VecOf<T>::type;

template <class T>
inline Vec<T> load(const T* p) {
  Vec<T> v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

template <ReduceOp Op, class X>
inline X apply(X acc, X x) {
  if constexpr (Op == ReduceOp::Sum || Op == ReduceOp::Avg) {
    return acc + x;
  } else if constexpr (Op == ReduceOp::Max) {
    return (x > acc || x != x) ? x : acc;  // NaN propagates
  } else {
    return (x < acc || x != x) ? x : acc;
  }
}

// Copies bytes with streaming (non-temporal) stores: aligned on dst (the head and tail go through
// memcpy), loads unaligned. The lines skip the caches and the read-for-ownership a normal store
// does, a third less memory traffic for results that will not be read soon. No fence here: the
// callers fence once at the end of their work (stream_fence).
void copy_streaming(void* dst_v, const void* src_v, std::size_t bytes) {
  auto* dst = static_cast<char*>(dst_v);
  const auto* src = static_cast<const char*>(src_v);
#if defined(__x86_64__)
#if defined(__AVX512F__)
  constexpr std::size_t kLine = 64;
#else
  constexpr std::size_t kLine = 16;
#endif
  const std::size_t head = std::min(bytes, (kLine - reinterpret_cast<std::uintptr_t>(dst) % kLine) % kLine);
  std::memcpy(dst, src, head);
  std::size_t i = head;
  for (; i + 4 * kLine <= bytes; i += 4 * kLine) {
#if defined(__AVX512F__)
    const __m512i a = _mm512_loadu_si512(src + i), b = _mm512_loadu_si512(src + i + 64);
    const __m512i c = _mm512_loadu_si512(src + i + 128), d = _mm512_loadu_si512(src + i + 192);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), a);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 64), b);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 128), c);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 192), d);
#else
    for (std::size_t k = 0; k < 4; ++k) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16 * k));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16 * k), v);
    }
#endif
  }
  std::memcpy(dst + i, src + i, bytes - i);
#else
  std::memcpy(dst, src, bytes);
#endif
}

template <class T, ReduceOp Op>
void reduce_typed(int divisor, const void* const* in_v, int n_in, void* const* outs_v, int n_out, std::size_t count,
                  bool stream) {
  const T* const* in = reinterpret_cast<const T* const*>(in_v);
  T* const* outs = reinterpret_cast<T* const*>(outs_v);
  constexpr std::size_t W = 64 / sizeof(T);
  const T div = static_cast<T>(divisor);
  // One element range [i, i + len): read every input, then write every output. Safe when an output
  // is an input (in place): both are at the same index and all reads of the range come first.
  auto reduce_into = [&](T* dst, std::size_t i, std::size_t len) {
    std::size_t j = 0;
    for (; j + W <= len; j += W) {
      Vec<T> v = load(in[0] + i + j);
      for (int k = 1; k < n_in; ++k) v = apply<Op>(v, load(in[k] + i + j));
      if constexpr (Op == ReduceOp::Avg) v = v / div;
      __builtin_memcpy(dst + j, &v, sizeof(v));
    }
    for (; j < len; ++j) {
      T v = in[0][i + j];
      for (int k = 1; k < n_in; ++k) v = apply<Op>(v, in[k][i + j]);
      if constexpr (Op == ReduceOp::Avg) v = v / div;
      dst[j] = v;
    }
  };
  if (!stream) {
    // Vector by vector straight into the outputs (a vector is all reads, then all writes).
    std::size_t i = 0;
    for (; i + W <= count; i += W) {
      Vec<T> v = load(in[0] + i);
      for (int k = 1; k < n_in; ++k) v = apply<Op>(v, load(in[k] + i));
      if constexpr (Op == ReduceOp::Avg) v = v / div;
      for (int k = 0; k < n_out; ++k) __builtin_memcpy(outs[k] + i, &v, sizeof(v));
    }
    if (i < count) {
      T tail[W];
      reduce_into(tail, i, count - i);
      for (int k = 0; k < n_out; ++k) std::memcpy(outs[k] + i, tail, (count - i) * sizeof(T));
    }
    return;
  }
  // Streaming: reduce a block into an L1-resident buffer, then stream it to every output (each output
  // has its own alignment; copy_streaming aligns on it).
  constexpr std::size_t kBlock = 4096 / sizeof(T);
  alignas(64) T block[kBlock];
  for (std::size_t i = 0; i < count; i += kBlock) {
    const std::size_t len = std::min(kBlock, count - i);
    reduce_into(block, i, len);
    for (int k = 0; k < n_out; ++k) copy_streaming(outs[k] + i, block, len * sizeof(T));
  }
}

template <class T>
void reduce_dispatch(ReduceOp op, int divisor, const void* const* in, int n_in, void* const* outs, int n_out,
                     std::size_t count, bool stream) {
  switch (op) {
    case ReduceOp::Sum: return reduce_typed<T, ReduceOp::Sum>(divisor, in, n_in, outs, n_out, count, stream);
    case ReduceOp::Avg: return reduce_typed<T, ReduceOp::Avg>(divisor, in, n_in, outs, n_out, count, stream);
    case ReduceOp::Max: return reduce_typed<T, ReduceOp::Max>(divisor, in, n_in, outs, n_out, count, stream);
    case ReduceOp::Min: return reduce_typed<T, ReduceOp::Min>(divisor, in, n_in, outs, n_out, count, stream);
  }
}

// bfloat16 buffers (--reduce-dtype bf16: gradients on the wire at half the bytes): every element's
// inputs widened exactly to float32 and combined there in rank order, then rounded once to bf16 (to
// nearest even). One rounding per reduction, as NCCL's and gloo's bf16 sums keep a float32
// accumulator. Blocks of kBlock elements through an L1-resident float32 row, so an output may be an
// input (all reads of a block come first).
void reduce_bf16(ReduceOp op, int divisor, const void* const* in_v, int n_in, void* const* outs_v, int n_out,
                 std::size_t count) {
  const auto* const* in = reinterpret_cast<const std::uint16_t* const*>(in_v);
  auto* const* outs = reinterpret_cast<std::uint16_t* const*>(outs_v);
  constexpr std::size_t kBlock = 1024;
  alignas(64) float acc[kBlock];
  alignas(64) std::uint16_t rounded[kBlock];
  const float div = static_cast<float>(divisor);
  for (std::size_t i = 0; i < count; i += kBlock) {
    const std::size_t len = std::min(kBlock, count - i);
    for (std::size_t j = 0; j < len; ++j) acc[j] = float_from_bf16_bits(in[0][i + j]);
    for (int k = 1; k < n_in; ++k) {
      const std::uint16_t* src = in[k] + i;
      switch (op) {
        case ReduceOp::Sum:
        case ReduceOp::Avg:
          for (std::size_t j = 0; j < len; ++j) acc[j] = apply<ReduceOp::Sum>(acc[j], float_from_bf16_bits(src[j]));
          break;
        case ReduceOp::Max:
          for (std::size_t j = 0; j < len; ++j) acc[j] = apply<ReduceOp::Max>(acc[j], float_from_bf16_bits(src[j]));
          break;
        case ReduceOp::Min:
          for (std::size_t j = 0; j < len; ++j) acc[j] = apply<ReduceOp::Min>(acc[j], float_from_bf16_bits(src[j]));
          break;
      }
    }
    for (std::size_t j = 0; j < len; ++j) {
      rounded[j] = bf16_bits_from_float(op == ReduceOp::Avg ? acc[j] / div : acc[j]);
    }
    for (int k = 0; k < n_out; ++k) std::memcpy(outs[k] + i, rounded, len * sizeof(std::uint16_t));
  }
}

}  // namespace

void stream_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

void copy_bytes(void* dst, const void* src, std::size_t bytes, Stores stores) {
  if (bytes == 0) return;
  const bool stream = stores == Stores::Streaming || (stores == Stores::Auto && bytes >= kStreamingBytes);
  if (!stream) {
    std::memcpy(dst, src, bytes);
    return;
  }
  copy_streaming(dst, src, bytes);
  if (stores == Stores::Auto) stream_fence();
}

void copy_to_all(const void* src_v, void* const* dsts, int n_dst, std::size_t bytes, Stores stores) {
  if (bytes == 0 || n_dst <= 0) return;
  const bool stream = stores == Stores::Streaming ||
                      (stores == Stores::Auto && bytes * std::size_t(n_dst) >= kStreamingBytes);
  if (stream) {
    // Each destination aligned on its own; the source stays in cache between them.
    for (int k = 0; k < n_dst; ++k) copy_streaming(dsts[k], src_v, bytes);
    if (stores == Stores::Auto) stream_fence();
    return;
  }
  const auto* src = static_cast<const char*>(src_v);
  std::size_t i = 0;
#if defined(__AVX512F__)
  // One pass: each 256 bytes loaded once, stored to every destination (12-25% faster than a memcpy
  // per destination here, whose second pass re-reads the source from cache).
  for (; i + 256 <= bytes; i += 256) {
    const __m512i a = _mm512_loadu_si512(src + i), b = _mm512_loadu_si512(src + i + 64);
    const __m512i c = _mm512_loadu_si512(src + i + 128), d = _mm512_loadu_si512(src + i + 192);
    for (int k = 0; k < n_dst; ++k) {
      char* dst = static_cast<char*>(dsts[k]) + i;
      _mm512_storeu_si512(dst, a);
      _mm512_storeu_si512(dst + 64, b);
      _mm512_storeu_si512(dst + 128, c);
      _mm512_storeu_si512(dst + 192, d);
    }
  }
#endif
  for (int k = 0; k < n_dst; ++k) std::memcpy(static_cast<char*>(dsts[k]) + i, src + i, bytes - i);
}

void reduce_rank_order(DType dtype, ReduceOp op, int divisor, const void* const* in, int n_in, void* const* outs,
                       int n_out, std::size_t count, Stores stores) {
  if (count == 0) return;
  const bool stream = stores == Stores::Streaming ||
                      (stores == Stores::Auto && count * dtype_size(dtype) * std::size_t(n_out) >= kStreamingBytes);
  if (dtype == DType::BFloat16) {
    reduce_bf16(op, divisor, in, n_in, outs, n_out, count);
    return;
  }
  dispatch_floating(dtype, "reduce", [&]<class T>() {
    reduce_dispatch<T>(op, divisor, in, n_in, outs, n_out, count, stream);
  });
  if (stream && stores == Stores::Auto) stream_fence();
}

// ---- deadlines --------------------------------------------------------------------------------------

Milliseconds resolve_timeout(Milliseconds per_call, Milliseconds communicator_default) {
  MG_CHECK(per_call.count() >= 0, "collective options: timeout must be >= 0 ms, got {}", per_call.count());
  return per_call.count() > 0 ? per_call : communicator_default;
}

std::string missing_text(const std::vector<int>& ranks) {
  return ranks.empty() ? std::string("unknown") : fmt::format("{}", fmt::join(ranks, ", "));
}

// ---- OpState / Executor -----------------------------------------------------------------------------

void OpState::finish(std::exception_ptr e) {
  error = std::move(e);
  {
    std::lock_guard lock(m);
    status.store(2, std::memory_order_release);
  }
  cv.notify_all();
}

bool OpState::wait_done(Clock::time_point until) {
  for (int i = 0; i < 2000; ++i) {  // a few microseconds: most ops finish while the caller spins
    if (status.load(std::memory_order_acquire) == 2) return true;
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  std::unique_lock lock(m);
  return cv.wait_until(lock, until, [&] { return status.load(std::memory_order_acquire) == 2; });
}

void Executor::run(OpState& op, bool on_caller) {
  op.status.store(1, std::memory_order_relaxed);
  const Clock::time_point started = op.trace ? Clock::now() : Clock::time_point{};
  std::exception_ptr error;
  try {
    op.body(op);
  } catch (...) {
    error = std::current_exception();
  }
  op.body = nullptr;  // release captured buffers / counts now
  // Traced: recorded before a waiter can see the op done, so a wait that returned is never ahead of
  // the span of what it waited for (the end of a run stops recording right after its last wait).
  if (op.trace) record(op, started, Clock::now(), on_caller, error != nullptr);
  op.finish(std::move(error));
}

namespace {
// The arguments a trace shows with a collective and with a wait on it.
trace::Args trace_args(const OpState& op) {
  trace::Args args{{"op", std::string(op_name(op.kind))}, {"seq", static_cast<std::int64_t>(op.seq)}};
  if (op.trace) {
    args.push_back({"bytes", op.trace->bytes});
    if (!op.trace->group.empty()) args.push_back({"group", op.trace->group});
    if (!op.trace->label.empty()) args.push_back({"label", op.trace->label});
  }
  return args;
}
}  // namespace

void Executor::record(const OpState& op, Clock::time_point started, Clock::time_point end, bool on_caller,
                      bool failed) {
  // From launch, or from the end of the operation before it if that came later (it queued behind
  // it), so the spans of one lane never overlap.
  const Clock::time_point begin = std::max(op.trace->launched, last_end_);
  last_end_ = end;
  trace::Args args = trace_args(op);
  args.push_back({"queued_us", std::chrono::duration<double, std::micro>(started - op.trace->launched).count()});
  if (failed) args.push_back({"failed", std::int64_t{1}});
  if (on_caller) {
    trace::Args wait_args = trace_args(op);
    wait_args.push_back({"on_caller", std::int64_t{1}});
    trace::complete(trace::this_thread_lane(), "wait", "wait", started, end, std::move(wait_args));
  }
  trace::complete(lane_.id(), op_name(op.kind), "comm", begin, end, std::move(args));
}

bool Executor::try_begin_inline() {
  std::lock_guard lock(m_);
  if (!queue_.empty() || busy_) return false;
  busy_ = true;
  return true;
}

void Executor::end_inline() {
  {
    std::lock_guard lock(m_);
    busy_ = false;
  }
  cv_.notify_all();
}

void Executor::submit(const std::shared_ptr<OpState>& op, bool caller_waits) {
  {
    std::unique_lock lock(m_);
    if (!(caller_waits && queue_.empty() && !busy_)) {
      // Started before the op is queued: when it cannot start (std::system_error), nothing is left queued.
      if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
      queue_.push_back(op);
      lock.unlock();
      cv_.notify_all();
      return;
    }
    busy_ = true;
  }
  run(*op, /*on_caller=*/true);
  {
    std::lock_guard lock(m_);
    busy_ = false;
  }
  cv_.notify_all();
}

void Executor::loop() {
  std::unique_lock lock(m_);
  for (;;) {
    // Idle wait for work: not a communication wait, so it has no deadline; the destructor wakes it.
    cv_.wait(lock, [&] { return stop_ || (!queue_.empty() && !busy_); });
    if (queue_.empty()) return;  // stop_ and nothing left
    auto op = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    run(*op, /*on_caller=*/false);
    lock.lock();
    busy_ = false;
  }
}

Executor::~Executor() {
  {
    std::lock_guard lock(m_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

// ---- Health / CommBase / the Work handle ------------------------------------------------------------

void Health::mark_broken(std::string why) {
  std::lock_guard lock(m);
  if (!broken.load()) reason = std::move(why);
  broken.store(true);
}

std::string Health::broken_reason() const {
  std::lock_guard lock(m);
  return reason;
}

namespace {

// Rethrows the op's stored error as a fresh object owned by this thread (same type and message). The
// stored exception object is shared with the thread that ran the op; rethrowing it directly would let
// this thread use it after dropping its reference to the op, with only the C++ runtime's internal
// (uninstrumented) reference count ordering that against the other thread's destruction of it, which
// ThreadSanitizer cannot see. A fresh copy (fresh message string too) keeps every access ordered.
[[noreturn]] void rethrow_fresh(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const CommTimeout& e) {
    throw CommTimeout(std::string(e.what()), e.backend(), e.op(), e.sequence(), e.rank(), e.missing_ranks());
  } catch (const PeerFailed& e) {
    throw PeerFailed(std::string(e.what()), e.backend(), e.op(), e.sequence(), e.rank());
  } catch (const CollectiveMismatch& e) {
    throw CollectiveMismatch(std::string(e.what()), e.backend(), e.op(), e.sequence(), e.rank());
  } catch (const CommError& e) {
    throw CommError(std::string(e.what()), e.backend(), e.op(), e.sequence(), e.rank());
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(std::string(e.what()));
  } catch (const Error& e) {
    throw Error(std::string(e.what()));
  }  // anything else (bad_alloc, ...): rethrown as it is
}

// A "wait" span on the waiting thread's lane while a trace records, when the wait finds its
// operation not yet complete. When the waiting thread launched the operation, the span also says
// how long that thread was off the CPU between the launch and the wait (args since_launch_us and
// off_cpu_us): on a machine with more runnable threads than cores, the progress thread a launch
// wakes often takes the launching rank's core until the operation is done, and the rank reaches
// its wait only then. That time is not computation the communication hid behind, and the trace
// summary counts it as blocked; so a wait that finds its operation complete after such a gap (10 us
// or more off the CPU) is drawn too, with zero length, to carry it. Other waits that return at once
// are not drawn.
class WaitSpan {
 public:
  explicit WaitSpan(const OpState& op) {
    if (!trace::enabled()) return;
    const bool done = op.status.load(std::memory_order_acquire) == 2;
    begin_ = Clock::now();
    // Less than kMinGap after the launch the thread cannot have been off the CPU for long: the CPU
    // clock (a system call) is not read.
    if (op.trace && op.trace->launcher_lane == trace::this_thread_lane() &&
        begin_ - op.trace->launched >= kMinGap) {
      since_launch_ = begin_ - op.trace->launched;
      off_cpu_ = std::max(Clock::duration::zero(),
                          since_launch_ - (trace::thread_cpu_time() - op.trace->launcher_cpu));
      measured_ = true;
    }
    if (!done || (measured_ && off_cpu_ >= kMinGap)) {
      op_ = &op;
      zero_length_ = done;
    }
  }
  ~WaitSpan() {
    if (op_ == nullptr) return;
    trace::Args args = trace_args(*op_);
    if (measured_) {
      args.push_back({"since_launch_us", std::chrono::duration<double, std::micro>(since_launch_).count()});
      args.push_back({"off_cpu_us", std::chrono::duration<double, std::micro>(off_cpu_).count()});
    }
    trace::complete(trace::this_thread_lane(), "wait", "wait", begin_, zero_length_ ? begin_ : Clock::now(),
                    std::move(args));
  }
  WaitSpan(const WaitSpan&) = delete;
  WaitSpan& operator=(const WaitSpan&) = delete;

 private:
  static constexpr auto kMinGap = std::chrono::microseconds(10);
  const OpState* op_ = nullptr;   // drawn when set
  bool zero_length_ = false;
  bool measured_ = false;
  Clock::time_point begin_;
  Clock::duration since_launch_{}, off_cpu_{};
};

class WorkHandle final : public Work {
 public:
  WorkHandle(std::shared_ptr<OpState> op, std::shared_ptr<Health> health, std::string where, std::string backend,
             int rank)
      : op_(std::move(op)), health_(std::move(health)), where_(std::move(where)), backend_(std::move(backend)),
        rank_(rank) {}

  ~WorkHandle() override {
    // The op may still use the caller's buffers: let it finish (bounded by its own deadlines; the
    // grace covers the final copy of a collective whose peers all arrived).
    if (op_->status.load(std::memory_order_acquire) == 2) return;
    if (op_->withdraw) {  // passive op: nothing enforces its deadline but us
      if (!op_->wait_done(op_->deadline)) op_->withdraw("at its deadline (Work destroyed)");
    }
    op_->wait_done(add_saturated(op_->deadline, kGrace));
  }

  bool is_completed() override { return op_->status.load(std::memory_order_acquire) == 2; }

  void wait(Milliseconds timeout) override {
    MG_CHECK(timeout.count() >= 0, "Work::wait: timeout must be >= 0 ms, got {}", timeout.count());
    WaitSpan span(*op_);
    // timeout 0: the op's own deadline, which its internal waits enforce with the precise error
    // (missing ranks); the grace lets that error arrive first.
    const bool own = timeout.count() == 0;
    if (op_->withdraw) {  // passive (point to point): completes when matched; we enforce the deadline
      const auto until = own ? op_->deadline : add_saturated(Clock::now(), timeout);
      if (!op_->wait_done(until)) {
        op_->withdraw(own ? "at its deadline" : fmt::format("after {} ms", timeout.count()));
        op_->wait_done(add_saturated(Clock::now(), kGrace));  // if it was matched just now, the copy is under way
      }
      if (op_->error) rethrow_fresh(op_->error);
      return;
    }
    const auto until = own ? add_saturated(op_->deadline, kGrace) : add_saturated(Clock::now(), timeout);
    if (!op_->wait_done(until)) {
      // Give up: make the op stop at its next wait, wait for it to stop touching our buffers, and
      // leave the communicator broken (this rank's sequence no longer matches its peers').
      op_->cancel.store(true);
      const bool stopped = op_->wait_done(add_saturated(std::max(op_->deadline, Clock::now()), kGrace));
      const std::string msg = fmt::format(
          "{}: {} in Work::wait{}; the communicator is unusable now", where_,
          own ? std::string("the operation's deadline passed") : fmt::format("timed out after {} ms", timeout.count()),
          stopped ? "" : " (the operation did not stop within the grace period)");
      health_->mark_broken(msg);
      if (stopped && op_->error) {
        try {
          rethrow_fresh(op_->error);
        } catch (const CommTimeout&) {
          throw;  // the op's own timeout names the missing ranks: the better message
        } catch (...) {
        }
      }
      throw CommTimeout(msg, backend_, std::string(op_name(op_->kind)), op_->seq, rank_, {});
    }
    if (op_->error) rethrow_fresh(op_->error);
  }

 private:
  static constexpr auto kGrace = std::chrono::seconds(2);
  std::shared_ptr<OpState> op_;
  std::shared_ptr<Health> health_;
  std::string where_, backend_;
  int rank_;
};

}  // namespace

namespace {
// submit's inline path ran the op to completion before returning this.
class DoneWork final : public Work {
 public:
  bool is_completed() override { return true; }
  void wait(Milliseconds timeout) override {
    MG_CHECK(timeout.count() >= 0, "Work::wait: timeout must be >= 0 ms, got {}", timeout.count());
  }
};
}  // namespace

CommBase::CommBase(int rank, int size, Milliseconds default_timeout, bool debug_checks)
    : rank_(rank), size_(size), default_timeout_(default_timeout), debug_checks_(debug_checks),
      done_work_(std::make_shared<DoneWork>()) {}

CommBase::~CommBase() = default;

void CommBase::check_usable(OpKind op, std::uint64_t seq) const {
  if (health_->broken.load()) {
    throw CommError(fmt::format("{}: communicator unusable after an earlier failure: {}", where(op, seq),
                                health_->broken_reason()),
                    std::string(backend()), std::string(op_name(op)), seq, rank_);
  }
}

std::string CommBase::where(OpKind op, std::uint64_t seq) const {
  return fmt::format("{}: {} seq {} on rank {} of {}{}", backend(), op_name(op), seq, rank_, size_,
                     label_.empty() ? std::string() : " of group " + label_);
}

Clock::time_point CommBase::deadline_of(const CollectiveOptions& opt) const {
  return add_saturated(Clock::now(), resolve_timeout(opt.timeout, default_timeout_));
}

std::shared_ptr<OpState> CommBase::new_op(OpKind kind, std::uint64_t seq, const CollectiveOptions& opt) const {
  auto op = std::make_shared<OpState>();
  op->kind = kind;
  op->seq = seq;
  op->deadline = deadline_of(opt);
  return op;
}

WorkPtr CommBase::make_work(std::shared_ptr<OpState> op) const {
  std::string w = where(op->kind, op->seq);
  return std::make_shared<WorkHandle>(std::move(op), health_, std::move(w), std::string(backend()), rank_);
}

WorkPtr CommBase::submit_collective(OpKind kind, const CollectiveOptions& opt, std::int64_t bytes,
                                    std::function<void(OpState&)> body) {
  const std::uint64_t seq = next_seq_++;
  auto op = new_op(kind, seq, opt);
  if (trace::enabled()) {
    // The lane of this communicator's operations is named after the rank (thread) that uses it.
    if (!executor_->lane().named()) {
      const auto [rank_lane, sort_index] = trace::this_thread_lane_name();
      executor_->lane().set_name(rank_lane + " progress" + (label_.empty() ? "" : " (" + label_ + ")"), sort_index + 1);
    }
    // The launcher's CPU clock (a system call) only for async launches: a blocking call waits at once.
    op->trace = std::make_unique<OpTrace>(OpTrace{Clock::now(), label_, std::string(opt.trace_label), bytes});
    if (!opt.caller_waits) {
      op->trace->launcher_lane = trace::this_thread_lane();
      op->trace->launcher_cpu = trace::thread_cpu_time();
    }
  }
  auto health = health_;
  op->body = [this, health, body = std::move(body)](OpState& state) mutable { run_body(*this, *health, body, state); };
  try {
    executor_->submit(op, opt.caller_waits);
  } catch (const std::system_error& e) {
    // The progress thread could not start (a thread or address-space limit): this rank cannot take
    // part in the collective, so the communicator is broken, and the error says why.
    std::string what = fmt::format("{}: cannot start this rank's communication thread: {} (the system's thread or "
                                   "memory limit, ulimit -u or -v; run fewer ranks per process)",
                                   where(kind, seq), e.what());
    health_->mark_broken(what);
    throw CommError(std::move(what), std::string(backend()), std::string(op_name(kind)), seq, rank_);
  }
  return make_work(std::move(op));
}

}  // namespace detail
}  // namespace meshgrad::comm
