#!/usr/bin/env bash
# reliability-3 C17: two runs given one --metrics file. The second is refused before it starts,
# naming the process that holds the file, and the first run's lines stay (before, both ran, their
# lines interleaved and the second's truncation dropped the first's).
#   r3_outputs_metrics_lock.sh MESHGRAD WORKDIR
set -u
mg=$1
dir=$2
rm -rf "$dir" && mkdir -p "$dir" && cd "$dir" || exit 1
model=(--layers 1 --hidden 32 --heads 4 --seq 16 --batch 4)
timeout 100 "$mg" train --steps 100000 "${model[@]}" --metrics shared.jsonl 2> live.log &
live=$!
# The live run has written its header and a step.
for _ in $(seq 300); do
  [ -f shared.jsonl ] && [ "$(wc -l < shared.jsonl)" -ge 2 ] && break
  sleep 0.1
done
"$mg" train --steps 3 "${model[@]}" --metrics shared.jsonl
second=$?
kill "$live" 2>/dev/null
wait "$live"
failures=0
[ "$second" -ne 0 ] || { echo "FAIL: the second run was not refused"; failures=$((failures + 1)); }
headers=$(grep -c '"type":"header"' shared.jsonl)
[ "$headers" -eq 1 ] || { echo "FAIL: $headers headers in shared.jsonl"; failures=$((failures + 1)); }
grep -q '"step":1,' <(sed -n 2p shared.jsonl) || { echo "FAIL: the live run's step 1 is gone:"; head -3 shared.jsonl; failures=$((failures + 1)); }
[ "$failures" -eq 0 ] && echo "PASS: the second run was refused and the live run's metrics kept"
exit "$failures"
