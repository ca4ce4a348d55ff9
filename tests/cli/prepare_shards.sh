#!/usr/bin/env bash
# `meshgrad prepare` streams (issue 26): a generated text of SIZE_MB (default 200) MB is prepared
# with --shard-tokens and without, each in a peak RSS (getrusage of the child) below LIMIT_MB (default
# 150; the whole text alone is 200 MB, and before streaming prepare held it and all its tokens);
# the shards have the names and sizes asked for; the progress on a non-terminal stderr is a plain
# line every 5%; `train --data DIR` and `--data 'DIR/train_*.bin'` train on the shards, and a glob
# matching nothing is refused naming it.
# Usage: prepare_shards.sh MESHGRAD GPT2_DIR WORK_DIR [SIZE_MB] [LIMIT_MB]
set -euo pipefail
mg=$1
gpt2=$2
work=$3
size_mb=${4:-200}
limit_mb=${5:-150}
fail() { echo "prepare_shards: $*" >&2; exit 1; }
rm -rf "$work"
mkdir -p "$work"
trap 'rm -rf "$work"' EXIT

# Lines of words and numbers: 20 MB generated, repeated up to the size.
python3 - "$work/text.txt" "$size_mb" <<'EOF'
import random, sys
random.seed(26)
words = ("the river begins in the hills above town where snow lies late into spring morning water cold clear "
         "light comes down through trees long bright lines miller said voice bridge stone market square").split()
lines = []
size = 0
while size < 20_000_000:
    line = " ".join(random.choice(words) for _ in range(random.randint(3, 20))) + f" {random.randint(0, 99999)}.\n"
    lines.append(line)
    size += len(line)
block = "".join(lines)
with open(sys.argv[1], "w") as f:
    for _ in range(max(1, int(sys.argv[2]) // 20)):
        f.write(block)
EOF

# Runs prepare with the given options; prints its peak RSS in MB (the only child of the wrapper).
prepare_peak_mb() {
  local out=$1
  shift
  python3 - "$mg" "$gpt2" "$out" "$work/text.txt" "$@" <<'EOF'
import resource, subprocess, sys
mg, gpt2, out, text, *opts = sys.argv[1:]
with open(out + ".stderr", "w") as err:
    rc = subprocess.run([mg, "prepare", "--vocab", gpt2 + "/encoder.json", "--merges", gpt2 + "/vocab.bpe",
                         "--out", out, *opts, text], stdout=subprocess.DEVNULL, stderr=err).returncode
if rc != 0:
    sys.exit(f"prepare {' '.join(opts)} exited {rc}: " + open(out + ".stderr").read()[-2000:])
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)
EOF
}

# Token count of an llm.c file (the header's third int32).
tokens_of() { python3 -c 'import struct,sys; print(struct.unpack("<3i", open(sys.argv[1], "rb").read(12))[2])' "$1"; }

peak=$(prepare_peak_mb "$work/sharded" --shard-tokens 10000000)
echo "prepare --shard-tokens of $size_mb MB: peak RSS $peak MB"
(( peak < limit_mb )) || fail "prepare --shard-tokens of $size_mb MB peaked at $peak MB (limit $limit_mb MB)"
peak=$(prepare_peak_mb "$work/plain")
echo "prepare (train.bin / val.bin) of $size_mb MB: peak RSS $peak MB"
(( peak < limit_mb )) || fail "prepare of $size_mb MB peaked at $peak MB (limit $limit_mb MB)"

# Shards: train_000000.bin ... of 10M tokens, the last shorter; val_000000.bin; no train.bin.
[[ -e "$work/sharded/train.bin" ]] && fail "a sharded prepare wrote train.bin"
mapfile -t shards < <(cd "$work/sharded" && ls train_*.bin)
(( ${#shards[@]} >= 2 )) || fail "expected several train shards, got: ${shards[*]}"
for i in "${!shards[@]}"; do
  expected=$(printf 'train_%06d.bin' "$i")
  [[ ${shards[$i]} == "$expected" ]] || fail "shard $i is ${shards[$i]}, expected $expected"
  n=$(tokens_of "$work/sharded/${shards[$i]}")
  if (( i + 1 < ${#shards[@]} )); then
    (( n == 10000000 )) || fail "${shards[$i]} has $n tokens, expected 10000000"
  else
    (( n > 0 && n <= 10000000 )) || fail "the last shard ${shards[$i]} has $n tokens"
  fi
done
[[ -e "$work/sharded/val_000000.bin" ]] || fail "no val_000000.bin"

# Progress on a non-terminal: plain lines (no carriage returns), one per 5% or so, ending at 100%.
err="$work/sharded.stderr"
grep -q $'\r' "$err" && fail "progress redrew in place on a non-terminal stderr"
lines=$(grep -c 'MB/s' "$err")
(( lines >= 10 && lines <= 22 )) || fail "expected a progress line every 5%, got $lines: $(cat "$err")"
grep -q "^100.0% | $size_mb.0 / $size_mb.0 MB | .* MB/s" "$err" || fail "no final 100% line: $(tail -3 "$err")"

# Training reads the shards, as a directory and as a glob.
tiny=(--steps 2 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --metrics "$work/metrics.jsonl")
"$mg" train --data "$work/sharded" "${tiny[@]}" > "$work/train_dir.log" 2>&1 ||
  fail "train --data DIR failed: $(tail -5 "$work/train_dir.log")"
"$mg" train --data "$work/sharded/train_*.bin" "${tiny[@]}" > "$work/train_glob.log" 2>&1 ||
  fail "train --data 'DIR/train_*.bin' failed: $(tail -5 "$work/train_glob.log")"
if "$mg" train --data "$work/sharded/nothing_*.bin" "${tiny[@]}" > "$work/train_none.log" 2>&1; then
  fail "a glob matching nothing was accepted"
fi
grep -q "nothing_\*.bin': the pattern matches no file" "$work/train_none.log" ||
  fail "the error does not name the glob: $(cat "$work/train_none.log")"
echo "prepare_shards: ok"
