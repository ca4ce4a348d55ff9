// The alpha-beta cost model against closed-form values. The link has alpha = 2 us and beta = 1 GB/s
// so that bytes / beta is bytes / 1000 us: every expected value below is worked out by hand.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "meshgrad/comm/errors.hpp"
#include "meshgrad/comm/threads.hpp"
#include "meshgrad/distributed/cost_model.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad::dist::test_cost_model {
namespace {

const Link kLink{"test", 2.0, 1.0, "closed-form test link", std::nullopt};

TEST(CostModel, RingAllReduce) {
  // n = 4, 8000 B: 2*3*2 = 12 us latency + 2*3/4 * 8 us = 12 us bandwidth.
  const CollectiveCost c = ring_all_reduce(4, 8000, kLink);
  EXPECT_EQ(c.algorithm, "ring");
  EXPECT_DOUBLE_EQ(c.latency_us, 12.0);
  EXPECT_DOUBLE_EQ(c.bandwidth_us, 12.0);
  EXPECT_DOUBLE_EQ(c.time_us, 24.0);
}

TEST(CostModel, TreeAllReduce) {
  // n = 4: 2*ceil(log2 4) = 4 steps * 2 us = 8 us + 2 * 8 us = 16 us -> 24 us (ties with ring).
  const CollectiveCost c = tree_all_reduce(4, 8000, kLink);
  EXPECT_EQ(c.algorithm, "tree");
  EXPECT_DOUBLE_EQ(c.latency_us, 8.0);
  EXPECT_DOUBLE_EQ(c.bandwidth_us, 16.0);
  // n = 5: ceil(log2 5) = 3 -> 12 us latency.
  EXPECT_DOUBLE_EQ(tree_all_reduce(5, 0, kLink).latency_us, 12.0);
}

TEST(CostModel, AllReducePicksTheCheaperAlgorithm) {
  // Small message on 8 ranks: ring 2*7*2 = 28 us + 2*7/8*0.08 = 0.14 us; tree 2*3*2 = 12 us + 0.16 us.
  const CollectiveCost small = predict_collective("all_reduce", 8, 80, kLink);
  EXPECT_EQ(small.algorithm, "tree");
  EXPECT_DOUBLE_EQ(small.time_us, 12.0 + 0.16);
  // Large message on 8 ranks: ring 28 + 1.75 * 8000 = 14028 us; tree 12 + 16000 us.
  const CollectiveCost large = predict_collective("all_reduce", 8, 8e6, kLink);
  EXPECT_EQ(large.algorithm, "ring");
  EXPECT_DOUBLE_EQ(large.time_us, 28.0 + 14000.0);
  // A tie (n = 4 above) goes to ring.
  EXPECT_EQ(predict_collective("all_reduce", 4, 8000, kLink).algorithm, "ring");
  // n = 2: ring and tree have the same latency (2 steps); ring moves half the bytes.
  EXPECT_EQ(predict_collective("all_reduce", 2, 1000, kLink).algorithm, "ring");
  EXPECT_DOUBLE_EQ(predict_collective("all_reduce", 2, 1000, kLink).time_us, 4.0 + 1.0);
}

TEST(CostModel, GatherScatterAllToAll) {
  // n = 4, 4000 B: 3 * 2 = 6 us + 3/4 * 4 us = 3 us.
  for (const char* op : {"all_gather", "reduce_scatter", "all_to_all"}) {
    const CollectiveCost c = predict_collective(op, 4, 4000, kLink);
    EXPECT_DOUBLE_EQ(c.latency_us, 6.0) << op;
    EXPECT_DOUBLE_EQ(c.bandwidth_us, 3.0) << op;
    EXPECT_DOUBLE_EQ(c.time_us, 9.0) << op;
  }
  EXPECT_EQ(predict_collective("all_gather", 4, 4000, kLink).algorithm, "ring");
  EXPECT_EQ(predict_collective("all_to_all", 4, 4000, kLink).algorithm, "pairwise");
}

TEST(CostModel, Broadcast) {
  // n = 8: ceil(log2 8) = 3 steps * 2 us + 4000 B / 1 GB/s = 4 us -> 10 us.
  const CollectiveCost c = predict_collective("broadcast", 8, 4000, kLink);
  EXPECT_EQ(c.algorithm, "pipelined-tree");
  EXPECT_DOUBLE_EQ(c.time_us, 10.0);
  // n = 3: ceil(log2 3) = 2.
  EXPECT_DOUBLE_EQ(predict_collective("broadcast", 3, 0, kLink).time_us, 4.0);
}

TEST(CostModel, OneRankCostsNothing) {
  for (const std::string& op : cost_model_ops()) {
    const CollectiveCost c = predict_collective(op, 1, 1e9, kLink);
    EXPECT_EQ(c.time_us, 0.0) << op;
    EXPECT_EQ(c.algorithm, "none") << op;
  }
}

TEST(CostModel, UnitsOfThePresets) {
  // 450 GB/s: 450 MB take 1000 us of bandwidth on a broadcast over 2 ranks (+1 step of 3.4 us).
  const Link nvlink = link_preset("nvlink4");
  EXPECT_DOUBLE_EQ(predict_collective("broadcast", 2, 450e6, nvlink).time_us, 1000.0 + nvlink.alpha_us);
  const Link ib = link_preset("ib-ndr");
  EXPECT_DOUBLE_EQ(ib.beta_gbs, 50.0);   // 400 Gb/s / 8
  for (const Link& link : link_presets()) {
    EXPECT_FALSE(link.source.empty()) << link.name;
    EXPECT_GT(link.beta_gbs, 0) << link.name;
    EXPECT_GE(link.alpha_us, 0) << link.name;
  }
}

TEST(CostModel, ErrorsNameWhatWasWrong) {
  try {
    link_preset("nvlink9");
    FAIL() << "unknown link accepted";
  } catch (const InvalidArgument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("nvlink9"), std::string::npos) << msg;
    for (const Link& link : link_presets()) EXPECT_NE(msg.find(link.name), std::string::npos) << msg;
  }
  try {
    predict_collective("all_scatter", 2, 8, kLink);
    FAIL() << "unknown op accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("all_scatter"), std::string::npos) << e.what();
  }
  EXPECT_THROW(predict_collective("all_reduce", 0, 8, kLink), InvalidArgument);
  EXPECT_THROW(predict_collective("all_gather", 2, -1, kLink), InvalidArgument);
  EXPECT_THROW(custom_link(1.0, 0.0), InvalidArgument);
  EXPECT_THROW(custom_link(-1.0, 1.0), InvalidArgument);
  const Link custom = custom_link(1.5, 25.0);
  EXPECT_EQ(custom.name, "custom");
  EXPECT_DOUBLE_EQ(predict_collective("all_gather", 2, 50e3, custom).time_us, 1.5 + 1.0);
}

// ---- measured links: the fit and the probe ------------------------------------------------------

// Times of the ring all-reduce on `link` at 1 KiB, 4 KiB, ... 4 MiB: what a link with exactly these
// figures would measure.
std::vector<LinkSample> exact_ring_samples(int n, const Link& link) {
  std::vector<LinkSample> samples;
  for (double bytes = 1024; bytes <= 4.0 * 1024 * 1024; bytes *= 4) {
    samples.push_back({bytes, ring_all_reduce(n, bytes, link).time_us});
  }
  return samples;
}

void expect_relative_near(double got, double want, double tolerance, const std::string& what) {
  EXPECT_LE(std::abs(got - want), tolerance * std::abs(want)) << what << ": got " << got << ", want " << want;
}

TEST(LinkFit, RecoversAlphaAndBetaFromExactTimes) {
  // The shm preset's figures on 2 ranks, NVLink's on 8, and a slow network's on 3.
  for (const auto& [n, alpha, beta] : std::vector<std::tuple<int, double, double>>{
           {2, 1.5, 16.0}, {8, 3.4, 450.0}, {3, 25.0, 1.25}}) {
    const Link truth{"truth", alpha, beta, "synthetic", std::nullopt};
    const Link fit = fit_ring_all_reduce_link(n, exact_ring_samples(n, truth));
    const std::string what = "n = " + std::to_string(n);
    EXPECT_EQ(fit.name, "measured");
    expect_relative_near(fit.alpha_us, alpha, 1e-9, what + " alpha");
    expect_relative_near(fit.beta_gbs, beta, 1e-9, what + " beta");
    ASSERT_TRUE(fit.measurement.has_value());
    EXPECT_EQ(fit.measurement->ranks, n);
    EXPECT_EQ(fit.measurement->samples.size(), 7u);
    EXPECT_LT(fit.measurement->rms_residual, 1e-12) << what;
    EXPECT_LT(fit.measurement->max_residual, 1e-12) << what;
    EXPECT_FALSE(fit.measurement->alpha_clamped);
    for (std::size_t i = 0; i < 7; ++i) {
      expect_relative_near(fit.measurement->fitted_us[i], fit.measurement->samples[i].time_us, 1e-12, what);
    }
  }
}

TEST(LinkFit, UsesTheRingFormulaWorkedByHand) {
  // n = 4, alpha = 2 us, beta = 1 GB/s: t = 2*3*2 + 2*3/4 * bytes/1000 = 12 + 1.5 bytes/1000 us
  // (0 B: 12 us; 8000 B: 24 us as in RingAllReduce; 16000 B: 36 us).
  const Link fit = fit_ring_all_reduce_link(4, {{0, 12.0}, {8000, 24.0}, {16000, 36.0}});
  expect_relative_near(fit.alpha_us, 2.0, 1e-12, "alpha");
  expect_relative_near(fit.beta_gbs, 1.0, 1e-12, "beta");
  // The same times read as 2 ranks (t = 2 alpha + bytes/beta): alpha 6 us, beta 8000 B / 12 us.
  const Link two = fit_ring_all_reduce_link(2, {{0, 12.0}, {8000, 24.0}, {16000, 36.0}});
  expect_relative_near(two.alpha_us, 6.0, 1e-12, "alpha n=2");
  expect_relative_near(two.beta_gbs, 8000.0 / 12.0 / 1e3, 1e-12, "beta n=2");
}

TEST(LinkFit, WeighsEverySizeByItsRelativeError) {
  // One time 10% too slow out of 7: the fit is pulled, and the residual says so.
  const Link truth{"truth", 1.5, 16.0, "synthetic", std::nullopt};
  std::vector<LinkSample> samples = exact_ring_samples(2, truth);
  samples[3].time_us *= 1.10;
  const Link fit = fit_ring_all_reduce_link(2, samples);
  EXPECT_GT(fit.measurement->rms_residual, 0.01);
  EXPECT_LT(fit.measurement->rms_residual, 0.10);
  EXPECT_GE(fit.measurement->max_residual, fit.measurement->rms_residual);
  expect_relative_near(fit.alpha_us, 1.5, 0.15, "alpha");
  expect_relative_near(fit.beta_gbs, 16.0, 0.15, "beta");
}

TEST(LinkFit, ClampsANegativeLatencyToZero) {
  // Times through -0.2 us at 0 B: the free fit's alpha is negative; the fit goes through 0 instead.
  const Link fit = fit_ring_all_reduce_link(2, {{1000, 0.8}, {2000, 1.8}, {4000, 3.8}});
  EXPECT_EQ(fit.alpha_us, 0.0);
  EXPECT_GT(fit.beta_gbs, 0.0);
  EXPECT_TRUE(fit.measurement->alpha_clamped);
}

TEST(LinkFit, RefusesWhatCannotBeFitted) {
  const auto message = [](auto&& f) {
    try {
      f();
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(message([] { fit_ring_all_reduce_link(1, {{1, 1}, {2, 2}}); }).find("n = 1"), std::string::npos);
  EXPECT_NE(message([] { fit_ring_all_reduce_link(2, {{1024, 3}, {1024, 4}}); }).find("2 or more sizes"),
            std::string::npos);
  EXPECT_NE(message([] { fit_ring_all_reduce_link(2, {{1024, 0}, {4096, 4}}); }).find("a time > 0"), std::string::npos);
  EXPECT_NE(message([] { fit_ring_all_reduce_link(2, {{1024, 9}, {4096, 5}, {16384, 1}}); }).find("do not grow"),
            std::string::npos);
  // "measured" is no preset: the message says where it comes from.
  EXPECT_NE(message([] { link_preset("measured"); }).find("probed at run time"), std::string::npos);
}

// A short probe for the tests: the default sizes (1 KiB .. 4 MiB) and the fastest of 3 blocks, each
// block ~2 ms. Not fewer: with one block per size up to 64 KiB every sample was latency (~13 us), and
// one 1 KiB block preempted to 1.5 ms on a loaded CI under ASan made the fitted slope negative.
LinkProbeOptions quick_probe() {
  LinkProbeOptions o;
  o.seconds_per_block = 0.002;
  o.warmup_seconds = 0.001;
  return o;
}

TEST(MeasureLink, FitsTheThreadsBackendOnEveryRank) {
  std::vector<Link> links(2);
  comm::run_ranks(2, [&](const comm::CommunicatorPtr& world) {
    links[static_cast<std::size_t>(world->rank())] = measure_link(*world, quick_probe());
  });
  for (const Link& link : links) {
    EXPECT_EQ(link.name, "measured");
    EXPECT_GE(link.alpha_us, 0);
    EXPECT_GT(link.beta_gbs, 0);
    ASSERT_TRUE(link.measurement.has_value());
    EXPECT_EQ(link.measurement->backend, "threads");
    EXPECT_EQ(link.measurement->ranks, 2);
    ASSERT_EQ(link.measurement->samples.size(), 7u);   // 1, 4, 16, 64, 256 KiB, 1, 4 MiB
    EXPECT_EQ(link.measurement->samples.front().bytes, 1024);
    EXPECT_EQ(link.measurement->samples.back().bytes, 4 << 20);
    EXPECT_GT(link.measurement->seconds, 0);
    EXPECT_LT(link.measurement->seconds, 2.0);
  }
  // The times are the slowest rank's and the fit is deterministic: both ranks hold the same link.
  EXPECT_EQ(links[0].alpha_us, links[1].alpha_us);
  EXPECT_EQ(links[0].beta_gbs, links[1].beta_gbs);
}

TEST(MeasureLink, RefusesOneRank) {
  try {
    comm::run_ranks(1, [&](const comm::CommunicatorPtr& world) { (void)measure_link(*world, quick_probe()); });
    FAIL() << "a 1-rank probe was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("has 1 rank"), std::string::npos) << e.what();
  }
}

TEST(MeasureLink, KeepsTheCommunicatorsDeadline) {
  // Rank 1 never joins the probe: rank 0's first wait ends at the communicator's 300 ms deadline
  // (CommTimeout), or when rank 1's thread ended (PeerFailed), never in a hang.
  comm::ThreadsOptions options;
  options.timeout = std::chrono::milliseconds(300);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(comm::run_ranks(
                   2,
                   [&](const comm::CommunicatorPtr& world) {
                     if (world->rank() == 0) (void)measure_link(*world, quick_probe());
                   },
                   options),
               comm::CommError);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 10.0);
}

}  // namespace
}  // namespace meshgrad::dist::test_cost_model
