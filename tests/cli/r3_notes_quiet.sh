#!/usr/bin/env bash
# The start-up notes on options that change nothing (docs/training.md) fire only for values the user
# gave: not for a run's recorded configuration fed back as --config (which gives every option, at its
# defaults), nor for what a resume takes from its checkpoint (issue 37: N27, N34, R9, N102).
#   r3_notes_quiet.sh path/to/meshgrad scratch-dir
set -euo pipefail
M=$1
W=$2
rm -rf "$W"
mkdir -p "$W"
cd "$W"
T=(--layers 1 --hidden 32 --heads 4 --seq 16 --batch 4)
# Given: every note fires.
"$M" train --steps 2 "${T[@]}" --mesh dp=2 --no-reshard-after-forward --batch-blocks 8 --invariant-blocks 8 \
  --checkpoint-dir ck --metrics a.jsonl 2>err.txt
for n in "--no-reshard-after-forward changes nothing" "--batch-blocks 8 changes nothing" "--invariant-blocks 8 changes nothing"; do
  grep -qF -- "note: $n" err.txt || { echo "FAIL no note '$n' for the given option:"; cat err.txt; exit 1; }
done
# A resume takes them from the checkpoint: not given, no note.
"$M" train --resume ck --steps 4 2>err.txt
if grep -q "note:" err.txt; then echo "FAIL a note on a resume that gave nothing:"; grep "note:" err.txt; exit 1; fi
# A default run's recorded configuration as --config: every option given, at its defaults: no note.
"$M" train --steps 2 "${T[@]}" --metrics b.jsonl 2>/dev/null
python3 -c '
import json
json.dump(json.loads(open("b.jsonl").readline())["config"], open("c.json", "w"))'
"$M" train --config c.json --metrics c.jsonl 2>err.txt
if grep -q "note:" err.txt; then echo "FAIL a note on a recorded default configuration:"; grep "note:" err.txt; exit 1; fi
echo "ok   notes for given options only"
