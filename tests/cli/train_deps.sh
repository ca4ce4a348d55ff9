#!/usr/bin/env bash
# `make train` installs and configures only what building and training need (issue 25: a fresh
# machine reaches the first step within minutes, not after the tests' 170 packages):
# 1) scripts/install-deps.sh's train set holds the build packages and none of the test-only ones,
#    the test set every train package and the tests' own but not clang (only `make fuzz` needs it),
#    and the all set every test package and clang;
# 2) CMake configured as `make build-program` does (tests, benchmarks, Python module off) does not
#    look for GoogleTest, Google Benchmark, Python or pybind11, so their absence cannot stop it.
# Usage: train_deps.sh SOURCE_DIR WORK_DIR
set -euo pipefail
src=$1
work=$2
fail() { echo "train_deps: $*" >&2; exit 1; }
rm -rf "$work"
mkdir -p "$work"

train=$("$src/scripts/install-deps.sh" train --list)
test_set=$("$src/scripts/install-deps.sh" test --list)
all=$("$src/scripts/install-deps.sh" all --list)
for needed in build-essential cmake libopenblas-dev libcli11-dev libfmt-dev nlohmann-json3-dev libpcre2-dev \
              libssl-dev libxxhash-dev libopenmpi-dev; do
  grep -qx "$needed" <<<"$train" || fail "the train set lacks $needed (building the program needs it)"
done
for test_only in googletest libgtest-dev libbenchmark-dev python3-torch clang pybind11-dev python3-pytest nodejs npm; do
  if grep -qx "$test_only" <<<"$train"; then fail "the train set installs $test_only, which only the tests use"; fi
done
while read -r p; do
  grep -qx "$p" <<<"$test_set" || fail "the test set lacks the train package $p"
done <<<"$train"
while read -r p; do
  grep -qx "$p" <<<"$all" || fail "the all set lacks the test package $p"
done <<<"$test_set"
for needed in googletest python3-torch pybind11-dev ccache time; do
  grep -qx "$needed" <<<"$test_set" || fail "the test set lacks $needed (make test needs it)"
done
for fuzz_only in clang libclang-rt-14-dev; do
  if grep -qx "$fuzz_only" <<<"$test_set"; then fail "the test set installs $fuzz_only, which only make fuzz uses"; fi
  grep -qx "$fuzz_only" <<<"$all" || fail "the all set lacks $fuzz_only (make fuzz needs it)"
done

# The same flags as the Makefile's build-program target (read from it, so the two cannot drift).
flags=$(sed -n '/^build-program:/,/^$/p' "$src/Makefile" | grep -o -- '-DMESHGRAD_[A-Z_]*=OFF' | tr '\n' ' ')
for f in -DMESHGRAD_BUILD_TESTS=OFF -DMESHGRAD_BUILD_BENCH=OFF -DMESHGRAD_PYTHON=OFF; do
  grep -q -- "$f" <<<"$flags" || fail "the Makefile's build-program target does not pass $f (found: $flags)"
done
# shellcheck disable=SC2086
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release $flags > "$work/configure.log" 2>&1 ||
  { cat "$work/configure.log"; fail "configure with $flags failed"; }
for looked_up in GTest_DIR benchmark_DIR pybind11_DIR Python3_EXECUTABLE; do
  if grep -q "^$looked_up:" "$work/build/CMakeCache.txt"; then
    fail "configure with $flags still looks for $looked_up: a machine without the tests' packages would depend on it"
  fi
done
grep -q '^meshgrad_cli' <(cmake --build "$work/build" --target help | sed 's/^\.\.\. //') ||
  fail "the program's target meshgrad_cli is missing from the configured build"
echo "train_deps: ok (train set: $(wc -l <<<"$train") packages, test set: $(wc -l <<<"$test_set"), all set: $(wc -l <<<"$all"))"
