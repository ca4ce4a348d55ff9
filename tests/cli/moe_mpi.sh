#!/usr/bin/env bash
# Expert parallelism across processes: under mpirun (one process per rank, OpenMPI's uneven
# all-to-all) a Mixtral-style run at ep=2 and dp=2,ep=2 saves, under --mesh-invariant, the bytes of
# the same run on one rank of the threads backend.
# usage: moe_mpi.sh MESHGRAD WORKDIR MPIRUN...
set -euo pipefail
mg=$1 work=$2
shift 2
rm -rf "$work" && mkdir -p "$work"
run=(train --model llama --layers 2 --hidden 32 --heads 4 --kv-heads 2 --ffn 48 --experts 4 --output-router-logits
     --seq 16 --batch 8 --steps 3 --mesh-invariant --no-metrics)
fail() { echo "$1"; [ -n "${2:-}" ] && cat "$2"; exit 1; }
"$mg" "${run[@]}" --mesh tp=1 --save "$work/one.safetensors" > "$work/one.log" 2>&1 || fail "one rank failed" "$work/one.log"
for mesh in ep=2 dp=2,ep=2; do
  np=$([ "$mesh" = ep=2 ] && echo 2 || echo 4)
  "$@" -np "$np" "$mg" "${run[@]}" --backend mpi --mesh "$mesh" --save "$work/$mesh.safetensors" > "$work/$mesh.log" 2>&1 ||
    fail "mpirun $mesh failed" "$work/$mesh.log"
  cmp "$work/one.safetensors" "$work/$mesh.safetensors" || fail "mpi $mesh differs from one rank"
done
echo "moe under mpirun: ep=2 and dp=2,ep=2 save one rank's bytes"
