#!/usr/bin/env bash
# A mixture of experts in whole runs (docs/training.md, "Mixture of experts and expert parallelism"):
#  1. train at ep=2 prints the experts and the load, and the metrics lines carry expert_load, dropped
#     and aux_loss (the load of every expert adds up to tokens x k x layers);
#  2. a checkpoint written at ep=4 resumes at ep=2 and on one rank, and under --mesh-invariant the
#     resumed run's bytes are the uninterrupted ep=4 run's (elastic resume across ep);
#  3. export to a Hugging Face directory (one nn.Linear per expert, model_type mixtral) and --init-from
#     of it; sample from the one-rank checkpoint; sampling at ep=2 is refused;
#  4. check at ep=2, dp=2,ep=2, fsdp=2,ep=2, tp=2x2 and in bf16 passes; bf16 under --mesh-invariant saves
#     one rank's bytes at dp=2,ep=2; --shard-optimizer at dp=2,ep=2 saves the bytes of
#     dp=2,ep=2 under --mesh-invariant; explain counts each MoE layer's all-to-alls;
#  5. pp=2 without the load-balancing loss trains; the refusals name the option and the value.
# usage: moe.sh MESHGRAD WORKDIR
set -euo pipefail
mg=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
moe=(--model llama --layers 2 --hidden 32 --heads 4 --kv-heads 2 --ffn 48 --experts 4 --experts-per-token 2 --seq 16 --batch 8)
fail() { echo "$1"; [ -n "${2:-}" ] && cat "$2"; exit 1; }

# 1. ep=2 with the load-balancing loss and a capacity factor.
"$mg" train "${moe[@]}" --output-router-logits --capacity-factor 1.0 --steps 3 --mesh ep=2 --metrics "$work/m.jsonl" \
  > "$work/m.log" 2>&1 || fail "ep=2 run failed" "$work/m.log"
grep -q "experts=4 top-2 capacity-factor=1" "$work/m.log" || fail "the banner names no experts" "$work/m.log"
grep -q "load max/mean [0-9.]* | aux [0-9.]*" "$work/m.log" || fail "the progress line shows no load" "$work/m.log"
python3 - "$work/m.jsonl" <<'PY' || fail "metrics: expert load"
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if '"step"' in l]
assert len(lines) == 3, lines
for l in lines:
    load = l["expert_load"]
    assert len(load) == 2 and all(len(layer) == 4 for layer in load), load
    # Every token of the global batch (8 x 16) picks 2 experts in each layer.
    assert all(sum(layer) == 8 * 16 * 2 for layer in load), load
    assert l["aux_loss"] > 0.5 and l["dropped"] >= 0, l
PY

# Activation checkpointing (no load-balancing loss): the recomputation does not count the load twice.
"$mg" train "${moe[@]}" --checkpoint-blocks --steps 2 --mesh ep=2 --metrics "$work/ck.jsonl" > "$work/ckb.log" 2>&1 ||
  fail "ep=2 with --checkpoint-blocks failed" "$work/ckb.log"
python3 - "$work/ck.jsonl" <<'PY' || fail "metrics: expert load with --checkpoint-blocks"
import json, sys
for l in (json.loads(l) for l in open(sys.argv[1]) if '"step"' in l):
    assert [sum(layer) for layer in l["expert_load"]] == [8 * 16 * 2] * 2, l["expert_load"]
PY

# 2. Elastic resume across ep under --mesh-invariant: ep=4 for 4 steps, or 2 at ep=4 then 2 at ep=2,
#    then from step 2 on one rank: the same bytes.
inv=(--mesh-invariant --output-router-logits --steps 4 --decay-steps 4 --no-metrics)
"$mg" train "${moe[@]}" "${inv[@]}" --mesh ep=4 --save "$work/whole.safetensors" > "$work/w.log" 2>&1 ||
  fail "ep=4 invariant run failed" "$work/w.log"
"$mg" train "${moe[@]}" --mesh-invariant --output-router-logits --steps 2 --decay-steps 4 --no-metrics --mesh ep=4 \
  --checkpoint-dir "$work/ck" --save-every 2 > "$work/c.log" 2>&1 || fail "checkpointed ep=4 run failed" "$work/c.log"
"$mg" train --resume "$work/ck/step_00000002" --steps 4 --mesh ep=2 --save "$work/ep2.safetensors" --no-metrics \
  > "$work/r2.log" 2>&1 || fail "resume at ep=2 failed" "$work/r2.log"
"$mg" train --resume "$work/ck/step_00000002" --steps 4 --mesh tp=1 --save "$work/one.safetensors" --no-metrics \
  --checkpoint-dir "$work/ck1" --save-every 4 > "$work/r1.log" 2>&1 || fail "resume on one rank failed" "$work/r1.log"
cmp "$work/whole.safetensors" "$work/ep2.safetensors" || fail "ep=4 -> ep=2 is not the uninterrupted run's bytes"
cmp "$work/whole.safetensors" "$work/one.safetensors" || fail "ep=4 -> one rank is not the uninterrupted run's bytes"

# 3. export, import, sample.
"$mg" export --checkpoint "$work/ck1" --out "$work/hf" > "$work/e.log" 2>&1 || fail "export failed" "$work/e.log"
python3 - "$work/hf" <<'PY' || fail "the export is not Mixtral's layout"
import json, struct, sys
d = sys.argv[1]
cfg = json.load(open(f"{d}/config.json"))
assert cfg["model_type"] == "mixtral" and cfg["architectures"] == ["MixtralForCausalLM"], cfg
assert cfg["num_local_experts"] == 4 and cfg["num_experts_per_tok"] == 2 and cfg["output_router_logits"], cfg
raw = open(f"{d}/model.safetensors", "rb").read()
header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
for e in range(4):
    assert header[f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight"]["shape"] == [48, 32]
    assert header[f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"]["shape"] == [32, 48]
assert header["model.layers.0.block_sparse_moe.gate.weight"]["shape"] == [4, 32]
assert not any(".mlp." in k for k in header), "a dense MLP in a Mixtral export"
PY
"$mg" train --init-from "$work/hf" --seq 16 --batch 8 --steps 1 --mesh ep=2 --no-metrics > "$work/i.log" 2>&1 ||
  fail "--init-from the export failed" "$work/i.log"
"$mg" sample --checkpoint "$work/ck1" --tokens 8 --prompt "a" > "$work/s.txt" 2>&1 || fail "sample failed" "$work/s.txt"
if "$mg" sample --checkpoint "$work/ck1" --tokens 8 --prompt "a" --mesh ep=2 > "$work/s2.txt" 2>&1; then
  fail "sampling at ep=2 was accepted"
fi
grep -q "sample on a mesh without ep" "$work/s2.txt" || fail "ep=2 sampling refusal" "$work/s2.txt"

# 4. check and explain.
for mesh in ep=2 dp=2,ep=2 fsdp=2,ep=2; do
  # shellcheck disable=SC2086
  "$mg" check "${moe[@]}" --output-router-logits --dtype float64 --mesh $mesh > "$work/check.log" 2>&1 ||
    fail "check at $mesh failed" "$work/check.log"
  grep -q "^PASS" "$work/check.log" || fail "check at $mesh did not pass" "$work/check.log"
done
for so in "" --shard-optimizer; do
  # shellcheck disable=SC2086
  "$mg" train "${moe[@]}" --output-router-logits --steps 2 --mesh-invariant --mesh dp=2,ep=2 $so --no-metrics \
    --save "$work/so$so.safetensors" > "$work/so.log" 2>&1 || fail "dp=2,ep=2 $so failed" "$work/so.log"
done
cmp "$work/so.safetensors" "$work/so--shard-optimizer.safetensors" || fail "--shard-optimizer at dp=2,ep=2 differs from dp=2,ep=2"
"$mg" check "${moe[@]}" --output-router-logits --dtype float64 --mesh tp=2x2 > "$work/check.log" 2>&1 ||
  fail "check at tp=2x2 failed" "$work/check.log"
"$mg" check "${moe[@]}" --output-router-logits --dtype float32 --precision bf16 --mesh ep=2 > "$work/check.log" 2>&1 ||
  fail "check --precision bf16 at ep=2 failed" "$work/check.log"
for mesh in tp=1 dp=2,ep=2; do
  "$mg" train "${moe[@]}" --output-router-logits --precision bf16 --steps 2 --mesh-invariant --mesh $mesh --no-metrics \
    --save "$work/bf16_$mesh.safetensors" > "$work/bf16.log" 2>&1 || fail "bf16 $mesh failed" "$work/bf16.log"
done
cmp "$work/bf16_tp=1.safetensors" "$work/bf16_dp=2,ep=2.safetensors" || fail "bf16 dp=2,ep=2 is not one rank's bytes"
"$mg" explain "${moe[@]}" --mesh ep=2 > "$work/x.txt" 2>&1 || fail "explain failed" "$work/x.txt"
for phase in forward backward; do
  n=$(grep -c -E "^ *$phase +all_to_all +ep +2 " "$work/x.txt" || true)
  [ "$n" = 4 ] || fail "explain: $n $phase all_to_all rows over ep (expected 2 per MoE layer, 2 layers)" "$work/x.txt"
done
grep -q "^model.layers.0.block_sparse_moe  *forward  *all_gather(sizes) ep" "$work/x.txt" || fail "explain: counts" "$work/x.txt"
grep -q "matmul parameters active (of [0-9]*: 2 of 4 experts per token)" "$work/x.txt" || fail "explain: FLOPs" "$work/x.txt"

# 5. pp=2 without the aux loss; refusals.
"$mg" train "${moe[@]}" --steps 2 --mesh pp=2,ep=2 --no-metrics > "$work/pp.log" 2>&1 || fail "pp=2,ep=2 failed" "$work/pp.log"
refused() {   # refused EXPECTED-TEXT ARGS...
  local expected=$1; shift
  if "$mg" train "$@" --steps 1 --no-metrics > "$work/ref.log" 2>&1; then fail "accepted: $*"; fi
  grep -q -- "$expected" "$work/ref.log" || fail "refusal of '$*' lacks '$expected'" "$work/ref.log"
}
refused "ep = 3 does not divide the 4 experts" --model llama --layers 2 --hidden 32 --heads 4 --experts 4 --batch 6 \
  --mesh ep=3
refused "ep = 8 ranks split the experts, and the model has 4" "${moe[@]}" --mesh ep=8
refused "--capacity-factor -0.5 must be > 0" "${moe[@]}" --capacity-factor -0.5
refused "--capacity-factor caps a mixture of experts' experts, and the model has none" --model llama --layers 2 \
  --hidden 32 --heads 4 --capacity-factor 1.5
refused "the llama model has none (--experts 0)" --model llama --layers 2 --hidden 32 --heads 4 --mesh ep=2
refused "a pipeline (--mesh pp=2,tp=1) runs" "${moe[@]}" --output-router-logits --mesh pp=2
echo "moe: ep=2 run with load metrics, elastic resume ep=4 -> ep=2 -> one rank bitwise, export/import/sample,"
echo "check at ep=2, dp=2,ep=2 and fsdp=2,ep=2, --shard-optimizer, --checkpoint-blocks, explain, pp=2,ep=2 and the refusals hold"
