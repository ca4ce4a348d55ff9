#include "meshgrad/distributed/cost_model.hpp"

#include <fmt/format.h>

#include <cmath>

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
       "docs/benchmarks-history.md (docs/explain.md)"},
      {"nvlink4", 3.4, 450.0,
       "NVLink 4 (H100 SXM): 900 GB/s bidirectional per GPU = 450 GB/s per direction (NVIDIA H100 datasheet); "
       "alpha = NCCL's per-step NVLink ring latency (src/graph/tuning.cc hwLat, Ring/Simple 3.4 us)"},
      {"ib-ndr", 4.0, 50.0,
       "InfiniBand NDR: 400 Gb/s = 50 GB/s per port (NVIDIA ConnectX-7 user manual); "
       "alpha = NCCL's per-step network ring latency (src/graph/tuning.cc hwLat NET, Ring/LL128 4.0 us)"},
  };
  return presets;
}

Link link_preset(std::string_view name) {
  for (const Link& link : link_presets()) {
    if (link.name == name) return link;
  }
  throw InvalidArgument(fmt::format("unknown link '{}' (presets: {}; or give --alpha-us A --beta-gbs B)", name,
                                    preset_names()));
}

Link custom_link(double alpha_us, double beta_gbs) {
  MG_CHECK(std::isfinite(alpha_us) && alpha_us >= 0, "custom link: alpha {} us must be >= 0", alpha_us);
  MG_CHECK(std::isfinite(beta_gbs) && beta_gbs > 0, "custom link: beta {} GB/s must be > 0", beta_gbs);
  return {"custom", alpha_us, beta_gbs, fmt::format("user-given: alpha {} us, beta {} GB/s", alpha_us, beta_gbs)};
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

}  // namespace meshgrad::dist
