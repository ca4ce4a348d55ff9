#!/usr/bin/env bash
# Peak tensor memory per rank against the sequence length at cp = 1, 2, 4 (docs/BENCHMARKS.md,
# "Context parallelism"), GPT-2 small (12 x 768, 12 heads, vocab 50257), batch 1, two full training
# steps each (the second's peak is a training step's: parameters, AdamW's moments, gradients and
# activations), with and
# without --checkpoint-blocks, then the longest sequence whose estimated peak fits the budget
# (bench/cp_memory_report.py says how it is estimated).
# usage: bench/cp_memory.sh MESHGRAD OUT_DIR [SEQS] [BUDGET_GIB]
set -euo pipefail
mg=$(realpath "$1") out=$2 seqs=${3:-"1024 2048 4096"} budget=${4:-22}
mkdir -p "$out"
export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-Haswell}
gpt2=(--layers 12 --hidden 768 --heads 12 --vocab 50257 --batch 1 --steps 2)
for ckpt in "" "--checkpoint-blocks"; do
  tag=$([ -z "$ckpt" ] && echo plain || echo ckpt)
  for seq in $seqs; do
    # shellcheck disable=SC2086
    "$mg" bench memory --mesh "tp=1 cp=2 cp=4" "${gpt2[@]}" --seq "$seq" $ckpt > "$out/mem_${tag}_$seq.txt" 2>&1 ||
      { cat "$out/mem_${tag}_$seq.txt"; exit 1; }
  done
done
python3 "$(dirname "$0")/cp_memory_report.py" "$out" "$seqs" "$budget"
python3 "$(dirname "$0")/plot_cp_memory.py" "$out" "$seqs" "$out/cp_memory.svg"
