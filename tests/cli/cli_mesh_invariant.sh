#!/usr/bin/env bash
# Mesh-invariant training through `meshgrad train` (docs/mesh-invariance.md): the same global batch
# gives the same bits on every mesh (losses, gradient norms, saved parameters); a checkpoint written
# on one mesh resumes on others and continues bitwise the run that never stopped (elastic resume:
# fewer ranks, more ranks, a pipeline); `check --mesh-invariant` passes bitwise; degrees that cannot
# keep the tree are refused naming the ones that can.
# Usage: cli_mesh_invariant.sh path/to/meshgrad scratch-dir [mpirun command...]
#   with an mpirun command: dp=2,tp=2 under `--backend mpi` (4 processes) gives the threads run's bits.
set -euo pipefail
M=$1
W=$2
shift 2
MPIRUN=("$@")
rm -rf "$W"
mkdir -p "$W"
cd "$W"
failures=0
fail() {
  echo "FAIL $*"
  failures=$((failures + 1))
}
# --decay-steps fixes the schedule, so a run of 10 steps and one of 20 take the same learning rates.
model=(--layers 2 --hidden 32 --heads 4 --seq 16 --batch 8 --grad-clip 0.5 --dropout 0.1 --decay-steps 20
       --mesh-invariant)

ranks_of() {
  python3 -c "import sys,math; print(math.prod(int(x) for a in sys.argv[1].split(',') for x in a.split('=')[1].split('x')))" "$1"
}
# run NAME MESH [FLAGS...]: train on rank threads, or under mpirun when MPIRUN is set.
run() {
  local name=$1 mesh=$2
  shift 2
  if [ ${#MPIRUN[@]} -gt 0 ]; then
    "${MPIRUN[@]}" -np "$(ranks_of "$mesh")" "$M" train --backend mpi --mesh "$mesh" "${model[@]}" "$@" \
      --metrics "$name.jsonl" --save "$name.safetensors" >"$name.out" 2>&1 || fail "$name: $(tail -c 600 "$name.out")"
  else
    "$M" train --mesh "$mesh" "${model[@]}" "$@" --metrics "$name.jsonl" --save "$name.safetensors" >"$name.out" 2>&1 ||
      fail "$name: $(tail -c 600 "$name.out")"
  fi
}
# same A B [FIRST]: the saved parameters are the same bytes; the losses and gradient norms of A's steps
# from FIRST on (1-based) are B's, bit for bit (json floats round-trip exactly).
same() {
  cmp -s "$1.safetensors" "$2.safetensors" || fail "$1 and $2 saved different parameters"
  python3 - "$1.jsonl" "$2.jsonl" "${3:-1}" <<'PY' || fail "$1 and $2: different losses or norms"
import json, sys
def steps(p):
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, open(p)) if "loss" in r}
a, b, first = steps(sys.argv[1]), steps(sys.argv[2]), int(sys.argv[3])
tail = {s: v for s, v in a.items() if s >= first}
sys.exit(0 if tail and all(b.get(s) == v for s, v in tail.items()) else 1)
PY
}

if [ ${#MPIRUN[@]} -gt 0 ]; then
  saved=("${MPIRUN[@]}")
  MPIRUN=()
  run one tp=1 --steps 20
  MPIRUN=("${saved[@]}")
  run mpi dp=2,tp=2 --steps 20
  same one mpi
  [ "$failures" -eq 0 ] && echo "ok   mesh-invariant: dp=2,tp=2 under mpi is the single rank's bits"
  exit "$failures"
fi

run one tp=1 --steps 20
run dp4 dp=4 --steps 20
run fsdp2tp2 fsdp=2,tp=2 --steps 20 --sequence-parallel --overlap
run pp2dp2 pp=2,dp=2 --steps 20
run grid tp=2x2 --steps 20
same one dp4
same one grid
same one fsdp2tp2
same one pp2dp2
# The normal mode is not invariant: the same pair differs (so the comparisons above can fail).
"$M" train --mesh dp=2 --layers 2 --hidden 32 --heads 4 --seq 16 --batch 8 --steps 20 --dropout 0.1 \
  --save normal_dp2.safetensors --no-metrics >normal.out 2>&1 || fail "normal dp=2: $(tail -c 600 normal.out)"
"$M" train --mesh tp=1 --layers 2 --hidden 32 --heads 4 --seq 16 --batch 8 --steps 20 --dropout 0.1 \
  --save normal_one.safetensors --no-metrics >normal.out 2>&1 || fail "normal tp=1: $(tail -c 600 normal.out)"
cmp -s normal_dp2.safetensors normal_one.safetensors && fail "the normal mode gave the same bits at dp=2 and tp=1"

# Elastic resume: 10 steps on dp=2,tp=2 (4 ranks), then on to 20 on fsdp=2 (lost two ranks), on
# pp=2,tp=2 (a pipeline), on one rank, on dp=4, on a 1 x 2 grid; each continues bitwise the run that
# never stopped.
run first dp=2,tp=2 --steps 10 --checkpoint-dir ck --save-every 10
for target in fsdp=2 pp=2,tp=2 tp=1 dp=4 tp=1x2; do
  name=resumed_$(echo "$target" | tr '=,' '__')
  "$M" train --resume ck/step_00000010 --mesh "$target" --steps 20 --checkpoint-dir "ck_$name" --metrics "$name.jsonl" \
    --save "$name.safetensors" >"$name.out" 2>&1 || fail "resume on $target: $(tail -c 600 "$name.out")"
  same one "$name" 11
done

# check against one rank, bitwise.
"$M" check --mesh dp=2,tp=2 --mesh-invariant --sequence-parallel --steps 3 >check.out 2>&1 ||
  fail "check on dp=2,tp=2: $(tail -c 600 check.out)"
grep -qF "PASS: mesh-invariant: losses, gradients and weights are bitwise those of the single rank" check.out ||
  fail "check: no bitwise PASS: $(tail -c 600 check.out)"
"$M" check --mesh fsdp=2 --mesh-invariant --batch-blocks 8 --batch 8 --steps 3 >check2.out 2>&1 ||
  fail "check on fsdp=2 with 8 blocks: $(tail -c 600 check2.out)"

# Refusals before step 1, naming what can work.
refused() {
  local expect=$1
  shift
  if "$M" "$@" >refused.out 2>&1; then
    fail "accepted: $*"
  elif ! grep -qF -- "$expect" refused.out; then
    fail "$*: the refusal does not say '$expect': $(tail -c 600 refused.out)"
  fi
}
refused "meshes whose dp x fsdp x ep is 1, 2, 4 keep the tree" train --mesh dp=8 --mesh-invariant --steps 1 --no-metrics
refused "--batch-blocks 3 must be a power of two" train --mesh-invariant --batch-blocks 3 --steps 1 --no-metrics
refused "the global batch of 6 rows must cut into --batch-blocks 4" train --mesh-invariant --batch 6 --steps 1 --no-metrics
refused "Degrees that work for this model: tp = 1, 2, 4" train --mesh tp=3 --mesh-invariant --steps 1 --no-metrics
refused "dp x fsdp x ep = 8 ranks" check --mesh dp=8 --mesh-invariant --batch 8
refused "the grid's 6 ranks split the vocabulary (256 tokens), which cannot keep the fixed tree of 4 blocks: grids whose R x C is 1, 2, 4 work" \
  train --mesh tp=3x2 --mesh-invariant --steps 1 --no-metrics

[ "$failures" -eq 0 ] && echo "ok   mesh-invariant: the same bits on every mesh, elastic resume, check, refusals"
exit "$failures"
