#!/usr/bin/env bash
# One name per option everywhere (issue 26): the "config" a run writes into its metrics header uses
# the command-line names, and fed back as --config it is the same run (the same configuration, the
# same losses bit for bit), the optimizer and schedule options included.
#   config_roundtrip.sh path/to/meshgrad scratch-dir
set -euo pipefail
M=$1
W=$2
rm -rf "$W"
mkdir -p "$W"
cd "$W"
"$M" train --steps 4 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --warmup 1 --lr-schedule wsd \
  --decay-fraction 0.5 --decay-steps 2 --min-lr 1e-4 --beta1 0.8 --beta2 0.99 --eps 1e-6 --weight-decay 0.05 \
  --no-reshard-after-forward --sequence-parallel \
  --metrics a.jsonl 2>/dev/null
python3 -c '
import json, sys
json.dump(json.loads(open("a.jsonl").readline())["config"], open("c.json", "w"))'
"$M" train --config c.json --metrics b.jsonl 2>err.txt || { echo "FAIL the recorded configuration as --config: $(tail -3 err.txt)"; exit 1; }
python3 - <<'PY'
import json, sys
def read(p):
    lines = [json.loads(l) for l in open(p)]
    config = lines[0]["config"]
    config.pop("metrics")
    return config, [l["loss"] for l in lines[1:] if "loss" in l]
(ca, la), (cb, lb) = read("a.jsonl"), read("b.jsonl")
expected = {"lr-schedule": "wsd", "decay-fraction": 0.5, "decay-steps": 2, "min-lr": 1e-4, "beta1": 0.8, "beta2": 0.99,
            "eps": 1e-6, "weight-decay": 0.05, "warmup": 1, "reshard-after-forward": False, "sequence-parallel": True}
wrong = {k: ca.get(k) for k, v in expected.items() if ca.get(k) != v}
if wrong: sys.exit(f"FAIL the header records {wrong}, expected {expected}")
if ca != cb: sys.exit(f"FAIL the configurations differ: {set(ca.items()) ^ set(cb.items())}")
if la != lb or len(la) != 4: sys.exit(f"FAIL the losses differ: {la} vs {lb}")
print("ok   the recorded configuration as --config is the same run:", la)
PY
