#!/usr/bin/env bash
# Sharded data parallelism end to end through `meshgrad train` (docs/training.md, "Sharded data
# parallelism"): fsdp=2 and dp=2 --shard-optimizer write bitwise the parameters and losses of dp=2;
# an fsdp=2,tp=2 checkpoint resumes on dp=2,tp=2 bitwise; a trace shows the fsdp gathers and
# reduce-scatters; bad combinations are refused before step 1, naming them.
# Usage: cli_fsdp.sh path/to/meshgrad scratch-dir [mpirun command...]
#   with an mpirun command: the same runs under `--backend mpi` (bitwise against the threads runs:
#   both backends add in rank order, docs/comm.md).
set -euo pipefail
M=$1
W=$2
shift 2
rm -rf "$W"
mkdir -p "$W"
cd "$W"
failures=0
fail() {
  echo "FAIL $*"
  failures=$((failures + 1))
}
model=(--layers 2 --hidden 32 --heads 4 --seq 16 --batch 6 --steps 8 --grad-clip 0.5 --dropout 0.1)

# run NAME MESH [FLAGS...]: train on rank threads (or under mpirun when given), save and keep metrics.
run() {
  local name=$1 mesh=$2
  shift 2
  local ranks
  ranks=$(python3 -c "import sys,math; print(math.prod(int(x) for a in sys.argv[1].split(',') for x in a.split('=')[1].split('x')))" "$mesh")
  if [ ${#MPIRUN[@]} -gt 0 ]; then
    "${MPIRUN[@]}" -np "$ranks" "$M" train --backend mpi --mesh "$mesh" "${model[@]}" "$@" --save "$name.safetensors" \
      --metrics "$name.jsonl" >"$name.out" 2>&1 || fail "$name: $(tail -c 600 "$name.out")"
  else
    "$M" train --mesh "$mesh" "${model[@]}" "$@" --save "$name.safetensors" --metrics "$name.jsonl" >"$name.out" 2>&1 ||
      fail "$name: $(tail -c 600 "$name.out")"
  fi
}
# same A B: the losses and gradient norms of every step and the saved parameters are the same bits.
same() {
  cmp -s "$1.safetensors" "$2.safetensors" || fail "$1 and $2 saved different parameters"
  python3 - "$1.jsonl" "$2.jsonl" <<'PY' || fail "$1 and $2: different losses or norms"
import json, sys
def steps(p):
    return [(r["loss"], r["grad_norm"]) for r in map(json.loads, open(p)) if "loss" in r]
a, b = steps(sys.argv[1]), steps(sys.argv[2])
sys.exit(0 if a == b and len(a) == 8 else 1)
PY
}

MPIRUN=()
backends="threads"
run dp2 dp=2
run fsdp2 fsdp=2
run zero2 dp=2 --shard-optimizer
run dp2tp2 dp=2,tp=2 --sequence-parallel
run fsdp2tp2 fsdp=2,tp=2 --sequence-parallel
same dp2 fsdp2
same dp2 zero2
same dp2tp2 fsdp2tp2

if [ $# -gt 0 ]; then
  MPIRUN=("$@")
  run mpi_fsdp2 fsdp=2
  run mpi_fsdp2tp2 fsdp=2,tp=2 --sequence-parallel
  same dp2 mpi_fsdp2
  same dp2tp2 mpi_fsdp2tp2
  MPIRUN=()
  backends="threads and mpi"
fi

# A sharded checkpoint (fsdp=2,tp=2, step 4 of 8) resumed on dp=2,tp=2 continues bitwise.
"$M" train --mesh fsdp=2,tp=2 "${model[@]}" --sequence-parallel --checkpoint-dir ck --save-every 4 --no-metrics \
  >ck.out 2>&1 || fail "checkpointed run: $(tail -c 600 ck.out)"
"$M" train --resume ck/step_00000004 --mesh dp=2,tp=2 --save resumed.safetensors --metrics resumed.jsonl \
  >resumed.out 2>&1 || fail "resume on dp=2,tp=2: $(tail -c 600 resumed.out)"
cmp -s resumed.safetensors dp2tp2.safetensors || fail "fsdp=2,tp=2 -> dp=2,tp=2 resume is not bitwise"

# The trace shows each block's parameter gathers and gradient reduce-scatters on the fsdp axis.
"$M" train --mesh fsdp=2 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --steps 1 --no-metrics --trace t.json \
  >t.out 2>&1 || fail "trace: $(tail -c 600 t.out)"
"$M" trace summary t.json >summary.txt 2>&1 || fail "trace summary: $(cat summary.txt)"
for needle in "fsdp:h.0" "fsdp_gather" "fsdp_reduce" "reduce_scatter"; do
  grep -qF -- "$needle" t.json || fail "no '$needle' in the fsdp trace"
done

# Refusals, before step 1, naming what is wrong.
refused() {
  local needle=$1
  shift
  if "$M" train "$@" >r.out 2>&1; then fail "accepted: $*"; return 0; fi
  grep -qF -- "$needle" r.out || fail "'$*' refused without '$needle': $(tail -c 400 r.out)"
  if grep -q "^step " r.out; then fail "'$*' ran a step before refusing"; fi
  return 0
}
refused "--shard-optimizer shards the optimizer state over the dp axis" --mesh tp=2 --shard-optimizer --steps 1
refused "fsdp shards the optimizer state already" --mesh dp=2,fsdp=2 --shard-optimizer --steps 1
refused "unknown axis 'FSDP' (did you mean 'fsdp'?)" --mesh FSDP=2 --steps 1
# The TP-invariant tree with micro-batches: fsdp adds them in the tree before its reduce-scatter, as dp
# does before its all-reduce (refused before 2026-11-27). Batch 8: 2 replicas x 2 micro-batches of 2 rows.
model=(--layers 2 --hidden 32 --heads 4 --seq 16 --batch 8 --steps 8 --grad-clip 0.5 --dropout 0.1)
run dp2tree dp=2 --tp-invariant --grad-accum 2
run fsdp2tree fsdp=2 --tp-invariant --grad-accum 2
same dp2tree fsdp2tree

[ "$failures" -eq 0 ] && echo "ok   fsdp: bitwise as dp ($backends), checkpoint, trace, refusals"
exit "$failures"
