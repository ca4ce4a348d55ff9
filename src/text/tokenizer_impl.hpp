// The tokenizer's state, shared by src/text/tokenizer.cpp (GPT-2 files, BPE) and
// src/text/hf_tokenizer.cpp (tokenizer.json). Internal to the text layer.
#pragma once

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "meshgrad/text/tokenizer.hpp"

namespace meshgrad::text::detail {

// GPT-2's byte <-> unicode alphabet: bytes '!'..'~', 0xA1..0xAC and 0xAE..0xFF stand for the code
// point of the same value; the other 68 bytes, in increasing order, for U+0100, U+0101, ...
std::array<char32_t, 256> byte_to_codepoint();
// The bytes a vocabulary symbol spelled in that alphabet stands for; nullopt when it is not.
std::optional<std::string> symbol_to_bytes(std::string_view symbol);
// A whole file (InvalidArgument naming `what` and the path when unreadable).
std::string read_file(const std::string& path, const char* what);
// A short printable excerpt of a symbol for messages.
std::string excerpt(std::string_view s);
// Compiles pattern with UTF + UCP + MATCH_INVALID_UTF (JIT when available); InvalidArgument naming
// `what` and PCRE2's message on a bad pattern.
pcre2_code* compile_pattern(const std::string& pattern, const std::string& what);
// GPT-2's pre-tokenizer pattern with \s spelled as Unicode White_Space (tokenizer.cpp says why).
const std::string& gpt2_pattern();
// A pattern with \s and \S outside and \s inside character classes written as Unicode White_Space,
// the \s of Hugging Face's regex engine (Oniguruma), Python's `regex` and tiktoken.
std::string white_space_as_unicode(const std::string& pattern);

inline std::uint64_t pair_key(TokenId a, TokenId b) { return (static_cast<std::uint64_t>(a) << 32) | b; }

struct Merge {
  std::uint32_t rank;
  TokenId result;
};

// (left id, right id) -> Merge, open addressing with linear probing in a power-of-two table at most
// half full. The BPE inner loop is a lookup per adjacent pair; std::unordered_map's node chasing was
// a third of the encoding time.
class MergeTable {
 public:
  void insert_or_assign(std::uint64_t key, Merge m) {
    if ((count_ + 1) * 2 > slots_.size()) grow();
    Slot& s = slots_[index(key)];
    if (s.key == kEmpty) ++count_;
    s = {key, m};
  }
  const Merge* find(std::uint64_t key) const {
    if (slots_.empty()) return nullptr;
    const Slot& s = slots_[index(key)];
    return s.key == key ? &s.merge : nullptr;
  }

 private:
  static constexpr std::uint64_t kEmpty = ~std::uint64_t{0};   // ids are < 2^31: never a real pair
  struct Slot {
    std::uint64_t key = kEmpty;
    Merge merge{};
  };
  // The slot holding key, or the empty slot where it would go.
  std::size_t index(std::uint64_t key) const {
    const std::size_t mask = slots_.size() - 1;
    std::size_t i = static_cast<std::size_t>((key * 0x9E3779B97F4A7C15ull) >> 32) & mask;
    while (slots_[i].key != kEmpty && slots_[i].key != key) i = (i + 1) & mask;
    return i;
  }
  void grow() {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(std::max<std::size_t>(64, old.size() * 2), Slot{});
    for (const Slot& s : old) {
      if (s.key != kEmpty) slots_[index(s.key)] = s;
    }
  }
  std::vector<Slot> slots_;
  std::size_t count_ = 0;
};

// Heterogeneous lookup (std::string_view into a map keyed by std::string).
struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

constexpr std::size_t kCacheMaxEntries = 1 << 20;   // cleared when full; bounded memory on any input
constexpr std::size_t kCacheMaxPieceBytes = 256;    // longer pieces are rare and not worth keeping


// One step of a tokenizer.json pre-tokenizer: each piece from the step before is split further.
struct PreStep {
  enum class Kind { kSplit, kByteLevel } kind = Kind::kSplit;
  pcre2_code* code = nullptr;   // kSplit: the matches and the gaps between them are pieces (Isolated)
  pcre2_match_data* match = nullptr;
  bool add_prefix_space = false;   // kByteLevel: " " before a piece that does not start with one
  bool use_regex = false;          // kByteLevel: split by GPT-2's pattern
};

// An entry of tokenizer.json's added_tokens.
struct AddedToken {
  std::string content;   // as matched: NFC'd when normalized and the normalizer is NFC
  TokenId id = 0;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false;
};

// The tokenizer.json pipeline (Tokenizer::Impl::hf).
struct HfPipeline {
  bool enabled = false;
  bool nfc = false;
  bool ignore_merges = false;
  std::vector<PreStep> steps;
  // Added tokens matched before the normalizer (normalized: false) and after it; per first byte,
  // the indices into `added`, longest first (leftmost-longest matching).
  std::vector<AddedToken> added;
  std::array<std::vector<std::uint32_t>, 256> raw_by_byte, normalized_by_byte;
  bool has_raw = false, has_normalized = false;
  pcre2_code* word_char = nullptr;   // \w of the Rust regex crate, for single_word
  pcre2_match_data* word_match = nullptr;
  ~HfPipeline();
};

}  // namespace meshgrad::text::detail

namespace meshgrad::text {

using detail::HfPipeline;
using detail::Merge;
using detail::MergeTable;
using detail::StringHash;

struct Tokenizer::Impl {
  std::vector<std::string> id_to_bytes;      // "" with valid[id] = false for ids the vocabulary skips
  std::vector<bool> valid;
  std::unordered_map<std::string, TokenId, StringHash, std::equal_to<>> bytes_to_id;
  std::array<TokenId, 256> byte_id{};
  MergeTable merges;   // (left id, right id) -> rank and merged id
  std::optional<TokenId> eot;

  // The GPT-2 pattern (GPT-2 files; tokenizer.json's ByteLevel with use_regex).
  pcre2_code* code = nullptr;
  pcre2_match_data* match = nullptr;

  // ---- tokenizer.json (hf.enabled) ----
  HfPipeline hf;
  std::vector<TokenId> bos;
  std::optional<TokenId> eos;
  std::string kind = "GPT-2 BPE (vocab + merges)";
  std::vector<std::string> sources;

  std::unordered_map<std::string, std::vector<TokenId>, StringHash, std::equal_to<>> cache;
  bool cache_enabled = true;
  std::int64_t lookups = 0, hits = 0;

  // Scratch of bpe(), kept to avoid allocations per piece.
  struct Node {
    TokenId id;
    std::int32_t prev, next;   // -1 at the ends
    bool alive;
  };
  struct Candidate {
    std::uint32_t rank;
    std::int32_t left;         // index of the left node (its position in the piece: left to right order)
    TokenId left_id, right_id; // the pair when the candidate was pushed; stale when either changed
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  std::vector<Node> nodes;
  std::vector<Candidate> heap;
  std::vector<Candidate> round;

  ~Impl();
  void compile();
  // GPT-2 files: the pattern's pieces, BPE-encoded.
  void gpt2_encode(std::string_view text, std::vector<TokenId>& out);
  // Byte-level BPE of one piece (ids appended to out).
  void bpe(std::string_view piece, std::vector<TokenId>& out);
  // bpe() through the cache.
  void encode_piece(std::string_view piece, std::vector<TokenId>& out);
  // tokenizer.json: the whole pipeline (hf_tokenizer.cpp).
  void hf_encode(std::string_view text, std::vector<TokenId>& out, bool text_start);
  // Pre-tokenizer step `step` and the ones after it on one piece; no_prefix: the piece continues
  // a text already encoded (no add_prefix_space).
  void hf_pre_tokenize(std::size_t step, std::string_view piece, bool no_prefix, std::vector<TokenId>& out);
  // BPE of one piece of the pre-tokenizer (ignore_merges first).
  void hf_model(std::string_view piece, std::vector<TokenId>& out);
};

}  // namespace meshgrad::text
