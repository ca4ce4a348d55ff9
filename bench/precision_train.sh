#!/bin/sh
# float32 against bf16 training (issue 39), in one run: the machine's product peaks in each precision
# (`meshgrad bench peak`, the probe behind train's MFU: the best float32 library, OpenBLAS or oneDNN,
# and bf16), then `meshgrad train` with --precision float32 and bf16 at
# tp = 1 and 2, and the PyTorch peer in float32 and under torch.autocast("cpu", torch.bfloat16), on
# one shape (default nanoGPT's, 6 layers, width 384, 6 heads, seq 256, batch 8). One table: tokens/s,
# bf16 against float32 of the same mesh, GFLOP/s (6 N + 12 L C T per token) as % of the peak of the
# run's precision, and the peak resident memory of the process (all ranks: threads of one process).
# Only ratios within one run mean anything on these shared machines. Needs python3-torch.
# Usage: [DATA=dir] [TPS="1 2"] [WARMUP=5] bench/precision_train.sh [BUILD_DIR [STEPS [LAYERS HIDDEN HEADS SEQ BATCH]]]
set -eu
build=${1:-build}
steps=${2:-20}
layers=${3:-6} hidden=${4:-384} heads=${5:-6} seq=${6:-256} batch=${7:-8}
tps=${TPS:-"1 2"}
warmup=${WARMUP:-5}
[ "$warmup" -ge 1 ] || { echo "precision_train: WARMUP must be >= 1, got $warmup" >&2; exit 2; }
peers=$(dirname "$0")/peers
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$build/meshgrad" bench peak --sizes 1024,2048 --reps 10 > "$work/peak.txt"
peak_f32=$(sed -n 's/^best float32: \([0-9.]*\) GFLOP\/s$/\1/p' "$work/peak.txt")
peak_bf16=$(sed -n 's/^best bf16: \([0-9.]*\) GFLOP\/s$/\1/p' "$work/peak.txt")
for tp in $tps; do
  for p in float32 bf16; do
    /usr/bin/time -f "%M" -o "$work/$p.tp$tp.rss" "$build/meshgrad" train --mesh tp=$tp ${DATA:+--data "$DATA"} \
      --steps $((steps + warmup)) --layers "$layers" --hidden "$hidden" --heads "$heads" --seq "$seq" --batch "$batch" \
      --precision $p --metrics "$work/$p.tp$tp.jsonl" > "$work/$p.tp$tp.log" 2>&1 || { cat "$work/$p.tp$tp.log"; exit 1; }
  done
done
first_tp=${tps%% *}
vocab=$(sed -n 's/.*vocab \([0-9]*\)).*/\1/p' "$work/float32.tp$first_tp.log" | head -1)
bf16_kernels=$(sed -n 's/.*bf16 products: \(.*\)$/\1/p' "$work/bf16.tp$first_tp.log" | head -1)
torch_f32=$(/usr/bin/python3 "$peers/torch_gpt_train.py" "$steps" "$layers" "$hidden" "$heads" "$seq" "$batch" "$vocab" "$warmup")
torch_bf16=$(TORCH_AUTOCAST=bf16 /usr/bin/python3 "$peers/torch_gpt_train.py" "$steps" "$layers" "$hidden" "$heads" "$seq" \
             "$batch" "$vocab" "$warmup")
/usr/bin/python3 - "$work" "$peak_f32" "$peak_bf16" "$steps" "$layers" "$hidden" "$seq" "$batch" "$vocab" "$warmup" "$tps" \
    "$torch_f32" "$torch_bf16" "$bf16_kernels" <<'PY'
import json, re, sys
work, peak = sys.argv[1], {"float32": float(sys.argv[2]), "bf16": float(sys.argv[3])}
steps, L, C, T, B, V, warmup = (int(a) for a in sys.argv[4:11])
tps = [int(t) for t in sys.argv[11].split()]
params = V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C
flops = 6 * params + 12 * L * C * T
print(f"shape: layers {L}, hidden {C}, seq {T}, batch {B}, vocab {V}, {params} parameters, {flops / 1e6:.1f} MFLOP/token")
print(f"peaks (meshgrad bench peak, 2 threads, best of n = 1024 and 2048 and of the libraries): float32 {peak['float32']:.0f} GFLOP/s, bf16 {peak['bf16']:.0f} GFLOP/s")
print(f"meshgrad's bf16 products: {sys.argv[14]}")
print("| run | tokens/s | bf16 / float32 | GFLOP/s | % of the precision's peak | peak RSS (MiB) |")
print("|---|---:|---:|---:|---:|---:|")
def torch_row(name, out, precision, base=None):
    rate = float(re.search(r"([0-9]+) tokens/s", out).group(1))
    rss = float(re.search(r"peak RSS ([0-9]+) MiB", out).group(1))
    g = rate * flops / 1e9
    ratio = f"{rate / base:.2f}x" if base else ""
    print(f"| {name} | {rate:.0f} | {ratio} | {g:.1f} | {100 * g / peak[precision]:.0f}% | {rss:.0f} |")
    return rate
t32 = torch_row("PyTorch 1.13 float32", sys.argv[12], "float32")
torch_row("PyTorch 1.13 bf16 autocast", sys.argv[13], "bf16", t32)
goals = []
for tp in tps:
    rates = {}
    for p in ("float32", "bf16"):
        rows = [json.loads(l) for l in open(f"{work}/{p}.tp{tp}.jsonl") if l.strip()]
        rows = [r for r in rows if "elapsed_s" in r]
        first, last = rows[warmup - 1], rows[warmup - 1 + steps]
        rate = rates[p] = steps * B * T / (last["elapsed_s"] - first["elapsed_s"])
        rss = int(open(f"{work}/{p}.tp{tp}.rss").read().split()[-1]) / 1024
        g = rate * flops / 1e9
        ratio = f"{rate / rates['float32']:.2f}x" if p == "bf16" else ""
        print(f"| meshgrad tp={tp} {p} | {rate:.0f} | {ratio} | {g:.1f} | {100 * g / peak[p]:.0f}% | {rss:.0f} |")
    f32_share = rates["float32"] * flops / 1e9 / peak["float32"]
    goals.append(f"tp={tp}: float32 at {100 * f32_share:.0f}% of its peak (goal 85%), bf16 {rates['bf16'] / rates['float32']:.2f}x float32 (goal 1.8x)")
print("\n".join(goals))
PY
