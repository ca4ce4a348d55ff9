#!/usr/bin/env bash
# `meshgrad sample` end to end on a model `meshgrad train --save` wrote: the greedy text is the same
# on every mesh, the same seed gives the same text, a full context is reported on stderr, and bad
# input fails with a message naming the option.
#   sample.sh path/to/meshgrad scratch-dir [mpirun-command...]
# With an mpirun command, the greedy text of 2 MPI processes (--backend mpi --mesh tp=2) is
# compared too.
set -euo pipefail
M=$1
W=$2
shift 2
MPIRUN=("$@")
rm -rf "$W"
mkdir -p "$W"
cd "$W"
failures=0
fail() { echo "FAIL $*"; failures=$((failures + 1)); }

# expect_error NAME NEEDLE -- COMMAND...: COMMAND fails (exit status 1 to 125) with NEEDLE on stderr
# and nothing on stdout.
expect_error() {
  local name=$1 needle=$2
  shift 3
  local rc=0
  "$@" >out.txt 2>err.txt || rc=$?
  if [ "$rc" -lt 1 ] || [ "$rc" -gt 125 ]; then fail "$name: exit status $rc; stderr: $(head -c 300 err.txt)"; return; fi
  grep -qF -- "$needle" err.txt || { fail "$name: no '$needle' in: $(head -c 300 err.txt)"; return; }
  [ ! -s out.txt ] || { fail "$name: printed '$(head -c 100 out.txt)' before failing"; return; }
  echo "ok   $name"
}

# A small byte-level GPT, trained a little (n_positions = --seq = 32).
"$M" train --mesh tp=2 --steps 300 --layers 1 --hidden 32 --heads 4 --seq 32 --batch 8 --no-metrics \
  --save w.safetensors 2>/dev/null

sample=("$M" sample --checkpoint w.safetensors --prompt "The " --tokens 20)
"${sample[@]}" --temperature 0 --mesh tp=1 >greedy_tp1.txt
[ "$(head -c 4 greedy_tp1.txt)" = "The " ] || fail "the output does not start with the prompt: $(cat greedy_tp1.txt)"
# 4 prompt bytes + 20 new ones + the final newline.
[ "$(wc -c <greedy_tp1.txt)" -eq 25 ] || fail "expected 24 bytes and a newline, got: $(od -c greedy_tp1.txt | head -3)"
# Not one byte repeated (which every mesh would trivially agree on).
[ "$(tail -c +5 greedy_tp1.txt | fold -w1 | sort -u | wc -l)" -gt 3 ] || fail "degenerate text: '$(cat greedy_tp1.txt)'"
for mesh in tp=2 tp=4 dp=2,tp=2 tp=2x2; do
  "${sample[@]}" --temperature 0 --mesh "$mesh" >greedy.txt
  cmp -s greedy.txt greedy_tp1.txt || fail "greedy text on $mesh: '$(cat greedy.txt)' differs from tp=1: '$(cat greedy_tp1.txt)'"
done
echo "ok   greedy text is the same on tp=1, tp=2, tp=4, dp=2,tp=2, tp=2x2: $(cat greedy_tp1.txt)"

"${sample[@]}" --seed 5 --top-k 20 >a.txt
"${sample[@]}" --seed 5 --top-k 20 --mesh tp=1 >b.txt
"${sample[@]}" --seed 6 --top-k 20 >c.txt
cmp -s a.txt b.txt || fail "seed 5 gave '$(cat a.txt)' at tp=2 and '$(cat b.txt)' at tp=1"
cmp -s a.txt c.txt && fail "seeds 5 and 6 gave the same text '$(cat a.txt)'"
"${sample[@]}" --top-k 1 --temperature 1.5 >k1.txt
"${sample[@]}" --temperature 0 >g.txt
cmp -s k1.txt g.txt || fail "top-k 1 gave '$(cat k1.txt)', greedy '$(cat g.txt)'"
echo "ok   seeds and top-k"

"$M" sample --checkpoint w.safetensors --prompt "The " --tokens 100 >long.txt 2>long.err
grep -qF "stopped after 29 of 100 tokens: the context is full (n_positions = 32" long.err \
  || fail "context full: $(cat long.err)"
echo "ok   a full context is reported"

if [ ${#MPIRUN[@]} -gt 0 ]; then
  "${MPIRUN[@]}" -np 2 "$M" sample --backend mpi --mesh tp=2 --checkpoint w.safetensors --prompt "The " --tokens 20 \
    --temperature 0 >mpi.txt
  cmp -s mpi.txt greedy_tp1.txt || fail "MPI tp=2 printed '$(cat mpi.txt)', threads tp=1 '$(cat greedy_tp1.txt)'"
  echo "ok   under mpirun (printed once, the same greedy text)"
fi

expect_error prompt-empty "--prompt is empty" -- "$M" sample --checkpoint w.safetensors --prompt '' --tokens 5
expect_error tokens-zero "--tokens: must be >= 1, got 0" -- "$M" sample --checkpoint w.safetensors --prompt a --tokens 0
expect_error temperature-negative "--temperature must be >= 0" -- \
  "$M" sample --checkpoint w.safetensors --prompt a --tokens 5 --temperature -1
expect_error top-k-negative "--top-k: must be an integer >= 0" -- \
  "$M" sample --checkpoint w.safetensors --prompt a --tokens 5 --top-k -3
expect_error prompt-too-long "longer than the model's context n_positions = 32" -- \
  "$M" sample --checkpoint w.safetensors --prompt "$(printf '%040d' 0)" --tokens 5
expect_error no-such-file "checkpoint 'nope.safetensors' does not exist" -- \
  "$M" sample --checkpoint nope.safetensors --prompt a --tokens 5
echo "just text" >notes.txt
expect_error not-a-checkpoint "'notes.txt' is not a safetensors file or model directory" -- \
  "$M" sample --checkpoint notes.txt --prompt a --tokens 5
expect_error heads "ranks split the attention heads but there are only 4 heads" -- \
  "$M" sample --checkpoint w.safetensors --prompt a --tokens 5 --mesh tp=8
expect_error checkpoint-required "--checkpoint is required" -- "$M" sample --prompt a --tokens 5

[ "$failures" -eq 0 ] || { echo "$failures failure(s)"; exit 1; }
echo "all sample checks passed"
