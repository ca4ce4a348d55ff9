#!/usr/bin/env bash
# `--trace FILE.json` end to end (issue 12): `meshgrad train`, `bench mlp` and `bench collectives`
# write a trace that `meshgrad trace summary` and `meshgrad trace svg` read back, with a lane per
# rank and per communicator; bad --trace paths are refused before the first step, naming --trace.
# Usage: cli_trace.sh path/to/meshgrad scratch-dir [mpirun command...]
#   with an mpirun command: the same under `--backend mpi` (one file for both processes).
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
# expect_in FILE NEEDLE...: every needle is in FILE.
expect_in() {
  local file=$1
  shift
  for n in "$@"; do
    grep -qF -- "$n" "$file" || { fail "no '$n' in $file: $(head -c 600 "$file")"; return 0; }
  done
  return 0
}

model=(--layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --overlap)
tiny=("${model[@]}" --no-metrics)

if [ $# -gt 0 ]; then
  # Under mpirun: every process records its rank, rank 0 writes one file with a pid per process.
  "$@" -np 2 "$M" train --backend mpi --mesh tp=2 --steps 2 "${tiny[@]}" --trace mpi.json >out.txt 2>err.txt ||
    fail "mpirun train --trace: $(tail -c 600 err.txt)"
  "$M" trace summary mpi.json >summary.txt 2>&1 || fail "trace summary of the mpi trace: $(cat summary.txt)"
  expect_in summary.txt "rank 0 " "rank 1 "
  expect_in mpi.json '"rank 0 (pid' '"rank 1 (pid' '"rank 0 progress (tp)"' '"rank 1 progress (tp)"' '"backend":"mpi"'
  [ "$failures" -eq 0 ] && echo "ok   mpi: one trace of both processes"
  exit "$failures"
fi

# train --trace: one file, every rank, every step; the summary and the SVG read it.
"$M" train --mesh tp=2 --steps 2 "${tiny[@]}" --trace t.json >out.txt 2>err.txt || fail "train --trace: $(tail -c 600 err.txt)"
expect_in err.txt "trace written to t.json"
"$M" trace summary t.json >summary.txt 2>&1 || fail "trace summary: $(cat summary.txt)"
expect_in summary.txt "hidden" "rank 0 " "rank 1 "
# Both ranks ran 2 steps: the steps column of each rank row.
[ "$(awk '$1 == "rank" && $3 == 2' summary.txt | wc -l)" -eq 2 ] || fail "summary rows without 2 steps: $(cat summary.txt)"
"$M" trace svg t.json --step 2 -o t.svg >/dev/null 2>svg-err.txt || fail "trace svg: $(cat svg-err.txt)"
expect_in t.svg "<svg" "rank 0 progress (tp)" "rank 1" "of the communication ran during compute"
expect_in t.json '"traceEvents"' '"thread_name"' '"h.0.mlp.c_fc"' '"backward"' '"all_reduce"' '"wait"' '"optimizer"'
"$M" trace svg t.json --step 3 -o t3.svg >/dev/null 2>err3.txt && fail "trace svg --step 3 of a 2-step trace succeeded"
expect_in err3.txt "--step 3"
[ "$failures" -eq 0 ] && echo "ok   train --trace, trace summary, trace svg"

# Without --trace nothing is written.
"$M" train --mesh tp=2 --steps 1 "${tiny[@]}" >/dev/null 2>err.txt || fail "train without --trace: $(tail -c 600 err.txt)"
if grep -q "trace written" err.txt; then fail "a run without --trace wrote a trace"; fi

# Bad paths: refused before the first step, naming --trace.
mkdir adir
head -c 4096 /dev/zero | tr '\0' 'a' >data.txt
check_refused() {
  local name=$1
  shift
  local needles=()
  while [ "$1" != "--" ]; do needles+=("$1"); shift; done
  shift
  if "$M" train --mesh tp=2 --steps 2 "${model[@]}" "$@" >out.txt 2>err.txt; then
    fail "$name: accepted"
    return
  fi
  expect_in err.txt "--trace" "${needles[@]}"
  if grep -q "step 1/" err.txt; then fail "$name: refused only after a step ran"; fi
  echo "ok   $name refused"
}
check_refused trace-directory "adir" -- --no-metrics --trace adir
check_refused trace-missing-directory "nowhere/t.json" -- --no-metrics --trace nowhere/t.json
check_refused trace-is-data "same file as --data" -- --no-metrics --data data.txt --trace data.txt
check_refused trace-is-metrics "--metrics" -- --trace m.jsonl --metrics m.jsonl
[ "$(wc -c <data.txt)" -eq 4096 ] || fail "the data file changed"

# The benches.
"$M" bench mlp --mesh tp=2 --overlap --tokens 64 --hidden 32 --ffn 64 --steps 2 --warmup 1 --trace mlp.json >out.txt 2>&1 ||
  fail "bench mlp --trace: $(tail -c 600 out.txt)"
"$M" trace summary mlp.json >summary.txt 2>&1 || fail "summary of bench mlp: $(cat summary.txt)"
# 2 timed steps without overlap, then 2 with.
[ "$(awk '$1 == "rank" && $3 == 4' summary.txt | wc -l)" -eq 2 ] || fail "bench mlp steps: $(cat summary.txt)"
"$M" bench collectives --ranks 2 --ops all_reduce,all_gather --min-bytes 1K --max-bytes 4K --iters 3 --warmup 1 \
  --trace coll.json >out.txt 2>&1 || fail "bench collectives --trace: $(tail -c 600 out.txt)"
"$M" trace summary coll.json >summary.txt 2>&1 || fail "summary of bench collectives: $(cat summary.txt)"
# Per rank: 2 ops x 3 sizes x (1 warm-up + 3 timed) iterations, plus the bench's own barriers and
# result checks: at least 24 collectives each.
awk '$1 == "rank" && $2 ~ /^[0-9]+$/ { if ($(NF - 1) < 24) bad = 1; n++ } END { exit !(n == 2 && !bad) }' summary.txt ||
  fail "bench collectives: $(cat summary.txt)"
[ "$failures" -eq 0 ] && echo "ok   bench mlp --trace, bench collectives --trace"

exit "$failures"
