#!/bin/sh
# Runs meshgrad's collective benchmark (threads and mpi backends) and the peer probes
# (bench/peers: OpenMPI, PyTorch gloo) back to back, at 2 and 4 ranks, so the figures in
# docs/BENCHMARKS.md come from one run on one machine. Usage: bench/compare_collectives.sh BUILD_DIR [OUT_DIR]
# (MESHGRAD=/path/to/meshgrad overrides BUILD_DIR/meshgrad.)
set -eu
build=${1:-build-comm}
out=${2:-/tmp/meshgrad-collectives}
peers=$(dirname "$0")/peers
mkdir -p "$out"
meshgrad=${MESHGRAD:-$build/meshgrad}
mpirun="mpirun --allow-run-as-root --oversubscribe"
ops=all_reduce,all_gather,reduce_scatter
mpicc -O2 "$peers/mpi_allreduce.c" -o "$out/mpi_allreduce"
for np in 2 4; do
  "$meshgrad" bench collectives --backend threads --ranks $np --ops $ops --min-bytes 64K --max-bytes 64M \
      --step-factor 4 | tee "$out/threads_np$np.txt"
  $mpirun -np $np "$meshgrad" bench collectives --backend mpi --ops $ops --min-bytes 64K --max-bytes 64M \
      --step-factor 4 | tee "$out/mpi_backend_np$np.txt"
  $mpirun -np $np "$out/mpi_allreduce" | tee "$out/peer_openmpi_np$np.txt"
  if [ -x /usr/bin/python3 ]; then
    /usr/bin/python3 "$peers/torch_gloo_collectives.py" $np 2>&1 | grep -v Warning | tee "$out/peer_gloo_np$np.txt"
  fi
done
