#!/usr/bin/env bash
# The float32 product library in whole runs (include/meshgrad/tensor/blas.hpp):
#  1. --mesh-invariant stays bitwise the same at tp=1, 2 and 4 at a width where the products are
#     long enough (K = 1024) for oneDNN's two kernels to round differently (the mode runs OpenBLAS),
#     in float32 and with --precision bf16;
#  2. a plain run names oneDNN in its banner and metrics header when the build has it, and
#     MESHGRAD_GEMM=openblas switches it; an unknown MESHGRAD_GEMM is refused naming it.
# usage: gemm_library.sh MESHGRAD WORKDIR ONEDNN(0|1)
set -euo pipefail
mg=$1 work=$2 onednn=$3
rm -rf "$work" && mkdir -p "$work"
shape=(--layers 1 --hidden 1024 --heads 8 --seq 64 --batch 4 --steps 2)
losses() { grep -o '"loss":[^,]*' "$1" | tr '\n' ' '; }
for mesh in tp=1 tp=2 tp=4; do
  "$mg" train --mesh $mesh --mesh-invariant "${shape[@]}" --metrics "$work/$mesh.jsonl" > "$work/$mesh.log" 2>&1
done
one=$(losses "$work/tp=1.jsonl")
[ -n "$one" ] || { echo "no losses in $work/tp=1.jsonl"; exit 1; }
for mesh in tp=2 tp=4; do
  got=$(losses "$work/$mesh.jsonl")
  [ "$got" = "$one" ] || { echo "--mesh-invariant $mesh: $got != tp=1: $one"; exit 1; }
done
# The same in bf16 (--precision bf16): its products round their operands elementwise and run the
# float32 kernels in the invariant modes, so tp=1, 2 and 4 still agree bit for bit.
for mesh in tp=1 tp=2 tp=4; do
  "$mg" train --mesh $mesh --mesh-invariant --precision bf16 "${shape[@]}" --metrics "$work/bf16_$mesh.jsonl" \
    > "$work/bf16_$mesh.log" 2>&1
done
one_bf16=$(losses "$work/bf16_tp=1.jsonl")
[ -n "$one_bf16" ] && [ "$one_bf16" != "$one" ] || { echo "bf16 losses missing or float32's: $one_bf16"; exit 1; }
for mesh in tp=2 tp=4; do
  got=$(losses "$work/bf16_$mesh.jsonl")
  [ "$got" = "$one_bf16" ] || { echo "--mesh-invariant --precision bf16 $mesh: $got != tp=1: $one_bf16"; exit 1; }
done
grep -q "compute: 1 BLAS thread per rank (--mesh-invariant" "$work/tp=4.log" || { echo "banner:"; cat "$work/tp=4.log"; exit 1; }
grep -q '"gemm":"openblas' "$work/tp=4.jsonl" || { echo "an invariant run's header must name OpenBLAS"; head -1 "$work/tp=4.jsonl"; exit 1; }
small=(--layers 1 --hidden 64 --heads 4 --seq 16 --batch 4 --steps 1 --mesh tp=1)
"$mg" train "${small[@]}" --metrics "$work/plain.jsonl" > "$work/plain.log" 2>&1
if [ "$onednn" = 1 ]; then
  grep -q "; oneDNN [0-9.]* .* for float32 products of >= 2^24" "$work/plain.log" || { cat "$work/plain.log"; exit 1; }
  grep -q '"gemm":"onednn' "$work/plain.jsonl" || { head -1 "$work/plain.jsonl"; exit 1; }
fi
MESHGRAD_GEMM=openblas "$mg" train "${small[@]}" --metrics "$work/openblas.jsonl" > "$work/openblas.log" 2>&1
grep -q '"gemm":"openblas' "$work/openblas.jsonl" || { head -1 "$work/openblas.jsonl"; exit 1; }
if MESHGRAD_GEMM=mkl "$mg" train "${small[@]}" --no-metrics > "$work/bad.log" 2>&1; then
  echo "MESHGRAD_GEMM=mkl was accepted"; exit 1
fi
grep -q "MESHGRAD_GEMM=mkl: the float32 product library must be 'openblas' or 'onednn'" "$work/bad.log" ||
  { cat "$work/bad.log"; exit 1; }
echo "gemm library: --mesh-invariant bitwise at tp=1, 2, 4 (losses $one); banners and MESHGRAD_GEMM hold"
