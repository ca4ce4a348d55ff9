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
//
// A measured link (`explain --link measured`, measure_link below): the run's ranks time an
// all-reduce over a sweep of sizes and alpha and beta are fitted to the times in the terms of the
// ring all-reduce above, t = 2(n-1) alpha + 2(n-1)/n bytes/beta = 2(n-1)(alpha + bytes/(n beta)):
// the link on which the model's all-reduce takes the times the run's own all-reduce took.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace meshgrad::comm {
class Communicator;
}

namespace meshgrad::dist {

// One probed size: the all-reduce's nccl-tests size and its time in microseconds.
struct LinkSample {
  double bytes = 0;
  double time_us = 0;
};

// How a measured link's figures were obtained (Link::measurement).
struct LinkMeasurement {
  int ranks = 0;                    // n of the probe's all-reduce (and of the fit's formula)
  std::string backend;              // "threads", "mpi" (the communicator's)
  std::string dtype = "float32";    // the probe's element type
  std::vector<LinkSample> samples;  // growing sizes; time: the slowest rank's, the fastest of `repeats` blocks
  std::vector<double> fitted_us;    // the fitted formula's time of each sample
  double rms_residual = 0;          // sqrt(mean(((fitted - measured) / measured)^2)): relative, 0.03 = 3%
  double max_residual = 0;          // max |fitted - measured| / measured
  bool alpha_clamped = false;       // the free fit's alpha was < 0: refitted with alpha = 0
  int repeats = 0;                  // timed blocks per size (0 = not a probe: synthetic samples)
  double seconds = 0;               // wall time of the probe (the slowest rank's)
};

struct Link {
  std::string name;     // "shm", "nvlink4", "ib-ndr", "custom", "measured"
  double alpha_us = 0;  // latency per algorithm step, microseconds (>= 0)
  double beta_gbs = 0;  // bandwidth per rank, one direction, GB/s = 1e9 B/s (> 0)
  std::string source;   // where the figures come from (citation text; docs/explain.md has the details)
  std::optional<LinkMeasurement> measurement;   // set on a measured link only
};

// The presets, in a fixed order: "shm", "nvlink4", "ib-ndr".
const std::vector<Link>& link_presets();
// The preset called name; throws InvalidArgument naming name and listing the presets otherwise
// ("measured" is no preset: it is probed at run time, measure_link; the message says so).
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

// ---- measured links ----------------------------------------------------------------------------

// The link ("measured") whose ring all-reduce on n >= 2 ranks takes the samples' times:
//   t(bytes) = A + B bytes,  A = 2(n-1) alpha,  B = 2(n-1)/n / beta
// fitted by least squares on relative error (each sample weighted by 1 / t^2, so a 1 KiB time's
// latency and a 4 MiB time's bandwidth count alike; exact samples give alpha and beta back exactly).
// A negative alpha from the free fit (noise on a link of ~0 latency) is refitted with alpha = 0
// (measurement->alpha_clamped). measurement holds the samples, the fitted times and the residuals;
// its backend, repeats and seconds are the caller's to fill. Throws InvalidArgument when n < 2,
// fewer than 2 distinct sizes, a size < 0 or a time <= 0 (or not finite), or when the times do not
// grow with the size (no bandwidth to fit: probe larger sizes).
Link fit_ring_all_reduce_link(int n, const std::vector<LinkSample>& samples);

// The probe measure_link runs: float32 all-reduces of min_bytes, min x step, ... <= max_bytes.
struct LinkProbeOptions {
  std::size_t min_bytes = std::size_t(1) << 10;
  std::size_t max_bytes = std::size_t(4) << 20;
  int step_factor = 4;              // 1 KiB .. 4 MiB by 4: 7 sizes
  int repeats = 3;                  // timed blocks per size; the fastest block's mean counts
  double seconds_per_block = 0.01;  // each block runs enough iterations for about this long (>= 5),
  int max_iters_per_block = 100;    // but at most this many: ops that slow down after the warm-up
                                    // timed them (a loaded machine) cannot stretch a block to seconds
  double warmup_seconds = 0.005;    // per size, after 5 untimed iterations (at most max_iters_per_block)
};

// Collective over comm (every rank calls it with the same options; comm.size() >= 2): times the
// all-reduce sweep (comm::run_collective_bench; each time is the slowest rank's) and returns
// fit_ring_all_reduce_link of it, the same on every rank, with the measurement's backend, repeats and
// seconds filled. Every wait is one of comm's own collectives, so each keeps comm's deadline. About
// 0.1 s with the defaults on a 2-rank shared-memory link (0.3 s on a loaded one). Throws
// InvalidArgument naming the communicator's size when it has one rank (nothing to measure), and
// Error when an all-reduce returned wrong values.
Link measure_link(comm::Communicator& comm, const LinkProbeOptions& options = {});

}  // namespace meshgrad::dist
