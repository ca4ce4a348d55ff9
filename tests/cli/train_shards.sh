#!/usr/bin/env bash
# `train` on sharded data (issue 26): the data position is in the checkpoints and a resume goes on
# from it (also with another --batch, which changes how many tokens a step takes), a resume works
# from another working directory (the paths of a run are recorded absolute), and --val-data
# evaluates on another set.
#   train_shards.sh MESHGRAD GPT2_DIR WORK_DIR TEXT...
set -euo pipefail
M=$1
gpt2=$2
W=$3
shift 3
texts=()
for f in "$@"; do texts+=("$(realpath "$f")"); done
rm -rf "$W"
mkdir -p "$W/elsewhere"
cd "$W"
failures=0
fail() { echo "FAIL $*"; failures=$((failures + 1)); }
prepare() {
  local out=$1
  shift
  "$M" prepare --vocab "$gpt2/encoder.json" --merges "$gpt2/vocab.bpe" --out "$out" --quiet "$@" >/dev/null
}
# position CHECKPOINT: the saved data position's "tokens" and "shard".
position() { python3 -c '
import json, sys
p = json.load(open(sys.argv[1] + "/manifest.json"))["state"]["data"]["position"]
print(p["tokens"], p["shard"])' "$1"; }

cat "${texts[@]}" >text.txt
prepare shards --shard-tokens 20000 --chunk-bytes 4096 text.txt
[ -f shards/train_000001.bin ] || fail "prepare wrote no second shard: $(ls shards)"
small=(--layers 1 --hidden 32 --heads 4 --seq 16 --no-metrics)
"$M" train --data shards --steps 4 --batch 4 "${small[@]}" --checkpoint-dir ck 2>train.err ||
  fail "train on shards: $(tail -3 train.err)"
# 4 steps of 4 rows of 16 tokens.
[ "$(position ck/step_00000004)" = "256 train_000000.bin" ] || fail "position after step 4: '$(position ck/step_00000004)'"
# Resume from another directory, with twice the rows: 2 more steps of 8 x 16 tokens.
(cd elsewhere && "$M" train --resume ../ck --steps 6 --batch 8 "${small[@]}" 2>../resume.err) ||
  fail "resume from another directory: $(tail -3 resume.err)"
[ "$(position ck/step_00000006)" = "512 train_000000.bin" ] || fail "position after the resume: '$(position ck/step_00000006)'"
echo "ok   the data position is checkpointed and a resume (from another folder, another --batch) goes on from it"

# --val-data: the validation loss of another set differs from the data's own split; a glob of
# shards has no split of its own and says so.
printf 'zzzz qqqq %s\n' $(seq 1 3000) >other.txt
prepare other other.txt
val_loss() { python3 -c '
import json, sys
print([json.loads(l)["val_loss"] for l in open(sys.argv[1]) if "val_loss" in l][-1])' "$1"; }
"$M" train --data shards --steps 4 --batch 4 --layers 1 --hidden 32 --heads 4 --seq 16 --eval-every 2 --metrics own.jsonl \
  2>own.err
# An evaluation is its own line at its step; the progress lines never show a validation loss (which
# would read as fresh at steps that did not evaluate).
[ "$(grep -c '^step [24]: val loss [0-9.]*$' own.err)" = 2 ] || fail "no 'step 2/4: val loss' lines: $(head -c 600 own.err)"
! grep -q '^step .*|.*val' own.err || fail "a progress line shows a validation loss: $(grep '^step .*|.*val' own.err | head -2)"
"$M" train --data shards --val-data other --steps 4 --batch 4 --layers 1 --hidden 32 --heads 4 --seq 16 --eval-every 2 \
  --metrics other.jsonl 2>/dev/null
[ "$(val_loss own.jsonl)" != "$(val_loss other.jsonl)" ] || fail "--val-data other gave the own split's loss $(val_loss own.jsonl)"
if "$M" train --data 'shards/train_*.bin' --steps 1 --eval-every 1 "${small[@]}" >/dev/null 2>glob.err; then
  fail "--eval-every on a glob without --val-data was accepted"
else
  grep -qF -- "--val-data" glob.err || fail "the refusal does not name --val-data: $(head -c 300 glob.err)"
fi
echo "ok   --val-data evaluates on another set; a glob without a split is refused naming it"
exit $((failures > 0))
