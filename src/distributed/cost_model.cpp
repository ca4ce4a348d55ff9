#include "meshgrad/distributed/cost_model.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "meshgrad/comm/collective_bench.hpp"
#include "meshgrad/comm/communicator.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad::dist {

namespace {

// Seconds per byte at beta GB/s, in microseconds: bytes / (beta * 1e9) * 1e6.
double transfer_us(double bytes, const Link& link) { return bytes / (link.beta_gbs * 1e3); }

// ceil(log2 n) for n >= 1, exact for powers of two (no floating-point log).
int ceil_log2(int n) {
  int steps = 0;
  for (long long reach = 1; reach < n; reach *= 2) ++steps;
  return steps;
}

CollectiveCost make_cost(std::string algorithm, double latency_us, double bandwidth_us) {
  return {latency_us + bandwidth_us, std::move(algorithm), latency_us, bandwidth_us};
}

void check_inputs(std::string_view op, int n, double bytes, const Link& link) {
  MG_CHECK(n >= 1, "cost model: {} on n = {} ranks (n must be >= 1)", op, n);
  MG_CHECK(std::isfinite(bytes) && bytes >= 0, "cost model: {} of {} bytes (bytes must be >= 0)", op, bytes);
  MG_CHECK(std::isfinite(link.alpha_us) && link.alpha_us >= 0 && std::isfinite(link.beta_gbs) && link.beta_gbs > 0,
           "cost model: link '{}' has alpha {} us and beta {} GB/s (need alpha >= 0, beta > 0)", link.name,
           link.alpha_us, link.beta_gbs);
}

std::string preset_names() {
  std::string names;
  for (const Link& link : link_presets()) names += (names.empty() ? "" : ", ") + link.name;
  return names;
}

}  // namespace

// The figures and their sources are explained in docs/explain.md ("Links"); keep the two in step.
const std::vector<Link>& link_presets() {
  static const std::vector<Link> presets = {
      // Measured on the development machine (2-core VM, threads backend, 2 ranks, float32); the run and
      // how the two figures were read off it are in docs/explain.md.
      {"shm", 1.5, 16.0,
       "this machine's shared memory (threads backend, 2 ranks), measured with `meshgrad bench collectives --backend "
       "threads`: alpha from the 8 B - 8 KiB times per step, beta the median 16-64 MiB busbw of a run in "
       "docs/benchmarks-history.md (docs/explain.md)",
       std::nullopt},
      {"nvlink4", 3.4, 450.0,
       "NVLink 4 (H100 SXM): 900 GB/s bidirectional per GPU = 450 GB/s per direction (NVIDIA H100 datasheet); "
       "alpha = NCCL's per-step NVLink ring latency (src/graph/tuning.cc hwLat, Ring/Simple 3.4 us)", std::nullopt},
      {"ib-ndr", 4.0, 50.0,
       "InfiniBand NDR: 400 Gb/s = 50 GB/s per port (NVIDIA ConnectX-7 user manual); "
       "alpha = NCCL's per-step network ring latency (src/graph/tuning.cc hwLat NET, Ring/LL128 4.0 us)",
       std::nullopt},
  };
  return presets;
}

Link link_preset(std::string_view name) {
  for (const Link& link : link_presets()) {
    if (link.name == name) return link;
  }
  MG_CHECK(name != "measured", "link 'measured' is no preset: it is probed at run time on the run's ranks "
           "(`meshgrad explain --link measured`); presets: {}; or give --alpha-us A --beta-gbs B", preset_names());
  throw InvalidArgument(fmt::format("unknown link '{}' (presets: {}; or give --alpha-us A --beta-gbs B)", name,
                                    preset_names()));
}

Link custom_link(double alpha_us, double beta_gbs) {
  MG_CHECK(std::isfinite(alpha_us) && alpha_us >= 0, "custom link: alpha {} us must be >= 0", alpha_us);
  MG_CHECK(std::isfinite(beta_gbs) && beta_gbs > 0, "custom link: beta {} GB/s must be > 0", beta_gbs);
  return {"custom", alpha_us, beta_gbs, fmt::format("user-given: alpha {} us, beta {} GB/s", alpha_us, beta_gbs),
          std::nullopt};
}

const std::vector<std::string>& cost_model_ops() {
  static const std::vector<std::string> ops = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                               "broadcast"};
  return ops;
}

CollectiveCost ring_all_reduce(int n, double bytes, const Link& link) {
  check_inputs("all_reduce", n, bytes, link);
  if (n == 1) return make_cost("none", 0, 0);
  // Reduce-scatter then all-gather around the ring: 2(n-1) steps, each moving bytes/n.
  return make_cost("ring", 2.0 * (n - 1) * link.alpha_us, 2.0 * (n - 1) / n * transfer_us(bytes, link));
}

CollectiveCost tree_all_reduce(int n, double bytes, const Link& link) {
  check_inputs("all_reduce", n, bytes, link);
  if (n == 1) return make_cost("none", 0, 0);
  // Pipelined reduce up a binary tree, then broadcast down: 2 ceil(log2 n) steps of latency; with
  // pipelining each direction streams the whole buffer once through every rank's link.
  return make_cost("tree", 2.0 * ceil_log2(n) * link.alpha_us, 2.0 * transfer_us(bytes, link));
}

CollectiveCost predict_collective(std::string_view op, int n, double bytes, const Link& link) {
  check_inputs(op, n, bytes, link);
  if (op == "all_reduce") {
    if (n == 1) return make_cost("none", 0, 0);
    CollectiveCost ring = ring_all_reduce(n, bytes, link);
    CollectiveCost tree = tree_all_reduce(n, bytes, link);
    return tree.time_us < ring.time_us ? tree : ring;
  }
  if (op == "send" || op == "recv") {
    // One message between two ranks of the group (a pipeline's neighbours): one step, the bytes once.
    return make_cost("point-to-point", link.alpha_us, transfer_us(bytes, link));
  }
  const bool known = op == "all_gather" || op == "reduce_scatter" || op == "all_to_all" || op == "broadcast";
  MG_CHECK(known, "cost model: unknown collective '{}' (known: all_reduce, all_gather, reduce_scatter, all_to_all, "
           "broadcast, send, recv)", op);
  if (n == 1) return make_cost("none", 0, 0);
  if (op == "broadcast") {
    // Pipelined binary tree: ceil(log2 n) steps to reach the last rank, then the buffer streams.
    return make_cost("pipelined-tree", ceil_log2(n) * link.alpha_us, transfer_us(bytes, link));
  }
  // all_gather / reduce_scatter: n-1 ring steps of bytes/n each; all_to_all: n-1 pairwise
  // exchanges of bytes/n each (the own block stays local).
  const double latency = (n - 1) * link.alpha_us;
  const double bandwidth = static_cast<double>(n - 1) / n * transfer_us(bytes, link);
  return make_cost(op == "all_to_all" ? "pairwise" : "ring", latency, bandwidth);
}

Link fit_ring_all_reduce_link(int n, const std::vector<LinkSample>& samples) {
  MG_CHECK(n >= 2, "link fit: an all-reduce on n = {} ranks moves nothing (n must be >= 2)", n);
  for (const LinkSample& s : samples) {
    MG_CHECK(std::isfinite(s.bytes) && s.bytes >= 0 && std::isfinite(s.time_us) && s.time_us > 0,
             "link fit: the sample ({} bytes, {} us) needs bytes >= 0 and a time > 0", s.bytes, s.time_us);
  }
  const auto distinct = std::count_if(samples.begin(), samples.end(),
                                      [&](const LinkSample& s) { return s.bytes != samples.front().bytes; });
  MG_CHECK(samples.size() >= 2 && distinct > 0, "link fit: {} sample(s) of one size cannot separate latency from "
           "bandwidth (need 2 or more sizes)", samples.size());
  // t = A + B x, weighted least squares with w = 1/t^2 (relative error). x is scaled by the largest
  // size so the normal equations stay well conditioned (x^2 of 4 MiB is 1.8e13).
  double scale = 0;
  for (const LinkSample& s : samples) scale = std::max(scale, s.bytes);
  double s0 = 0, s1 = 0, s2 = 0, t0 = 0, t1 = 0;
  for (const LinkSample& s : samples) {
    const double w = 1.0 / (s.time_us * s.time_us), x = s.bytes / scale;
    s0 += w;
    s1 += w * x;
    s2 += w * x * x;
    t0 += w * s.time_us;
    t1 += w * x * s.time_us;
  }
  const double det = s0 * s2 - s1 * s1;
  double a = (t0 * s2 - s1 * t1) / det;   // us
  double b = (s0 * t1 - s1 * t0) / det;   // us per `scale` bytes
  bool clamped = false;
  if (a < 0) {
    // No negative latency: the best fit through the origin, t = B x.
    a = 0;
    b = t1 / s2;
    clamped = true;
  }
  MG_CHECK(std::isfinite(b) && b > 0,
           "link fit: the all-reduce times do not grow with the message size ({} us at {} B, {} us at {} B), so no "
           "bandwidth can be fitted; probe larger sizes", samples.front().time_us, samples.front().bytes,
           samples.back().time_us, samples.back().bytes);
  Link link;
  link.name = "measured";
  link.alpha_us = a / (2.0 * (n - 1));
  // B / scale us per byte = 2(n-1)/n / (beta * 1e3)  ->  beta GB/s = 2(n-1)/n * scale / (B * 1e3).
  link.beta_gbs = 2.0 * (n - 1) / n * scale / (b * 1e3);
  LinkMeasurement m;
  m.ranks = n;
  m.samples = samples;
  double sum_sq = 0;
  for (const LinkSample& s : samples) {
    const double fitted = ring_all_reduce(n, s.bytes, link).time_us;
    const double relative = std::abs(fitted - s.time_us) / s.time_us;
    m.fitted_us.push_back(fitted);
    sum_sq += relative * relative;
    m.max_residual = std::max(m.max_residual, relative);
  }
  m.rms_residual = std::sqrt(sum_sq / static_cast<double>(samples.size()));
  m.alpha_clamped = clamped;
  link.source = fmt::format("fitted to the ring all-reduce t = 2(n-1)(alpha + bytes/(n beta)) of {} measured times on "
                            "n = {} ranks (least squares on relative error)", samples.size(), n);
  link.measurement = std::move(m);
  return link;
}

Link measure_link(comm::Communicator& comm, const LinkProbeOptions& o) {
  MG_CHECK(comm.size() >= 2, "link probe: the {} communicator has {} rank: there is no link between ranks to "
           "measure (a measured link needs 2 or more ranks)", comm.backend(), comm.size());
  MG_CHECK(o.repeats >= 1 && o.seconds_per_block > 0 && o.warmup_seconds >= 0 && o.max_iters_per_block >= 5,
           "link probe: repeats {} must be >= 1, seconds per block {} > 0, iterations per block {} >= 5 and warm-up {} "
           "s >= 0", o.repeats, o.seconds_per_block, o.max_iters_per_block, o.warmup_seconds);
  const auto start = std::chrono::steady_clock::now();
  comm::CollectiveBenchOptions bench;
  bench.ops = {"all_reduce"};
  bench.min_bytes = o.min_bytes;
  bench.max_bytes = o.max_bytes;
  bench.step_factor = o.step_factor;
  bench.dtype = DType::Float32;
  bench.repeats = o.repeats;
  bench.seconds_per_size = o.seconds_per_block;
  bench.warmup_seconds = o.warmup_seconds;
  bench.max_iters = o.max_iters_per_block;
  // run_collective_bench's every wait is a collective of comm (blocking form, comm's default deadline).
  const std::vector<comm::CollectiveBenchRow> rows = comm::run_collective_bench(comm, bench);
  std::vector<LinkSample> samples;
  for (const comm::CollectiveBenchRow& row : rows) {
    if (row.wrong != 0) {
      throw Error(fmt::format("link probe: the {} all-reduce of {} bytes returned {} wrong values on {} ranks", comm.backend(),
                              row.bytes, row.wrong, comm.size()));
    }
    samples.push_back({static_cast<double>(row.bytes), row.time_us});
  }
  Link link = fit_ring_all_reduce_link(comm.size(), samples);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  comm.all_reduce(comm::buffer(std::span<double>(&seconds, 1)), comm::ReduceOp::Max);
  LinkMeasurement& m = *link.measurement;
  m.backend = std::string(comm.backend());
  m.repeats = o.repeats;
  m.seconds = seconds;
  link.source = fmt::format("fitted to the ring all-reduce t = 2(n-1)(alpha + bytes/(n beta)) of this run's {} ranks, "
                            "{} backend (least squares on relative error)", comm.size(), comm.backend());
  return link;
}

}  // namespace meshgrad::dist
