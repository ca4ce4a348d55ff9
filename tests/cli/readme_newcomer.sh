#!/usr/bin/env bash
# The README's "Your own text" commands, run as written (issue 26): the shell block under that heading
# is taken from README.md and run in a scratch directory where build/, scripts/ and third_party/ are
# the project's (links) and my.txt is the given text. Each command must succeed, and the outputs the
# README promises must be there: mydata/meta.json, my.safetensors, a metrics file with evaluations
# and samples, a PNG, and sample's text starting with the prompt.
#   readme_newcomer.sh README.md BUILD_DIR SCRATCH TEXT
set -euo pipefail
readme=$(realpath "$1")
build=$(realpath "$2")
W=$3
text=$(realpath "$4")
root=$(dirname "$readme")
rm -rf "$W"
mkdir -p "$W"
cd "$W"
ln -s "$build" build
ln -s "$root/scripts" scripts
ln -s "$root/third_party" third_party
cp "$text" my.txt
python3 - "$readme" >commands.sh <<'PY'
import re, sys
text = open(sys.argv[1]).read()
section = text.split("## Your own text", 1)[1]
block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
print(block)
PY
[ "$(grep -c . commands.sh)" -eq 5 ] || { echo "FAIL the README block has $(grep -c . commands.sh) commands, not 5"; exit 1; }
failures=0
while IFS= read -r command; do
  [ -n "$command" ] || continue
  start=$SECONDS
  if ! bash -c "$command" >out.txt 2>err.txt; then
    echo "FAIL '$command': $(tail -c 500 err.txt)"
    failures=$((failures + 1))
    continue
  fi
  printf 'ok   %4d s  %s\n' "$((SECONDS - start))" "$command"
  case "$command" in *" sample "*) grep -q "^The " out.txt || { echo "FAIL sample printed '$(head -c 200 out.txt)'"; failures=$((failures + 1)); } ;; esac
done <commands.sh
for f in mydata/meta.json my.safetensors my.png; do [ -s "$f" ] || { echo "FAIL no $f"; failures=$((failures + 1)); }; done
python3 - <<'PY' || failures=$((failures + 1))
import json, sys
lines = [json.loads(l) for l in open("my.jsonl")]
evals = [l for l in lines if "val_loss" in l]
samples = [l for l in lines if l.get("type") == "sample"]
if not evals or not samples:
    sys.exit(f"FAIL my.jsonl has {len(evals)} evaluations and {len(samples)} samples")
PY
exit $((failures > 0))
