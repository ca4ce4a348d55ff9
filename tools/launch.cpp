#include "launch.hpp"

#include <fmt/core.h>

#include <exception>
#include <memory>

#include "meshgrad/comm/errors.hpp"
#include "meshgrad/comm/mpi.hpp"
#include "meshgrad/comm/threads.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad::tools {

std::vector<dist::MeshAxis> mesh_axes_from_spec(const std::string& spec) {
  std::vector<dist::MeshAxis> axes = dist::parse_mesh_spec(spec);   // throws naming the text
  bool has_dp = false, has_tp = false;
  for (const auto& a : axes) {
    has_dp = has_dp || a.name == "dp";
    has_tp = has_tp || a.name == "tp";
  }
  if (!has_tp) axes.push_back({"tp", 1});
  if (!has_dp) axes.push_back({"dp", 1});
  return dist::canonical_mesh_order(std::move(axes));
}

int mesh_world_size(const std::string& spec) {
  int n = 1;
  for (const auto& a : mesh_axes_from_spec(spec)) n *= a.size;
  return n;
}

int run_on_backend(const std::string& backend, int world_size,
                   const std::function<void(const comm::CommunicatorPtr& world)>& fn) {
  if (backend == "threads") {
    MG_CHECK(world_size >= 1, "--backend threads: need at least one rank, got {}", world_size);
    comm::run_ranks(world_size, fn);   // rethrows the first rank's error after every rank joined
    return 0;
  }
  if (backend == "mpi") {
    int argc = 0;
    char** argv = nullptr;
    // Throws CommError naming the mpi backend (and how to build it) in a build without MPI.
    comm::MpiSession session(&argc, &argv);
    comm::CommunicatorPtr world = session.world();
    MG_CHECK(world_size == 0 || world_size == world->size(),
             "--backend mpi: the mesh needs {} ranks but the MPI world has {} processes (start with "
             "`mpirun -np {} meshgrad ...`)",
             world_size, world->size(), world_size);
    try {
      fn(world);
    } catch (const std::exception& e) {
      if (world->size() == 1) throw;
      // The other ranks may be blocked in a collective this rank will never join; MPI cannot cancel
      // it and MPI_Finalize would wait for them, so the job is aborted with this rank's message.
      comm::mpi_abort(1, fmt::format("meshgrad: error on rank {} of {}: {}", world->rank(), world->size(), e.what()));
    }
    return 0;
  }
  throw InvalidArgument(fmt::format("unknown --backend '{}': choose threads or mpi", backend));
}

dist::DeviceMeshPtr make_mesh(const comm::CommunicatorPtr& world, const std::string& spec) {
  MG_CHECK(world != nullptr, "make_mesh: no communicator");
  auto axes = mesh_axes_from_spec(spec);
  int size = 1;
  for (const auto& a : axes) size *= a.size;
  MG_CHECK(size == world->size(), "--mesh {} ({}) needs {} ranks but the {} world has {}", spec,
           dist::mesh_spec_str(axes), size, world->backend(), world->size());
  return std::make_shared<const dist::DeviceMesh>(world, std::move(axes));
}

}  // namespace meshgrad::tools
