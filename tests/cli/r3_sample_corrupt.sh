#!/usr/bin/env bash
# reliability-3 C3: `sample --checkpoint` of a checkpoint with a corrupt piece of rank 1 printed the
# prompt to stdout before the hash check failed. Every rank's pieces are now checked before
# anything is printed: stdout stays empty.
#   r3_sample_corrupt.sh MESHGRAD WORK_DIR
set -uo pipefail
M=$1 W=$2
rm -rf "$W"
mkdir -p "$W"
cd "$W"
"$M" train --steps 2 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --mesh tp=2 --no-metrics --checkpoint-dir ck \
  >/dev/null 2>&1 || { echo "train failed"; exit 1; }
piece=$(ls ck/step_*/rank_00001.bin | head -1)
python3 - "$piece" <<'PY'
import sys
with open(sys.argv[1], "r+b") as f:
    b = f.read(1)
    f.seek(0)
    f.write(bytes([b[0] ^ 0xFF]))
PY
"$M" sample --checkpoint ck --prompt "The " --tokens 5 --mesh tp=2 >out.txt 2>err.txt
echo "rc $?"
cat err.txt
echo "stdout=[$(cat out.txt)]"
