#!/usr/bin/env bash
# Peak tensor memory per rank against the sequence length at cp = 1, 2, 4 (docs/BENCHMARKS.md,
# "Context parallelism"), GPT-2 small (12 x 768, 12 heads, vocab 50257), batch 1, two full training
# steps each (the second's peak is a training step's: parameters, AdamW's moments, gradients and
# activations), with and
# without --checkpoint-blocks, then a linear fit of peak against T per mesh (the blocked attention
# keeps no [T, T] matrix, so every saved tensor is linear in T) and the longest sequence whose fitted
# peak fits the budget (default: 24 GiB less 2 GiB for the process): with all of a run's ranks on this
# one machine (the budget over the ranks), and with one rank per machine of this size (what cp is for).
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
python3 - "$out" "$seqs" "$budget" <<'PY'
import sys
out, seqs, budget = sys.argv[1], [int(s) for s in sys.argv[2].split()], float(sys.argv[3])
meshes = (("tp=1", 1), ("cp=2", 2), ("cp=4", 4))
for tag in ("plain", "ckpt"):
    print(f"\n{'--checkpoint-blocks' if tag == 'ckpt' else 'without activation checkpointing'}: MiB per rank, "
          f"peak / saved activations (measured)")
    rows = {}
    print(f"{'T':>7} " + " ".join(f"{m:>17}" for m, _ in meshes))
    for seq in seqs:
        row = {}
        for line in open(f"{out}/mem_{tag}_{seq}.txt"):
            f = line.split()
            if f and f[0] in dict(meshes) and len(f) > 12:
                # mesh params states act ideal | resident peak peak/ideal | saved grads+act step-pmv | RSS
                row[f[0]] = dict(params=float(f[1]), peak=float(f[7]), saved=float(f[10]), pmv=float(f[12]))
        rows[seq] = row
        print(f"{seq:>7} " + " ".join(f"{row[m]['peak']:>8.0f} / {row[m]['saved']:>6.0f}" for m, _ in meshes))
    print("saved activations against tp=1: " + "; ".join(
        f"T={s}: cp=2 {rows[s]['cp=2']['saved'] / rows[s]['tp=1']['saved']:.3f}, "
        f"cp=4 {rows[s]['cp=4']['saved'] / rows[s]['tp=1']['saved']:.3f}" for s in seqs))
    # A step's peak is the parameters, m and v (3 x params, float32) plus the step's own peak above them
    # (gradients and activations: linear in T, the blocked attention keeps no [T, T] matrix).
    for m, ranks in meshes:
        xs = seqs
        ys = [rows[s][m]["pmv"] for s in xs]
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        base = my - slope * mx + 3 * rows[xs[0]][m]["params"]
        shared = int((budget * 1024 / ranks - base) / slope)   # every rank on this machine
        own = int((budget * 1024 - base) / slope)               # one rank per machine of this size
        print(f"  {m}: peak per rank = {base:.0f} MiB + {slope * 1024:.1f} MiB per 1K positions; longest T: "
              f"{shared} with its {ranks} rank(s) on this machine ({budget:.0f} GiB), {own} with one rank per "
              f"{budget:.0f} GiB machine")
PY
python3 "$(dirname "$0")/plot_cp_memory.py" "$out" "$seqs" "$out/cp_memory.svg"
