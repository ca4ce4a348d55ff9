// Unit tests of tools/launch.cpp: the --mesh grammar, the BLAS thread policy of launched ranks and
// the start-up agreement of ranks on their options.
#include <gtest/gtest.h>

#include <string>

#include "launch.hpp"
#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/tensor/error.hpp"

using namespace meshgrad;
using meshgrad::tools::mesh_axes_from_spec;
using meshgrad::tools::mesh_world_size;

namespace {

// The error message of mesh_axes_from_spec(spec), or "" when it is accepted.
std::string mesh_error(const std::string& spec) {
  try {
    mesh_axes_from_spec(spec);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(MeshSpec, OneDimensionalGivesDpAndTp) {
  EXPECT_EQ(dist::mesh_spec_str(mesh_axes_from_spec("tp=2")), "dp=1,tp=2");
  EXPECT_EQ(dist::mesh_spec_str(mesh_axes_from_spec("dp=3")), "dp=3,tp=1");
  EXPECT_EQ(dist::mesh_spec_str(mesh_axes_from_spec("tp=2,dp=3")), "dp=3,tp=2");
  EXPECT_EQ(mesh_world_size("dp=3,tp=2"), 6);
}

TEST(MeshSpec, TwoDimensionalGivesDpRowCol) {
  EXPECT_EQ(dist::mesh_spec_str(mesh_axes_from_spec("tp=2x3")), "dp=1,tp_row=2,tp_col=3");
  EXPECT_EQ(dist::mesh_spec_str(mesh_axes_from_spec("tp=2x3,dp=2")), "dp=2,tp_row=2,tp_col=3");
  EXPECT_EQ(mesh_world_size("dp=2,tp=2x3"), 12);
  EXPECT_NE(mesh_error("tp=2x"), "");
  EXPECT_NE(mesh_error("tp=x2"), "");
  EXPECT_NE(mesh_error("tp=2x2x2").find("'2x2'"), std::string::npos) << mesh_error("tp=2x2x2");
  EXPECT_NE(mesh_error("tp=0x2").find("positive integer"), std::string::npos);
  EXPECT_NE(mesh_error("dp=2x2").find("'2x2'"), std::string::npos) << "only tp is 2-D";
}

TEST(MeshSpec, OnlyDpAndTpCaseSensitive) {
  for (const std::string spec : {"pp=2", "TP=2", "Dp=2", "dp=2,tq=2", "rows=2"}) {
    const std::string msg = mesh_error(spec);
    EXPECT_NE(msg.find("valid axes are dp and tp"), std::string::npos) << spec << ": " << msg;
    EXPECT_NE(msg.find(spec), std::string::npos) << "names the spec: " << msg;
  }
  EXPECT_NE(mesh_error("TP=2").find("did you mean 'tp'"), std::string::npos);
  EXPECT_NE(mesh_error("tp=2,tp=2").find("appears twice"), std::string::npos);
  EXPECT_NE(mesh_error("tp=2x2,tp=2").find("appears twice"), std::string::npos);
}

TEST(MeshSpec, MalformedSizes) {
  for (const std::string spec : {"", "tp", "tp=", "=2", "tp=0", "tp=-1", "tp=1e3", "tp= 2", "tp=2,", "tp=+2"}) {
    EXPECT_NE(mesh_error(spec), "") << "'" << spec << "' was accepted";
  }
}

TEST(MeshSpec, RankCountBoundedWithoutOverflow) {
  // The int product of 4 x 1073741825 wraps to 4: it must be refused, not run on 4 ranks.
  EXPECT_NE(mesh_error("dp=4,tp=1073741825").find("at most 4096"), std::string::npos);
  EXPECT_NE(mesh_error("dp=65536,tp=65536").find("at most 4096"), std::string::npos);
  EXPECT_NE(mesh_error("tp=99999999999999999999999").find("at most 4096"), std::string::npos);
  EXPECT_NE(mesh_error("dp=64,tp=8x16").find("needs 8192 ranks"), std::string::npos) << mesh_error("dp=64,tp=8x16");
  EXPECT_EQ(mesh_world_size("dp=64,tp=8x8"), tools::kMaxMeshRanks);
}
