#!/bin/sh
# Runs `meshgrad bench mlp` and the PyTorch + gloo peer (bench/peers/torch_tp_mlp.py) back to
# back at tp = 1, 2 and 4 on the same shapes (tokens 1024, hidden 512, ffn 2048), REPEATS times, so
# the ratio in docs/BENCHMARKS.md comes from one run on one machine (these machines are noisy:
# compare the pairs, not single figures). Needs python3-torch for the peer.
# Usage: bench/compare_mlp.sh BUILD_DIR [REPEATS]
set -eu
build=${1:-build}
repeats=${2:-3}
peers=$(dirname "$0")/peers
for r in $(seq "$repeats"); do
  for tp in 1 2 4; do
    echo "== repeat $r, tp=$tp"
    "$build/meshgrad" bench mlp --mesh tp=$tp --steps 5 --overlap | sed -n '3,4p'
    /usr/bin/python3 "$peers/torch_tp_mlp.py" $tp 2>&1 | grep torch-gloo
  done
done
