// The collective benchmark (see collective_bench.hpp for the conventions).
#include "meshgrad/comm/collective_bench.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>

#include "comm/detail.hpp"

namespace meshgrad::comm {

std::size_t parse_byte_size(std::string_view text) {
  std::string t(text);
  std::string digits;
  std::size_t i = 0;
  while (i < t.size() && std::isdigit(static_cast<unsigned char>(t[i]))) digits += t[i++];
  std::string suffix;
  for (; i < t.size(); ++i) suffix += static_cast<char>(std::toupper(static_cast<unsigned char>(t[i])));
  if (!suffix.empty() && suffix.back() == 'B') suffix.pop_back();
  std::size_t mult = 1;
  if (suffix == "K") mult = std::size_t(1) << 10;
  else if (suffix == "M") mult = std::size_t(1) << 20;
  else if (suffix == "G") mult = std::size_t(1) << 30;
  else MG_CHECK(suffix.empty(), "byte size '{}': unknown suffix (expected K, M or G)", text);
  MG_CHECK(!digits.empty() && digits.size() < 12, "byte size '{}': expected a number with an optional K/M/G suffix",
           text);
  std::size_t bytes = 0;
  MG_CHECK(!__builtin_mul_overflow(std::stoull(digits), mult, &bytes),
           "byte size '{}' is too large (more than 2^64 bytes)", text);
  return bytes;
}

double busbw_factor(std::string_view op, int n) {
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "all_gather" || op == "reduce_scatter" || op == "all_to_all") return double(n - 1) / n;
  if (op == "broadcast") return 1.0;
  throw InvalidArgument(fmt::format("bench collectives: unknown op '{}' (all_reduce, all_gather, reduce_scatter, "
                                    "broadcast, all_to_all)", op));
}

namespace {

using Clock = std::chrono::steady_clock;

// Rank-valued inputs whose sums are exact in float: small integers.
template <class T>
T input_value(int rank, std::size_t i) {
  return static_cast<T>(rank + 1) + static_cast<T>(i % 5);
}

template <class T>
struct Case {
  std::vector<T> in, out;
  std::size_t count = 0;  // nccl-tests "count": elements of the whole buffer
};

template <class T>
std::size_t count_wrong(std::string_view op, int r, int P, std::size_t count, const std::vector<T>& in,
                        const std::vector<T>& out) {
  std::size_t wrong = 0;
  const std::size_t shard = count / std::size_t(P);
  if (op == "all_reduce") {
    for (std::size_t i = 0; i < count; ++i) {
      wrong += out[i] != static_cast<T>(P * (P + 1) / 2) + static_cast<T>(P) * static_cast<T>(i % 5);
    }
  } else if (op == "all_gather") {
    for (std::size_t i = 0; i < count; ++i) wrong += out[i] != input_value<T>(int(i / shard), i % shard);
  } else if (op == "reduce_scatter") {
    for (std::size_t i = 0; i < shard; ++i) {
      const std::size_t g = std::size_t(r) * shard + i;
      wrong += out[i] != static_cast<T>(P * (P + 1) / 2) + static_cast<T>(P) * static_cast<T>(g % 5);
    }
  } else if (op == "broadcast") {
    for (std::size_t i = 0; i < count; ++i) wrong += in[i] != input_value<T>(0, i);  // buf is `in`
  } else if (op == "all_to_all") {
    // rank s sends block d of its input (elements d*shard..) to d: out block s = input_value(s, r*shard + i)
    for (std::size_t i = 0; i < count; ++i) {
      const std::size_t s = i / shard, k = i % shard;
      wrong += out[i] != input_value<T>(int(s), std::size_t(r) * shard + k);
    }
  }
  return wrong;
}

template <class T>
CollectiveBenchRow bench_one(Communicator& c, const std::string& op, std::size_t bytes, const CollectiveBenchOptions& o) {
  const int P = c.size(), r = c.rank();
  const bool divisible = op != "all_reduce" && op != "broadcast";
  std::size_t count = bytes / sizeof(T);
  if (divisible) count -= count % std::size_t(P);
  const std::size_t shard = count / std::size_t(P);
  std::vector<T> in, out;
  if (op == "all_reduce" || op == "reduce_scatter" || op == "all_to_all" || op == "broadcast") {
    in.resize(count);
    for (std::size_t i = 0; i < count; ++i) in[i] = input_value<T>(r, i);
  } else {  // all_gather: my shard
    in.resize(shard);
    for (std::size_t i = 0; i < shard; ++i) in[i] = input_value<T>(r, i);
  }
  if (op == "reduce_scatter") out.assign(shard, T(0));
  else if (op != "broadcast") out.assign(count, T(0));
  auto run = [&] {
    if (op == "all_reduce") {
      c.all_reduce(buffer(std::span<const T>(in)), buffer(std::span<T>(out)), ReduceOp::Sum);
    } else if (op == "all_gather") {
      c.all_gather(buffer(std::span<const T>(in)), buffer(std::span<T>(out)));
    } else if (op == "reduce_scatter") {
      c.reduce_scatter(buffer(std::span<const T>(in)), buffer(std::span<T>(out)), ReduceOp::Sum);
    } else if (op == "broadcast") {
      c.broadcast(buffer(std::span<T>(in)), 0);
    } else {
      c.all_to_all(buffer(std::span<const T>(in)), {}, buffer(std::span<T>(out)), {});
    }
  };
  // Auto iterations: time the warm-up, then run enough iterations for ~50 ms per size (5..20000;
  // o.seconds_per_size), so a single preemption on a shared machine does not dominate a small size's mean.
  const int warmup = o.warmup > 0 ? o.warmup : 5;
  const auto w0 = Clock::now();
  for (int i = 0; i < warmup; ++i) run();
  double per_op = std::chrono::duration<double>(Clock::now() - w0).count() / warmup;
  c.all_reduce(buffer(std::span<double>(&per_op, 1)), ReduceOp::Max);  // every rank picks the same count
  if (o.warmup == 0) {
    // Auto: warm up for ~20 ms more, timed again. Right after the ranks start (the first size) the
    // scheduler has not spread them over the cores yet: 5 iterations measured 2-3x the settled
    // time of a small size on 2 threads.
    const int more = int(std::clamp(o.warmup_seconds / std::max(per_op, 1e-9), 0.0, double(o.max_iters)));
    const auto w1 = Clock::now();
    for (int i = 0; i < more; ++i) run();
    if (more > 0) per_op = std::chrono::duration<double>(Clock::now() - w1).count() / more;
    c.all_reduce(buffer(std::span<double>(&per_op, 1)), ReduceOp::Max);
  }
  const int iters =
      o.iters > 0 ? o.iters
                  : int(std::clamp(o.seconds_per_size / std::max(per_op, 1e-9), 5.0, double(std::max(o.max_iters, 5))));
  // With repeats > 1 the fastest block counts: a block a preemption hit on a shared machine does not.
  double secs = 0;
  for (int block = 0; block < std::max(o.repeats, 1); ++block) {
    c.barrier();
    const auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i) run();
    double mine = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
    c.all_reduce(buffer(std::span<double>(&mine, 1)), ReduceOp::Max);  // the slowest rank's time
    secs = block == 0 ? mine : std::min(secs, mine);
  }
  double wrong = double(count_wrong<T>(op, r, P, count, in, out));
  c.all_reduce(buffer(std::span<double>(&wrong, 1)), ReduceOp::Sum);
  CollectiveBenchRow row;
  row.op = op;
  row.count = count;
  row.bytes = count * sizeof(T);
  row.dtype = dtype_of<T>();
  row.iters = iters;
  row.time_us = secs * 1e6;
  row.algbw_gbps = double(row.bytes) / secs / 1e9;
  row.busbw_gbps = row.algbw_gbps * busbw_factor(op, P);
  row.wrong = std::size_t(wrong);
  return row;
}

}  // namespace

std::vector<CollectiveBenchRow> run_collective_bench(Communicator& comm, const CollectiveBenchOptions& o) {
  MG_CHECK(o.min_bytes > 0 && o.min_bytes <= o.max_bytes, "bench collectives: need 0 < min-bytes <= max-bytes, got {} "
           "and {}", o.min_bytes, o.max_bytes);
  MG_CHECK(o.step_factor >= 2, "bench collectives: step factor must be >= 2, got {}", o.step_factor);
  MG_CHECK(o.repeats >= 1 && o.seconds_per_size > 0 && o.warmup_seconds >= 0 && o.max_iters >= 1,
           "bench collectives: need repeats >= 1, seconds per size > 0, warm-up seconds >= 0 and max iterations >= 1, "
           "got {}, {}, {} and {}", o.repeats, o.seconds_per_size, o.warmup_seconds, o.max_iters);
  MG_CHECK(o.dtype == DType::Float32 || o.dtype == DType::Float64, "bench collectives: dtype must be float32 or "
           "float64, got {}", dtype_name(o.dtype));
  for (const auto& op : o.ops) busbw_factor(op, comm.size());  // validates the names
  std::vector<CollectiveBenchRow> rows;
  for (const auto& op : o.ops) {
    for (std::size_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= std::size_t(o.step_factor)) {
      rows.push_back(o.dtype == DType::Float32 ? bench_one<float>(comm, op, bytes, o)
                                               : bench_one<double>(comm, op, bytes, o));
    }
  }
  return rows;
}

double measure_memcpy_gbps(std::size_t bytes) {
  bytes = std::max<std::size_t>(bytes, 1 << 20);
  std::unique_ptr<char[]> a(new char[bytes]), b(new char[bytes]);
  std::memset(a.get(), 1, bytes);
  std::memset(b.get(), 2, bytes);
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = Clock::now();
    std::memcpy(b.get(), a.get(), bytes);
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
    a[rep] = b[bytes - 1 - rep];  // keep the copies observable
  }
  return 2.0 * double(bytes) / best / 1e9;
}

std::string format_collective_table(const std::vector<CollectiveBenchRow>& rows, std::string_view backend, int ranks,
                                    double memcpy_gbps) {
  std::string s = fmt::format("# meshgrad bench collectives: backend {}, {} ranks\n", backend, ranks);
  s += fmt::format("# memcpy 64 MiB (1 thread, this run): {:.2f} GB/s read+write\n", memcpy_gbps);
  s += fmt::format("#{:>14} {:>12} {:>8} {:>15} {:>10} {:>8} {:>8} {:>7}\n", "op", "size(B)", "count", "type",
                   "time(us)", "algbw", "busbw", "#wrong");
  s += fmt::format("#{:>14} {:>12} {:>8} {:>15} {:>10} {:>8} {:>8} {:>7}\n", "", "", "(elems)", "", "", "(GB/s)",
                   "(GB/s)", "");
  std::map<std::string, std::pair<double, int>> avg;
  std::vector<std::string> order;
  std::size_t wrong_total = 0;
  for (const auto& row : rows) {
    s += fmt::format(" {:>14} {:>12} {:>8} {:>15} {:>10.2f} {:>8.2f} {:>8.2f} {:>7}\n", row.op, row.bytes, row.count,
                     dtype_name(row.dtype), row.time_us, row.algbw_gbps, row.busbw_gbps, row.wrong);
    if (!avg.count(row.op)) order.push_back(row.op);
    avg[row.op].first += row.busbw_gbps;
    avg[row.op].second += 1;
    wrong_total += row.wrong;
  }
  double all = 0;
  for (const auto& op : order) {
    s += fmt::format("# avg busbw {:<15} {:.2f} GB/s\n", op, avg[op].first / avg[op].second);
    all += avg[op].first;
  }
  if (!rows.empty()) s += fmt::format("# Avg bus bandwidth    : {:.3f} GB/s\n", all / double(rows.size()));
  s += fmt::format("# Out of bounds values : {} {}\n", wrong_total, wrong_total == 0 ? "OK" : "FAILED");
  return s;
}

}  // namespace meshgrad::comm
