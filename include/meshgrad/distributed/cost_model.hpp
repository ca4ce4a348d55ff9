// The alpha-beta cost model behind `meshgrad explain`: a predicted time for one collective on n
// ranks over a link with a per-step latency alpha and a per-rank bandwidth beta.
//
// Conventions:
// - bytes is the nccl-tests size (PERFORMANCE.md), the same number CommCounter records: the whole
//   buffer (all_reduce: the buffer; all_gather: the gathered output; reduce_scatter: the unreduced
//   input; all_to_all: one rank's send buffer; broadcast: the buffer).
// - beta is the bandwidth of one rank's link in one direction, GB/s = 1e9 bytes/s; alpha is the
//   latency of one algorithm step in microseconds.
// - n = 1 costs 0: every collective is a no-op on a group of one (the size-1 fast path).
//
// Formulas (t in us, bytes / beta converted to us):
//   all_reduce      ring: 2(n-1) alpha + 2(n-1)/n * bytes/beta
//                   tree: 2 ceil(log2 n) alpha + 2 bytes/beta    (pipelined reduce + broadcast)
//                   predicted = min(ring, tree); the chosen algorithm is reported
//   all_gather      ring: (n-1) alpha + (n-1)/n * bytes/beta
//   reduce_scatter  ring: (n-1) alpha + (n-1)/n * bytes/beta
//   all_to_all      pairwise: (n-1) alpha + (n-1)/n * bytes/beta
//   broadcast       pipelined tree: ceil(log2 n) alpha + bytes/beta
// The bandwidth terms are the nccl-tests "bus bandwidth" factors, so a link's beta can be read off
// a busbw column directly.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace meshgrad::dist {

struct Link {
  std::string name;     // "shm", "nvlink4", "ib-ndr", "custom"
  double alpha_us = 0;  // latency per algorithm step, microseconds (>= 0)
  double beta_gbs = 0;  // bandwidth per rank, one direction, GB/s = 1e9 B/s (> 0)
  std::string source;   // where the figures come from (citation text; docs/explain.md has the details)
};

// The presets, in a fixed order: "shm", "nvlink4", "ib-ndr".
const std::vector<Link>& link_presets();
// The preset called name; throws InvalidArgument naming name and listing the presets otherwise.
Link link_preset(std::string_view name);
// A user-given link ("custom"); throws InvalidArgument when alpha < 0 or beta <= 0 (or not finite).
Link custom_link(double alpha_us, double beta_gbs);

struct CollectiveCost {
  double time_us = 0;
  // "ring", "tree", "pairwise" (all_to_all), "pipelined-tree" (broadcast), "none" (n = 1)
  std::string algorithm;
  double latency_us = 0;    // the alpha part of time_us
  double bandwidth_us = 0;  // the beta part of time_us
};

// Ops the model knows, in a fixed order.
const std::vector<std::string>& cost_model_ops();

// The predicted cost of op on n ranks moving `bytes` (nccl-tests size) over link. Throws
// InvalidArgument naming the op when it is unknown, or naming the value when n < 1 or bytes < 0.
CollectiveCost predict_collective(std::string_view op, int n, double bytes, const Link& link);

// The two all_reduce algorithms separately (predict_collective picks the cheaper; ties go to ring).
CollectiveCost ring_all_reduce(int n, double bytes, const Link& link);
CollectiveCost tree_all_reduce(int n, double bytes, const Link& link);

}  // namespace meshgrad::dist
