#!/bin/sh
# Training throughput against PyTorch and against the machine, in one run: the OpenBLAS sgemm
# peak (bench/peers/sgemm_peak.c, n = 1024, OpenBLAS's default threads), the PyTorch peer
# (bench/peers/torch_gpt_train.py, 2 threads) and `meshgrad train` at tp = 1, 2 and 4 on one
# shape (default: nanoGPT-sized, 6 layers, width 384, 6 heads, seq 256, batch 8), then one table:
# tokens/s, ratio to PyTorch, GFLOP/s counting 6 N + 12 L C T flops per token (N parameters,
# L layers, C width, T sequence) and that as % of the sgemm peak. These machines are noisy: only
# the ratios within one run mean anything. Needs gcc, libopenblas-dev and python3-torch.
#
# GEMM kernels: all three run OpenBLAS (PyTorch's GEMMs too), whose kernel table is OpenBLAS's choice
# for the CPU unless OPENBLAS_CORETYPE says otherwise. When the environment sets it (this workplace
# sets OPENBLAS_CORETYPE=Haswell: AVX2 kernels, about half the sgemm speed of the AVX-512 ones on its
# CPUs), the whole comparison runs twice: with the environment's kernels and with OpenBLAS's own
# choice, one table each, every row of a table on the same kernels.
# Usage: bench/compare_train.sh [BUILD_DIR [STEPS [LAYERS HIDDEN HEADS SEQ BATCH]]]
set -eu
build=${1:-build}
steps=${2:-20}
layers=${3:-6} hidden=${4:-384} heads=${5:-6} seq=${6:-256} batch=${7:-8}
peers=$(dirname "$0")/peers
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
gcc -O2 "$peers/sgemm_peak.c" -lopenblas -o "$work/sgemm"

settings="own"
[ -n "${OPENBLAS_CORETYPE:-}" ] && settings="environment own"
environment_core=${OPENBLAS_CORETYPE:-}

for setting in $settings; do
  if [ "$setting" = own ]; then unset OPENBLAS_CORETYPE; else export OPENBLAS_CORETYPE="$environment_core"; fi
  peak=$("$work/sgemm" 1024 | sed -n 's/.*: \([0-9.]*\) GFLOP\/s/\1/p')
  torch=$(/usr/bin/python3 "$peers/torch_gpt_train.py" "$steps" "$layers" "$hidden" "$heads" "$seq" "$batch")
  torch_tps=$(echo "$torch" | sed -n 's/.*: \([0-9]*\) tokens\/s.*/\1/p')
  # meshgrad: 5 warm-up steps, then tokens/s over the next STEPS from the per-step metrics.
  for tp in 1 2 4; do
    "$build/meshgrad" train --mesh tp=$tp --steps $((steps + 5)) --layers "$layers" --hidden "$hidden" \
      --heads "$heads" --seq "$seq" --batch "$batch" --metrics "$work/tp$tp.jsonl" > "$work/tp$tp.log" 2>&1 ||
      { cat "$work/tp$tp.log"; exit 1; }
  done
  kernels=$(sed -n 's/^compute: [^;]*; \(.*\)$/\1/p' "$work/tp1.log" | head -1)

  /usr/bin/python3 - "$work" "$peak" "$torch_tps" "$steps" "$layers" "$hidden" "$seq" "$batch" "$kernels" <<'PY'
import json, sys
work, peak, torch_tps = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
steps, L, C, T, B = (int(a) for a in sys.argv[4:9])
print(f"\nkernels: {sys.argv[9]}")
V = 256
params = V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C   # tied wte, wpe, blocks, final LayerNorm
flops_per_token = 6 * params + 12 * L * C * T
print(f"shape: layers {L}, hidden {C}, seq {T}, batch {B}, {params} parameters; "
      f"{flops_per_token / 1e6:.1f} MFLOP per token; sgemm peak (n=1024) {peak:.1f} GFLOP/s")
print(f"| run | tokens/s | vs PyTorch | GFLOP/s | % of sgemm peak |")
print(f"|---|---:|---:|---:|---:|")
def row(name, tps):
    g = tps * flops_per_token / 1e9
    print(f"| {name} | {tps:.0f} | {tps / torch_tps:.2f}x | {g:.1f} | {100 * g / peak:.0f}% |")
row("PyTorch 1.13 (2 threads)", torch_tps)
for tp in (1, 2, 4):
    rows = [json.loads(l) for l in open(f"{work}/tp{tp}.jsonl") if l.strip()]
    rows = [r for r in rows if r.get("type") != "header"]
    first, last = rows[4], rows[4 + steps]   # after 5 warm-up steps
    tps = steps * B * T / (last["elapsed_s"] - first["elapsed_s"])
    row(f"meshgrad tp={tp}", tps)
PY
done
