// The mpi backend is there exactly when the build has MPI; asking for it otherwise is an error that
// names the backend and how to build it (never a silent fallback to threads).
#include <gtest/gtest.h>

#include <string>

#include "meshgrad/comm/errors.hpp"
#include "meshgrad/comm/mpi.hpp"

namespace meshgrad::comm::test_mpi_availability {
namespace {

TEST(MpiAvailability, MatchesTheBuild) {
#if MESHGRAD_HAVE_MPI
  EXPECT_TRUE(mpi_backend_available());
#else
  EXPECT_FALSE(mpi_backend_available());
  try {
    MpiSession session(nullptr, nullptr);
    ADD_FAILURE() << "MpiSession constructed in a build without MPI";
  } catch (const CommError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("mpi backend"), std::string::npos) << m;
    EXPECT_NE(m.find("MESHGRAD_WITH_MPI=ON"), std::string::npos) << m;
  }
#endif
}

}  // namespace
}  // namespace meshgrad::comm::test_mpi_availability
