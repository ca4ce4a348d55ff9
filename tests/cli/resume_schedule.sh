#!/usr/bin/env bash
# A resume with another --steps (issue 42's friction list): without --keep-schedule the default decay
# stretches to the new last step and the resume says so, naming the next step's rate before and now
# and how to keep it; with --keep-schedule the rate follows the checkpoint's schedule (--min-lr from
# its last step on); the same --steps says nothing.
# usage: resume_schedule.sh MESHGRAD WORKDIR
set -euo pipefail
mg=$(realpath "$1") work=$2
rm -rf "$work" && mkdir -p "$work" && cd "$work"
fail() { echo "$1"; [ -n "${2:-}" ] && cat "$2"; exit 1; }
tiny=(--seq 16 --layers 1 --hidden 32 --mesh tp=1)
"$mg" train "${tiny[@]}" --steps 30 --checkpoint-dir ck --save-every 15 --no-metrics > a.log 2>&1 || fail "training failed" a.log
"$mg" train --resume ck/step_00000015 --steps 60 --checkpoint-dir ck2 --metrics m1.jsonl > b.log 2>&1 || fail "resume failed" b.log
grep -q "steps 60 instead of the checkpoint's 30 moves the end of the cosine learning-rate decay from step 30 to step 60: step 16 trains at 0.00293, not 0.00256; give --keep-schedule" b.log ||
  fail "the resume does not say how the schedule changes" b.log
"$mg" train --resume ck/step_00000015 --steps 60 --keep-schedule --checkpoint-dir ck3 --metrics m2.jsonl > c.log 2>&1 ||
  fail "resume with --keep-schedule failed" c.log
grep -q "keep-schedule: the learning rate follows the checkpoint's schedule (--decay-steps 19" c.log || fail "no --keep-schedule line" c.log
python3 - <<'PY' || fail "the learning rates do not follow the schedules"
import json
def lrs(path):
    return {json.loads(l)["step"]: json.loads(l)["lr"] for l in open(path) if '"step"' in l}
stretched, kept = lrs("m1.jsonl"), lrs("m2.jsonl")
assert abs(stretched[16] - 0.00293) < 1e-5 and abs(kept[16] - 0.00256) < 1e-5, (stretched[16], kept[16])
assert all(abs(kept[s] - 3e-4) < 1e-12 for s in range(30, 61)), kept          # --min-lr from step 30 on
assert stretched[45] > 5e-4, stretched[45]                                    # still decaying
PY
"$mg" train --resume ck/step_00000015 --checkpoint-dir ck4 --no-metrics > d.log 2>&1 || fail "plain resume failed" d.log
! grep -q "keep-schedule" d.log || fail "the same --steps reports a schedule change" d.log
echo "resume schedule: reported, kept with --keep-schedule"
