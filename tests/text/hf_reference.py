#!/usr/bin/env python3
"""Reference ids for a Hugging Face tokenizer.json of the byte-level BPE kind, written from the
published behaviour of Hugging Face's tokenizers (Rust), independently of meshgrad's C++:

  added tokens (not normalized) -> NFC (unicodedata) -> added tokens (normalized) ->
  pre-tokenizers (Split with the `regex` module, Digits, ByteLevel) -> OpenAI's encoder.py BPE

Usage: hf_reference.py TOKENIZER_JSON TEXTS_JSON
  TEXTS_JSON: a JSON array of strings. Prints a JSON array of id arrays, one per text.
Needs Debian's python3-regex (the `regex` module; its \\s is Unicode White_Space, as Oniguruma's).
"""
import json
import sys
import unicodedata

import regex

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
WORD = regex.compile(r"[\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\u200c\u200d]")   # Rust regex's \w
WHITE = regex.compile(r"\p{White_Space}")                              # Rust regex's \s


def bytes_to_unicode():
    """OpenAI's encoder.py table: byte -> the character that spells it in the vocabulary."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


BYTE_CHARS = bytes_to_unicode()


class Reference:
    def __init__(self, path):
        with open(path, encoding="utf-8") as f:
            t = json.load(f)
        model = t["model"]
        assert model.get("type", "BPE") == "BPE"
        self.vocab = model["vocab"]
        self.ranks = {}
        for i, m in enumerate(model["merges"]):
            pair = tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
            self.ranks[pair] = i
        self.ignore_merges = bool(model.get("ignore_merges", False))
        self.nfc = self._normalizer(t.get("normalizer"))
        self.steps = []
        self._pre(t["pre_tokenizer"])
        self.raw, self.normalized = [], []
        for a in t.get("added_tokens") or []:
            normalized = a.get("normalized", not a.get("special", False))
            content = a["content"]
            if normalized and self.nfc:
                content = unicodedata.normalize("NFC", content)
            (self.normalized if normalized else self.raw).append(dict(a, content=content))
        self.cache = {}

    def _normalizer(self, n):
        if n is None:
            return False
        if n["type"] == "NFC":
            return True
        assert n["type"] == "Sequence"
        return any(self._normalizer(x) for x in n["normalizers"])

    def _pre(self, p):
        if p["type"] == "Sequence":
            for x in p["pretokenizers"]:
                self._pre(x)
        elif p["type"] == "Split":
            pattern = p["pattern"]
            rx = regex.compile(pattern["Regex"]) if "Regex" in pattern else regex.compile(regex.escape(pattern["String"]))
            self.steps.append(("split", rx))
        elif p["type"] == "Digits":
            self.steps.append(("split", regex.compile(r"\p{N}" if p.get("individual_digits") else r"\p{N}+")))
        elif p["type"] == "ByteLevel":
            self.steps.append(("bytelevel", p.get("add_prefix_space", True), p.get("use_regex", True)))
        else:
            raise ValueError(p["type"])

    # ---- added tokens: AddedVocabulary::find_matches ----
    @staticmethod
    def _find(text, tokens):
        """[(is_token, id_or_text)] covering text."""
        out, start_offset, pos, n = [], 0, 0, len(text)
        while pos < n:
            best = None
            for start in range(pos, n):
                for t in tokens:
                    c = t["content"]
                    if text.startswith(c, start) and (best is None or len(c) > len(best[1]["content"])):
                        best = (start, t)
                if best:
                    break
            if not best:
                break
            start, t = best
            stop = start + len(t["content"])
            pos = stop
            if t.get("single_word"):
                if (start > 0 and WORD.match(text[start - 1])) or (stop < n and WORD.match(text[stop])):
                    continue
            if t.get("lstrip"):
                s = start
                while s > 0 and WHITE.match(text[s - 1]):
                    s -= 1
                start = max(s, start_offset)
            if t.get("rstrip"):
                while stop < n and WHITE.match(text[stop]):
                    stop += 1
            if start_offset < start:
                out.append((False, text[start_offset:start]))
            out.append((True, t["id"]))
            start_offset = stop
        if start_offset < n:
            out.append((False, text[start_offset:]))
        return out

    # ---- pre-tokenizers ----
    @staticmethod
    def _isolated(rx, s):
        pieces, prev = [], 0
        for m in rx.finditer(s):
            if m.start() == m.end():
                continue
            if m.start() > prev:
                pieces.append(s[prev:m.start()])
            pieces.append(m.group())
            prev = m.end()
        if prev < len(s):
            pieces.append(s[prev:])
        return pieces

    def _pre_tokenize(self, s):
        pieces = [s]
        for step in self.steps:
            nxt = []
            for p in pieces:
                if step[0] == "split":
                    nxt += self._isolated(step[1], p)
                else:
                    _, prefix, use_regex = step
                    if prefix and not p.startswith(" "):
                        p = " " + p
                    nxt += self._isolated(regex.compile(GPT2_PATTERN), p) if use_regex else [p]
            pieces = [p for p in nxt if p]
        return pieces

    # ---- BPE: OpenAI's encoder.py ----
    def _bpe(self, word):
        if word in self.cache:
            return self.cache[word]
        parts = list(word)
        while len(parts) > 1:
            pairs = set(zip(parts, parts[1:]))
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        self.cache[word] = parts
        return parts

    def _model(self, piece, out):
        word = "".join(BYTE_CHARS[b] for b in piece.encode("utf-8"))
        if self.ignore_merges and word in self.vocab:
            out.append(self.vocab[word])
            return
        out += [self.vocab[p] for p in self._bpe(word)]

    def encode(self, text):
        out = []
        for is_token, raw in self._find(text, self.raw):
            if is_token:
                out.append(raw)
                continue
            norm = unicodedata.normalize("NFC", raw) if self.nfc else raw
            for is_token2, part in self._find(norm, self.normalized):
                if is_token2:
                    out.append(part)
                    continue
                for piece in self._pre_tokenize(part):
                    self._model(piece, out)
        return out


def main():
    ref = Reference(sys.argv[1])
    with open(sys.argv[2], encoding="utf-8") as f:
        texts = json.load(f)
    json.dump([ref.encode(t) for t in texts], sys.stdout)


if __name__ == "__main__":
    main()
