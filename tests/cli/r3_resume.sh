#!/usr/bin/env bash
# reliability-3 (issue 37), the resume area, end to end: where a resumed run writes (N1, N78), commit
# numbers out of range (N67), errors about options taken from a checkpoint (N58, N53, N71, the
# --shard-optimizer one) and what a run aborted by a second SIGINT leaves (C30).
# Usage: r3_resume.sh path/to/meshgrad scratch-dir CASE
set -euo pipefail
M=$1
W=$2
CASE=$3
rm -rf "$W"
mkdir -p "$W"
cd "$W"
W=$(pwd -P)   # as a run records it (absolute, without links)
T=(--layers 1 --hidden 32 --heads 4 --seq 16 --batch 4)
T2=(--layers 2 --hidden 32 --heads 4 --seq 16 --batch 4)

fail() {
  echo "FAIL $CASE: $*"
  for f in err.txt; do [ -f "$f" ] && { echo "--- $f"; tail -c 1500 "$f"; }; done
  exit 1
}
# has NEEDLE: stderr of the last command holds NEEDLE (fixed string).
has() { grep -qF -- "$1" err.txt || fail "stderr lacks: $1"; }
lacks() { ! grep -qF -- "$1" err.txt || fail "stderr holds: $1"; }
# run RC COMMAND...: COMMAND exits with RC; its stderr goes to err.txt.
run() {
  local want=$1 rc=0
  shift
  "$@" >out.txt 2>err.txt || rc=$?
  [ "$rc" = "$want" ] || fail "exit status $rc, expected $want: $*"
}
steps_in() { (cd "$1" && ls -d step_* 2>/dev/null | tr '\n' ' '); }

# The original run: checkpoints of steps 2, 4, 6 with --keep 2 (4 and 6 stay), 6 metrics lines + header.
original() {
  run 0 "$M" train --steps 6 "${T[@]}" --checkpoint-dir orig --save-every 2 --keep 2 --metrics om.jsonl
  [ "$(steps_in orig)" = "step_00000004 step_00000006 " ] || fail "original run left $(steps_in orig)"
  [ "$(wc -l <om.jsonl)" = 7 ] || fail "original metrics have $(wc -l <om.jsonl) lines"
}

# The original is untouched: its checkpoints, their bytes, its metrics.
original_untouched() {
  [ "$(steps_in orig)" = "step_00000004 step_00000006 " ] || fail "the original folder now holds $(steps_in orig)"
  [ "$(wc -l <om.jsonl)" = 7 ] || fail "the original metrics file now has $(wc -l <om.jsonl) lines"
  run 0 "$M" checkpoint verify orig
}

case "$CASE" in
copy)   # N1: a resume from a copy writes into the copy, prunes only there, and not the original's metrics
  original
  cp -a orig origcopy
  run 0 "$M" train --resume origcopy --steps 12
  has "checkpoints: into origcopy (the folder resumed from) every 2 steps and at the end; --keep 2 removes all but the newest 2 checkpoints there"
  has "resuming from 'origcopy', not from the checkpoint's own folder '$W/orig': the output files recorded for the run there (--metrics $W/om.jsonl) are not written; give them again to write them"
  original_untouched
  [ "$(steps_in origcopy)" = "step_00000010 step_00000012 " ] || fail "the copy holds $(steps_in origcopy)"
  [ ! -e meshgrad-metrics.jsonl ] || fail "wrote the default metrics file"
  # The copy's own checkpoints now record the copy: the next resume from it is in place.
  run 0 "$M" train --resume origcopy --steps 14 --metrics copy.jsonl
  run 0 "$M" train --resume origcopy --steps 16
  has "checkpoints: into $W/origcopy (the folder resumed from)"
  [ "$(grep -c '"step"' copy.jsonl)" -ge 4 ] || fail "the in-place resume of the copy did not go on with its metrics"
  original_untouched
  ;;
copy_step)   # N1: --resume COPY/step_N saves into COPY as well; a copy's copy in another directory too
  original
  mkdir -p elsewhere && cp -a orig elsewhere/c
  run 0 "$M" train --resume elsewhere/c/step_00000004 --steps 8 --save-every 0
  has "checkpoints: into elsewhere/c (the folder resumed from) at the end; --keep 2"
  original_untouched
  [ "$(steps_in elsewhere/c)" = "step_00000006 step_00000008 " ] || fail "the copy holds $(steps_in elsewhere/c)"
  ;;
in_place)   # resuming in place is as before: the recorded folder and metrics file, --keep there
  original
  run 0 "$M" train --resume orig --steps 8
  [ "$(steps_in orig)" = "step_00000006 step_00000008 " ] || fail "the folder holds $(steps_in orig)"
  [ "$(wc -l <om.jsonl)" = 10 ] || fail "the metrics file has $(wc -l <om.jsonl) lines, expected 7 + header + 2"
  has "checkpoints: into $W/orig (the folder resumed from)"
  lacks "not written"
  # Another spelling of the same folder (a symbolic link) is the same folder.
  ln -s orig link
  run 0 "$M" train --resume link --steps 10
  [ "$(steps_in orig)" = "step_00000008 step_00000010 " ] || fail "the folder holds $(steps_in orig)"
  [ "$(wc -l <om.jsonl)" = 13 ] || fail "the metrics file has $(wc -l <om.jsonl) lines"
  ;;
given)   # the command line names the outputs: they are used as given, from a copy too
  original
  cp -a orig origcopy
  run 0 "$M" train --resume origcopy --steps 8 --checkpoint-dir out --metrics new.jsonl
  has "checkpoints: into out every 2 steps and at the end"
  original_untouched
  [ "$(steps_in out)" = "step_00000008 " ] || fail "--checkpoint-dir out holds $(steps_in out)"
  [ "$(steps_in origcopy)" = "step_00000004 step_00000006 " ] || fail "the copy holds $(steps_in origcopy)"
  [ "$(grep -c resumed_from new.jsonl)" = 1 ] || fail "no metrics in new.jsonl"
  ;;
no_metrics)   # --no-metrics on a resume in place writes none (it took the checkpoint's --metrics before)
  original
  run 0 "$M" train --resume orig --steps 8 --no-metrics
  [ "$(wc -l <om.jsonl)" = 7 ] || fail "--no-metrics: the metrics file has $(wc -l <om.jsonl) lines"
  lacks "metrics written to"
  ;;
readonly)   # N78: a read-only copy is refused before step 1, naming it and --checkpoint-dir
  original
  mkdir src ro && cp -a orig src/ck
  # A read-only bind mount in a mount namespace of its own (root ignores mode bits, not a ro mount).
  if ! unshare -m true 2>/dev/null; then echo "SKIP: no mount namespace"; exit 77; fi
  unshare -m bash -c "mount --bind -o ro src ro && exec \"\$0\" train --resume ro/ck --steps 8" "$M" >out.txt 2>err.txt && rc=0 || rc=$?
  [ "$rc" = 1 ] || fail "exit status $rc on a read-only folder"
  has "a resumed run writes its checkpoints into the folder it resumed from, 'ro/ck', and that folder is not writable: Read-only file system; name another folder for them with --checkpoint-dir OTHER"
  lacks "step 1"
  unshare -m bash -c "mount --bind -o ro src ro && exec \"\$0\" train --resume ro/ck --steps 8 --checkpoint-dir out" "$M" >out.txt 2>err.txt || fail "--checkpoint-dir out from a read-only folder failed"
  [ "$(steps_in out)" = "step_00000008 " ] || fail "out holds $(steps_in out)"
  original_untouched
  ;;
commit_overflow)   # N67: a commit number out of range is refused reading the manifest, naming it and the value
  run 0 "$M" train --steps 6 "${T[@]}" --checkpoint-dir K --save-every 2 --keep 3 --no-metrics
  python3 - K/step_00000006/manifest.json <<'EOF'
import json, sys
p = sys.argv[1]
m = json.load(open(p))
m["commit"] = 9223372036854775807
json.dump(m, open(p, "w"))
EOF
  run 1 "$M" train --resume K --steps 10 --save-every 2 --checkpoint-dir K
  has "K/step_00000006/manifest.json': \"commit\" = 9223372036854775807 is out of range"
  run 1 "$M" checkpoint list K
  has "\"commit\" = 9223372036854775807 is out of range"
  # The older checkpoint, named: the new ones (step 6 rewritten) number after the readable ones.
  run 0 "$M" train --resume K/step_00000004 --steps 10 --save-every 2 --checkpoint-dir K
  run 0 "$M" checkpoint list K
  grep -q 'step_00000010 .*newest' out.txt err.txt || { cat out.txt err.txt; fail "step 10 is not the newest"; }
  run 0 "$M" train --resume K --steps 12
  has "resumed from K/step_00000010"
  [ "$(steps_in K)" = "step_00000008 step_00000010 step_00000012 " ] || fail "K holds $(steps_in K)"
  ;;
grad_accum)   # N58: a pipeline's micro-batches resumed on fsdp=2: the error says where the 4 came from
  run 0 "$M" train --steps 3 "${T2[@]}" --mesh pp=2 --micro-batches 4 --checkpoint-dir c --no-metrics
  run 1 "$M" train --resume c --steps 6 --mesh fsdp=2
  has "--grad-accum 4 needs at least that many rows per dp replica"
  has "--grad-accum 4 came from the checkpoint 'c/step_00000003', not from the command line"
  has "override with --batch ..., --grad-accum ...)"
  lacks "step 1/"
  # A pipeline's message says --micro-batches: the same option, so the same note.
  run 1 "$M" train --resume c --steps 6 --batch 6
  has "--micro-batches 4 on pp=2"
  has "--grad-accum 4 came from the checkpoint 'c/step_00000003'"
  # --micro-batches is --grad-accum: given, it overrides the checkpoint's.
  run 0 "$M" train --resume c --steps 6 --mesh fsdp=2 --micro-batches 2 --no-metrics
  has "--grad-accum 4 -> 2"
  ;;
mesh_invariant)   # N53: a --mesh-invariant checkpoint on --mesh tp=3
  run 0 "$M" train --steps 2 "${T[@]}" --mesh dp=2 --mesh-invariant --checkpoint-dir c --no-metrics
  run 1 "$M" train --resume c --steps 4 --mesh tp=3
  has "cannot keep the fixed tree"
  has "--mesh-invariant true came from the checkpoint 'c/step_00000002', not from the command line"
  has "override with --mesh-invariant=false"
  ;;
mesh)   # N71: an edited manifest's mesh
  run 0 "$M" train --steps 2 "${T[@]}" --mesh tp=1 --checkpoint-dir c --no-metrics
  python3 - c/step_00000002/manifest.json <<'EOF'
import json, sys
p = sys.argv[1]
m = json.load(open(p))
m["state"]["mesh"] = "pp=5"
json.dump(m, open(p, "w"))
EOF
  run 1 "$M" train --resume c --steps 4
  has "--mesh pp=5 came from the checkpoint 'c/step_00000002', not from the command line"
  ;;
shard_optimizer)   # the first message that said so, now through the same mechanism
  run 0 "$M" train --steps 2 "${T[@]}" --mesh dp=2 --shard-optimizer --checkpoint-dir c --no-metrics
  run 1 "$M" train --resume c --steps 4 --mesh tp=2
  has "--shard-optimizer true came from the checkpoint 'c/step_00000002', not from the command line"
  has "override with --shard-optimizer=false"
  run 0 "$M" train --resume c --steps 4 --mesh tp=2 --shard-optimizer=false --no-metrics
  ;;
aborted)   # C30: what a second SIGINT leaves (the lock file, a partial temporary) does not stop the next run
  original
  mkdir orig/.step_00000008.tmp && head -c 1000 /dev/urandom >orig/.step_00000008.tmp/rank_00000.bin
  [ -e orig/.lock ] || fail "no lock file"
  run 0 "$M" train --resume orig --steps 8
  [ ! -e orig/.step_00000008.tmp ] || fail "the partial temporary is still there"
  [ "$(steps_in orig)" = "step_00000006 step_00000008 " ] || fail "the folder holds $(steps_in orig)"
  run 0 "$M" checkpoint verify orig
  ;;
*)
  fail "unknown case"
  ;;
esac
echo "PASS $CASE"
