// The alpha-beta cost model against closed-form values. The link has alpha = 2 us and beta = 1 GB/s
// so that bytes / beta is bytes / 1000 us: every expected value below is worked out by hand.
#include <gtest/gtest.h>

#include <string>

#include "meshgrad/distributed/cost_model.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad::dist {
namespace {

const Link kLink{"test", 2.0, 1.0, "closed-form test link"};

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

}  // namespace
}  // namespace meshgrad::dist
