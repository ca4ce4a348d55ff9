#!/usr/bin/env bash
# Installs a built meshgrad to a temporary prefix and uses it as an outside project would:
#   1. examples/ configured with find_package(meshgrad) (CMAKE_PREFIX_PATH=prefix), built and run;
#   2. examples/parallel_mlp.cpp compiled with `pkg-config --cflags --libs meshgrad` and run;
#   3. with --python PY: PYTHONPATH=prefix/lib/python3/dist-packages PY -c "import meshgrad; train"
#   4. prefix/bin/meshgrad runs.
# Every example exits non-zero unless its result checked out, and so does this script.
# Usage: scripts/test-install.sh [BUILD_DIR (default: build)] [--python PY]
# ctest runs it (label install) with the build's own directory and interpreter.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
build=$src/build
python=""
while [ $# -gt 0 ]; do
  case "$1" in
    --python) python=$2; shift 2 ;;
    -*) echo "test-install: unknown option '$1' (usage: $0 [BUILD_DIR] [--python PY])" >&2; exit 2 ;;
    *) build=$1; shift ;;
  esac
done
[ -f "$build/CMakeCache.txt" ] || { echo "test-install: '$build' is not a configured build directory" >&2; exit 2; }

work=$(mktemp -d /tmp/meshgrad-install.XXXXXX)
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi

echo "== install to $prefix"
cmake --install "$build" --prefix "$prefix" >/dev/null

echo "== examples with find_package(meshgrad)"
cmake -S "$src/examples" -B "$work/examples" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
      "${launcher[@]}" >/dev/null
cmake --build "$work/examples" -j2 >/dev/null
for example in parallel_mlp train_gpt train_llama dtensor_redistribute custom_model; do
  echo "-- $example"
  "$work/examples/$example"
done

echo "== parallel_mlp with pkg-config"
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
# shellcheck disable=SC2046  # pkg-config's output is a list of flags
g++ -O1 "$src/examples/parallel_mlp.cpp" -o "$work/parallel_mlp_pc" $(pkg-config --cflags --libs meshgrad) \
    -Wl,-rpath,"$prefix/lib"
"$work/parallel_mlp_pc"

if [ -n "$python" ]; then
  echo "== python module from $prefix/lib/python3/dist-packages"
  PYTHONPATH=$prefix/lib/python3/dist-packages "$python" -c "
import meshgrad
steps = meshgrad.train(mesh='tp=2', steps=3)
assert [s['step'] for s in steps] == [1, 2, 3] and all(s['loss'] > 0 for s in steps), steps
assert meshgrad.__file__.startswith('$prefix'), meshgrad.__file__
print('trained', len(steps), 'steps, loss', round(steps[-1]['loss'], 4), 'from', meshgrad.__file__)
"
fi

echo "== installed CLI"
"$prefix/bin/meshgrad" --help >/dev/null
echo "test-install: PASS"
