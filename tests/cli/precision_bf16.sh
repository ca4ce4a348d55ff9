#!/usr/bin/env bash
# --precision bf16 in whole runs (docs/training.md, "Mixed precision"):
#  1. the banner and the metrics header say bf16 and which kernels run its products: oneDNN's bf16
#     kernels when the build and the CPU have them, else the float32 kernels and why;
#     MESHGRAD_GEMM=openblas takes the float32-kernel route and says so;
#  2. a float64 model with bf16 is refused naming both options;
#  3. a bf16 checkpoint resumes on another mesh (tp=1 -> tp=2) in bf16 (the recorded precision), a
#     resume may switch to float32, and `sample` and `export --dtype bfloat16` take the checkpoint.
# usage: precision_bf16.sh MESHGRAD WORKDIR ONEDNN(0|1)
set -euo pipefail
mg=$1 work=$2 onednn=$3
rm -rf "$work" && mkdir -p "$work"
small=(--layers 2 --hidden 64 --heads 4 --seq 32 --batch 4)
fail() { echo "$1"; [ -n "${2:-}" ] && cat "$2"; exit 1; }
"$mg" train "${small[@]}" --steps 3 --precision bf16 --metrics "$work/b.jsonl" > "$work/b.log" 2>&1 || fail "bf16 run failed" "$work/b.log"
grep -q "^precision: bf16 (bf16 inputs to the products and attention" "$work/b.log" || fail "no precision line" "$work/b.log"
header=$(head -1 "$work/b.jsonl")
# MFU's peak is the bf16 one in a bf16 run: `bench peak` prints the same probe's figures.
"$mg" bench peak --sizes 256 --reps 2 > "$work/peak.txt" 2>&1 || fail "bench peak failed" "$work/peak.txt"
grep -q "^float32 OpenBLAS: n=256: [0-9.]* GFLOP/s$" "$work/peak.txt" || fail "bench peak: float32 line" "$work/peak.txt"
grep -q "^bf16 [a-zA-Z0-9 ]*: n=256: [0-9.]* GFLOP/s$" "$work/peak.txt" || fail "bench peak: bf16 line" "$work/peak.txt"
grep -q "^best bf16: [0-9.]* GFLOP/s$" "$work/peak.txt" || fail "bench peak: best bf16" "$work/peak.txt"
echo "$header" | grep -q '"precision":"bf16"' || fail "header lacks the precision: $header"
echo "$header" | grep -q '"bf16_products":"' || fail "header lacks bf16_products: $header"
if [ "$onednn" = 1 ] && grep -q -E 'avx512_bf16|amx_bf16' /proc/cpuinfo; then
  grep -q "bf16 products: oneDNN [0-9.]* brg:" "$work/b.log" || fail "a bf16 CPU with oneDNN must run oneDNN's bf16 kernels" "$work/b.log"
fi
# --config takes it as the command line does.
echo '{"precision": "bf16", "reduce-dtype": "bf16"}' > "$work/config.json"
"$mg" train "${small[@]}" --steps 1 --mesh dp=2 --config "$work/config.json" --metrics "$work/cfg.jsonl" > "$work/cfg.log" 2>&1 ||
  fail "--config run failed" "$work/cfg.log"
head -1 "$work/cfg.jsonl" | grep -q '"precision":"bf16","reduce-dtype":"bf16"' || fail "--config: $(head -1 "$work/cfg.jsonl")"
MESHGRAD_GEMM=openblas "$mg" train "${small[@]}" --steps 1 --precision bf16 --no-metrics > "$work/o.log" 2>&1 ||
  fail "openblas bf16 run failed" "$work/o.log"
grep -q "bf16 products: float32 kernels on bf16 operands (float32 products run on OpenBLAS here (MESHGRAD_GEMM=openblas" \
  "$work/o.log" || fail "the fallback must say why" "$work/o.log"
if "$mg" train "${small[@]}" --steps 1 --precision bf16 --dtype float64 --no-metrics > "$work/f64.log" 2>&1; then
  fail "bf16 with --dtype float64 was accepted"
fi
grep -q -- "--precision bf16 needs --dtype float32" "$work/f64.log" || fail "float64 refusal" "$work/f64.log"
# Checkpoints: bf16 on one rank, resumed at tp=2 (still bf16, from the record), then in float32.
"$mg" train "${small[@]}" --steps 4 --precision bf16 --checkpoint-dir "$work/ck" --save-every 2 --no-metrics \
  > "$work/c1.log" 2>&1 || fail "checkpointed bf16 run failed" "$work/c1.log"
"$mg" train --resume "$work/ck/step_00000002" --checkpoint-dir "$work/ck2" --mesh tp=2 --metrics "$work/r.jsonl" \
  > "$work/r.log" 2>&1 || fail "resume at tp=2 failed" "$work/r.log"
grep -q "^precision: bf16" "$work/r.log" || fail "the resume must keep bf16" "$work/r.log"
"$mg" train --resume "$work/ck/step_00000002" --checkpoint-dir "$work/ck3" --precision float32 --no-metrics \
  > "$work/r32.log" 2>&1 || fail "resume in float32 failed" "$work/r32.log"
if grep -q "^precision: bf16" "$work/r32.log"; then fail "--precision float32 on resume was ignored" "$work/r32.log"; fi
"$mg" sample --checkpoint "$work/ck" --tokens 8 --prompt "a" > "$work/s.txt" 2>&1 || fail "sample failed" "$work/s.txt"
"$mg" export --checkpoint "$work/ck" --out "$work/hf" --dtype bfloat16 > "$work/e.log" 2>&1 || fail "export failed" "$work/e.log"
python3 - "$work/hf/model.safetensors" <<'PY' || fail "the export is not BF16"
import json, struct, sys
raw = open(sys.argv[1], "rb").read()
header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
sys.exit(0 if dtypes == {"BF16"} else f"dtypes {dtypes}")
PY
# --reduce-dtype bf16: gradients over dp and fsdp as bf16 (explain counts half the bytes), a run close
# to the float32 reduction's but not its bits; refused with an invariant mode and with float64.
for rd in float32 bf16; do
  "$mg" train "${small[@]}" --steps 6 --mesh dp=2,fsdp=2 --reduce-dtype $rd --metrics "$work/rd_$rd.jsonl"     > "$work/rd_$rd.log" 2>&1 || fail "--reduce-dtype $rd failed" "$work/rd_$rd.log"
  "$mg" explain --mesh dp=2,fsdp=2 --reduce-dtype $rd > "$work/ex_$rd.txt" 2>&1 || fail "explain failed" "$work/ex_$rd.txt"
done
python3 - "$work" <<'PY' || fail "--reduce-dtype bf16 against float32"
import json, re, sys
w = sys.argv[1]
loss = {rd: [json.loads(l)["loss"] for l in open(f"{w}/rd_{rd}.jsonl") if '"loss"' in l] for rd in ("float32", "bf16")}
assert loss["bf16"] != loss["float32"], "the bf16 reduction gave float32's bits"
assert all(abs(a - b) / a < 1e-2 for a, b in zip(loss["bf16"], loss["float32"])), loss
def rs_bytes(rd):
    rows = [l for l in open(f"{w}/ex_{rd}.txt") if re.search(r"backward\s+reduce_scatter\s+fsdp", l)]
    return sum(int(l.split()[-3]) for l in rows)
assert rs_bytes("bf16") * 2 == rs_bytes("float32"), (rs_bytes("bf16"), rs_bytes("float32"))
PY
if "$mg" train "${small[@]}" --steps 1 --mesh dp=2 --reduce-dtype bf16 --mesh-invariant --no-metrics > "$work/rdi.log" 2>&1; then
  fail "--reduce-dtype bf16 with --mesh-invariant was accepted"
fi
grep -q -- "--reduce-dtype bf16 cannot be combined with --mesh-invariant" "$work/rdi.log" || fail "invariant refusal" "$work/rdi.log"
echo "precision bf16: banners, header, refusal, resume on tp=2 and in float32, sample and BF16 export hold;"
echo "reduce-dtype bf16: half the reduce-scatter bytes, close to float32's reduction, refused with --mesh-invariant"
