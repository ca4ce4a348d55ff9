#!/bin/sh
# Sharded data parallelism against plain dp, in one run: `meshgrad train` tokens/s on dp=2,
# dp=2 --shard-optimizer, fsdp=2 (and --no-reshard-after-forward), dp=2,tp=2 and fsdp=2,tp=2, each
# run ROUNDS times interleaved (these machines are noisy: only ratios within one run mean anything),
# the median of each, and its ratio to dp=2 (the issue's goal: fsdp=2 at most 10% slower).
# tokens/s: the steady rate over STEPS timed steps after 3 warm-ups, from the per-step metrics.
# Usage: [CONFIGS="dp=2 fsdp=2 ..."] [DATA=dir] bench/compare_fsdp.sh [BUILD_DIR [STEPS [ROUNDS [LAYERS HIDDEN HEADS SEQ BATCH]]]]
#   (a config is a mesh, with a train flag after a +: dp=2+--shard-optimizer; DATA: a `meshgrad
#   prepare` directory, e.g. GPT-2 BPE tokens for GPT-2 small's vocabulary; default: the built-in bytes)
set -eu
build=${1:-build}
steps=${2:-10}
rounds=${3:-2}
layers=${4:-6} hidden=${5:-384} heads=${6:-6} seq=${7:-256} batch=${8:-8}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
configs=${CONFIGS:-"dp=2 dp=2+--shard-optimizer fsdp=2 fsdp=2+--no-reshard-after-forward dp=2,tp=2 fsdp=2,tp=2"}
r=0
while [ "$r" -lt "$rounds" ]; do
  for c in $configs; do
    mesh=${c%%+*}
    flag=""
    case "$c" in *+*) flag=${c#*+} ;; esac
    name=$(echo "$c" | tr '+,=' '_._')
    "$build/meshgrad" train --mesh "$mesh" $flag ${DATA:+--data "$DATA"} --steps $((steps + 3)) --layers "$layers" --hidden "$hidden" \
      --heads "$heads" --seq "$seq" --batch "$batch" --metrics "$work/$name.$r.jsonl" > "$work/$name.$r.log" 2>&1 ||
      { cat "$work/$name.$r.log"; exit 1; }
  done
  r=$((r + 1))
done
/usr/bin/python3 - "$work" "$rounds" "$steps" "$layers" "$hidden" "$seq" "$batch" "$configs" <<'PY'
import json, statistics, sys
work, rounds, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
L, C, T, B = (int(a) for a in sys.argv[4:8])
configs = sys.argv[8].split()
def rate(path):
    rows = [json.loads(l) for l in open(path) if l.strip()]
    rows = [r for r in rows if "elapsed_s" in r]
    timed = rows[3:]
    seconds = timed[-1]["elapsed_s"] - rows[2]["elapsed_s"]
    return len(timed) * B * T / seconds
print(f"shape: layers {L}, hidden {C}, seq {T}, batch {B}; {steps} timed steps after 3 warm-ups, median of {rounds} interleaved runs")
print("| mesh | tokens/s (runs) | median | vs dp=2 |")
print("|---|---|---:|---:|")
base = None
for c in configs:
    name = c.replace("+", "_").replace(",", ".").replace("=", "_")
    runs = [rate(f"{work}/{name}.{r}.jsonl") for r in range(rounds)]
    med = statistics.median(runs)
    if base is None:
        base = med
    label = c.replace("+", " ")
    print(f"| {label} | {', '.join(f'{x:.0f}' for x in runs)} | {med:.0f} | {med / base:.2f} |")
PY
