#!/usr/bin/env bash
# `meshgrad train --sample-every N`: samples printed and written to the metrics at steps N, 2N, ...;
# the text is what `meshgrad sample --seed SEED+STEP` draws from the weights of that step (so it
# comes from the trained model, not another one); meshes that train the same bits (a pipeline and
# gradient accumulation, fsdp and dp) sample the same text; bad options are refused by name.
#   train_samples.sh path/to/meshgrad scratch-dir
set -euo pipefail
M=$1
W=$2
rm -rf "$W"
mkdir -p "$W"
cd "$W"
failures=0
fail() { echo "FAIL $*"; failures=$((failures + 1)); }
small=(--layers 2 --hidden 32 --heads 4 --seq 32 --batch 8 --steps 6 --sample-every 3 --sample-tokens 12)

# run NAME MESH ARGS...: a run whose samples go to NAME.jsonl, its stderr to NAME.err.
run() {
  local name=$1 mesh=$2
  shift 2
  "$M" train --mesh "$mesh" "${small[@]}" --metrics "$name.jsonl" "$@" 2>"$name.err" || fail "$name: exit status $?: $(tail -3 "$name.err")"
}
# samples NAME: the sample lines of NAME.jsonl as "step<TAB>text (JSON)".
samples() { python3 -c '
import json, sys
for line in open(sys.argv[1]):
    j = json.loads(line)
    if j.get("type") == "sample": print(j["step"], json.dumps(j["text"]), sep="\t")' "$1.jsonl"; }

run tp2 tp=2 --save w.safetensors
[ "$(samples tp2 | cut -f1 | tr '\n' ' ')" = "3 6 " ] || fail "samples at steps '$(samples tp2 | cut -f1 | tr '\n' ' ')', expected 3 6"
grep -q "^step 3 sample: " tp2.err || fail "no 'step 3 sample:' line on stderr: $(head -c 400 tp2.err)"
# The last sample is what `meshgrad sample` draws from the saved weights with seed 1234 + 6.
"$M" sample --checkpoint w.safetensors --prompt $'\n' --tokens 12 --seed 1240 --mesh tp=1 >cli.txt
python3 - tp2.jsonl cli.txt <<'PY' || fail "the step-6 sample differs from meshgrad sample of the saved weights"
import json, sys
text = [json.loads(l)["text"] for l in open(sys.argv[1]) if '"sample"' in l][-1]
cli = open(sys.argv[2], encoding="utf-8", errors="replace").read()
sys.exit(0 if cli == text + "\n" else 1)
PY
echo "ok   samples at steps 3 and 6; the last is meshgrad sample's text from the saved weights"

# Any mesh: the bits of one rank's run give its text.
run one tp=1 --grad-accum 2
run pp2 pp=2 --micro-batches 2
run dp2 dp=2
run fsdp2 fsdp=2
[ "$(samples one)" = "$(samples pp2)" ] || fail "pp=2 sampled '$(samples pp2)', tp=1 with --grad-accum 2 '$(samples one)'"
[ "$(samples dp2)" = "$(samples fsdp2)" ] || fail "fsdp=2 sampled '$(samples fsdp2)', dp=2 '$(samples dp2)'"
[ "$(samples one)" != "$(samples dp2)" ] || [ -n "$(samples one)" ] || fail "no samples"
echo "ok   pp=2 samples tp=1 --grad-accum 2's text, fsdp=2 dp=2's"

expect_refusal() {
  local name=$1 needle=$2
  shift 2
  if "$M" train "$@" >out.txt 2>err.txt; then fail "$name: accepted"; return; fi
  grep -qF -- "$needle" err.txt || { fail "$name: no '$needle' in: $(head -c 300 err.txt)"; return; }
  echo "ok   $name refused"
}
expect_refusal "--sample-tokens 0" "--sample-tokens" --steps 2 --no-metrics --sample-every 1 --sample-tokens 0
expect_refusal "--sample-prompt ''" "--sample-prompt" --steps 2 --no-metrics --sample-every 1 --sample-prompt ""
exit $((failures > 0))
