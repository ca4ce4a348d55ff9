#!/usr/bin/env bash
# Context parallelism across processes: under mpirun (one process per rank, OpenMPI's all-gather and
# reduce-scatter of the keys and values) a GPT-2 run at cp=2 and a Llama at cp=2,tp=2 save the bytes of
# the same mesh on the threads backend (the reductions add two ranks' terms the same way).
# usage: cp_mpi.sh MESHGRAD WORKDIR MPIRUN...
set -euo pipefail
mg=$1 work=$2
shift 2
rm -rf "$work" && mkdir -p "$work"
fail() { echo "$1"; [ -n "${2:-}" ] && cat "$2"; exit 1; }
for mesh in cp=2 cp=2,tp=2; do
  run=(train --layers 2 --hidden 32 --heads 4 --seq 32 --batch 4 --steps 3 --no-metrics --mesh "$mesh")
  [ "$mesh" = cp=2,tp=2 ] && run+=(--model llama --kv-heads 2 --sequence-parallel)
  np=$([ "$mesh" = cp=2 ] && echo 2 || echo 4)
  "$mg" "${run[@]}" --save "$work/threads_$mesh.safetensors" > "$work/threads_$mesh.log" 2>&1 ||
    fail "threads $mesh failed" "$work/threads_$mesh.log"
  "$@" -np "$np" "$mg" "${run[@]}" --backend mpi --save "$work/mpi_$mesh.safetensors" > "$work/mpi_$mesh.log" 2>&1 ||
    fail "mpirun $mesh failed" "$work/mpi_$mesh.log"
  cmp "$work/threads_$mesh.safetensors" "$work/mpi_$mesh.safetensors" || fail "mpi $mesh differs from threads $mesh"
done
# --mesh-invariant's sequence blocks: the mpi run at cp=2,tp=2 saves one rank's threads bytes.
inv=(train --layers 2 --hidden 32 --heads 4 --seq 32 --batch 4 --steps 3 --no-metrics --mesh-invariant --sequence-blocks 4)
"$mg" "${inv[@]}" --mesh tp=1 --save "$work/inv_one.safetensors" > "$work/inv_one.log" 2>&1 ||
  fail "the invariant one-rank run failed" "$work/inv_one.log"
"$@" -np 4 "$mg" "${inv[@]}" --mesh cp=2,tp=2 --backend mpi --save "$work/inv_mpi.safetensors" > "$work/inv_mpi.log" 2>&1 ||
  fail "mpirun --mesh-invariant cp=2,tp=2 failed" "$work/inv_mpi.log"
cmp "$work/inv_one.safetensors" "$work/inv_mpi.safetensors" || fail "mpi --mesh-invariant cp=2,tp=2 differs from one rank"
echo "cp under mpirun: cp=2 and cp=2,tp=2 save the threads backend's bytes; --mesh-invariant cp=2,tp=2 one rank's"
