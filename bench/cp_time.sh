#!/usr/bin/env bash
# Step time at long sequences, cp = 2 against cp = 1 on the same cores (docs/BENCHMARKS.md, "Context
# parallelism"): a GPT of 6 x 384 (6 heads, byte vocabulary), batch 1, T = 4096 and 8192, one rank
# with every core's BLAS threads against cp = 2 ranks sharing them, with the ring (the default) and
# with --cp-schedule all-gather; --trace on each cp=2 run for the communication's share and how much
# of it was hidden under compute (meshgrad trace summary).
# The data: the bytes of the repository's docs (the built-in corpus is shorter than one window).
# usage: bench/cp_time.sh MESHGRAD OUT_DIR [STEPS] [SEQS]
set -euo pipefail
mg=$(realpath "$1") out=$2 steps=${3:-4} seqs=${4:-"4096 8192"}
mkdir -p "$out"
export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-Haswell}
cat "$(dirname "$0")"/../docs/*.md > "$out/docs.txt"
model=(--layers 6 --hidden 384 --heads 6 --batch 1 --steps "$steps" --eval-every 0 --sample-every 0 --data "$out/docs.txt")
for seq in $seqs; do
  for run in tp=1 ring gather; do
    args=(--mesh cp=2 --trace "$out/t_${run}_${seq}.json")
    [ "$run" = tp=1 ] && args=(--mesh tp=1)
    [ "$run" = gather ] && args+=(--cp-schedule all-gather)
    "$mg" train "${args[@]}" "${model[@]}" --seq "$seq" --positions "$seq" --metrics "$out/m_${run}_${seq}.jsonl" \
      > "$out/log_${run}_${seq}.txt" 2>&1 || { cat "$out/log_${run}_${seq}.txt"; exit 1; }
    [ "$run" = tp=1 ] || "$mg" trace summary "$out/t_${run}_${seq}.json" > "$out/summary_${run}_${seq}.txt"
  done
done
python3 - "$out" "$seqs" <<'PY'
import json, statistics, sys
out, seqs = sys.argv[1], [int(s) for s in sys.argv[2].split()]
def ms(run, seq):
    lines = [json.loads(l) for l in open(f"{out}/m_{run}_{seq}.jsonl") if '"step"' in l]
    return statistics.median(l["ms_per_step"] for l in lines[1:])
def comm(run, seq):
    ranks = []
    for line in open(f"{out}/summary_{run}_{seq}.txt"):
        f = line.split()
        if len(f) > 10 and f[0] == "rank" and f[1].isdigit():
            ranks.append(f"r{f[1]} {float(f[5]):.0f}, {float(f[8]):.0f}, {f[10]}")
    return "; ".join(ranks)
print(f"{'T':>6} {'schedule':>10} {'cp=1 ms':>9} {'cp=2 ms':>9} {'cp=2/cp=1':>9} | cp=2 per rank: comm ms, exposed ms, hidden %")
for seq in seqs:
    one = ms("tp=1", seq)
    for run, name in (("ring", "ring"), ("gather", "all-gather")):
        print(f"{seq:>6} {name:>10} {one:>9.0f} {ms(run, seq):>9.0f} {ms(run, seq) / one:>9.2f} | {comm(run, seq)}")
PY
