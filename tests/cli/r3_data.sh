#!/usr/bin/env bash
# reliability-3 (issue 37), prepare and --data: one case per finding, each printing what the cmake
# test's regex checks (tests/cli/r3_plot_data.cmake).
#   r3_data.sh MESHGRAD GPT2_DIR WORK_DIR CASE
# CASE: stray_glob (N94), no_val (P2), twice (P13), letters (P6).
set -uo pipefail
M=$1 gpt2=$2 W=$3 case=$4
rm -rf "$W"
mkdir -p "$W"
cd "$W"
prepare() {
  local out=$1
  shift
  "$M" prepare --vocab "$gpt2/encoder.json" --merges "$gpt2/vocab.bpe" --out "$out" --quiet "$@"
}
tiny=(--steps 1 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --no-metrics)
here=$(dirname "$(realpath "$0")")
case $case in
  stray_glob)
    # A shard of another corpus copied in with the next number: the directory refuses it, and so
    # must the glob (it trained on it silently).
    prepare shd --shard-tokens 3000 --chunk-bytes 4096 "$here/../../README.md" >/dev/null || exit 1
    prepare other --shard-tokens 3000 --chunk-bytes 4096 "$here/../../docs/data.md" >/dev/null || exit 1
    n=$(ls shd/train_*.bin | wc -l)
    cp other/train_000000.bin "shd/$(printf 'train_%06d.bin' "$n")"
    "$M" train --data 'shd/train_*.bin' "${tiny[@]}" 2>&1
    echo "rc $?"
    ;;
  no_val)
    printf 'Hi there.' >short.txt
    prepare small short.txt 2>&1
    ;;
  twice)
    printf 'Hi there.' >short.txt
    prepare twice short.txt ./short.txt 2>&1
    ;;
  letters)
    # 4 MB of letters without a space: one pre-token, read whole before (memory ~36 bytes per byte).
    python3 -c "import random; random.seed(1); open('word.txt', 'w').write(''.join(random.choice('abcdefghijklmnopqrstuvwxyz') for _ in range(4000000)))"
    /usr/bin/time -f "max RSS %M KB" "$M" prepare --vocab "$gpt2/encoder.json" --merges "$gpt2/vocab.bpe" --out letters \
      --quiet --chunk-bytes 65536 word.txt 2>&1
    rss=$(tail -1 < <(/usr/bin/time -f "%M" "$M" prepare --vocab "$gpt2/encoder.json" --merges "$gpt2/vocab.bpe" \
      --out letters2 --quiet --chunk-bytes 65536 word.txt 2>&1 >/dev/null))
    [ "$rss" -lt 120000 ] && echo "rss-bounded $rss KB < 120000" || echo "rss-unbounded $rss KB"
    ;;
esac
