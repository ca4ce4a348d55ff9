// The one file CMake compiles with the version definitions: a new commit (after cmake runs again)
// recompiles this file alone, and every other tool file stays in its unity batch.
#include "version.hpp"

#ifndef MESHGRAD_VERSION
#define MESHGRAD_VERSION "unknown"
#endif
#ifndef MESHGRAD_GIT_COMMIT
#define MESHGRAD_GIT_COMMIT "unknown"
#endif

namespace meshgrad::tools {

const char* program_version() { return MESHGRAD_VERSION; }
const char* program_git_commit() { return MESHGRAD_GIT_COMMIT; }

}  // namespace meshgrad::tools
