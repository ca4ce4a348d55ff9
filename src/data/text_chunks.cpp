#include "meshgrad/data/text_chunks.hpp"

#include <algorithm>
#include <vector>

#include "meshgrad/tensor/error.hpp"
#include "meshgrad/text/tokenizer.hpp"

namespace meshgrad::data {

namespace {

bool printable_non_space(char c) {
  const auto u = static_cast<unsigned char>(c);
  return u > 0x20 && u < 0x7F;
}

// The pre-tokenizer's classes of a printable ASCII character other than space: \p{L}, \p{N}, or
// neither (the pattern's [^\s\p{L}\p{N}]).
int ascii_class(char c) {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return 0;
  return c >= '0' && c <= '9' ? 1 : 2;
}

// Whether c (0 < c < text.size()) is a cut of the kinds safe_text_cut's comment lists, judged by the
// bytes next to it: after a '\n' between printable characters, before a single ' ' between
// printable characters (needs text[c + 1]), or between printable characters of different classes
// where the left one is not an apostrophe.
bool is_safe_cut(std::string_view text, std::size_t c, const text::CutRules& rules) {
  const char left = text[c - 1], right = text[c];
  if (left == '\n') return rules.newline && c >= 2 && printable_non_space(text[c - 2]) && printable_non_space(right);
  if (right == ' ') {
    return rules.space && c + 1 < text.size() && printable_non_space(left) && printable_non_space(text[c + 1]);
  }
  return rules.class_change && printable_non_space(left) && printable_non_space(right) && left != '\'' &&
         ascii_class(left) != ascii_class(right);
}

// The last safe cut in (0, before); nullopt when there is none.
std::optional<std::size_t> last_safe_cut(std::string_view text, std::size_t before, const text::CutRules& rules) {
  for (std::size_t c = std::min(before, text.size()); c-- > 1;) {
    if (is_safe_cut(text, c, rules)) return c;
  }
  return std::nullopt;
}

// The start of the UTF-8 character at or before `at` (at most 3 bytes back: a longer run of
// continuation bytes is not UTF-8, and any place in it will do).
std::size_t character_start(std::string_view text, std::size_t at) {
  for (int back = 0; back < 3 && at > 1 && (static_cast<unsigned char>(text[at]) & 0xC0) == 0x80; ++back) --at;
  return at;
}

}  // namespace

std::optional<std::size_t> safe_text_cut(std::string_view text, std::size_t from, const text::CutRules& rules) {
  from = std::max<std::size_t>(from, 1);
  if (from >= text.size()) return std::nullopt;
  // split_points(text, from) gives the newline cuts at or after `from` (its first one is the one).
  if (rules.newline) {
    const std::vector<std::size_t> newline_cuts = text::split_points(text, from);
    if (!newline_cuts.empty()) return newline_cuts.front();
  }
  for (std::size_t i = text.find(' ', from); rules.space && i != std::string_view::npos && i + 1 < text.size();
       i = text.find(' ', i + 1)) {
    if (printable_non_space(text[i - 1]) && printable_non_space(text[i + 1])) return i;
  }
  // Text without either (long lines with no spaces: code, URLs, base64): a change of class.
  for (std::size_t c = from; rules.class_change && c < text.size(); ++c) {
    if (text[c] != ' ' && text[c - 1] != '\n' && is_safe_cut(text, c, rules)) return c;
  }
  return std::nullopt;
}

TextChunkReader::TextChunkReader(const std::string& path, std::size_t chunk_bytes, const std::string& what,
                                 const text::CutRules& rules)
    : path_(path), chunk_bytes_(std::max<std::size_t>(chunk_bytes, 1)), rules_(rules) {
  std::uint64_t size = 0;
  try {
    fd_ = io::open_regular_file(path, &size);
  } catch (const io::FileIoError& e) {
    throw InvalidArgument(fmt::format("{}: {}", what, e.what()));
  }
  size_ = static_cast<std::int64_t>(size);
}

void TextChunkReader::fill(std::size_t want) {
  while (pending_.size() < want && read_ < size_) {
    const auto n = static_cast<std::size_t>(std::min<std::int64_t>(static_cast<std::int64_t>(want - pending_.size()), size_ - read_));
    const std::size_t at = pending_.size();
    pending_.resize(at + n);
    io::read_exact(fd_.get(), pending_.data() + at, n, static_cast<std::uint64_t>(read_), path_);
    read_ += static_cast<std::int64_t>(n);
  }
}

bool TextChunkReader::next(std::string& chunk) {
  chunk.clear();
  // At most window_bytes() is read ahead and handed out: memory is bounded whatever the text.
  fill(window_bytes());
  const bool at_end = read_ == size_;
  std::optional<std::size_t> cut;
  if (!(at_end && pending_.size() <= chunk_bytes_)) {
    // The first cut at or after chunk_bytes, searched a chunk's worth at a time (so a newline far
    // off does not win over a space near chunk_bytes; each search but the first starts at the last
    // byte of the one before, whose right neighbour it lacked).
    const std::string_view text(pending_);
    for (std::size_t from = chunk_bytes_, end = 2 * chunk_bytes_; !cut; from = end - 1, end += chunk_bytes_) {
      cut = safe_text_cut(text.substr(0, std::min(end, text.size())), from, rules_);
      if (end >= text.size()) break;
    }
    if (!cut && !at_end) cut = last_safe_cut(pending_, chunk_bytes_, rules_);   // else the last before it
    if (!cut && !at_end) {
      // A window without a safe cut (one run of letters, text with no ASCII): cut at a character
      // boundary anyway, where the tokens may differ from the whole text's (the header says so).
      cut = character_start(pending_, pending_.size() - 1);
      ++forced_cuts_;
    }
  }
  const std::size_t n = cut.value_or(pending_.size());
  chunk.assign(pending_, 0, n);
  pending_.erase(0, n);
  return !chunk.empty();
}

}  // namespace meshgrad::data
