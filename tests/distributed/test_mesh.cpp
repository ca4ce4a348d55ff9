#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "dist_test_util.hpp"
#include "meshgrad/comm/errors.hpp"
#include "meshgrad/distributed/collectives.hpp"

using namespace meshgrad;
using namespace meshgrad::dist;
using meshgrad::testing::run_on_mesh;

TEST(MeshSpec, ParsesAndRejects) {
  auto axes = parse_mesh_spec("tp=4,dp=2");
  ASSERT_EQ(axes.size(), 2u);
  EXPECT_EQ(axes[0].name, "tp");
  EXPECT_EQ(axes[1].size, 2);
  auto canon = canonical_mesh_order(axes);
  EXPECT_EQ(mesh_spec_str(canon), "dp=2,tp=4");
  EXPECT_THROW(parse_mesh_spec("tp"), InvalidArgument);
  EXPECT_THROW(parse_mesh_spec("tp=0"), InvalidArgument);
  EXPECT_THROW(parse_mesh_spec("tp=2,tp=2"), InvalidArgument);
  EXPECT_THROW(parse_mesh_spec("tp=2x"), InvalidArgument);
  try {
    parse_mesh_spec("tp=two");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("tp=two"), std::string::npos) << e.what();
  }
}

TEST(DeviceMesh, CoordinatesAndAxisGroups) {
  // dp=2 x tp=3: tp groups are adjacent ranks {0,1,2}, {3,4,5}; dp groups {0,3}, {1,4}, {2,5}.
  run_on_mesh(
      6,
      [](const DeviceMeshPtr& mesh) {
        const int r = mesh->rank();
        EXPECT_EQ(mesh->coordinate("dp"), r / 3);
        EXPECT_EQ(mesh->coordinate("tp"), r % 3);
        EXPECT_EQ(mesh->rank_of(mesh->coordinates()), r);
        EXPECT_EQ(mesh->group("tp").size(), 3);
        EXPECT_EQ(mesh->group("dp").size(), 2);
        EXPECT_EQ(mesh->group("tp").rank(), r % 3);
        EXPECT_EQ(mesh->group("dp").rank(), r / 3);
        // Sum of world ranks over each group identifies its members.
        Tensor v = Tensor::full({1}, r, DType::Float64);
        const double tp_sum = all_reduce(v, mesh->group("tp")).item();
        const double dp_sum = all_reduce(v, mesh->group("dp")).item();
        EXPECT_EQ(tp_sum, (r / 3) * 9 + 3);      // {0,1,2} -> 3, {3,4,5} -> 12
        EXPECT_EQ(dp_sum, 2 * (r % 3) + 3);      // {c, c+3}
        EXPECT_THROW(mesh->axis_index("pp"), InvalidArgument);
      },
      {{"dp", 2}, {"tp", 3}});
}

TEST(DeviceMesh, SizeMismatchIsAnError) {
  EXPECT_THROW(run_on_mesh(4, [](const DeviceMeshPtr&) {}, {{"tp", 3}}), InvalidArgument);
}

TEST(DeviceMesh, AxisProductOverflowIsAnError) {
  // 3 x 1431655766 = 2^32 + 2: an int product wraps to 2 and would match a 2-rank world.
  try {
    run_on_mesh(2, [](const DeviceMeshPtr&) {}, {{"a", 3}, {"b", 1431655766}});
    FAIL() << "a mesh whose size overflows int was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("a=3,b=1431655766"), std::string::npos) << e.what();
  }
}

TEST(DeviceMesh, AxisGroupErrorsNameTheAxis) {
  // A rank that never joins a tp all-reduce: the waiting rank's error says which group it waited in
  // (its "rank 1 of 2" is a group rank, which alone is ambiguous in a larger world).
  comm::ThreadsOptions o;
  o.timeout = std::chrono::milliseconds(300);
  std::string message;
  comm::run_ranks(2, [&](const comm::CommunicatorPtr& world) {
    auto mesh = std::make_shared<const DeviceMesh>(world, std::vector<MeshAxis>{{"dp", 1}, {"tp", 2}});
    if (mesh->rank() == 0) return;
    double x = 1;
    try {
      mesh->group("tp").comm->all_reduce(comm::MutableBuffer{&x, 1, DType::Float64}, comm::ReduceOp::Sum);
    } catch (const comm::CommTimeout& e) {
      message = e.what();
    }
  }, o);
  EXPECT_NE(message.find("on rank 1 of 2 of group tp"), std::string::npos) << message;
}

// A PendingTensor dropped while its collective is still in flight (an error path that never waits)
// must wait for the operation before the buffers it holds are freed: the destructor returns only
// after the slow peer joined. Without that the progress thread writes into freed memory (ASan).
TEST(PendingTensor, DroppedInFlightWaitsBeforeFreeingItsBuffers) {
  std::atomic<bool> peer_joined{false};
  meshgrad::testing::run_on_mesh(2, [&](const dist::DeviceMeshPtr& mesh) {
    const dist::ProcessGroup& g = mesh->group("tp");
    if (g.rank() == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      peer_joined = true;
      dist::all_reduce(Tensor::full({1024}, 1.0, DType::Float64), g);
      return;
    }
    {
      dist::PendingTensor p = dist::all_reduce_async(Tensor::full({1024}, 2.0, DType::Float64), g);
    }   // dropped without wait()
    EXPECT_TRUE(peer_joined.load()) << "the PendingTensor went before its operation finished";
  });
}
