#!/usr/bin/env bash
# The Llama family's Hugging Face directories from the command line: train --save, export (F32 and
# BF16, config.json's model_type and architectures, linears [out, in]), train --init-from (the
# same first loss at tp=1 and tp=2, sizes from config.json, a disagreeing size refused), a sharded
# directory read as the single file, sample from the directory and from the --save file (the same
# greedy text), grads with --mesh-invariant bitwise across meshes, and refusals naming the file.
# Usage: hf_llama.sh path/to/meshgrad scratch-dir
set -euo pipefail
M=$1
W=$2
rm -rf "$W"
mkdir -p "$W"
cd "$W"
failures=0
fail() { echo "FAIL $1"; failures=$((failures + 1)); }
ok() { echo "ok   $1"; }

# expect_error NAME NEEDLE... -- COMMAND...: COMMAND fails and its stderr holds every NEEDLE.
expect_error() {
  local name=$1
  shift
  local needles=()
  while [ "$1" != "--" ]; do needles+=("$1"); shift; done
  shift
  local rc=0
  "$@" >out.txt 2>err.txt || rc=$?
  if [ "$rc" -lt 1 ] || [ "$rc" -gt 125 ]; then fail "$name: exit status $rc; stderr: $(head -c 400 err.txt)"; return; fi
  for n in "${needles[@]}"; do
    grep -qF -- "$n" err.txt || { fail "$name: no '$n' in: $(head -c 400 err.txt)"; return; }
  done
  ok "$name"
}
first_loss() { sed -n 2p "$1" | sed 's/.*"loss":\([^,}]*\).*/\1/'; }
# The JSON value of a key of a config.json (one line per key, as export writes them).
key() { grep "\"$2\":" "$1" | head -1 | sed 's/.*": *//; s/,$//'; }

# shard SRC DST: DST as a sharded copy of the Hugging Face directory SRC (two shards and the index).
shard() {
/usr/bin/python3 - "$1" "$2" <<'PY'
import json, os, struct, sys
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst)
with open(os.path.join(src, "model.safetensors"), "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
    data = f.read()
header.pop("__metadata__", None)
names = list(header)
weight_map = {}
for k, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
    leaf = f"model-0000{k + 1}-of-00002.safetensors"
    h, blobs, at = {}, [], 0
    for name in part:
        b, e = header[name]["data_offsets"]
        h[name] = {"dtype": header[name]["dtype"], "shape": header[name]["shape"], "data_offsets": [at, at + e - b]}
        blobs.append(data[b:e]); at += e - b; weight_map[name] = leaf
    text = json.dumps(h).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(os.path.join(dst, leaf), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
with open(os.path.join(src, "config.json")) as a, open(os.path.join(dst, "config.json"), "w") as b:
    b.write(a.read())
PY
}

L=(--model llama --layers 2 --hidden 32 --heads 4 --kv-heads 2 --seq 16 --batch 4)
"$M" train --mesh tp=2 "${L[@]}" --steps 3 --no-metrics --save ck.safetensors 2>/dev/null
"$M" export --checkpoint ck.safetensors --out hf >export.txt 2>/dev/null
# --save on a pipeline and on fsdp writes the same file layout (names, shapes, order: the header).
header() { /usr/bin/python3 -c "import struct,sys;f=open(sys.argv[1],'rb');n=struct.unpack('<Q',f.read(8))[0];sys.stdout.write(f.read(n).decode())" "$1"; }
for mesh in pp=2 fsdp=2; do
  "$M" train --mesh $mesh "${L[@]}" --steps 1 --no-metrics --save "ck_$mesh.safetensors" 2>/dev/null
  [ "$(header "ck_$mesh.safetensors")" = "$(header ck.safetensors)" ] && ok "--save at $mesh: the file layout of tp=2's" \
    || fail "--save at $mesh: header $(header "ck_$mesh.safetensors" | head -c 300)"
done
grep -q "wrote hf (.* parameters, float32): config.json, model.safetensors" export.txt || fail "export: $(cat export.txt)"
[ "$(key hf/config.json model_type)" = '"llama"' ] && grep -q '"LlamaForCausalLM"' hf/config.json \
  && [ "$(key hf/config.json num_key_value_heads)" = 2 ] && ok "export: config.json is a LlamaForCausalLM's" \
  || fail "export config: $(cat hf/config.json)"
# The header names linears [out, in]: gate_proj of hidden 32 -> ffn 128 is [128, 32].
# (The header through a file, not a pipe: grep -q stops reading at its match, and head's SIGPIPE would
# fail the pipeline under pipefail.)
head -c 20000 hf/model.safetensors > header.txt
grep -q '"model.layers.0.mlp.gate_proj.weight":{"dtype":"F32","shape":\[128,32\]' header.txt \
  && ok "export: linears in Hugging Face's [out, in]" || fail "export layout: $(head -c 600 hf/model.safetensors | tail -c 560)"
"$M" export --checkpoint ck.safetensors --out hf16 --dtype bfloat16 >/dev/null 2>&1
grep -q '"torch_dtype": "bfloat16"' hf16/config.json && ok "export --dtype bfloat16" || fail "bf16 config"

"$M" train --mesh tp=1 --init-from hf --seq 16 --batch 4 --steps 1 --metrics m1.jsonl 2>train.err
grep -q "starting from 'hf': Hugging Face llama: num_hidden_layers 2, hidden_size 32, num_attention_heads 4, num_key_value_heads 2" train.err \
  && ok "init-from reports the directory's model" || fail "init-from report: $(head -c 400 train.err)"
"$M" train --mesh tp=2 --init-from hf --seq 16 --batch 4 --steps 1 --metrics m2.jsonl 2>/dev/null
"$M" train --mesh tp=2 --init-from hf16 --seq 16 --batch 4 --steps 1 --metrics m16.jsonl 2>/dev/null
l1=$(first_loss m1.jsonl) l2=$(first_loss m2.jsonl) l16=$(first_loss m16.jsonl)
awk -v a="$l1" -v b="$l2" -v c="$l16" 'BEGIN { d = a - b; e = a - c; if (d < 0) d = -d; if (e < 0) e = -e;
  exit !(d < 1e-5 * a && e < 1e-2 * a && e > 0) }' \
  && ok "init-from: tp=1 and tp=2 start at the same loss ($l1, $l2); BF16 close ($l16)" \
  || fail "init-from losses $l1 $l2 $l16"
expect_error "init-from: a size that disagrees is refused" "--kv-heads 4 disagrees with num_key_value_heads = 2" -- \
  "$M" train --model llama --kv-heads 4 --init-from hf --seq 16 --batch 4 --steps 1 --no-metrics

# A sharded copy (what save_pretrained writes for large models) starts at the same loss.
shard hf sharded
"$M" train --mesh tp=2 --init-from sharded --seq 16 --batch 4 --steps 1 --metrics ms.jsonl 2>/dev/null
[ "$(first_loss ms.jsonl)" = "$l2" ] && ok "init-from a sharded directory: the same first loss" \
  || fail "sharded loss $(first_loss ms.jsonl) vs $l2"
cp sharded/model-00002-of-00002.safetensors sharded/model-00003-of-00003.safetensors
expect_error "a shard the index does not name is refused" "'model-00003-of-00003.safetensors' is a shard file" -- \
  "$M" train --init-from sharded --seq 16 --batch 4 --steps 1 --no-metrics
rm sharded/model-0000[23]-of-0000[23].safetensors
expect_error "a missing shard is refused naming it" "'model-00002-of-00002.safetensors', which is not a file" -- \
  "$M" train --init-from sharded --seq 16 --batch 4 --steps 1 --no-metrics

# GPT-2 directories read through the same reader, sharded too.
"$M" train --mesh tp=1 --layers 2 --hidden 32 --heads 4 --seq 16 --batch 4 --steps 2 --no-metrics --save gpt.safetensors 2>/dev/null
"$M" export --checkpoint gpt.safetensors --out gpt >/dev/null 2>&1
shard gpt gpt_sharded
"$M" train --init-from gpt --seq 16 --batch 4 --steps 1 --metrics g1.jsonl 2>/dev/null
"$M" train --init-from gpt_sharded --seq 16 --batch 4 --steps 1 --metrics g2.jsonl 2>/dev/null
[ -n "$(first_loss g1.jsonl)" ] && [ "$(first_loss g1.jsonl)" = "$(first_loss g2.jsonl)" ] \
  && ok "init-from a sharded GPT-2 directory: the same first loss" || fail "gpt2 sharded $(first_loss g1.jsonl) $(first_loss g2.jsonl)"

# sample: the directory and the --save file give the same greedy text, at tp=1 and tp=2.
"$M" sample --checkpoint hf --prompt "The " --tokens 12 --temperature 0 --mesh tp=2 >s_dir.txt 2>/dev/null
"$M" sample --checkpoint ck.safetensors --prompt "The " --tokens 12 --temperature 0 --mesh tp=1 >s_file.txt 2>/dev/null
[ -s s_dir.txt ] && cmp -s s_dir.txt s_file.txt && ok "sample: a Llama directory and its --save file, the same text" \
  || fail "sample: $(od -c s_dir.txt | head -3) vs $(od -c s_file.txt | head -3)"

# grads: a config.json and weights in Hugging Face layout; --mesh-invariant bitwise across meshes
# (2 blocks: the fixed tree nests in the shards of the 2 key/value heads).
/usr/bin/python3 - <<'PY'
import struct, json
ids = [(7 * i + 3) % 256 for i in range(4 * 16)]
tg = ids[1:] + [5]
h = {"inputs": {"dtype": "I64", "shape": [4, 16], "data_offsets": [0, 512]},
     "targets": {"dtype": "I64", "shape": [4, 16], "data_offsets": [512, 1024]}}
t = json.dumps(h).encode(); t += b" " * ((8 - len(t) % 8) % 8)
open("batch.safetensors", "wb").write(struct.pack("<Q", len(t)) + t + struct.pack("<64q", *ids) + struct.pack("<64q", *tg))
PY
for mesh in tp=1 tp=2 dp=2 pp=2; do
  "$M" grads --config hf/config.json --weights hf/model.safetensors --batch batch.safetensors --mesh "$mesh" \
    --mesh-invariant --invariant-blocks 2 --out "g_$mesh.safetensors" >/dev/null 2>g.err || fail "grads $mesh: $(cat g.err)"
done
same=1
for mesh in tp=2 dp=2 pp=2; do
  # The files differ in their "mesh" metadata only: compare from the tensors' data on.
  a=$(/usr/bin/python3 -c "import struct,sys;f=open(sys.argv[1],'rb');n=struct.unpack('<Q',f.read(8))[0];f.read(n);import hashlib;print(hashlib.sha256(f.read()).hexdigest())" "g_tp=1.safetensors")
  b=$(/usr/bin/python3 -c "import struct,sys;f=open(sys.argv[1],'rb');n=struct.unpack('<Q',f.read(8))[0];f.read(n);import hashlib;print(hashlib.sha256(f.read()).hexdigest())" "g_$mesh.safetensors")
  [ "$a" = "$b" ] || { same=0; fail "grads --mesh-invariant: $mesh differs from tp=1"; }
done
[ $same = 1 ] && ok "grads --mesh-invariant: tp=1, tp=2, dp=2 and pp=2 write the same bits"
head -c 20000 g_tp=1.safetensors > header.txt
grep -q '"model.layers.0.mlp.gate_proj.weight":{"dtype":"F32","shape":\[128,32\]' header.txt \
  && ok "grads: gradients in the weights' Hugging Face layout" || fail "grads layout"

if [ $failures -gt 0 ]; then
  echo "$failures failure(s)"
  exit 1
fi
echo "all passed"
