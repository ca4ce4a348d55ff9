#!/usr/bin/env bash
# Peak tensor memory per rank against the sequence length at cp = 1, 2, 4 (docs/BENCHMARKS.md,
# "Context parallelism"), GPT-2 small (12 x 768, 12 heads, vocab 50257), batch 1, one full training
# step each (forward, backward, the gradients' reduction, AdamW's first step: its moments), with and
# without --checkpoint-blocks, then a linear fit of peak against T per mesh (the blocked attention
# keeps no [T, T] matrix, so every saved tensor is linear in T) and the longest sequence whose fitted
# peak per rank fits the budget (default: 24 GiB less 2 GiB for the process, over the ranks of a run
# on this one machine).
# usage: bench/cp_memory.sh MESHGRAD OUT_DIR [SEQS] [BUDGET_GIB]
set -euo pipefail
mg=$(realpath "$1") out=$2 seqs=${3:-"1024 2048 4096"} budget=${4:-22}
mkdir -p "$out"
export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-Haswell}
gpt2=(--layers 12 --hidden 768 --heads 12 --vocab 50257 --batch 1 --steps 1)
for ckpt in "" "--checkpoint-blocks"; do
  tag=$([ -z "$ckpt" ] && echo plain || echo ckpt)
  for seq in $seqs; do
    # shellcheck disable=SC2086
    "$mg" bench memory --mesh "tp=1 cp=2 cp=4" "${gpt2[@]}" --seq "$seq" $ckpt > "$out/mem_${tag}_$seq.txt" 2>&1 ||
      { cat "$out/mem_${tag}_$seq.txt"; exit 1; }
  done
done
python3 - "$out" "$seqs" "$budget" <<'PY'
import re, sys
out, seqs, budget = sys.argv[1], [int(s) for s in sys.argv[2].split()], float(sys.argv[3])
for tag in ("plain", "ckpt"):
    print(f"\n{'--checkpoint-blocks' if tag == 'ckpt' else 'without activation checkpointing'}: "
          f"peak MiB per rank (act: the formula's activations)")
    peaks = {}
    print(f"{'T':>7} " + " ".join(f"{m:>18}" for m in ("tp=1", "cp=2", "cp=4")))
    for seq in seqs:
        row = {}
        for line in open(f"{out}/mem_{tag}_{seq}.txt"):
            f = line.split()
            if f and f[0] in ("tp=1", "cp=2", "cp=4") and len(f) > 7:
                row[f[0]] = (float(f[3]), float(f[6]))   # act, peak
        peaks[seq] = row
        print(f"{seq:>7} " + " ".join(f"{row[m][1]:>9.0f} ({row[m][0]:>6.0f})" for m in ("tp=1", "cp=2", "cp=4")))
    print("ratio of peaks to tp=1: " + "; ".join(
        f"T={s}: cp=2 {peaks[s]['cp=2'][1] / peaks[s]['tp=1'][1]:.2f}, cp=4 {peaks[s]['cp=4'][1] / peaks[s]['tp=1'][1]:.2f}"
        for s in seqs))
    for m, ranks in (("tp=1", 1), ("cp=2", 2), ("cp=4", 4)):
        xs = seqs
        ys = [peaks[s][m][1] for s in xs]
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        base = my - slope * mx
        per_rank = budget * 1024 / ranks
        longest = int((per_rank - base) / slope)
        print(f"  {m}: peak = {base:.0f} MiB + {slope * 1024:.1f} MiB per 1K positions; the longest T whose "
              f"peak fits {per_rank / 1024:.1f} GiB per rank ({ranks} rank(s) in {budget:.0f} GiB): {longest}")
PY
