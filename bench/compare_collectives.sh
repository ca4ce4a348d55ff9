#!/bin/sh
# meshgrad's threads backend against the OpenMPI peer (bench/peers/mpi_allreduce.c: blocking
# MPI_Allreduce / MPI_Allgather / MPI_Reduce_scatter_block), the same sizes (64 KiB .. 64 MiB, x4), at
# 2 and 4 ranks, in one run, and one table: per op, ranks and size the best (lowest) time of each side
# over ROUNDS alternated rounds (this machine is shared: one preemption can double a single figure;
# the best of a few is what each side reaches), busbw (nccl-tests) and ratio = OpenMPI time / meshgrad
# time. The goals: ratio >= 2 at every size from 1 KiB to 64 MiB; no size slower than a larger one
# (per op and rank count); from 1 MiB, at least half of what memcpy moves: the memory traffic
# meshgrad's op implies (bytes every rank reads and writes, at least) per second against one core's
# memcpy bandwidth (bench/peers/membw.c, read + write), the limit at large sizes. At small sizes the
# limit is the hand-off between cores (bench/peers/handoff.c: two pinned threads passing a flag, and
# pulling the bytes one rank would from the other), printed with the table.
# Usage: bench/compare_collectives.sh BUILD_DIR [ROUNDS] [OUT_DIR]   (MESHGRAD=/path/to/meshgrad
# overrides BUILD_DIR/meshgrad; raw outputs are kept in OUT_DIR, default /tmp/meshgrad-collectives)
set -eu
build=${1:-build}
rounds=${2:-3}
out=${3:-/tmp/meshgrad-collectives}
peers=$(dirname "$0")/peers
meshgrad=${MESHGRAD:-$build/meshgrad}
mpirun="mpirun --allow-run-as-root --oversubscribe"
sizes="1024 4096 16384 65536 262144 1048576 4194304 16777216 67108864"
mkdir -p "$out"
rm -f "$out"/peer_*.txt "$out"/meshgrad_*.txt
mpicc -O2 "$peers/mpi_allreduce.c" -o "$out/mpi_allreduce"
gcc -O3 -march=native "$peers/membw.c" -o "$out/membw"
gcc -O2 -pthread "$peers/handoff.c" -o "$out/handoff"
"$out/membw" 64 | tee "$out/membw.txt"
{ "$out/handoff" 0; "$out/handoff" 512; "$out/handoff" 2048; } | tee "$out/handoff.txt"
round=1
while [ "$round" -le "$rounds" ]; do
  for np in 2 4; do
    # shellcheck disable=SC2086
    $mpirun -np $np "$out/mpi_allreduce" $sizes > "$out/peer_np${np}_r$round.txt"
    "$meshgrad" bench collectives --backend threads --ranks $np --ops all_reduce,all_gather,reduce_scatter \
        --min-bytes 1K --max-bytes 64M --step-factor 4 > "$out/meshgrad_np${np}_r$round.txt"
  done
  echo "round $round of $rounds done" >&2
  round=$((round + 1))
done
python3 - "$out" <<'EOF'
import glob, os, re, sys
out = sys.argv[1]
best = {}   # (side, np, op, bytes) -> us
for path in glob.glob(os.path.join(out, '*_np*_r*.txt')):
    side, np_ = re.match(r'(peer|meshgrad)_np(\d+)_r', os.path.basename(path)).groups()
    for line in open(path):
        f = line.split()
        if len(f) < 5 or line.startswith('#') or f[0] == 'op':
            continue
        op, nbytes, us = f[0], int(f[1]), float(f[2] if side == 'peer' else f[4])
        if side == 'meshgrad' and f[-1] != '0':
            sys.exit(f'{path}: meshgrad reported wrong values: {line.strip()}')
        k = (side, int(np_), op, nbytes)
        best[k] = min(best.get(k, 1e30), us)
membw = open(os.path.join(out, 'membw.txt')).readline().split(':')[1].split()[0]
def busbw(op, n, nbytes, us):
    f = 2 * (n - 1) / n if op == 'all_reduce' else (n - 1) / n
    return nbytes / us / 1e3 * f
def traffic(op, n, s):   # bytes all ranks read + write at least (every buffer once)
    return {'all_reduce': 2 * n * s, 'all_gather': s + n * s, 'reduce_scatter': n * s + s}[op]
print(f'best of {len({p for p in glob.glob(os.path.join(out, "meshgrad_np2_r*.txt"))})} rounds; busbw in GB/s '
      f'(nccl-tests); traffic = bytes all ranks read and write at least / time (one core memcpy: {membw} GB/s)')
print(f'{"op":<15}{"ranks":>5}{"size":>10}{"OpenMPI us":>12}{"busbw":>8}{"meshgrad us":>13}{"busbw":>8}'
      f'{"traffic":>9}{"ratio":>8}')
misses = []
for op in ('all_reduce', 'all_gather', 'reduce_scatter'):
    for n in (2, 4):
        for s in sorted({k[3] for k in best if k[0] == 'meshgrad' and k[1] == n and k[2] == op}):
            m, p = best.get(('meshgrad', n, op, s)), best.get(('peer', n, op, s))
            if m is None or p is None:
                continue
            size = f'{s >> 20}M' if s >= 1 << 20 else f'{s >> 10}K'
            ratio = p / m
            mark = '' if ratio >= 2 else '  < 2'
            if ratio < 2:
                misses.append(f'{op} {n} ranks {size}')
            print(f'{op:<15}{n:>5}{size:>10}{p:>12.2f}{busbw(op, n, s, p):>8.2f}{m:>13.2f}{busbw(op, n, s, m):>8.2f}'
                  f'{traffic(op, n, s) / m / 1e3:>9.1f}{ratio:>7.2f}x{mark}')
print('ratio = OpenMPI time / meshgrad time; goal >= 2x: ' + ('met everywhere' if not misses else
      'not met at ' + ', '.join(misses)))
# No size slower than a larger one; from 1 MiB at least half of memcpy's traffic.
slower, below = [], []
for op in ('all_reduce', 'all_gather', 'reduce_scatter'):
    for n in (2, 4):
        sizes = sorted({k[3] for k in best if k[0] == 'meshgrad' and k[1] == n and k[2] == op})
        for i, s in enumerate(sizes):
            m = best[('meshgrad', n, op, s)]
            for t in sizes[i + 1:]:
                if m > best[('meshgrad', n, op, t)]:
                    slower.append(f'{op} {n} ranks {s} B ({m:.1f} us) > {t} B ({best[("meshgrad", n, op, t)]:.1f} us)')
            if s >= 1 << 20 and traffic(op, n, s) / m / 1e3 < float(membw) / 2:
                below.append(f'{op} {n} ranks {s >> 20}M ({traffic(op, n, s) / m / 1e3:.1f} GB/s)')
print('no size slower than a larger one: ' + ('met' if not slower else 'not met: ' + '; '.join(slower)))
print(f'from 1 MiB >= half of memcpy ({float(membw) / 2:.1f} GB/s traffic): ' +
      ('met' if not below else 'not met at ' + ', '.join(below)))
print('hand-off between two cores (bench/peers/handoff.c): ' +
      '; '.join(l.strip() for l in open(os.path.join(out, 'handoff.txt'))))
EOF
