// The launcher the library's jobs run on (train::RunOnMesh) for a --backend and a --mesh: ranks
// started by run_on_backend, the mesh built by make_mesh (launch.hpp). Shared by the commands and
// the Python module, so both start ranks the same way.
#pragma once

#include <string>

#include "launch.hpp"
#include "meshgrad/train/equivalence.hpp"

namespace meshgrad::tools {

inline train::RunOnMesh mesh_runner(std::string backend, std::string mesh) {
  return [backend = std::move(backend), mesh = std::move(mesh)](
             const std::function<void(const dist::DeviceMeshPtr&)>& fn) {
    run_on_backend(backend, mesh_world_size(mesh),
                   [&](const comm::CommunicatorPtr& world) { fn(make_mesh(world, mesh)); });
  };
}

}  // namespace meshgrad::tools
