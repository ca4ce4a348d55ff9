#!/bin/sh
# What the GEMMs of one training step can reach on this machine: OpenBLAS sgemm GFLOP/s at each
# matrix-product shape of a GPT step (tokens S = batch x seq, width C, ffn 4C, vocab V; per block
# c_attn S x 3C x C, attn c_proj S x C x C, c_fc S x 4C x C, mlp c_proj S x C x 4C, the tied head
# S x V x C; attention's 64 x 64 tiles, as src/tensor/kernels_attention.cpp computes it: per batch
# and head the causal half of the (T/64)^2 tile pairs, a scores and a weighted-values product of
# 64 x 64 x 64 each, the heads split over the threads, so timed on one thread and counted THREADS
# times as fast), each timed as the forward product (backward's products have the same flops), weighted by flops,
# against the square n = 1024 product that bench/compare_train.sh takes as the peak. The ratio is the
# ceiling of "% of the sgemm peak" for a step made only of these GEMMs at OpenBLAS's speed.
# Usage: [LIB=openblas|blis] bench/gemm_ceiling.sh LAYERS HIDDEN HEADS SEQ BATCH VOCAB [THREADS]
#   THREADS: threads per product, default 2 = one rank at tp=1 on this 2-core machine. LIB=blis times
#   BLIS (Debian libblis-pthread-dev, its CBLAS layer) instead of OpenBLAS, to choose by the numbers.
set -eu
L=$1 C=$2 H=$3 T=$4 B=$5 V=$6 threads=${7:-2}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
case "${LIB:-openblas}" in
  openblas) gcc -O2 "$(dirname "$0")/peers/sgemm_peak.c" -lopenblas -o "$work/sgemm" ;;
  blis) blis=/usr/lib/x86_64-linux-gnu/blis-pthread
        gcc -O2 -I/usr/include/x86_64-linux-gnu/blis-pthread "$(dirname "$0")/peers/sgemm_peak.c" \
            -L"$blis" -Wl,-rpath,"$blis" -lblis -lpthread -lm -o "$work/sgemm" ;;
  *) echo "gemm_ceiling: LIB must be openblas or blis, got $LIB" >&2; exit 2 ;;
esac
export OPENBLAS_NUM_THREADS=$threads BLIS_NUM_THREADS=$threads
S=$((B * T)) D=$((C / H))
peak=$("$work/sgemm" 1024 1024 1024 10 | sed -n 's/.*: \([0-9.]*\) GFLOP\/s/\1/p')
echo "${LIB:-openblas} sgemm peak n=1024, $threads threads: $peak GFLOP/s"
# name M N K count (products of that shape per step's forward) threads-per-product
nb=$(( (T + 63) / 64 ))
tiles=$((L * B * H * nb * (nb + 1) / 2))
printf '%s\n' "c_attn $S $((3 * C)) $C $L $threads" "attn_proj $S $C $C $L $threads" "c_fc $S $((4 * C)) $C $L $threads" \
  "mlp_proj $S $C $((4 * C)) $L $threads" "head $S $V $C 1 $threads" "att_scores 64 64 $D $tiles 1" "att_values 64 $D 64 $tiles 1" |
while read -r name m n k count per; do
  g=$(OPENBLAS_NUM_THREADS=$per BLIS_NUM_THREADS=$per "$work/sgemm" "$m" "$n" "$k" 20 | sed -n 's/.*: \([0-9.]*\) GFLOP\/s/\1/p')
  echo "$name $m $n $k $count $(python3 -c "print($g * $threads / $per)")"
done > "$work/shapes.txt"
python3 - "$work/shapes.txt" "$peak" <<'PY'
import sys
rows = [l.split() for l in open(sys.argv[1])]
peak = float(sys.argv[2])
print(f"{'product':<10} {'M x N x K':>20} {'count':>6} {'GFLOP/s':>9} {'% peak':>7} {'share of flops':>15}")
total_flops = sum(2 * int(m) * int(n) * int(k) * int(c) for _, m, n, k, c, _ in rows)
total_time = 0.0
for name, m, n, k, c, g in rows:
    f = 2 * int(m) * int(n) * int(k) * int(c)
    total_time += f / (float(g) * 1e9)
    print(f"{name:<10} {m + ' x ' + n + ' x ' + k:>20} {c:>6} {float(g):>9.1f} {100 * float(g) / peak:>6.0f}% {100 * f / total_flops:>14.1f}%")
ceiling = total_flops / total_time / 1e9
print(f"all products, weighted by flops: {ceiling:.1f} GFLOP/s = {100 * ceiling / peak:.0f}% of the n=1024 peak")
PY
