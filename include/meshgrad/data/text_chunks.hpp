// A text file read in chunks that can be encoded one at a time: each chunk ends at a place where
// GPT-2's pre-tokenizer splits anyway, so the tokens of the chunks, concatenated, are the tokens of
// the whole text. What `meshgrad prepare` streams its inputs through: memory is bounded by the
// window (a chunk is at most max(2 x chunk_bytes, 64 KiB)), not the file size. The one exception to
// equal tokens: a window of text with no safe cut at all (a single run of letters, digits or symbols
// that long, or text with no two adjacent printable ASCII characters) is cut anyway at a UTF-8
// character boundary (forced_cuts() counts them); the pre-token across such a cut is encoded as two
// pieces, so the tokens next to it may differ from encoding the whole text.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "meshgrad/io/file_io.hpp"
#include "meshgrad/text/tokenizer.hpp"

namespace meshgrad::data {

// The first safe cut in text at or after `from`: encode(text[0, c)) + encode(text[c, n)) ==
// encode(text). Preferred: after a '\n' with a printable ASCII character other than space on both
// sides (text::split_points). Else: before a single ' ' with a printable ASCII character other than
// space on both sides ("word| next"): the pre-token left of it ends there (no pattern runs from a
// non-space into a space), and the one right of it starts there (" next" is ` ?\p{L}+`,
// ` ?\p{N}+` or ` ?[^\s\p{L}\p{N}]+`, and the pattern has no look-behind). Else: between two
// printable ASCII characters other than space of different classes (letter, digit, other; "abc|123",
// "x|=", "=|y"), the left one not an apostrophe: every pattern that can match the left character
// (a run of its class, or a contraction 's 't 're 've 'm 'll 'd, which ends in a letter) stops
// before a character of another class, and the right one starts a match ("'" left is excluded: "'s"
// would be a contraction). All need only the bytes next to the cut, so a cut found in a prefix of a
// text holds for the whole text. nullopt when text has none after `from` (a cut needs its right
// neighbour in text). Only the kinds `rules` allows (text::Tokenizer::cut_rules: what holds for
// the tokenizer's pre-tokenizer and added tokens) are taken.
std::optional<std::size_t> safe_text_cut(std::string_view text, std::size_t from, const text::CutRules& rules = {});

class TextChunkReader {
 public:
  // Opens path (a regular file; the error names `what` and the path) for chunks of about
  // chunk_bytes (>= 1).
  TextChunkReader(const std::string& path, std::size_t chunk_bytes, const std::string& what,
                  const text::CutRules& rules = {});

  std::int64_t size() const { return size_; }    // bytes, as opened
  std::int64_t offset() const { return read_ - static_cast<std::int64_t>(pending_.size()); }   // bytes handed out

  // The next chunk into `chunk`; false (and chunk empty) at the end of the file. A chunk is the
  // rest of the file when that is at most chunk_bytes, else it ends at the first safe cut at or
  // after chunk_bytes within the window (window_bytes() from the chunk's start), else at the last
  // safe cut before chunk_bytes, else (none in the window) at the last UTF-8 character boundary
  // before the window's end (a forced cut). So a chunk is at most window_bytes() and memory a few
  // windows. Throws InvalidArgument naming the file when it cannot be read or shrinks while being read.
  bool next(std::string& chunk);

  // Chunks that ended at a forced cut (inside a pre-token) so far.
  std::int64_t forced_cuts() const { return forced_cuts_; }
  // The most text read ahead and searched for a cut: max(2 x chunk_bytes, 64 KiB), so that a small
  // chunk_bytes (a fine validation split) does not force cuts into ordinary long words.
  std::size_t window_bytes() const { return std::max<std::size_t>(2 * chunk_bytes_, std::size_t{64} << 10); }

 private:
  // Reads until pending_ holds `want` bytes or the file ends.
  void fill(std::size_t want);

  std::string path_;
  io::UniqueFd fd_;
  std::size_t chunk_bytes_;
  text::CutRules rules_;
  std::int64_t size_ = 0;
  std::int64_t read_ = 0;   // bytes of the file read into pending_ so far
  std::string pending_;
  std::int64_t forced_cuts_ = 0;
};

}  // namespace meshgrad::data
