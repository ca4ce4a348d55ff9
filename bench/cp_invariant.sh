#!/usr/bin/env bash
# What --mesh-invariant's sequence blocks cost (docs/BENCHMARKS.md, "Context parallelism",
# docs/mesh-invariance.md, "cp: sequence blocks"): a GPT of 6 x 384 (6 heads, byte vocabulary),
# batch 2 in 2 row blocks, T = 1024, median ms per step (the first step dropped) of
#   one rank:  the normal mode, --mesh-invariant, and --mesh-invariant --sequence-blocks 4;
#   cp = 2:    the normal mode and --mesh-invariant --sequence-blocks 4,
# the configurations interleaved round by round so that a drift of the machine's speed falls on all.
# The data: the bytes of the repository's docs.
# usage: bench/cp_invariant.sh MESHGRAD OUT_DIR [ROUNDS] [STEPS] [SEQ]
set -euo pipefail
mg=$(realpath "$1") out=$2 rounds=${3:-3} steps=${4:-5} seq=${5:-1024}
mkdir -p "$out"
export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-Haswell}
cat "$(dirname "$0")"/../docs/*.md > "$out/docs.txt"
model=(--layers 6 --hidden 384 --heads 6 --batch 2 --batch-blocks 2 --seq "$seq" --positions "$seq" --steps "$steps"
       --eval-every 0 --sample-every 0 --data "$out/docs.txt")
declare -A runs=(
  [one_normal]="--mesh tp=1"
  [one_invariant]="--mesh tp=1 --mesh-invariant"
  [one_blocks4]="--mesh tp=1 --mesh-invariant --sequence-blocks 4"
  [cp2_normal]="--mesh cp=2"
  [cp2_blocks4]="--mesh cp=2 --mesh-invariant --sequence-blocks 4"
)
for round in $(seq 1 "$rounds"); do
  for name in one_normal one_invariant one_blocks4 cp2_normal cp2_blocks4; do
    # shellcheck disable=SC2086
    "$mg" train "${model[@]}" ${runs[$name]} --metrics "$out/m_${name}_${round}.jsonl" > "$out/log_${name}_${round}.txt" 2>&1 ||
      { cat "$out/log_${name}_${round}.txt"; exit 1; }
  done
done
python3 - "$out" "$rounds" <<'PY'
import glob, json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def ms(name):
    times = []
    for r in range(1, rounds + 1):
        lines = [json.loads(l) for l in open(f"{out}/m_{name}_{r}.jsonl") if '"step"' in l]
        times += [l["ms_per_step"] for l in lines[1:]]
    return statistics.median(times)
m = {n: ms(n) for n in ("one_normal", "one_invariant", "one_blocks4", "cp2_normal", "cp2_blocks4")}
print(f"{'run':<48} {'ms/step':>8} {'ratio':>20}")
print(f"{'one rank, normal mode':<48} {m['one_normal']:>8.0f}")
print(f"{'one rank, --mesh-invariant':<48} {m['one_invariant']:>8.0f} {m['one_invariant'] / m['one_normal']:>10.2f} x normal")
print(f"{'one rank, --mesh-invariant --sequence-blocks 4':<48} {m['one_blocks4']:>8.0f} {m['one_blocks4'] / m['one_invariant']:>10.2f} x invariant")
print(f"{'cp=2, normal mode':<48} {m['cp2_normal']:>8.0f}")
print(f"{'cp=2, --mesh-invariant --sequence-blocks 4':<48} {m['cp2_blocks4']:>8.0f} {m['cp2_blocks4'] / m['cp2_normal']:>10.2f} x normal")
PY
