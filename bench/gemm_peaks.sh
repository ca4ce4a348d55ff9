#!/bin/sh
# The machine's product peaks, in one run: OpenBLAS sgemm on the environment's kernel table (this
# workplace sets OPENBLAS_CORETYPE=Haswell: AVX2) and on OpenBLAS's own choice for the CPU, oneDNN's
# float32 matmul and its bf16 one (bf16 inputs, float32 accumulation and output), square n x n x n,
# 2 threads, best of REPS after one untimed call. Then, at the products of a training step of the
# nanoGPT shape (tokens 2048, width 384: the MLP's 384 x 1536, attention's 384 x 1152 and 384 x 384)
# and below kOneDnnMinProduct, the float32 pair that blas::gemm chooses between: the table that sets
# blas.hpp's routing. Needs gcc, g++, libopenblas-dev and libdnnl-dev.
# Usage: bench/gemm_peaks.sh [REPS]      (default 10)
set -eu
reps=${1:-10}
peers=$(dirname "$0")/peers
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
gcc -O2 "$peers/sgemm_peak.c" -lopenblas -o "$work/sgemm"
g++ -O2 "$peers/dnnl_peak.cpp" -ldnnl -lgomp -o "$work/dnnl"
core=${OPENBLAS_CORETYPE:-}
gflops() { sed -n 's/.*: \([0-9.]*\) GFLOP\/s.*/\1/p'; }
echo "| n | OpenBLAS ${core:-own} (environment) | OpenBLAS own choice | oneDNN float32 | oneDNN bf16 |"
echo "|---:|---:|---:|---:|---:|"
for n in 1024 2048; do
  env_blas=$(OPENBLAS_NUM_THREADS=2 "$work/sgemm" $n $n $n "$reps" | gflops)
  own_blas=$(env -u OPENBLAS_CORETYPE OPENBLAS_NUM_THREADS=2 "$work/sgemm" $n $n $n "$reps" | gflops)
  f32=$(OMP_NUM_THREADS=2 "$work/dnnl" $n "$reps" f32)
  bf16=$(OMP_NUM_THREADS=2 "$work/dnnl" $n "$reps" bf16)
  echo "| $n | $env_blas | $own_blas | $(echo "$f32" | gflops) | $(echo "$bf16" | gflops) |"
  kernels="$(echo "$f32" | sed -n 's/.*(\(.*\))/\1/p'), $(echo "$bf16" | sed -n 's/.*(\(.*\))/\1/p')"
done
echo "oneDNN kernels: $kernels"
echo
echo "step shapes, float32 (M x N x K, 2 threads): OpenBLAS (environment) against oneDNN"
echo "| M x N x K | multiply-adds | OpenBLAS | oneDNN | oneDNN / OpenBLAS |"
echo "|---|---:|---:|---:|---:|"
for shape in "2048 1536 384" "2048 384 1536" "2048 1152 384" "2048 384 384" "256 256 64" "128 128 128" "256 128 64"; do
  set -- $shape
  blas=$(OPENBLAS_NUM_THREADS=2 "$work/sgemm" "$1" "$2" "$3" "$reps" | gflops)
  dnnl=$(OMP_NUM_THREADS=2 "$work/dnnl" "$1" "$reps" f32 "$2" "$3" | gflops)
  echo "| $1 x $2 x $3 | $(( $1 * $2 * $3 )) | $blas | $dnnl | $(echo "$dnnl $blas" | awk '{printf "%.2f", $1 / $2}') |"
done
