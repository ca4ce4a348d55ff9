#!/usr/bin/env bash
# Context parallelism in whole runs (docs/training.md, "Context parallelism: long sequences"):
#  1. GPT-2 at cp=2 trains the losses of one rank (float32: to 2e-5 relative; the float64 gradients
#     are checked at 1e-9 in tests/train/test_context_parallel.cpp), and its metrics and banner say cp;
#  2. a checkpoint written at cp=2 resumes on one rank and at cp=4 and continues the curve;
#  3. a Llama at cp=2,tp=2 with sequence parallelism, and pp=2,cp=2, train; check passes at cp=2,
#     cp=4, dp=2,cp=2, fsdp=2,cp=2, cp=2,tp=2 with SP and for a Llama with a sliding window;
#  4. explain counts each block's ring transfers over cp (and with --cp-schedule all-gather the keys'
#     and values' all-gather and their reduce-scatter); a trace of a cp run has the transfers;
#  5. greedy samples at cp=2 are the one-rank samples;
#  6. the refusals name the sequence and the mesh;
#  7. --mesh-invariant --sequence-blocks: cp=2, cp=4 and cp=2,tp=2 with SP save one rank's bytes, and
#     a cp=2 checkpoint resumed on one rank and at cp=2,tp=2 saves the uninterrupted run's.
# usage: cp.sh MESHGRAD WORKDIR
set -euo pipefail
mg=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
gpt=(--layers 2 --hidden 32 --heads 4 --seq 64 --batch 4)
fail() { echo "$1"; [ -n "${2:-}" ] && cat "$2"; exit 1; }

# 1. cp=2 against one rank.
"$mg" train "${gpt[@]}" --steps 6 --mesh tp=1 --metrics "$work/one.jsonl" > "$work/one.log" 2>&1 ||
  fail "the one-rank run failed" "$work/one.log"
"$mg" train "${gpt[@]}" --steps 6 --mesh cp=2 --metrics "$work/cp2.jsonl" --checkpoint-dir "$work/ck" --save-every 3 \
  > "$work/cp2.log" 2>&1 || fail "the cp=2 run failed" "$work/cp2.log"
grep -q "cp=2" "$work/cp2.log" || fail "the banner does not name the mesh's cp" "$work/cp2.log"
python3 - "$work/one.jsonl" "$work/cp2.jsonl" <<'PY' || fail "cp=2 does not train the one-rank losses"
import json, sys
def losses(path):
    return [json.loads(l)["loss"] for l in open(path) if '"step"' in l]
one, cp = losses(sys.argv[1]), losses(sys.argv[2])
assert len(one) == len(cp) == 6, (one, cp)
for a, b in zip(one, cp):
    assert abs(a - b) <= 2e-5 * abs(a), (one, cp)
assert cp[-1] < cp[0], cp
header = json.loads(open(sys.argv[2]).readline())
assert "cp=2" in json.dumps(header), header
PY

# The all-gather schedule trains the same losses (another order of the softmax's parts).
"$mg" train "${gpt[@]}" --steps 6 --mesh cp=2 --cp-schedule all-gather --metrics "$work/cpg.jsonl" > "$work/cpg.log" 2>&1 ||
  fail "the cp=2 all-gather run failed" "$work/cpg.log"
python3 - "$work/one.jsonl" "$work/cpg.jsonl" <<'PY' || fail "cp=2 --cp-schedule all-gather does not train the one-rank losses"
import json, sys
def losses(path):
    return [json.loads(l)["loss"] for l in open(path) if '"step"' in l]
one, cp = losses(sys.argv[1]), losses(sys.argv[2])
assert len(one) == len(cp) == 6 and all(abs(a - b) <= 2e-5 * abs(a) for a, b in zip(one, cp)), (one, cp)
PY

# 2. Resume the cp=2 checkpoint on one rank and at cp=4: the curve continues (float32, other sums).
for mesh in tp=1 cp=4; do
  "$mg" train --resume "$work/ck/step_00000003" --steps 6 --mesh "$mesh" --metrics "$work/r_$mesh.jsonl" \
    --checkpoint-dir "$work/ck_$mesh" > "$work/r_$mesh.log" 2>&1 || fail "resume at $mesh failed" "$work/r_$mesh.log"
  python3 - "$work/cp2.jsonl" "$work/r_$mesh.jsonl" <<'PY' || fail "resume at $mesh leaves the curve"
import json, sys
full = {json.loads(l)["step"]: json.loads(l)["loss"] for l in open(sys.argv[1]) if '"step"' in l}
resumed = {json.loads(l)["step"]: json.loads(l)["loss"] for l in open(sys.argv[2]) if '"step"' in l}
assert sorted(resumed) == [4, 5, 6], resumed
for s, v in resumed.items():
    assert abs(v - full[s]) <= 2e-5 * abs(full[s]), (s, v, full[s])
PY
done

# 3. The Llama family, SP, pp, and check on the meshes cp combines with.
llama=(--model llama --layers 2 --hidden 32 --heads 4 --kv-heads 2 --ffn 48 --seq 32 --batch 4)
"$mg" train "${llama[@]}" --steps 2 --mesh cp=2,tp=2 --sequence-parallel --no-metrics > "$work/l.log" 2>&1 ||
  fail "llama at cp=2,tp=2 with SP failed" "$work/l.log"
"$mg" train "${gpt[@]}" --steps 2 --mesh pp=2,cp=2 --no-metrics > "$work/pp.log" 2>&1 ||
  fail "pp=2,cp=2 failed" "$work/pp.log"
for mesh in cp=2 cp=4 dp=2,cp=2 fsdp=2,cp=2 "cp=2,tp=2 --sequence-parallel"; do
  # shellcheck disable=SC2086
  "$mg" check --mesh $mesh --seq 16 --dtype float64 > "$work/check.log" 2>&1 || fail "check at $mesh failed" "$work/check.log"
  grep -q "PASS" "$work/check.log" || fail "check at $mesh did not pass" "$work/check.log"
done
"$mg" check --model llama --kv-heads 2 --sliding-window 5 --mesh cp=2 --seq 16 --dtype float64 > "$work/check.log" 2>&1 ||
  fail "check of a windowed llama at cp=2 failed" "$work/check.log"

# 4. explain and the trace: the ring's transfers (the default), and the all-gather schedule's collectives.
"$mg" explain --mesh cp=2 > "$work/x.log" 2>&1 || fail "explain at cp=2 failed" "$work/x.log"
[ "$(grep -cE 'forward\s+send\s+cp' "$work/x.log")" -ge 2 ] || fail "explain shows no ring transfer of the keys" "$work/x.log"
[ "$(grep -cE 'backward\s+send\s+cp' "$work/x.log")" -ge 6 ] || fail "explain shows no gradients' ring" "$work/x.log"
"$mg" explain --mesh cp=2 --cp-schedule all-gather > "$work/xg.log" 2>&1 || fail "explain all-gather failed" "$work/xg.log"
[ "$(grep -cE 'forward\s+all_gather\s+cp' "$work/xg.log")" -ge 4 ] || fail "explain shows no keys' gather" "$work/xg.log"
grep -qE 'backward\s+reduce_scatter\s+cp' "$work/xg.log" || fail "explain shows no gradients' return" "$work/xg.log"
"$mg" train "${gpt[@]}" --steps 2 --mesh cp=2 --trace "$work/t.json" --no-metrics > "$work/t.log" 2>&1 ||
  fail "a traced cp run failed" "$work/t.log"
python3 - "$work/t.json" <<'PY' || fail "the trace has no cp collectives"
import json, sys
events = json.load(open(sys.argv[1]))
events = events["traceEvents"] if isinstance(events, dict) else events
names = " ".join(str(e.get("name", "")) + " " + json.dumps(e.get("args", {})) for e in events)
assert "send" in names and "recv" in names, names[:2000]
PY

# 5. Samples: every cp rank decodes the whole sequence, as one rank does.
"$mg" sample --checkpoint "$work/ck/step_00000006" --mesh cp=2 --tokens 12 --prompt "ab" --temperature 0 \
  > "$work/s2.txt" 2>&1 || fail "sampling at cp=2 failed" "$work/s2.txt"
"$mg" sample --checkpoint "$work/ck/step_00000006" --mesh tp=1 --tokens 12 --prompt "ab" --temperature 0 \
  > "$work/s1.txt" 2>&1 || fail "sampling on one rank failed" "$work/s1.txt"
cmp "$work/s1.txt" "$work/s2.txt" || fail "cp=2 samples differ from one rank's"

# 6. Refusals, before any step.
expect_refusal() {   # expect_refusal PATTERN ARGS...
  local pattern=$1
  shift
  if "$mg" "$@" > "$work/bad.log" 2>&1; then fail "accepted: $*" "$work/bad.log"; fi
  grep -q "$pattern" "$work/bad.log" || fail "the refusal of '$*' does not say '$pattern'" "$work/bad.log"
  ! grep -q "^step 1" "$work/bad.log" || fail "'$*' was refused only after a step" "$work/bad.log"
}
expect_refusal "a sequence of 30 positions does not cut into 8 equal chunks" train --mesh cp=4 --seq 30 --steps 1 --no-metrics
expect_refusal "give --sequence-blocks a multiple of 2 x cp = 4 (got 1)" train --mesh cp=2 --mesh-invariant --steps 1 --no-metrics
expect_refusal "tp-invariant with context parallelism" train --mesh cp=2 --tp-invariant --steps 1 --no-metrics
expect_refusal "give --sequence-blocks a multiple of 2 x cp = 8 (got 4)" train --mesh cp=4 --mesh-invariant --sequence-blocks 4 --steps 1 --no-metrics
expect_refusal "with fsdp on the mesh fsdp=2,cp=2" train --mesh fsdp=2,cp=2 --mesh-invariant --sequence-blocks 4 --steps 1 --no-metrics

# 7. The same bytes on every cp under --mesh-invariant's sequence blocks, and an elastic resume.
inv=(train "${gpt[@]}" --dropout 0.1 --mesh-invariant --sequence-blocks 8 --no-metrics)
"$mg" "${inv[@]}" --steps 4 --mesh tp=1 --save "$work/inv_one.safetensors" > "$work/inv_one.log" 2>&1 ||
  fail "the invariant one-rank run failed" "$work/inv_one.log"
for mesh in cp=2 cp=4 cp=2,tp=2; do
  extra=()
  [ "$mesh" = cp=2,tp=2 ] && extra=(--sequence-parallel --overlap)
  "$mg" "${inv[@]}" --steps 4 --mesh "$mesh" "${extra[@]}" --save "$work/inv_$mesh.safetensors" \
    > "$work/inv_$mesh.log" 2>&1 || fail "the invariant $mesh run failed" "$work/inv_$mesh.log"
  cmp "$work/inv_one.safetensors" "$work/inv_$mesh.safetensors" || fail "--mesh-invariant $mesh differs from one rank"
done
"$mg" "${inv[@]}" --steps 2 --decay-steps 4 --mesh cp=2 --checkpoint-dir "$work/inv_ck" --save-every 2 \
  > "$work/inv_ck.log" 2>&1 || fail "the invariant checkpointed run failed" "$work/inv_ck.log"
"$mg" "${inv[@]}" --steps 4 --decay-steps 4 --mesh tp=1 --save "$work/inv_full.safetensors" > "$work/inv_full.log" 2>&1 ||
  fail "the uninterrupted invariant run failed" "$work/inv_full.log"
for mesh in tp=1 cp=2,tp=2; do
  "$mg" train --resume "$work/inv_ck/step_00000002" --steps 4 --mesh "$mesh" --no-metrics \
    --save "$work/inv_r_$mesh.safetensors" > "$work/inv_r_$mesh.log" 2>&1 || fail "resume at $mesh failed" "$work/inv_r_$mesh.log"
  cmp "$work/inv_full.safetensors" "$work/inv_r_$mesh.safetensors" ||
    fail "the cp=2 checkpoint resumed at $mesh differs from the uninterrupted run"
done
echo "cp: all checks passed"
