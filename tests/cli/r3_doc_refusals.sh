#!/usr/bin/env bash
# Runs every example of docs/training.md's "What is refused: the examples" block (the fenced block
# after its `<!-- refusal examples ... -->` marker) and expects each to be refused: exit status
# non-zero (not a timeout), the message after its `#` in the output, and no training step. So a
# refusal the docs promise that the code stops making fails here, and a new refusal sentence in the
# docs gets its example in that block (reliability-3, issue 37).
# Usage: r3_doc_refusals.sh path/to/meshgrad path/to/docs/training.md scratch-dir
set -euo pipefail
M=$(realpath "$1")
DOC=$(realpath "$2")
W=$3
rm -rf "$W"
mkdir -p "$W/bin"
cd "$W"
ln -s "$M" bin/meshgrad   # the examples call `meshgrad`, also behind `VAR=value` and timeout
export PATH="$W/bin:$PATH"
unset OMPI_COMM_WORLD_SIZE PMI_SIZE

# The files the block's preamble names.
head -c 3000 "$(dirname "$DOC")/../README.md" >book.txt
head -c 3000 "$(dirname "$DOC")/data.md" >other.txt
meshgrad train --mesh tp=1 --steps 2 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --data book.txt \
  --checkpoint-dir ck --save w.safetensors --no-metrics >fixture.out 2>&1 || { cat fixture.out; exit 1; }
meshgrad export --checkpoint w.safetensors --out hf >>fixture.out 2>&1 || { cat fixture.out; exit 1; }
cp -r ck ck-unreadable
echo '{' >ck-unreadable/step_00000002/manifest.json
cp -r ck ck-corrupt
printf '\xff' | dd of="$(ls ck-corrupt/step_00000002/rank_*.bin | head -1)" bs=1 seek=10 conv=notrunc status=none
ln -s w.safetensors link.safetensors
mkfifo fifo
mkdir empty bare
python3 - <<'PY'
import json, os, shutil, struct
def read(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    return json.loads(b[8:8 + n]), b[8 + n:]
def write(path, header, data):
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    open(path, "wb").write(struct.pack("<Q", len(h)) + h + data)
header, data = read("w.safetensors")
header.pop("__metadata__", None)
write("bare/w.safetensors", header, data)
for name, edit in (("hf-relu", "config"), ("hf-prefixed", "names")):
    os.makedirs(name)
    config = json.load(open("hf/config.json"))
    if edit == "config":
        config["activation_function"] = "relu"
    json.dump(config, open(f"{name}/config.json", "w"))
    header, data = read("hf/model.safetensors")
    if edit == "names":
        header = {(k if k == "__metadata__" else "transformer." + k): v for k, v in header.items()}
    write(f"{name}/model.safetensors", header, data)
PY

# The examples: "command  # expected part of the message", comments and blank lines skipped.
python3 - "$DOC" >examples.txt <<'PY'
import re, sys
lines = open(sys.argv[1]).read().split("\n")
start = next(i for i, l in enumerate(lines) if l.startswith("<!-- refusal examples:"))
assert lines[start + 1].startswith("```"), "the marker must be followed by the fenced block"
for line in lines[start + 2:]:
    if line.startswith("```"):
        break
    if not line.strip() or line.startswith("#"):
        continue
    m = re.match(r"(.*?)\s+#\s+(.*)$", line)
    assert m, f"an example without its message: {line}"
    print(f"{m.group(1)}\t{m.group(2)}")
PY
failures=0
count=0
while IFS=$'\t' read -r command needle; do
  count=$((count + 1))
  rc=0
  timeout 60 bash -c "$command" >out.txt 2>&1 </dev/null || rc=$?
  if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ]; then
    echo "FAIL not refused (exit $rc): $command"; failures=$((failures + 1)); continue
  fi
  if ! grep -qF -- "$needle" out.txt; then
    echo "FAIL '$command' refused without '$needle': $(tail -c 400 out.txt)"; failures=$((failures + 1)); continue
  fi
  if grep -q '^step ' out.txt; then
    echo "FAIL '$command' trained before refusing"; failures=$((failures + 1))
  fi
done <examples.txt
[ "$count" -ge 40 ] || { echo "FAIL only $count examples found in $DOC"; exit 1; }
if [ "$failures" -gt 0 ]; then
  echo "$failures of $count examples failed"
  exit 1
fi
echo "all $count examples refused as docs/training.md says"
