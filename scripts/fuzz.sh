#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/, clang, ASan+UBSan) in build-fuzz and runs each one for a
# fixed number of executions from its seed corpus fuzz/corpus/<name>/. Any crash, sanitizer report,
# unexpected exception type or unbounded error message fails the script. New inputs that libFuzzer
# finds go to a scratch directory, never into the repository's corpus.
#   scripts/fuzz.sh [RUNS]          RUNS per target, default 20000 (well under a minute each)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-20000}
CXX=${FUZZ_CXX:-clang++} CC=${FUZZ_CC:-clang} cmake -S . -B build-fuzz -DMESHGRAD_FUZZ=ON -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g" ${FUZZ_LAUNCHER:-} >/dev/null
cmake --build build-fuzz -j "${JOBS:-$(nproc)}" --target meshgrad_fuzz
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for corpus in fuzz/corpus/*/; do
  name=$(basename "$corpus")
  mkdir -p "$scratch/$name"
  echo "fuzz: $name, $runs runs"
  # -seed fixed: the same executions every CI run; -rss_limit_mb: a reader may not balloon.
  build-fuzz/fuzz/fuzz_"$name" -runs="$runs" -seed=1 -rss_limit_mb=2048 -timeout=10 \
    -artifact_prefix="$scratch/" "$scratch/$name" "$corpus" 2>"$scratch/$name.log" || {
    tail -40 "$scratch/$name.log"
    echo "fuzz: $name FAILED (crash input under $scratch is printed above; rerun: build-fuzz/fuzz/fuzz_$name FILE)"
    trap - EXIT
    exit 1
  }
  tail -1 "$scratch/$name.log"
done
