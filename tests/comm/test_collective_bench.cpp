// The collective benchmark's pieces: size parsing, nccl-tests busbw factors, and a small run on the
// threads backend whose every row must verify (#wrong == 0) with the sizes it was asked for.
#include <gtest/gtest.h>

#include "meshgrad/comm/collective_bench.hpp"
#include "meshgrad/comm/threads.hpp"

namespace meshgrad::comm::test_collective_bench {
namespace {

TEST(CollectiveBench, ParsesByteSizes) {
  EXPECT_EQ(parse_byte_size("4096"), 4096u);
  EXPECT_EQ(parse_byte_size("1K"), 1024u);
  EXPECT_EQ(parse_byte_size("64M"), std::size_t(64) << 20);
  EXPECT_EQ(parse_byte_size("2g"), std::size_t(2) << 30);
  EXPECT_EQ(parse_byte_size("16KB"), std::size_t(16) << 10);
  EXPECT_THROW(parse_byte_size("3X"), InvalidArgument);
  EXPECT_THROW(parse_byte_size("K"), InvalidArgument);
  EXPECT_THROW(parse_byte_size(""), InvalidArgument);
  // 17179869185 x 2^30 = 2^64 + 2^30: used to wrap to 1 GiB without a word.
  EXPECT_THROW(parse_byte_size("17179869185G"), InvalidArgument);
  EXPECT_EQ(parse_byte_size("17179869183G"), std::size_t(17179869183) << 30);
}

TEST(CollectiveBench, BusBandwidthFactorsAreNcclTests) {
  EXPECT_DOUBLE_EQ(busbw_factor("all_reduce", 4), 1.5);
  EXPECT_DOUBLE_EQ(busbw_factor("all_gather", 4), 0.75);
  EXPECT_DOUBLE_EQ(busbw_factor("reduce_scatter", 2), 0.5);
  EXPECT_DOUBLE_EQ(busbw_factor("all_to_all", 3), 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(busbw_factor("broadcast", 4), 1.0);
  EXPECT_THROW(busbw_factor("gather", 2), InvalidArgument);
}

TEST(CollectiveBench, SmallRunVerifiesEveryRow) {
  CollectiveBenchOptions o;
  o.min_bytes = 1024;
  o.max_bytes = 16384;
  o.step_factor = 4;
  o.iters = 3;
  o.warmup = 1;
  for (DType dtype : {DType::Float32, DType::Float64}) {
    o.dtype = dtype;
    std::vector<CollectiveBenchRow> rows;
    run_ranks(3, [&](const CommunicatorPtr& c) {
      auto mine = run_collective_bench(*c, o);
      if (c->rank() == 0) rows = mine;
    });
    ASSERT_EQ(rows.size(), 5u * 3u);  // 5 ops x sizes 1K, 4K, 16K
    for (const auto& row : rows) {
      EXPECT_EQ(row.wrong, 0u) << row.op << " " << row.bytes;
      EXPECT_EQ(row.bytes, row.count * dtype_size(dtype));
      EXPECT_GT(row.time_us, 0.0);
      EXPECT_DOUBLE_EQ(row.busbw_gbps, row.algbw_gbps * busbw_factor(row.op, 3));
      if (row.op != "all_reduce" && row.op != "broadcast") {
        EXPECT_EQ(row.count % 3, 0u) << row.op;
      }
    }
    const std::string table = format_collective_table(rows, "threads", 3, 12.5);
    EXPECT_NE(table.find("# memcpy 64 MiB (1 thread, this run): 12.50 GB/s"), std::string::npos) << table;
    EXPECT_NE(table.find("Out of bounds values : 0 OK"), std::string::npos) << table;
  }
}

// A communicator whose all_reduce gets one element wrong: the benchmark's verification must see it.
class OffByOneAllReduce final : public Communicator {
 public:
  explicit OffByOneAllReduce(CommunicatorPtr inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string_view backend() const override { return "broken"; }
  Milliseconds default_timeout() const override { return inner_->default_timeout(); }
  WorkPtr all_reduce_async(ConstBuffer in, MutableBuffer out, ReduceOp op, const CollectiveOptions& opt) override {
    auto w = inner_->all_reduce_async(in, out, op, opt);
    w->wait();
    if (out.count > 1 && out.dtype == DType::Float32) static_cast<float*>(out.data)[1] += 1.0f;
    return w;
  }
  WorkPtr all_gather_async(ConstBuffer in, MutableBuffer out, Counts c, const CollectiveOptions& o) override {
    return inner_->all_gather_async(in, out, c, o);
  }
  WorkPtr reduce_scatter_async(ConstBuffer in, MutableBuffer out, ReduceOp op, Counts c,
                               const CollectiveOptions& o) override {
    return inner_->reduce_scatter_async(in, out, op, c, o);
  }
  WorkPtr broadcast_async(MutableBuffer b, int root, const CollectiveOptions& o) override {
    return inner_->broadcast_async(b, root, o);
  }
  WorkPtr all_to_all_async(ConstBuffer in, Counts sc, MutableBuffer out, Counts rc, const CollectiveOptions& o) override {
    return inner_->all_to_all_async(in, sc, out, rc, o);
  }
  WorkPtr send_async(ConstBuffer in, int peer, int tag, const CollectiveOptions& o) override {
    return inner_->send_async(in, peer, tag, o);
  }
  WorkPtr recv_async(MutableBuffer out, int peer, int tag, const CollectiveOptions& o) override {
    return inner_->recv_async(out, peer, tag, o);
  }
  WorkPtr barrier_async(const CollectiveOptions& o) override { return inner_->barrier_async(o); }
  std::shared_ptr<Communicator> split(int color, int key) override { return inner_->split(color, key); }

 private:
  CommunicatorPtr inner_;
};

TEST(CollectiveBench, VerificationCountsWrongResults) {
  CollectiveBenchOptions o;
  o.ops = {"all_reduce", "all_gather"};
  o.min_bytes = o.max_bytes = 4096;
  o.iters = 2;
  o.warmup = 1;
  std::vector<CollectiveBenchRow> rows;
  run_ranks(2, [&](const CommunicatorPtr& c) {
    OffByOneAllReduce broken(c);
    auto mine = run_collective_bench(broken, o);
    if (c->rank() == 0) rows = mine;
  });
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].wrong, 2u);  // element 1 on each of the 2 ranks
  EXPECT_EQ(rows[1].wrong, 0u);
  EXPECT_NE(format_collective_table(rows, "broken", 2, 1).find("FAILED"), std::string::npos);
}

}  // namespace
}  // namespace meshgrad::comm::test_collective_bench
