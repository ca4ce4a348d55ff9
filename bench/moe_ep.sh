#!/usr/bin/env bash
# A mixture of experts of the nanoGPT size at ep = 1, 2, 4 (docs/BENCHMARKS.md, "Mixture of experts"):
# 6 blocks x 384, 6 heads, 8 SwiGLU experts of 1024 features, top-2, the load-balancing loss, seq 256,
# batch 8, bytes. One process per rank under mpirun (so each rank's peak RSS is its process's),
# --trace on the last run of each size; prints per ep:
#   tokens/s (median of the steps after the first two), the step-time split per rank from the trace
#   (router, permute, dispatch + combine = the all-to-alls, experts = the grouped products, all in
#   forward and backward; the rest of the step), the all-to-all's share of the step and how much of
#   it the rank waited (not hidden under other work), and the peak RSS per rank.
# usage: bench/moe_ep.sh MESHGRAD DATA_DIR OUT_DIR [STEPS]
set -euo pipefail
mg=$(realpath "$1") data=$2 out=$3 steps=${4:-12}
mkdir -p "$out"
export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-Haswell}
model=(--model llama --layers 6 --hidden 384 --heads 6 --ffn 1024 --experts 8 --experts-per-token 2
       --output-router-logits --seq 256 --batch 8 --data "$data" --steps "$steps" --eval-every 0 --lr 1e-3)
mpirun=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
for ep in 1 2 4; do
  mesh=$([ "$ep" = 1 ] && echo tp=1 || echo "ep=$ep")
  rm -f "$out"/rss_ep${ep}.*
  "${mpirun[@]}" -np "$ep" bash -c 'exec /usr/bin/time -f "%M" -o "$0.$OMPI_COMM_WORLD_RANK" "$@"' \
    "$out/rss_ep$ep" "$mg" train --backend mpi --mesh "$mesh" "${model[@]}" \
    --metrics "$out/m_ep$ep.jsonl" --trace "$out/t_ep$ep.json" > "$out/log_ep$ep.txt" 2>&1
done
python3 - "$out" <<'PY'
import json, statistics, sys
out = sys.argv[1]
print(f"{'ep':>3} {'tok/s':>8} {'step ms':>8} | {'router':>7} {'permute':>7} {'a2a':>7} {'experts':>7} {'other':>7} |"
      f" {'a2a %':>6} {'waited %':>8} | {'peak RSS/rank MiB':>17}")
for ep in (1, 2, 4):
    lines = [json.loads(l) for l in open(f"{out}/m_ep{ep}.jsonl") if '"step"' in l]
    tps = statistics.median(l["tokens_per_s"] for l in lines[2:])
    ms = statistics.median(l["ms_per_step"] for l in lines[2:])
    events = json.load(open(f"{out}/t_ep{ep}.json"))
    events = events["traceEvents"] if isinstance(events, dict) else events
    # Per rank lane: the step spans after the first two, and the named spans inside them.
    spans = [e for e in events if e.get("ph") == "X"]
    rank_of = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            rank_of[(e["pid"], e["tid"])] = e["args"]["name"]
    steps = sorted((e for e in spans if e["name"] == "step" and rank_of.get((e["pid"], e["tid"]), "").startswith("rank")),
                   key=lambda e: e["ts"])
    per_rank = {}
    for s in steps:
        per_rank.setdefault((s["pid"], s["tid"]), []).append(s)
    totals = {k: 0.0 for k in ("step", "router", "permute", "a2a", "experts", "wait_a2a")}
    for lane, st in per_rank.items():
        for s in st[2:]:
            lo, hi = s["ts"], s["ts"] + s["dur"]
            totals["step"] += s["dur"]
            for e in spans:
                if (e["pid"], e["tid"]) != lane or not (lo <= e["ts"] < hi):
                    continue
                n = e["name"]
                if n in ("router", "permute", "experts"):
                    totals[n] += e["dur"]
                elif n in ("dispatch", "combine"):
                    totals["a2a"] += e["dur"]
                elif n == "wait" and e.get("args", {}).get("op") == "all_to_all":
                    totals["wait_a2a"] += e["dur"]
    ranks = max(len(per_rank), 1)
    per = {k: v / ranks / max(len(next(iter(per_rank.values()))) - 2, 1) / 1e3 for k, v in totals.items()}
    other = per["step"] - per["router"] - per["permute"] - per["a2a"] - per["experts"]
    rss = [int(open(f"{out}/rss_ep{ep}.{r}").read().split()[-1]) / 1024 for r in range(ep)]
    share = 100 * per["a2a"] / per["step"] if per["step"] else 0
    waited = 100 * per["wait_a2a"] / per["a2a"] if per["a2a"] else 0
    print(f"{ep:>3} {tps:>8.0f} {ms:>8.0f} | {per['router']:>7.1f} {per['permute']:>7.1f} {per['a2a']:>7.1f}"
          f" {per['experts']:>7.1f} {other:>7.1f} | {share:>6.1f} {waited:>8.1f} | {max(rss):>17.0f}")
PY
