// The launch helpers (--backend, --mesh) moved into the library (meshgrad/train/launch.hpp) so the
// Python bindings start ranks exactly as the CLI does; the commands keep using them unqualified.
#pragma once

#include "meshgrad/train/launch.hpp"

namespace meshgrad::tools {
using train::make_mesh;
using train::mesh_axes_from_spec;
using train::mesh_world_size;
using train::run_on_backend;
}  // namespace meshgrad::tools
