// Encoding with a tokenizer.json pipeline (hf_tokenizer.cpp reads it): added tokens, the NFC
// normalizer, the pre-tokenizer steps and the BPE model, in Hugging Face tokenizers' order.
#include <algorithm>

#include "meshgrad/tensor/error.hpp"
#include "meshgrad/text/normalize.hpp"
#include "tokenizer_impl.hpp"

namespace meshgrad::text {

namespace {

using detail::AddedToken;
using detail::HfPipeline;
using detail::PreStep;

// One UTF-8 character: its code point and length; valid = false for a byte that does not start a
// well-formed character (taken as one byte, neither space nor word).
struct Char {
  char32_t cp = 0;
  std::size_t len = 1;
  bool valid = false;
};

Char char_at(std::string_view s, std::size_t i) {
  const auto c0 = static_cast<unsigned char>(s[i]);
  if (c0 < 0x80) return {c0, 1, true};
  const std::size_t len = c0 >= 0xF0 && c0 < 0xF5 ? 4 : c0 >= 0xE0 ? 3 : c0 >= 0xC2 && c0 < 0xE0 ? 2 : 0;
  if (len == 0 || i + len > s.size()) return {};
  char32_t cp = c0 & (0x7F >> len);
  for (std::size_t k = 1; k < len; ++k) {
    const auto c = static_cast<unsigned char>(s[i + k]);
    if ((c & 0xC0) != 0x80) return {};
    cp = (cp << 6) | (c & 0x3Fu);
  }
  return {cp, len, true};
}

// The character that ends at `end` (> 0).
Char char_before(std::string_view s, std::size_t end) {
  std::size_t start = end - 1;
  while (start > 0 && end - start < 4 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
  const Char c = char_at(s, start);
  return c.valid && start + c.len == end ? c : Char{};
}

// Unicode White_Space: the \s of Rust's regex crate, which added tokens' lstrip / rstrip strip.
bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) ||
         c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

bool is_word(const HfPipeline& hf, std::string_view s, std::size_t at, const Char& c) {
  if (!c.valid) return false;
  const int rc = pcre2_match(hf.word_char, reinterpret_cast<PCRE2_SPTR>(s.data() + at), c.len, 0, PCRE2_ANCHORED,
                             hf.word_match, nullptr);
  return rc >= 0;
}

// Hugging Face's AddedVocabulary::find_matches over s with one set of added tokens: leftmost-longest
// matches, left to right without overlap; a single_word token next to a word character (\w) is
// dropped; lstrip / rstrip take the White_Space before / after into the token. Calls
// on_gap(begin, end) for the text between tokens and on_token(id) for each token, in order.
template <class OnGap, class OnToken>
void split_added(const HfPipeline& hf, std::string_view s, const std::array<std::vector<std::uint32_t>, 256>& table,
                 OnGap on_gap, OnToken on_token) {
  const std::size_t n = s.size();
  std::size_t start_offset = 0, pos = 0;
  while (pos < n) {
    const AddedToken* token = nullptr;
    std::size_t start = pos;
    for (; start < n && !token; ++start) {
      for (std::uint32_t k : table[static_cast<unsigned char>(s[start])]) {
        if (s.substr(start).starts_with(hf.added[k].content)) {
          token = &hf.added[k];
          break;
        }
      }
    }
    if (!token) break;
    --start;
    std::size_t stop = start + token->content.size();
    pos = stop;   // the automaton goes on after the match, kept or not
    if (token->single_word) {
      const bool start_space = start == 0 || !is_word(hf, s, start - char_before(s, start).len, char_before(s, start));
      const bool stop_space = stop == n || !is_word(hf, s, stop, char_at(s, stop));
      if (!start_space || !stop_space) continue;
    }
    if (token->lstrip) {
      std::size_t new_start = start;
      for (Char c; new_start > 0 && (c = char_before(s, new_start)).valid && is_white_space(c.cp);) new_start -= c.len;
      start = std::max(new_start, start_offset);   // white space a token before took is not taken again
    }
    if (token->rstrip) {
      for (Char c; stop < n && (c = char_at(s, stop)).valid && is_white_space(c.cp);) stop += c.len;
    }
    if (start_offset < start) on_gap(start_offset, start);
    on_token(token->id);
    start_offset = stop;
  }
  if (start_offset < n) on_gap(start_offset, n);
}

// Splits text by a pattern with Hugging Face's "Isolated" behaviour: every match and every gap
// between matches (a run of invalid UTF-8 included) is a piece, in order. Calls emit(begin, end).
template <class Emit>
void split_isolated(pcre2_code* code, pcre2_match_data* match, std::string_view text, Emit emit) {
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const std::size_t n = text.size();
  std::size_t pos = 0, gap = 0;
  while (pos < n) {
    const int rc = pcre2_match(code, subject, n, pos, 0, match, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      std::array<PCRE2_UCHAR, 256> msg{};
      pcre2_get_error_message(rc, msg.data(), msg.size());
      throw Error(fmt::format("tokenizer: PCRE2 match failed at byte offset {}: {}", pos,
                              reinterpret_cast<const char*>(msg.data())));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(match);
    const std::size_t a = ov[0], b = ov[1];
    if (b == a) {   // an empty match splits nothing: search again from the next character
      pos = a + 1;
      while (pos < n && (static_cast<unsigned char>(text[pos]) & 0xC0) == 0x80) ++pos;
      continue;
    }
    if (a > gap) emit(gap, a);
    emit(a, b);
    gap = pos = b;
  }
  if (gap < n) emit(gap, n);
}

}  // namespace

void Tokenizer::Impl::hf_model(std::string_view piece, std::vector<TokenId>& out) {
  if (hf.ignore_merges) {
    if (const auto it = bytes_to_id.find(piece); it != bytes_to_id.end()) {
      out.push_back(it->second);
      return;
    }
  }
  encode_piece(piece, out);
}

void Tokenizer::Impl::hf_pre_tokenize(std::size_t step, std::string_view piece, bool no_prefix,
                                      std::vector<TokenId>& out) {
  if (piece.empty()) return;
  const PreStep& s = hf.steps[step];
  if (s.kind == PreStep::Kind::kSplit) {
    // Every piece a Split makes gets ByteLevel's prefix space in the whole text too: no_prefix ends here.
    split_isolated(s.code, s.match, piece, [&](std::size_t a, std::size_t b) {
      hf_pre_tokenize(step + 1, piece.substr(a, b - a), false, out);
    });
    return;
  }
  std::string prefixed;
  if (s.add_prefix_space && !no_prefix && piece.front() != ' ') {
    prefixed = " " + std::string(piece);
    piece = prefixed;
  }
  if (!s.use_regex) {
    hf_model(piece, out);
    return;
  }
  split_isolated(code, match, piece, [&](std::size_t a, std::size_t b) { hf_model(piece.substr(a, b - a), out); });
}

void Tokenizer::Impl::hf_encode(std::string_view text, std::vector<TokenId>& out, bool text_start) {
  auto push = [&](TokenId id) { out.push_back(id); };
  // A segment between non-normalized added tokens: normalized, then split by the normalized ones.
  auto normalized_part = [&](std::string_view segment, bool at_text_start) {
    std::string storage;
    std::string_view norm = segment;
    if (hf.nfc) {
      storage = nfc(segment);
      norm = storage;
    }
    auto pre = [&](std::size_t a, std::size_t b) {
      hf_pre_tokenize(0, norm.substr(a, b - a), at_text_start && a == 0 && !text_start, out);
    };
    if (hf.has_normalized) {
      split_added(hf, norm, hf.normalized_by_byte, pre, push);
    } else {
      pre(0, norm.size());
    }
  };
  if (hf.has_raw) {
    split_added(hf, text, hf.raw_by_byte, [&](std::size_t a, std::size_t b) { normalized_part(text.substr(a, b - a), a == 0); },
                push);
  } else {
    normalized_part(text, true);
  }
}

}  // namespace meshgrad::text
