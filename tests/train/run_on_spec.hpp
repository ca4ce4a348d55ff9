// Runs fn on every rank thread of the mesh `spec` ("pp=2,tp=2"), with a deadline long enough for
// the slowest test run and short enough that a lost message fails instead of hanging.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "meshgrad/comm/threads.hpp"
#include "meshgrad/distributed/mesh.hpp"

namespace meshgrad::train {

inline void run_on(const std::string& spec, const std::function<void(const dist::DeviceMeshPtr&)>& fn) {
  comm::ThreadsOptions options;
  options.timeout = std::chrono::milliseconds(120000);
  const std::vector<dist::MeshAxis> axes = dist::parse_mesh(spec);
  comm::run_ranks(dist::mesh_world_size(spec),
                  [&](const comm::CommunicatorPtr& world) { fn(std::make_shared<const dist::DeviceMesh>(world, axes)); },
                  options);
}

}  // namespace meshgrad::train
