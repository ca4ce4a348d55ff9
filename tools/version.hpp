// The program's version and the git commit it was configured from (`meshgrad --version`, and the
// provenance the metrics header of `meshgrad train` records).
#pragma once

namespace meshgrad::tools {

// The CMake project's version, e.g. "0.1.0"; "unknown" when built without CMake's definitions.
const char* program_version();
// `git describe --always --dirty` of the checkout at configure time (stale until cmake runs again);
// "unknown" outside a git checkout.
const char* program_git_commit();

}  // namespace meshgrad::tools
