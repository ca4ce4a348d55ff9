// The mpi backend: one process per rank under `mpirun -np P`, across machines with a hostfile.
// Built when MESHGRAD_WITH_MPI is ON (MESHGRAD_HAVE_MPI defined); asking for it in a build without it
// throws, naming the backend (never a silent fallback to threads).
#pragma once

#include <memory>
#include <string>

#include "meshgrad/comm/communicator.hpp"

namespace meshgrad::comm {

// True when this build has the mpi backend.
bool mpi_backend_available();

struct MpiOptions {
  Milliseconds timeout{0};  // 0 = default_timeout_from_env()
  bool debug_checks = debug_checks_from_env();
};

// Initialises MPI (MPI_THREAD_MULTIPLE if available, else SERIALIZED with every MPI call under one
// lock) once per process and finalises it when the last MpiSession and communicator are gone. In a
// build without MPI the constructor throws CommError naming the mpi backend and how to build it.
class MpiSession {
 public:
  MpiSession(int* argc, char*** argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  // The communicator over (a duplicate of) MPI_COMM_WORLD.
  CommunicatorPtr world(const MpiOptions& options = {});

 private:
  std::shared_ptr<void> runtime_;  // MPI stays initialised while a session or communicator holds it
};

}  // namespace meshgrad::comm

namespace meshgrad::comm {

// For top-level error handlers of programs run under mpirun: prints `message` to stderr and calls
// MPI_Abort(MPI_COMM_WORLD, code) when MPI is initialised (a rank that hit a deadline cannot leave
// cleanly: MPI cannot cancel a collective and MPI_Finalize would wait for the peers), else exits.
[[noreturn]] void mpi_abort(int code, const std::string& message);
// This process's rank / size in MPI_COMM_WORLD when MPI is initialised, else 0 / 1.
int mpi_world_rank();
int mpi_world_size();

}  // namespace meshgrad::comm
