#!/usr/bin/env bash
# reliability-3 C19: --save into a file system without room for the parameters is refused before step
# 1, naming the bytes needed and free (before, the run trained and then lost its weights to "No space
# left on device"). Needs a small file system: a 2 MB tmpfs, mounted here when this may mount
# (root); exit 77 (ctest: skipped) otherwise.
#   r3_outputs_free_space.sh MESHGRAD WORKDIR
set -u
mg=$1
dir=$2
rm -rf "$dir" && mkdir -p "$dir/small" && cd "$dir" || exit 1
mount -t tmpfs -o size=2m tmpfs small 2> /dev/null || { echo "SKIP: cannot mount a tmpfs here"; exit 77; }
trap 'umount "$dir/small"' EXIT
head -c 1700000 /dev/zero > small/filler
out=$("$mg" train --steps 20 --layers 2 --hidden 64 --heads 4 --seq 16 --batch 4 --no-metrics --save small/w.safetensors 2>&1)
rc=$?
echo "$out"
failures=0
[ "$rc" -ne 0 ] || { echo "FAIL: the run was not refused"; failures=$((failures + 1)); }
grep -q "not enough free space for --save 'small/w.safetensors': at least 470016 bytes (0.4 MiB) are needed on the file system of 'small', which has [0-9]* bytes" <<< "$out" ||
  { echo "FAIL: no message with the bytes needed and free"; failures=$((failures + 1)); }
! grep -q '^step 1/' <<< "$out" || { echo "FAIL: the run trained before it was refused"; failures=$((failures + 1)); }
[ ! -e small/w.safetensors ] || { echo "FAIL: a file was written"; failures=$((failures + 1)); }
[ "$failures" -eq 0 ] && echo "PASS: refused before step 1"
exit "$failures"
