#!/usr/bin/env bash
# `meshgrad export` and `meshgrad train --init-from` end to end (issue 11 part 6): the commands
# round-trip a run, refuse what disagrees naming the option, never clobber, and (with an mpirun
# given) load at tp=2 across MPI processes to the same first loss as rank threads.
# Usage: cli_hf.sh path/to/meshgrad scratch-dir [mpirun...]
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
  echo "FAIL $1"
  failures=$((failures + 1))
}

# expect_error NAME NEEDLE... -- COMMAND...: COMMAND fails (exit status 1..125) and its stderr holds
# every NEEDLE.
expect_error() {
  local name=$1
  shift
  local needles=()
  while [ "$1" != "--" ]; do needles+=("$1"); shift; done
  shift
  local rc=0
  "$@" >out.txt 2>err.txt || rc=$?
  if [ "$rc" -lt 1 ] || [ "$rc" -gt 125 ]; then
    fail "$name: exit status $rc, expected an error; stderr: $(head -c 400 err.txt)"
    return
  fi
  for n in "${needles[@]}"; do
    grep -qF -- "$n" err.txt || { fail "$name: no '$n' in: $(head -c 400 err.txt)"; return; }
  done
  echo "ok   $name"
}

# The first step's loss of a metrics file.
first_loss() { sed -n 2p "$1" | sed 's/.*"loss":\([^,}]*\).*/\1/'; }

small=(--layers 2 --hidden 32 --heads 4 --seq 16 --batch 4)
"$M" train --mesh tp=2 "${small[@]}" --steps 3 --no-metrics --save ck.safetensors 2>/dev/null
"$M" export --checkpoint ck.safetensors --out hf >export.txt 2>export.err
grep -q "wrote hf (.* parameters, float32): config.json, model.safetensors" export.txt || fail "export: $(cat export.txt)"
grep -q "no tokenizer files written: the model was trained on bytes" export.err || fail "export note: $(cat export.err)"
[ -f hf/config.json ] && [ -f hf/model.safetensors ] && echo "ok   export writes config.json and model.safetensors"
"$M" export --checkpoint ck.safetensors --out hf16 --dtype float16 >/dev/null 2>&1

# The sizes come from config.json: the same first loss at tp=1 and tp=2, from F32 and F16 (close).
"$M" train --mesh tp=1 --init-from hf --seq 16 --batch 4 --steps 1 --metrics m1.jsonl 2>train.err
grep -q "starting from 'hf': GPT-2 n_layer 2, n_embd 32, n_head 4, vocab_size 256, n_positions 16, F32 weights" train.err \
  || fail "init-from report: $(head -c 400 train.err)"
"$M" train --mesh tp=2 --init-from hf --seq 16 --batch 4 --steps 1 --metrics m2.jsonl 2>/dev/null
"$M" train --mesh tp=2 --init-from hf16 --seq 16 --batch 4 --steps 1 --metrics m16.jsonl 2>/dev/null
l1=$(first_loss m1.jsonl) l2=$(first_loss m2.jsonl) l16=$(first_loss m16.jsonl)
awk -v a="$l1" -v b="$l2" -v c="$l16" 'BEGIN { d = a - b; e = a - c; if (d < 0) d = -d; if (e < 0) e = -e;
  exit !(d < 1e-5 * a && e < 1e-2 * a && e > 0) }' \
  && echo "ok   init-from: step-1 loss $l1 (tp=1) = $l2 (tp=2); from float16 $l16" \
  || fail "init-from losses: tp=1 $l1, tp=2 $l2, float16 $l16"
"$M" train --mesh tp=2 --steps 1 "${small[@]}" --metrics mr.jsonl 2>/dev/null
[ "$(first_loss mr.jsonl)" != "$l2" ] || fail "a fresh model has the loaded model's loss"

expect_error init-layers-disagree "--layers 3 disagrees with n_layer = 2" "hf/config.json" -- \
  "$M" train --init-from hf --layers 3 --seq 16 --steps 1 --no-metrics
# The advice is one the command line takes (reliability-2 I5: it said "or 0", which --hidden refuses).
expect_error init-hidden-disagree "--hidden 64 disagrees with n_embd = 32" "(leave --hidden out to take the file's)" -- \
  "$M" train --init-from hf --hidden 64 --seq 16 --steps 1 --no-metrics
expect_error init-seq-too-long "--seq 32 exceeds n_positions = 16" -- \
  "$M" train --init-from hf --seq 32 --steps 1 --no-metrics
expect_error init-not-a-dir "--init-from 'ck.safetensors' is not a directory" -- \
  "$M" train --init-from ck.safetensors --seq 16 --steps 1 --no-metrics
mkdir cfgonly && cp hf/config.json cfgonly/
expect_error init-no-weights "has no model.safetensors" -- "$M" train --init-from cfgonly --seq 16 --steps 1 --no-metrics
# Refused before anything is written: no metrics file appears.
expect_error init-checked-first "disagrees" -- "$M" train --init-from hf --heads 2 --seq 16 --steps 1 --metrics early.jsonl
[ ! -e early.jsonl ] || fail "the metrics file was written before the refusal"

mkdir full && echo mine >full/keep.txt
expect_error export-out-not-empty "--out 'full' is a directory that is not empty" -- \
  "$M" export --checkpoint ck.safetensors --out full
[ "$(cat full/keep.txt)" = mine ] || fail "export changed a file in --out"
expect_error export-dtype "--dtype" -- "$M" export --checkpoint ck.safetensors --out x --dtype float8
# A Hugging Face directory is read (tests/cli/hf_llama.sh); a directory that is neither is refused.
mkdir notmodel
expect_error export-directory-checkpoint "is a directory but not a training checkpoint" -- "$M" export --checkpoint notmodel --out x
mkdir empty
# "new/" names the directory new (reliability-2 E3: it said "its parent 'new' is not a directory").
"$M" export --checkpoint ck.safetensors --out slash/ >/dev/null 2>export_slash.err && [ -f slash/model.safetensors ] \
  && echo "ok   export --out with a trailing slash" || fail "export --out slash/: $(head -c 300 export_slash.err)"
"$M" export --checkpoint ck.safetensors --out empty --dtype bfloat16 >/dev/null 2>&1 && [ -f empty/model.safetensors ] \
  && echo "ok   export into an empty directory" || fail "export into an empty directory"

# Across MPI processes: tp=2 from the same directory, the same first loss as rank threads.
if [ ${#MPIRUN[@]} -gt 0 ]; then
  "${MPIRUN[@]}" -np 2 "$M" train --backend mpi --mesh tp=2 --init-from hf --seq 16 --batch 4 --steps 1 \
    --metrics mm.jsonl >/dev/null 2>mpi.err || fail "mpi init-from: $(head -c 400 mpi.err)"
  lm=$(first_loss mm.jsonl)
  [ "$lm" = "$l2" ] && echo "ok   mpi init-from: step-1 loss $lm" || fail "mpi init-from loss $lm, threads $l2"
fi

ls -A | grep -q '\.tmp-' && fail "temporaries left: $(ls -A | grep '\.tmp-')"
[ "$failures" -eq 0 ] || { echo "$failures failures"; exit 1; }
echo "all passed"
