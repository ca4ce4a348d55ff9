#!/usr/bin/env bash
# Pipeline parallelism end to end through `meshgrad train` (docs/training.md, "Pipeline
# parallelism"): pp=2 and pp=4 with --micro-batches M report bitwise the losses and gradient norms of
# one rank with --grad-accum M, in both schedules, and save its parameters' bytes; pp=2,tp=2 those of
# tp=2; checkpoints written per stage resume bitwise on other meshes (pp=2 -> one rank, pp=2 with
# --pp-layers -> pp=4, tp=2 -> pp=2,tp=2); the trace shows every stage's forwards, backwards, sends and
# receives; bad combinations are refused before step 1, naming them.
# Usage: cli_pipeline.sh path/to/meshgrad scratch-dir [mpirun command...]
#   with an mpirun command: pp=2,tp=2 and pp=2,dp=2 under `--backend mpi` (4 processes), bitwise
#   against the threads runs, and a stage killed (SIGKILL) under `mpirun --enable-recovery`: the
#   surviving stage stops with meshgrad's deadline error naming its rank, the operation and the group.
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
model=(--layers 4 --hidden 32 --heads 4 --seq 16 --batch 8 --steps 8 --grad-clip 0.5 --dropout 0.1)

# run NAME MESH [FLAGS...]: train on rank threads (or under mpirun when MPIRUN is set), keep metrics.
run() {
  local name=$1 mesh=$2
  shift 2
  local ranks
  ranks=$(python3 -c "import sys,math; print(math.prod(int(x) for a in sys.argv[1].split(',') for x in a.split('=')[1].split('x')))" "$mesh")
  if [ ${#MPIRUN[@]} -gt 0 ]; then
    "${MPIRUN[@]}" -np "$ranks" "$M" train --backend mpi --mesh "$mesh" "${model[@]}" "$@" --metrics "$name.jsonl" \
      --save "$name.safetensors" >"$name.out" 2>&1 || fail "$name: $(tail -c 600 "$name.out")"
  else
    "$M" train --mesh "$mesh" "${model[@]}" "$@" --metrics "$name.jsonl" --save "$name.safetensors" >"$name.out" 2>&1 ||
      fail "$name: $(tail -c 600 "$name.out")"
  fi
}
# same A B: the losses and gradient norms of every step and the saved parameters are the same bits
# (and the run moved).
same() {
  cmp -s "$1.safetensors" "$2.safetensors" || fail "$1 and $2 saved different parameters"
  python3 - "$1.jsonl" "$2.jsonl" <<'PY' || fail "$1 and $2: different losses or norms"
import json, sys
def steps(p):
    return [(r["loss"], r["grad_norm"]) for r in map(json.loads, open(p)) if "loss" in r]
a, b = steps(sys.argv[1]), steps(sys.argv[2])
sys.exit(0 if a == b and len(a) == 8 and a[-1][0] < a[0][0] else 1)
PY
}

MPIRUN=()
backends="threads"
run one4 tp=1 --grad-accum 4
run pp2 pp=2 --micro-batches 4
run pp2gpipe pp=2 --micro-batches 4 --pp-schedule gpipe --pp-layers 3,1
run pp4 pp=4 --micro-batches 4
run tp2 tp=2 --grad-accum 2 --sequence-parallel --overlap
run pp2tp2 pp=2,tp=2 --micro-batches 2 --sequence-parallel --overlap
run dp2 dp=2 --grad-accum 2
run pp2dp2 pp=2,dp=2 --micro-batches 2
same one4 pp2
# The metrics header records the pipeline's options.
python3 - pp2gpipe.jsonl <<'PY' || fail "the metrics header lacks the pipeline's options"
import json, sys
header = json.loads(open(sys.argv[1]).readline())
config = header["config"]
sys.exit(0 if header["mesh"] == "pp=2,tp=1" and config["pp-schedule"] == "gpipe" and config["pp-layers"] == [3, 1]
         else 1)
PY
same one4 pp2gpipe
same one4 pp4
same tp2 pp2tp2
same dp2 pp2dp2
# Sharded data parallelism on every stage.
run fsdp2 fsdp=2 --grad-accum 2
run pp2fsdp2 pp=2,fsdp=2 --micro-batches 2
same fsdp2 pp2fsdp2
# TP-invariant: the bits of one rank whatever the tp and pp.
run inv_one tp=1 --grad-accum 4 --tp-invariant
run inv_pp2tp2 pp=2,tp=2 --micro-batches 4 --tp-invariant --sequence-parallel
same inv_one inv_pp2tp2

if [ $# -gt 0 ]; then
  MPIRUN=("$@")
  run mpi_pp2tp2 pp=2,tp=2 --micro-batches 2 --sequence-parallel --overlap
  run mpi_pp2dp2 pp=2,dp=2 --micro-batches 2
  same tp2 mpi_pp2tp2
  same dp2 mpi_pp2dp2
  # A stage killed mid-run: the other stage's receive or send fails at the deadline, naming them.
  MESHGRAD_COMM_TIMEOUT_MS=3000 "$@" --enable-recovery -x MESHGRAD_COMM_TIMEOUT_MS -np 2 "$M" train --backend mpi \
    --mesh pp=2 --layers 2 --hidden 32 --heads 4 --seq 16 --batch 4 --steps 100000 --metrics killed.jsonl \
    >killed.out 2>&1 &
  job=$!
  for _ in $(seq 1 200); do
    [ -s killed.jsonl ] && [ "$(grep -c '"loss"' killed.jsonl || true)" -ge 2 ] && break
    sleep 0.1
  done
  victim=""
  for pid in $(pgrep -f "meshgrad train --backend mpi --mesh pp=2 --layers 2" || true); do
    if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=1"; then victim=$pid; fi
  done
  if [ -z "$victim" ]; then
    fail "killed stage: no rank-1 process found"
    kill "$job" 2>/dev/null || true
  else
    t0=$(date +%s)
    kill -9 "$victim"
    rc=0
    wait "$job" || rc=$?
    elapsed=$(($(date +%s) - t0))
    # (mpirun --enable-recovery may exit 0 after the survivor's abort: the message is the verdict.)
    echo "killed stage: mpirun exited $rc after ${elapsed}s" >killed.verdict
    [ "$elapsed" -le 15 ] || fail "killed stage: the survivor took ${elapsed}s (deadline 3 s)"
    # The survivor waits in a receive from the dead stage (then it names it: "missing rank: 1") or
    # in a collective over pp (the gradient norm's; MPI cannot tell who is missing there).
    grep -qE "error on rank 0 of 2: mpi: [a-z_]+ seq [0-9]+ on rank 0 of 2 of group pp: deadline passed" killed.out ||
      fail "killed stage: the survivor's error does not name the operation and the missing rank: $(tail -c 800 killed.out)"
    ! grep -q '"step": *100000' killed.jsonl || fail "killed stage: the run finished"
  fi
  MPIRUN=()
  backends="threads and mpi"
fi

# Checkpoints: every stage writes its own tensors into one checkpoint, which resumes on any mesh.
resumed() {   # resumed NAME CHECKPOINT REFERENCE [FLAGS...]: resume, save, compare with REFERENCE's save
  local name=$1 ck=$2 ref=$3
  shift 3
  "$M" train --resume "$ck" "$@" --save "$name.safetensors" --no-metrics >"$name.out" 2>&1 ||
    fail "$name: $(tail -c 600 "$name.out")"
  cmp -s "$name.safetensors" "$ref.safetensors" || fail "$name: the resumed run's parameters differ from $ref's"
}
"$M" train --mesh pp=2 "${model[@]}" --micro-batches 4 --pp-layers 3,1 --checkpoint-dir ck --save-every 4 \
  --no-metrics >ck.out 2>&1 || fail "pp=2 checkpoints: $(tail -c 600 ck.out)"
"$M" checkpoint verify ck/step_00000004 >verify.out 2>&1 || fail "pp=2 checkpoint verify: $(cat verify.out)"
resumed pp2_on_one ck/step_00000004 one4 --mesh tp=1
resumed pp2_on_pp2 ck/step_00000004 one4
resumed pp2_on_pp4 ck/step_00000004 one4 --mesh pp=4
"$M" train --mesh tp=2 "${model[@]}" --grad-accum 2 --sequence-parallel --overlap --checkpoint-dir ck_tp --save-every 4 \
  --no-metrics >ck_tp.out 2>&1 || fail "tp=2 checkpoints: $(tail -c 600 ck_tp.out)"
resumed tp2_on_pp2tp2 ck_tp/step_00000004 tp2 --mesh pp=2,tp=2
# --init-from: each stage loads its own parameters from a Hugging Face directory (exported here).
"$M" export --checkpoint ck/step_00000008 --out hf >export.out 2>&1 || fail "export of a pp checkpoint: $(tail -c 400 export.out)"
# Both on one core, so each rank has one BLAS thread: OpenBLAS's Haswell sgemm kernels (what
# OPENBLAS_CORETYPE=Haswell forces, e.g. on a Zen 5 it does not know) add some of this model's
# products in another order with 2 threads than with 1, and the bits compared here would then
# differ by the BLAS thread count of the one-rank run, not by anything meshgrad does.
taskset -c 0 "$M" train --init-from hf --mesh tp=1 --steps 3 --seq 16 --batch 8 --grad-accum 2 --save init_one.safetensors \
  --no-metrics >init_one.out 2>&1 || fail "init-from on one rank: $(tail -c 400 init_one.out)"
taskset -c 0 "$M" train --init-from hf --mesh pp=2 --steps 3 --seq 16 --batch 8 --micro-batches 2 --save init_pp.safetensors \
  --no-metrics >init_pp.out 2>&1 || fail "init-from on pp=2: $(tail -c 400 init_pp.out)"
cmp -s init_one.safetensors init_pp.safetensors || fail "--init-from on pp=2 trained other parameters than on one rank"
# A pipeline's checkpoint samples on a mesh without pp; sampling on a pp mesh is refused, naming it.
"$M" sample --checkpoint ck/step_00000008 --mesh tp=1 --prompt "a" --tokens 4 --temperature 0 >sample.out 2>&1 ||
  fail "sample from a pp checkpoint: $(tail -c 400 sample.out)"
if "$M" sample --checkpoint ck/step_00000008 --mesh pp=2 --prompt "a" --tokens 4 >sample_pp.out 2>&1; then
  fail "sample accepted a pp mesh"
fi
grep -qF "sample: the mesh pp=2,tp=1 is a pipeline" sample_pp.out || fail "sample on pp=2: $(tail -c 400 sample_pp.out)"

# The trace shows each stage's micro-batch forwards and backwards and the sends and receives.
"$M" train --mesh pp=2 --layers 2 --hidden 32 --heads 4 --seq 16 --batch 4 --micro-batches 2 --steps 1 --no-metrics \
  --trace t.json >t.out 2>&1 || fail "trace: $(tail -c 600 t.out)"
python3 - t.json <<'PY' || fail "the pipeline trace lacks a stage's forwards, backwards, sends or receives"
import json, sys
d = json.load(open(sys.argv[1]))
events = d["traceEvents"] if isinstance(d, dict) else d
seen = {(e.get("name"), e.get("cat")) for e in events}
need = {("forward 0", "pipeline_forward"), ("forward 1", "pipeline_forward"), ("backward 0", "pipeline_backward"),
        ("backward 1", "pipeline_backward"), ("send", "p2p"), ("recv", "p2p")}
sys.exit(0 if need <= seen else 1)
PY

# Refusals, before step 1, naming what is wrong.
refused() {
  local needle=$1
  shift
  if "$M" train "$@" >r.out 2>&1; then fail "accepted: $*"; return 0; fi
  grep -qF -- "$needle" r.out || fail "'$*' refused without '$needle': $(tail -c 400 r.out)"
  if grep -q "^step " r.out; then fail "'$*' ran a step before refusing"; fi
  return 0
}
refused "a pipeline of 3 stages needs at least 3 transformer blocks, and the model has 2" --mesh pp=3 --layers 2 --steps 1
refused "each data-parallel replica's 8 rows of --batch 8 must divide into 3 micro-batches" --mesh pp=2 --batch 8 \
  --micro-batches 3 --steps 1
refused "--pp-layers 1,2: the counts add up to 3 blocks, and the model has 4" --mesh pp=2 --layers 4 --pp-layers 1,2 \
  --steps 1
refused "--pp-layers 2,2 needs a pipeline" --mesh tp=2 --pp-layers 2,2 --steps 1
refused "--pp-schedule gpipe needs a pipeline" --mesh tp=1 --pp-schedule gpipe --steps 1
refused "unknown axis 'PP' (did you mean 'pp'?)" --mesh PP=2 --steps 1
# check: a pipeline with tp-invariance against one rank, bitwise (the PASS line says so).
"$M" check --mesh pp=2,tp=2 --micro-batches 2 --tp-invariant --sequence-parallel >check.out 2>&1 ||
  fail "check on pp=2,tp=2: $(tail -c 600 check.out)"
grep -qF "PASS: tp-invariant: losses, gradients and weights are bitwise those of the single rank" check.out ||
  fail "check on pp=2,tp=2: no bitwise PASS: $(tail -c 600 check.out)"
"$M" check --mesh pp=2 --micro-batches 2 --steps 3 >check2.out 2>&1 || fail "check on pp=2: $(tail -c 600 check2.out)"
# explain counts every stage's sends and receives and prints the schedule's bubble.
"$M" explain --mesh pp=2,tp=2 --layers 2 --batch 4 --micro-batches 4 --pp-schedule gpipe >explain.out 2>&1 ||
  fail "explain on pp=2,tp=2: $(tail -c 600 explain.out)"
grep -qF "pipeline: 2 stages, schedule gpipe, 4 micro-batches; bubble (p-1)/(m+p-1) = 0.200" explain.out ||
  fail "explain on pp=2,tp=2 prints no bubble: $(tail -c 600 explain.out)"
grep -qE "^ +1 +1\.\.1 +4 " explain.out || fail "explain: stage 1's row (blocks 1..1, 4 in flight under gpipe) is missing"

[ "$failures" -eq 0 ] && echo "ok   pipeline: bitwise as gradient accumulation ($backends), checkpoints across meshes, trace, refusals"
exit "$failures"
