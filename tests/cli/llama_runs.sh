#!/usr/bin/env bash
# The Llama family through the command line (issue 38): a checkpointed run resumes bit for bit (the
# model from the checkpoint alone); a tp=2 SP checkpoint resumes on tp=1 and fsdp=2 (float64, within
# 1e-9 relative); under --mesh-invariant on another mesh bit for bit; --sample-every samples the
# trained model (its last sample is `meshgrad sample --checkpoint` of that step's checkpoint with
# seed SEED+STEP); check and explain take --model llama and --model-config; --trace names Llama's
# modules; --save and --init-from are still refused.
#   llama_runs.sh path/to/meshgrad scratch-dir CASE
# CASE: resume | reshard | mesh_invariant | sample | check_explain | trace | refused
set -euo pipefail
M=$1
W=$2
CASE=$3
rm -rf "$W"
mkdir -p "$W"
cd "$W"
failures=0
fail() { echo "FAIL $*"; failures=$((failures + 1)); }

# Every recorded Llama field away from its default: grouped-query attention, head_dim, llama3 RoPE.
llama=(--model llama --layers 2 --hidden 32 --heads 4 --kv-heads 2 --head-dim 12 --ffn 48 --rope-theta 1000
       --rope-scaling llama3 --rope-factor 8 --rope-low-freq-factor 2 --rope-high-freq-factor 8
       --rope-original-positions 64 --attention-bias --seq 16 --batch 4 --seed 7)

# losses FILE [FIRST]: the losses of a metrics file, one per line (repr: every bit), from step FIRST.
losses() { python3 -c '
import json, sys
first = int(sys.argv[2]) if len(sys.argv) > 2 else 0
for line in open(sys.argv[1]):
    j = json.loads(line)
    if "loss" in j and j.get("type") is None and j["step"] >= first: print(repr(j["loss"]))' "$@"; }

# close A B TOL: every line of A within TOL relative of B's, and as many.
close() { python3 - "$1" "$2" "$3" <<'PY'
import sys
a = [float(x) for x in open(sys.argv[1])]
b = [float(x) for x in open(sys.argv[2])]
tol = float(sys.argv[3])
sys.exit(0 if len(a) == len(b) and a and all(abs(x - y) <= tol * abs(y) for x, y in zip(a, b)) else 1)
PY
}

case "$CASE" in
resume)
  "$M" train "${llama[@]}" --mesh tp=2 --sequence-parallel --dtype float64 --steps 6 --metrics full.jsonl 2>full.err ||
    fail "uninterrupted: $(tail -3 full.err)"
  "$M" train "${llama[@]}" --mesh tp=2 --sequence-parallel --dtype float64 --steps 6 --save-every 3 \
    --checkpoint-dir ck --metrics first.jsonl 2>first.err || fail "checkpointed: $(tail -3 first.err)"
  rm -rf ck/step_00000006
  # Nothing of the model is given: it comes from the checkpoint.
  "$M" train --resume ck --metrics resumed.jsonl 2>resumed.err || fail "resume: $(tail -3 resumed.err)"
  losses full.jsonl 4 >want.txt
  losses resumed.jsonl >got.txt
  [ -s got.txt ] && cmp -s got.txt want.txt || fail "resumed losses $(tr '\n' ' ' <got.txt) != $(tr '\n' ' ' <want.txt)"
  grep -q "meshgrad train: llama layers=2" resumed.err || fail "the resumed run is not a llama: $(head -3 resumed.err)"
  echo "ok   a resumed Llama run continues the uninterrupted one bit for bit"
  # Another shape is refused naming the option.
  if "$M" train --resume ck --kv-heads 4 --no-metrics >out.txt 2>err.txt; then fail "--kv-heads 4 accepted on resume"; fi
  grep -qF -- "--kv-heads 4 (the checkpoint has 2)" err.txt || fail "no refusal naming --kv-heads: $(head -c 300 err.txt)"
  ;;
reshard)
  "$M" train "${llama[@]}" --mesh tp=2 --sequence-parallel --dtype float64 --steps 5 --metrics full.jsonl 2>full.err ||
    fail "uninterrupted: $(tail -3 full.err)"
  "$M" train "${llama[@]}" --mesh tp=2 --sequence-parallel --dtype float64 --steps 5 --save-every 2 \
    --checkpoint-dir ck --no-metrics 2>first.err || fail "checkpointed: $(tail -3 first.err)"
  losses full.jsonl 3 >want.txt
  for mesh in tp=1 fsdp=2; do
    "$M" train --resume ck/step_00000002 --mesh "$mesh" --checkpoint-dir "ck_$mesh" --metrics "r_$mesh.jsonl" \
      2>"r_$mesh.err" || fail "resume on $mesh: $(tail -3 "r_$mesh.err")"
    losses "r_$mesh.jsonl" >"got_$mesh.txt"
    # float64: only the order of split sums differs (1e-16 per operation over 3 steps).
    close "got_$mesh.txt" want.txt 1e-9 || fail "on $mesh: $(tr '\n' ' ' <"got_$mesh.txt") vs $(tr '\n' ' ' <want.txt)"
  done
  echo "ok   a tp=2 SP Llama checkpoint resumes on tp=1 and fsdp=2 within 1e-9"
  ;;
mesh_invariant)
  inv=(--mesh-invariant --invariant-blocks 2)
  "$M" train "${llama[@]}" "${inv[@]}" --mesh tp=2 --sequence-parallel --steps 6 --metrics full.jsonl 2>full.err ||
    fail "uninterrupted: $(tail -3 full.err)"
  "$M" train "${llama[@]}" "${inv[@]}" --mesh tp=2 --sequence-parallel --steps 6 --save-every 3 --checkpoint-dir ck \
    --no-metrics 2>first.err || fail "checkpointed: $(tail -3 first.err)"
  losses full.jsonl 4 >want.txt
  for mesh in tp=1 dp=2; do
    "$M" train --resume ck/step_00000003 --mesh "$mesh" --checkpoint-dir "ck_$mesh" --metrics "r_$mesh.jsonl" \
      2>"r_$mesh.err" || fail "resume on $mesh: $(tail -3 "r_$mesh.err")"
    losses "r_$mesh.jsonl" >"got_$mesh.txt"
    [ -s "got_$mesh.txt" ] && cmp -s "got_$mesh.txt" want.txt || fail "on $mesh: $(tr '\n' ' ' <"got_$mesh.txt") != $(tr '\n' ' ' <want.txt)"
  done
  echo "ok   under --mesh-invariant a Llama checkpoint of tp=2 resumes on tp=1 and dp=2 bit for bit"
  ;;
sample)
  # The sampler draws with seed = the run's (7) + the step.
  "$M" train "${llama[@]}" --mesh tp=2 --steps 4 --sample-every 2 --sample-tokens 8 --checkpoint-dir ck \
    --save-every 2 --metrics m.jsonl 2>m.err || fail "train: $(tail -3 m.err)"
  grep -q "^step 4 sample: " m.err || fail "no 'step 4 sample:' on stderr: $(head -c 300 m.err)"
  "$M" sample --checkpoint ck/step_00000004 --prompt $'\n' --tokens 8 --seed 11 --mesh tp=1 >cli.txt 2>cli.err ||
    fail "sample: $(tail -3 cli.err)"
  "$M" sample --checkpoint ck --prompt $'\n' --tokens 8 --seed 11 --mesh tp=2 >cli2.txt 2>cli2.err ||
    fail "sample on tp=2: $(tail -3 cli2.err)"
  python3 - m.jsonl cli.txt cli2.txt <<'PY' || fail "the step-4 sample differs from meshgrad sample of its checkpoint"
import json, sys
text = [json.loads(l)["text"] for l in open(sys.argv[1]) if '"sample"' in l][-1]
for f in sys.argv[2:]:
    cli = open(f, encoding="utf-8", errors="replace").read()
    if cli != text + "\n": sys.exit(f"{f}: {cli!r} vs {text!r}")
PY
  echo "ok   --sample-every samples the Llama being trained: meshgrad sample of its checkpoint draws the same text"
  ;;
check_explain)
  cat >config.json <<'JSON'
{"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
 "num_key_value_heads": 1, "vocab_size": 96, "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
 "tie_word_embeddings": true}
JSON
  "$M" check --model llama --layers 2 --hidden 32 --heads 4 --kv-heads 1 --mesh tp=2 --sequence-parallel >c1.txt 2>&1 ||
    fail "check --model llama: $(tail -5 c1.txt)"
  grep -q "PASS: the mesh model matches" c1.txt && grep -q "^meshgrad check: llama" c1.txt || fail "check: $(head -3 c1.txt)"
  "$M" check --model-config config.json --mesh dp=2,tp=2 >c2.txt 2>&1 || fail "check --model-config: $(tail -5 c2.txt)"
  grep -q "kv heads 1" c2.txt && grep -q "model.layers.0.self_attn.q_proj.bias" c2.txt || fail "check: $(head -3 c2.txt)"
  # The check must be able to fail: a scaled tp reduction.
  if "$M" check --model-config config.json --mesh tp=2 --inject-fault scale:tp:1.001 >c3.txt 2>&1; then
    fail "check passed a faulty mesh"
  fi
  "$M" explain --model-config config.json --mesh tp=2 --sequence-parallel >e.txt 2>&1 || fail "explain: $(tail -3 e.txt)"
  for name in model.layers.1.self_attn.k_proj model.layers.1.mlp.gate_proj model.layers.1.mlp.down_proj \
              model.layers.0.self_attn.k_proj.weight "model FLOPs"; do
    grep -qF "$name" e.txt || fail "explain names no $name: $(head -c 400 e.txt)"
  done
  "$M" explain --model llama --kv-heads 2 --mesh tp=2 --format json >e.json || fail "explain json"
  python3 -c 'import json,sys; r=json.load(open("e.json")); sys.exit(0 if any(x["layer"].endswith("o_proj") for x in r) else 1)' ||
    fail "explain --format json has no o_proj row"
  if "$M" explain --model gpt --kv-heads 2 >x.txt 2>&1; then fail "explain --model gpt --kv-heads accepted"; fi
  grep -qF -- "--kv-heads is an option of --model llama" x.txt || fail "no refusal naming --kv-heads: $(cat x.txt)"
  # check --checkpoint of a Llama run: its family and fields from the checkpoint; another one refused.
  "$M" train "${llama[@]}" --mesh tp=2 --steps 1 --checkpoint-dir ck --no-metrics 2>t.err || fail "train: $(tail -3 t.err)"
  "$M" check --checkpoint ck --mesh tp=2 --sequence-parallel >c4.txt 2>&1 || fail "check --checkpoint: $(tail -5 c4.txt)"
  grep -q "^meshgrad check: llama (2 layers, hidden 32, heads 4, kv heads 2, head dim 12" c4.txt ||
    fail "check --checkpoint: $(head -2 c4.txt)"
  if "$M" check --checkpoint ck --mesh tp=2 --rope-theta 10000 >c5.txt 2>&1; then fail "another --rope-theta accepted"; fi
  grep -qF -- "--rope-theta 10000.0 (it has 1000.0)" c5.txt || fail "no refusal naming --rope-theta: $(tail -2 c5.txt)"
  echo "ok   check and explain take --model llama and --model-config; check --checkpoint a Llama checkpoint"
  ;;
trace)
  "$M" train "${llama[@]}" --mesh tp=2 --sequence-parallel --steps 2 --no-metrics --trace t.json 2>t.err ||
    fail "train --trace: $(tail -3 t.err)"
  python3 - t.json <<'PY' || fail "the trace lacks Llama's modules"
import json, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
names = {(e.get("name"), e.get("cat")) for e in events if e.get("ph") == "X"}
for module in ["llama", "model.embed_tokens", "model.layers.1.self_attn.q_proj", "model.layers.1.mlp.up_proj", "model.norm", "lm_head"]:
    for phase in ["forward", "backward"]:
        if (module, phase) not in names: sys.exit(f"no {phase} span of {module}")
PY
  "$M" trace summary t.json >report.txt 2>&1 || fail "meshgrad trace summary: $(tail -3 report.txt)"
  echo "ok   a Llama run's trace has forward and backward spans of its modules"
  ;;
refused)
  # The Llama options given to a GPT-2 are refused, not ignored (the new ones too). (--save and
  # --init-from of the family: tests/cli/hf_llama.sh.)
  for opt in "--rope-scaling linear" "--sliding-window 64" "--max-window-layers 2" "--model-type qwen2" "--kv-heads 2"; do
    # shellcheck disable=SC2086
    if "$M" train --model gpt --steps 1 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --no-metrics $opt >out.txt 2>err.txt; then
      fail "$opt accepted for a gpt"
    fi
    grep -qF -- "${opt%% *} is an option of --model llama" err.txt || fail "$opt with gpt: $(head -c 300 err.txt)"
  done
  echo "ok   the Llama family's options are refused for a GPT-2"
  ;;
*) fail "unknown case $CASE" ;;
esac
exit $((failures > 0))
