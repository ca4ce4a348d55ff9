#!/usr/bin/env bash
# The command line's file handling, end to end (issue 10 parts 8-10; reliability.md probes #36,
# #48, #60, #70-72): `meshgrad train` and `meshgrad grads` refuse empty, clobbering and hostile
# paths with a message naming the option, and a config that disagrees with the weights fails at
# once. Usage: cli_files.sh path/to/meshgrad scratch-dir
set -euo pipefail
M=$1
W=$2
rm -rf "$W"
mkdir -p "$W"
cd "$W"
failures=0

# expect_error NAME NEEDLE... -- COMMAND...: COMMAND fails with an error (exit status 1 to 125:
# meshgrad's 1 or a CLI11 parse error, not a signal) and its stderr holds every NEEDLE.
expect_error() {
  local name=$1
  shift
  local needles=()
  while [ "$1" != "--" ]; do needles+=("$1"); shift; done
  shift
  local rc=0
  "$@" >out.txt 2>err.txt || rc=$?
  if [ "$rc" -lt 1 ] || [ "$rc" -gt 125 ]; then
    echo "FAIL $name: exit status $rc, expected an error (1..125); stderr: $(head -c 400 err.txt)"
    failures=$((failures + 1))
    return
  fi
  for n in "${needles[@]}"; do
    if ! grep -qF -- "$n" err.txt; then
      echo "FAIL $name: no '$n' in: $(head -c 400 err.txt)"
      failures=$((failures + 1))
      return
    fi
  done
  echo "ok   $name"
}

small=(--mesh tp=1 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --no-metrics)

# --data '' must not mean the built-in corpus, --resume '' a fresh run, --checkpoint-dir '' no
# checkpoints (an unset shell variable): every path option given empty is refused naming it, on the
# command line and in a --config file (reliability-2 C32-C35).
expect_error data-empty "--data" "empty" -- "$M" train "${small[@]}" --steps 1 --data ''
for option in resume checkpoint-dir save metrics trace init-from; do
  expect_error "$option-empty" "--$option: the path is empty" -- "$M" train "${small[@]:0:12}" --steps 1 "--$option" ''
done
printf '{"resume": ""}' >resume-empty.json
expect_error resume-empty-in-config "--resume: the path is empty" -- "$M" train "${small[@]}" --steps 1 --config resume-empty.json
# A --config that is not a small regular file is refused at once, naming it (reliability-2 F4: a
# directory read as empty JSON, /dev/zero read until memory ran out, a FIFO blocked for ever); a flag
# given a string names the key and the file (F3).
mkdir -p config-dir
expect_error config-directory "--config: 'config-dir' is not a regular file (a directory)" -- \
  timeout 10 "$M" train "${small[@]}" --steps 1 --config config-dir
expect_error config-dev-zero "--config: '/dev/zero' is not a regular file (a character device)" -- \
  timeout 10 "$M" train "${small[@]}" --steps 1 --config /dev/zero
rm -f config-fifo && mkfifo config-fifo
expect_error config-fifo "--config: 'config-fifo' is not a regular file" -- \
  timeout 10 "$M" train "${small[@]}" --steps 1 --config config-fifo
printf '{"sequence-parallel": "yes"}' >config-flag.json
expect_error config-flag-string "--config 'config-flag.json': sequence-parallel is a flag: its value must be true or false, got string \"yes\"" -- \
  "$M" train "${small[@]}" --steps 1 --config config-flag.json
# bench checkpoint names its options (reliability-2 B2, B3): an empty --dir, a --tp of 0 before any run.
bench_small=(--layers 1 --hidden 32 --heads 4 --vocab 256)
expect_error bench-checkpoint-dir-empty "--dir: the path is empty" -- "$M" bench checkpoint --dir '' "${bench_small[@]}" --tp 1
expect_error bench-checkpoint-tp-zero "--tp: must be >= 1, got 0" -- \
  "$M" bench checkpoint --dir bench-new "${bench_small[@]}" --tp 1 --tp 0
[ ! -e bench-new ] || fail "bench checkpoint --tp 0 ran before refusing"
expect_error metrics-and-no-metrics "excludes" -- "$M" train --mesh tp=1 --steps 1 --metrics m.jsonl --no-metrics

# Weights for grads (and the full Hugging Face-named file --save writes).
"$M" train "${small[@]}" --steps 1 --save w.safetensors 2>/dev/null
printf '{"n_layer":1,"n_head":4,"n_embd":32,"vocab_size":256,"n_positions":16,"layer_norm_epsilon":1e-5}' >cfg.json
# A batch file: int64 inputs [1, 4] = 1 2 3 4 and targets [1, 4] = 2 3 4 5.
header='{"inputs":{"dtype":"I64","shape":[1,4],"data_offsets":[0,32]},"targets":{"dtype":"I64","shape":[1,4],"data_offsets":[32,64]}}'
while [ $(( ${#header} % 8 )) -ne 0 ]; do header="$header "; done
{
  printf "\\x$(printf %02x $(( ${#header} % 256 )))\\x$(printf %02x $(( ${#header} / 256 )))\\0\\0\\0\\0\\0\\0"
  printf '%s' "$header"
  for v in 1 2 3 4 2 3 4 5; do printf "\\x$(printf %02x "$v")\\0\\0\\0\\0\\0\\0\\0"; done
} >b.safetensors
"$M" grads --config cfg.json --weights w.safetensors --batch b.safetensors --out g.safetensors >/dev/null
echo "ok   grads loads the weights train --save wrote"

before=$(md5sum w.safetensors)
expect_error grads-out-is-weights "--out" "same file as --weights" -- \
  "$M" grads --config cfg.json --weights w.safetensors --batch b.safetensors --out ./w.safetensors
expect_error grads-out-is-batch "--out" "same file as --batch" -- \
  "$M" grads --config cfg.json --weights w.safetensors --batch b.safetensors --out "../$(basename "$W")/b.safetensors"
[ "$(md5sum w.safetensors)" = "$before" ] || { echo "FAIL the weights changed"; failures=$((failures + 1)); }
head -c 4096 /dev/zero | tr '\0' 'a' >data.txt
expect_error train-save-is-data "--save" "same file as --data" -- \
  "$M" train "${small[@]}" --steps 1 --data data.txt --save data.txt
[ "$(wc -c <data.txt)" -eq 4096 ] || { echo "FAIL the data file changed"; failures=$((failures + 1)); }
ln -s w.safetensors link.safetensors
expect_error grads-out-symlink "--out" "symbolic link" -- \
  "$M" grads --config cfg.json --weights w.safetensors --batch b.safetensors --out link.safetensors

# Hostile config values: refused, never a crash or a multi-GB allocation.
deep=$(printf '%*s' 200000 '' | tr ' ' '[')1$(printf '%*s' 200000 '' | tr ' ' ']')
printf '{"n_layer":%s,"n_head":4,"n_embd":32,"vocab_size":256,"n_positions":16,"layer_norm_epsilon":1e-5}' "$deep" >deep.json
expect_error config-deep "deep.json" "nested deeper than" -- \
  "$M" grads --config deep.json --weights w.safetensors --batch b.safetensors --out g.safetensors
sed 's/"n_positions":16/"n_positions":99999999999/' cfg.json >big.json
expect_error config-too-large "\"n_positions\" is 99999999999" -- \
  "$M" grads --config big.json --weights w.safetensors --batch b.safetensors --out g.safetensors
sed 's/"n_positions":16/"n_positions":30000000/' cfg.json >wrong.json
expect_error config-vs-weights "wpe.weight" "[30000000, 32]" "[16, 32]" -- \
  "$M" grads --config wrong.json --weights w.safetensors --batch b.safetensors --out g.safetensors

# A batch whose shape is nested 100,000 deep (used to overflow the stack in an error message).
deep_header="{\"inputs\":{\"dtype\":\"I64\",\"shape\":$deep,\"data_offsets\":[0,0]}}"
n=${#deep_header}
{
  printf "\\x$(printf %02x $(( n % 256 )))\\x$(printf %02x $(( n / 256 % 256 )))\\x$(printf %02x $(( n / 65536 )))\\0\\0\\0\\0\\0"
  printf '%s' "$deep_header"
} >deep.safetensors
expect_error batch-deep "deep.safetensors" "nested deeper than 3 levels" -- \
  "$M" grads --config cfg.json --weights w.safetensors --batch deep.safetensors --out g.safetensors

# The data's identity (reliability-2 D8): a resume on a file re-written with other text of the same
# length is refused naming both content hashes, as is another --data; --data-changed-ok goes on.
head -c 6000 < <(yes "the cat sat on the mat.") >identity.txt
"$M" train "${small[@]}" --steps 4 --data identity.txt --checkpoint-dir ck-identity 2>/dev/null
head -c 6000 < <(yes "the dog sat on the rug.") >identity.txt
expect_error resume-data-changed "the data changed since the checkpoint" "--data-changed-ok" "XXH3-128" -- \
  "$M" train --resume ck-identity --steps 6 --no-metrics
head -c 6000 < <(yes "a third text, other bytes.") >identity-other.txt
expect_error resume-other-data "the data changed since the checkpoint" -- \
  "$M" train --resume ck-identity --steps 6 --data identity-other.txt --no-metrics
"$M" train --resume ck-identity --steps 6 --data-changed-ok --no-metrics 2>/dev/null \
  && echo "ok   --data-changed-ok resumes on the changed data" || fail "--data-changed-ok did not resume"

# A manifest whose configuration does not describe its tensors is refused before a model is built
# (reliability-2 C10: "layers": 1000000000 allocated that model first).
python3 - ck-identity <<'PY'
import json, os, sys
root = sys.argv[1]
step = sorted(d for d in os.listdir(root) if d.startswith("step_"))[-1]
path = os.path.join(root, step, "manifest.json")
m = json.load(open(path))
m["state"]["config"]["layers"] = 1000000000
json.dump(m, open(path, "w"))
PY
expect_error resume-config-edited "its configuration says 1000000000 layers but it holds" -- \
  timeout 20 "$M" train --resume ck-identity --steps 8 --no-metrics
# export and sample build the same model from the checkpoint: the same refusal, not a minute of
# allocation and an out-of-memory error that names options nobody gave.
expect_error export-config-edited "its configuration says 1000000000 layers but it holds" -- \
  timeout 20 "$M" export --checkpoint ck-identity --out hf-config-edited
expect_error sample-config-edited "its configuration says 1000000000 layers but it holds" -- \
  timeout 20 "$M" sample --checkpoint ck-identity --tokens 2 --prompt a

ls -A | grep -q '\.tmp-' && { echo "FAIL temporaries left: $(ls -A | grep '\.tmp-')"; failures=$((failures + 1)); }
[ "$failures" -eq 0 ] || { echo "$failures failures"; exit 1; }
echo "all passed"
