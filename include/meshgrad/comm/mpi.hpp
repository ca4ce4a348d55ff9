// The mpi backend: one process per rank under `mpirun -np P`, across machines with a hostfile.
// Built when MESHGRAD_WITH_MPI is ON (MESHGRAD_HAVE_MPI defined); asking for it in a build without it
// throws, naming the backend (never a silent fallback to threads).
#pragma once

#include "meshgrad/comm/communicator.hpp"

namespace meshgrad::comm {

// True when this build has the mpi backend.
bool mpi_backend_available();

struct MpiOptions {
  Milliseconds timeout{0};  // 0 = default_timeout_from_env()
  bool debug_checks = debug_checks_from_env();
};

// Initialises MPI (MPI_THREAD_MULTIPLE if available, else SERIALIZED with a progress thread lock)
// once per process and finalises it when the last MpiSession is destroyed.
class MpiSession {
 public:
  MpiSession(int* argc, char*** argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  // The communicator over MPI_COMM_WORLD.
  CommunicatorPtr world(const MpiOptions& options = {});
};

}  // namespace meshgrad::comm
