// The launch API: starting ranks on a backend and building the mesh of a --mesh spec, shared by the
// CLI (tools/), the Python module (python/) and C++ programs, so `--backend` and `--mesh` mean the
// same thing everywhere. The jobs they run are in launch/jobs.hpp.
//
//   --backend threads   P rank threads in this process (comm::run_ranks); P = the mesh's size.
//   --backend mpi       one process per rank under `mpirun -np P meshgrad ...`; the mesh's size must
//                       equal the MPI world size. A build without MPI is an error naming the backend,
//                       never a quiet fallback to threads.
//   --mesh              the grammar of dist::parse_mesh (distributed/mesh.hpp): "tp=2", "dp=2,tp=2",
//                       "tp=2x3", ...
#pragma once

#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "meshgrad/comm/communicator.hpp"
#include "meshgrad/distributed/mesh.hpp"

namespace meshgrad::launch {

// One option of the parsed command line, as the ranks must agree on it: its name ("--hidden",
// "command", "env MESHGRAD_COMM_DEBUG") and its effective value (given, else the default).
struct OptionValue {
  std::string name;
  std::string value;
};
// The configuration of this process, recorded by main.cpp after parsing; run_on_backend's mpi ranks
// check at start-up that they all have the same (agree_on_options) before fn runs.
void set_launch_options(std::vector<OptionValue> options);
const std::vector<OptionValue>& launch_options();

// Collective over world (every rank calls it; in the same order as its other collectives): the ranks
// all-gather a hash of their options; when any differs they gather the options themselves and every
// rank throws InvalidArgument naming the first option that differs with rank 0's value and the
// differing rank's (this rank's when it differs). MPMD runs (`mpirun -np 1 meshgrad ... --hidden 32
// : -np 1 meshgrad ... --hidden 64`) used to corrupt the heap or train each rank on its own config.
void agree_on_options(comm::Communicator& world, const std::vector<OptionValue>& options);

// Keeps a small block of memory in reserve (once per process) and installs a new-handler that gives
// it back when an allocation fails, then throws std::bad_alloc: the allocation still fails, but the
// small allocations the unwinding makes (a JSON value being destroyed copies its children into a
// vector) find memory, so an out-of-memory run ends with error_message's words instead of
// std::terminate in a destructor.
void reserve_memory_for_out_of_memory_errors();

// The message meshgrad prints for an error that ends a command: e.what(), except that an allocation
// failure (std::bad_alloc, whose what() says nothing) says what ran out and what to change.
std::string error_message(const std::exception& e);

// The number of processes an MPI launcher (mpirun, srun) started this job with, from the
// environment it sets; 0 when not started by one.
int mpi_launcher_world_size();
// How many MPI ranks share this node (OMPI_COMM_WORLD_LOCAL_SIZE); world_size when unknown.
int mpi_ranks_on_this_node(int world_size);

// Runs fn(world) on every rank of the chosen backend and returns 0 when all ranks finished (errors
// propagate as exceptions: threads rethrows the first rank's error after all joined; under mpi a
// rank that fails aborts the job with its message, since MPI cannot cancel the peers' collectives).
//   backend "threads": world_size rank threads (world_size >= 1).
//   backend "mpi":     this process is one rank; world_size must be the MPI world size or 0 (any).
// Any other backend name is an error naming it and the choices. The threads backend refuses to run
// under an MPI launcher (every process would run the whole job). While the ranks run, each uses
// max(1, cores / ranks on this node) BLAS threads (blas::ThreadsPerRank), so ranks x BLAS threads
// never exceeds the cores: threads -> all world_size ranks share this process; mpi -> the processes
// on this node (OMPI_COMM_WORLD_LOCAL_SIZE) share it. A job may set its own count inside the ranks
// (blas::set_threads_per_rank: train's --blas-threads); the launch's scope restores the count at the
// end. Under mpi the ranks first agree on their options (agree_on_options over launch_options()).
int run_on_backend(const std::string& backend, int world_size,
                   const std::function<void(const comm::CommunicatorPtr& world)>& fn);

// The DeviceMesh of a --mesh spec over world (collective: every rank calls it). The spec's size
// must equal world->size() (error naming both otherwise).
dist::DeviceMeshPtr make_mesh(const comm::CommunicatorPtr& world, const std::string& spec);

// The launcher the library's jobs run on (dist::RunOnMesh) for a --backend and a --mesh: ranks
// started by run_on_backend, the mesh built by make_mesh. The CLI, the Python module and C++
// programs start ranks through it, so all start them the same way.
dist::RunOnMesh mesh_runner(std::string backend, std::string mesh);

}  // namespace meshgrad::launch
