#!/usr/bin/env bash
# Issue 42's friction list in whole runs: --eval-steps beyond the validation split is said (not capped
# silently); MFU's peak is measured once per machine and then read from the cache (the metrics
# header's peak_gflops_source says which, and the two runs divide by the same figure); the progress
# line carries an ETA.
# usage: progress_notes.sh MESHGRAD WORKDIR
set -euo pipefail
mg=$(realpath "$1") work=$2
rm -rf "$work" && mkdir -p "$work" && cd "$work"
fail() { echo "$1"; [ -n "${2:-}" ] && cat "$2"; exit 1; }
export MESHGRAD_CACHE_DIR="$work/cache"
python3 -c "print('the quick brown fox jumps over the lazy dog. ' * 200)" > book.txt
python3 -c "print('pack my box with five dozen liquor jugs. ' * 8)" > val.txt
tiny=(--seq 16 --batch 4 --layers 1 --hidden 32 --heads 4 --mesh tp=1 --data book.txt --val-data val.txt --steps 4)
"$mg" train "${tiny[@]}" --eval-every 2 --eval-steps 999 --metrics m1.jsonl > a.log 2>&1 || fail "training failed" a.log
grep -qE "note: --eval-steps 999 is more than the validation split's [0-9]+ batches of --batch 4 x --seq 16: each evaluation reads those [0-9]+ once" a.log ||
  fail "the cap of --eval-steps is not said" a.log
grep -qE "eta [0-9]+s" a.log || fail "the progress line has no ETA" a.log
"$mg" train "${tiny[@]}" --eval-every 2 --eval-steps 1 --metrics m2.jsonl > b.log 2>&1 || fail "training failed" b.log
! grep -q "note: --eval-steps" b.log || fail "a fitting --eval-steps is noted" b.log
python3 - <<'PY' || fail "the peak is not measured once and then read from the cache"
import json, os
h1 = json.loads(open("m1.jsonl").readline())
h2 = json.loads(open("m2.jsonl").readline())
assert h1["peak_gflops_source"] == "measured", h1.get("peak_gflops_source")
cache = os.path.join(os.environ["MESHGRAD_CACHE_DIR"], "peak-gflops.json")
assert h2["peak_gflops_source"] == "cached in " + cache, h2.get("peak_gflops_source")
assert h1["peak_gflops"] == h2["peak_gflops"] > 0, (h1["peak_gflops"], h2["peak_gflops"])
assert len(json.load(open(cache))) == 1
PY
echo "progress notes: all checks passed"
