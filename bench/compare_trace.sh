#!/bin/sh
# What `--trace` costs a training run: the same `meshgrad train` with and without --trace, run
# alternately ROUNDS times each (so both see the same neighbours), then one table of the median
# tokens/s of each and the difference, with the trace's size. These machines are noisy: read the
# spread of the rounds next to the difference.
# Usage: bench/compare_trace.sh [BUILD_DIR [ROUNDS [STEPS [train options...]]]]
#   default: tp=2 --overlap, 4 layers, width 128, seq 64, batch 16 (the train defaults), 30 steps.
set -eu
build=${1:-build}
rounds=${2:-5}
steps=${3:-30}
[ $# -gt 3 ] && shift 3 || set --
[ $# -gt 0 ] || set -- --mesh tp=2 --overlap
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

i=0
while [ "$i" -lt "$rounds" ]; do
  for variant in off on; do
    trace=""
    [ "$variant" = on ] && trace="--trace $work/t.json"
    # shellcheck disable=SC2086
    "$build/meshgrad" train --steps "$steps" --metrics '' "$@" $trace >"$work/out" 2>"$work/err" ||
      { cat "$work/err"; exit 1; }
    # "loss a -> b (...) in S s, T tokens/s, G GFLOP/s"
    sed -n 's/.* in \([0-9.]*\) s, \([0-9]*\) tokens\/s.*/\2/p' "$work/err" >>"$work/$variant"
  done
  i=$((i + 1))
done
size=$(wc -c <"$work/t.json")
spans=$(grep -c '"ph":"X"' "$work/t.json")

/usr/bin/python3 - "$work" "$size" "$spans" "$steps" "$*" <<'PY'
import statistics, sys
work, size, spans, steps, args = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
runs = {v: [float(x) for x in open(f"{work}/{v}").read().split()] for v in ("off", "on")}
off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
print(f"meshgrad train {args} --steps {steps}: {len(runs['off'])} rounds, alternating")
print("| --trace | median tokens/s | min .. max | vs off |")
print("|---|---|---|---|")
for v, m in (("off", off), ("on", on)):
    r = runs[v]
    print(f"| {v} | {m:.0f} | {min(r):.0f} .. {max(r):.0f} | {100 * (m / off - 1):+.1f}% |")
print(f"trace: {size / 1e6:.2f} MB, {spans} spans ({spans / steps:.0f} per step)")
PY
