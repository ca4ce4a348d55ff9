#!/usr/bin/env bash
# reliability-3 N108: `meshgrad plot` of a 200,000-step metrics file. Every point went to librsvg
# (the PNG never finished); each curve now keeps at most 4 vertices per pixel column, so the train
# loss of a 900 px wide plot has at most 3600 whatever the number of steps.
#   r3_plot_long_run.sh MESHGRAD DIR
set -euo pipefail
mg=$1 dir=$2
mkdir -p "$dir"
python3 - "$dir/long.jsonl" <<'PY'
import math, sys
with open(sys.argv[1], "w") as f:
    f.writelines('{"step":%d,"loss":%.6f,"lr":0.001}\n' % (i, 3 + math.sin(i * 0.37)) for i in range(1, 200001))
PY
"$mg" plot "$dir/long.jsonl" -o "$dir/long.svg"
python3 - "$dir/long.svg" <<'PY'
import re, sys
points = re.search(r'<polyline id="train_loss"[^>]*points="([^"]*)"', open(sys.argv[1]).read()).group(1).split()
print("train_loss vertices", len(points), "<=" if len(points) <= 3600 else ">", 3600)
PY
