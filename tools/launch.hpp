// Starting ranks and building the mesh, shared by every command that runs on a mesh (train, grads,
// check, explain, bench ...), so `--backend` and `--mesh` mean the same thing everywhere.
//
//   --backend threads   P rank threads in this process (comm::run_ranks); P = the mesh's size.
//   --backend mpi       one process per rank under `mpirun -np P meshgrad ...`; the mesh's size must
//                       equal the MPI world size. A build without MPI is an error naming the backend,
//                       never a quiet fallback to threads.
//   --mesh "tp=2", "dp=2,tp=2", "tp=2,dp=2" (same mesh): axes laid out dp outermost, tp innermost
//                       (tp groups are adjacent ranks); a missing tp or dp axis is added with size 1,
//                       so models always find both.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "meshgrad/comm/communicator.hpp"
#include "meshgrad/distributed/mesh.hpp"

namespace meshgrad::tools {

// The axes of a --mesh spec in canonical order (dp, others, tp), with dp=1 / tp=1 added when absent.
// Throws InvalidArgument naming the text on a malformed spec.
std::vector<dist::MeshAxis> mesh_axes_from_spec(const std::string& spec);
// The number of ranks a --mesh spec needs (product of its axis sizes).
int mesh_world_size(const std::string& spec);

// Runs fn(world) on every rank of the chosen backend and returns 0 when all ranks finished (errors
// propagate as exceptions: threads rethrows the first rank's error after all joined; under mpi a
// rank that fails aborts the job with its message, since MPI cannot cancel the peers' collectives).
//   backend "threads": world_size rank threads (world_size >= 1).
//   backend "mpi":     this process is one rank; world_size must be the MPI world size or 0 (any).
// Any other backend name is an error naming it and the choices.
int run_on_backend(const std::string& backend, int world_size,
                   const std::function<void(const comm::CommunicatorPtr& world)>& fn);

// The DeviceMesh of a --mesh spec over world (collective: every rank calls it). The spec's size
// must equal world->size() (error naming both otherwise).
dist::DeviceMeshPtr make_mesh(const comm::CommunicatorPtr& world, const std::string& spec);

}  // namespace meshgrad::tools
