#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "dist_test_util.hpp"
#include "meshgrad/comm/errors.hpp"
#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/distributed/layout.hpp"
#include "meshgrad/tensor/error.hpp"

#include <fmt/format.h>
#include <string>
#include <vector>

namespace test_mesh {

using namespace meshgrad;
using namespace meshgrad::dist;
using meshgrad::testing::run_on_mesh;

namespace {

// The error message of parse_mesh(spec), or "" when it is accepted.
std::string mesh_error(const std::string& spec) {
  try {
    parse_mesh(spec);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

std::string axes_str(const std::vector<MeshAxis>& axes) {
  std::string s;
  for (const auto& a : axes) s += fmt::format("{}{}={}", s.empty() ? "" : " ", a.name, a.size);
  return s;
}

}  // namespace

TEST(MeshSpec, OneDimensionalGivesDpAndTp) {
  EXPECT_EQ(axes_str(parse_mesh("tp=2")), "dp=1 tp=2");
  EXPECT_EQ(axes_str(parse_mesh("dp=3")), "dp=3 tp=1");
  EXPECT_EQ(axes_str(parse_mesh("tp=2,dp=3")), "dp=3 tp=2");
  EXPECT_EQ(mesh_world_size("dp=3,tp=2"), 6);
}

TEST(MeshSpec, TwoDimensionalGivesDpRowCol) {
  EXPECT_EQ(axes_str(parse_mesh("tp=2x3")), "dp=1 tp_row=2 tp_col=3");
  EXPECT_EQ(axes_str(parse_mesh("tp=2x3,dp=2")), "dp=2 tp_row=2 tp_col=3");
  EXPECT_EQ(mesh_world_size("dp=2,tp=2x3"), 12);
  EXPECT_NE(mesh_error("tp=2x"), "");
  EXPECT_NE(mesh_error("tp=x2"), "");
  EXPECT_NE(mesh_error("tp=2x2x2").find("'2x2'"), std::string::npos) << mesh_error("tp=2x2x2");
  EXPECT_NE(mesh_error("tp=0x2").find("positive integer"), std::string::npos);
  EXPECT_NE(mesh_error("dp=2x2").find("'2x2'"), std::string::npos) << "only tp is 2-D";
}

TEST(MeshSpec, FsdpComesAfterDpAndBeforeTheTpAxesOnlyWhenGiven) {
  EXPECT_EQ(axes_str(parse_mesh("fsdp=4")), "dp=1 fsdp=4 tp=1");
  EXPECT_EQ(axes_str(parse_mesh("tp=2,fsdp=2,dp=2")), "dp=2 fsdp=2 tp=2");
  EXPECT_EQ(axes_str(parse_mesh("dp=2,fsdp=2,tp=2x2")), "dp=2 fsdp=2 tp_row=2 tp_col=2");
  EXPECT_EQ(mesh_world_size("dp=2,fsdp=3,tp=2x2"), 24);
  for (const std::string spec : {"fsdp=4", "fsdp=2,tp=2", "dp=2,fsdp=2,tp=2", "dp=3,fsdp=2,tp=2x2", "fsdp=1"}) {
    EXPECT_EQ(mesh_spec(parse_mesh(spec)), spec == "fsdp=4" ? "fsdp=4,tp=1" : spec == "fsdp=1" ? "fsdp=1,tp=1" : spec);
  }
  EXPECT_NE(mesh_error("fsdp=2x2").find("'2x2'"), std::string::npos) << "only tp is 2-D";
  EXPECT_NE(mesh_error("fsdp=2,fsdp=2").find("appears twice"), std::string::npos);
  EXPECT_NE(mesh_error("FSDP=2").find("did you mean 'fsdp'"), std::string::npos);
}

// pp (pipeline stages) is the outermost axis, present only when given, and written back the same way.
TEST(MeshSpec, PpComesFirstOnlyWhenGiven) {
  EXPECT_EQ(axes_str(parse_mesh("pp=2")), "pp=2 dp=1 tp=1");
  EXPECT_EQ(axes_str(parse_mesh("tp=2,pp=4,dp=2")), "pp=4 dp=2 tp=2");
  EXPECT_EQ(axes_str(parse_mesh("dp=2,tp=2x2,pp=2")), "pp=2 dp=2 tp_row=2 tp_col=2");
  for (const std::string spec : {"pp=2,tp=1", "pp=2,dp=2,tp=2", "pp=3,dp=2,fsdp=2,tp=2x2", "pp=1,tp=2"}) {
    EXPECT_EQ(mesh_spec(parse_mesh(spec)), spec);
  }
  EXPECT_EQ(mesh_spec(parse_mesh("tp=2,pp=2")), "pp=2,tp=2");
  EXPECT_NE(mesh_error("pp=2,pp=2").find("appears twice"), std::string::npos);
  EXPECT_NE(mesh_error("pp=2x2").find("'2x2'"), std::string::npos) << "only tp is 2-D";
  EXPECT_NE(mesh_error("pp=0").find("positive integer"), std::string::npos);
  EXPECT_NE(mesh_error("pp=4096,tp=2").find("at most 4096"), std::string::npos);
  EXPECT_NE(mesh_error("PP=2").find("did you mean 'pp'"), std::string::npos);
}

// ep and cp sit between fsdp and the tp axes (cp inside ep), present only when given, and are written
// back in that order whatever order the spec names them in.
TEST(MeshSpec, EpAndCpComeBeforeTpOnlyWhenGiven) {
  EXPECT_EQ(axes_str(parse_mesh("cp=2")), "dp=1 cp=2 tp=1");
  EXPECT_EQ(axes_str(parse_mesh("tp=2,cp=2,dp=2")), "dp=2 cp=2 tp=2");
  EXPECT_EQ(axes_str(parse_mesh("cp=2,ep=2,fsdp=2,pp=2")), "pp=2 dp=1 fsdp=2 ep=2 cp=2 tp=1");
  EXPECT_EQ(axes_str(parse_mesh("cp=2,tp=2x2")), "dp=1 cp=2 tp_row=2 tp_col=2");
  EXPECT_EQ(mesh_world_size("pp=2,dp=2,fsdp=2,ep=2,cp=2,tp=2x2"), 128);
  for (const std::string spec : {"cp=2,tp=1", "dp=2,cp=2,tp=2", "pp=2,fsdp=2,ep=2,cp=4,tp=2", "cp=1,tp=2x2",
                                 "ep=2,tp=1"}) {
    EXPECT_EQ(mesh_spec(parse_mesh(spec)), spec);
  }
  EXPECT_EQ(mesh_spec(parse_mesh("tp=2,cp=2,dp=2")), "dp=2,cp=2,tp=2");
  EXPECT_NE(mesh_error("cp=2,cp=2").find("appears twice"), std::string::npos);
  EXPECT_NE(mesh_error("cp=2x2").find("'2x2'"), std::string::npos) << "only tp is 2-D";
  EXPECT_NE(mesh_error("CP=2").find("did you mean 'cp'"), std::string::npos);
}

TEST(MeshSpec, OnlyPpDpFsdpEpCpAndTpCaseSensitive) {
  for (const std::string spec : {"xp=2", "EP=2", "TP=2", "Dp=2", "dp=2,tq=2", "rows=2", "Fsdp=2", "PP=2"}) {
    const std::string msg = mesh_error(spec);
    EXPECT_NE(msg.find("valid axes are pp, dp, fsdp, ep, cp and tp"), std::string::npos) << spec << ": " << msg;
    EXPECT_NE(msg.find(spec), std::string::npos) << "names the spec: " << msg;
  }
  EXPECT_NE(mesh_error("TP=2").find("did you mean 'tp'"), std::string::npos);
  EXPECT_NE(mesh_error("tp=2,tp=2").find("appears twice"), std::string::npos);
  EXPECT_NE(mesh_error("tp=2x2,tp=2").find("appears twice"), std::string::npos);
}

TEST(MeshSpec, MalformedSizes) {
  for (const std::string spec : {"", "tp", "tp=", "=2", "tp=0", "tp=-1", "tp=1e3", "tp= 2", "tp=2,", "tp=+2", "tp=two"}) {
    EXPECT_NE(mesh_error(spec), "") << "'" << spec << "' was accepted";
  }
  EXPECT_NE(mesh_error("tp=two").find("tp=two"), std::string::npos) << mesh_error("tp=two");
}

TEST(MeshSpec, RankCountBoundedWithoutOverflow) {
  // The int product of 4 x 1073741825 wraps to 4: it must be refused, not run on 4 ranks.
  EXPECT_NE(mesh_error("dp=4,tp=1073741825").find("at most 4096"), std::string::npos);
  EXPECT_NE(mesh_error("dp=65536,tp=65536").find("at most 4096"), std::string::npos);
  EXPECT_NE(mesh_error("tp=99999999999999999999999").find("at most 4096"), std::string::npos);
  EXPECT_NE(mesh_error("dp=64,tp=8x16").find("needs 8192 ranks"), std::string::npos) << mesh_error("dp=64,tp=8x16");
  EXPECT_EQ(mesh_world_size("dp=64,tp=8x8"), kMaxMeshRanks);
}

// mesh_spec is the one way a mesh is written (checkpoints, metrics, messages): it is the inverse of
// parse_mesh, and the canonical spelling of every equivalent spec.
TEST(MeshSpec, WritingIsTheInverseOfReading) {
  for (const std::string spec : {"tp=1", "tp=2", "dp=2,tp=4", "tp=2x2", "dp=2,tp=2x3", "dp=3,tp=1", "tp=3x1"}) {
    EXPECT_EQ(mesh_spec(parse_mesh(spec)), spec);
    EXPECT_EQ(axes_str(parse_mesh(mesh_spec(parse_mesh(spec)))), axes_str(parse_mesh(spec))) << spec;
  }
  EXPECT_EQ(mesh_spec(parse_mesh("tp=4,dp=2")), "dp=2,tp=4");
  EXPECT_EQ(mesh_spec(parse_mesh("dp=1,tp=2")), "tp=2");
  EXPECT_EQ(mesh_spec({{"tp", 3}}), "tp=3");
  // A hand-built mesh outside the grammar is written name=size in its order.
  EXPECT_EQ(mesh_spec({{"rows", 2}, {"cols", 3}}), "rows=2,cols=3");
  EXPECT_EQ(mesh_spec({{"tp", 2}, {"dp", 2}}), "tp=2,dp=2");
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

// Sp(0) on fsdp splits the piece the tp axis leaves, not the full dim: gathering the fsdp pieces in
// coordinate order gives back exactly the tp piece (uneven counts by the shard rule, fused blocks
// kept whole), and gather_pieces over both axes gives back the full tensor.
TEST(Layout, ShardOfPieceSplitsTheTensorParallelPieceAndGathersBack) {
  EXPECT_EQ(parse_placement("Sp(0)"), Placement::shard_of_piece(0));
  EXPECT_EQ(Placement::shard_of_piece(1).str(), "Sp(1)");
  EXPECT_FALSE(Placement::shard_of_piece(0) == Placement::shard(0));
  EXPECT_THROW(parse_placement("Sp(x)"), InvalidArgument);
  const std::vector<MeshAxis> axes{{"dp", 1}, {"fsdp", 3}, {"tp", 2}};
  struct Case {
    Shape full;
    Placement tp;
  };
  // c_proj-like rows split by tp then fsdp; c_attn-like bias: 3 blocks of heads of 2 on tp, then fsdp.
  for (const Case& c : {Case{{10, 4}, Shard(0)}, Case{{7, 5}, Shard(1)}, Case{{24}, Placement::shard(0, 3, 2)}}) {
    const Placements with_fsdp{Replicate(), Placement::shard_of_piece(0), c.tp};
    const Placements tp_only{Replicate(), Replicate(), c.tp};
    const Tensor full = meshgrad::testing::global_randn(c.full, 3);
    run_on_mesh(6, [&](const DeviceMeshPtr& mesh) {
      const PieceLayout piece = piece_layout(c.full, *mesh, with_fsdp, mesh->coordinates());
      const PieceLayout tp_piece = piece_layout(c.full, *mesh, tp_only, mesh->coordinates());
      const Tensor mine = take_piece(full, piece);
      // Rows f of the tp piece by the shard rule.
      const ShardRange rows = shard_range(tp_piece.local_shape[0], 3, mesh->coordinate("fsdp"));
      const Tensor expected = take_piece(full, tp_piece).narrow(0, rows.offset, rows.size);
      EXPECT_TRUE(bitwise_equal(mine, expected.contiguous())) << shape_str(c.full) << " " << c.tp.str();
      const Tensor again = gather_pieces(mine, c.full, *mesh, with_fsdp);
      EXPECT_TRUE(bitwise_equal(again, full)) << shape_str(c.full) << " " << c.tp.str();
    }, axes);
  }
}

}  // namespace test_mesh
