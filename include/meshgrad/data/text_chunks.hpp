// A text file read in chunks that can be encoded one at a time: each chunk ends at a place where
// GPT-2's pre-tokenizer splits anyway, so the tokens of the chunks, concatenated, are the tokens of
// the whole text. What `meshgrad prepare` streams its inputs through (memory bounded by the chunk
// size, not the file size).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "meshgrad/io/file_io.hpp"

namespace meshgrad::data {

// The first safe cut in text at or after `from`: encode(text[0, c)) + encode(text[c, n)) ==
// encode(text). Preferred: after a '\n' with a printable ASCII character other than space on both
// sides (text::split_points). Else: before a single ' ' with a printable ASCII character other than
// space on both sides ("word| next"): the pre-token left of it ends there (no pattern runs from a
// non-space into a space), and the one right of it starts there (" next" is ` ?\p{L}+`,
// ` ?\p{N}+` or ` ?[^\s\p{L}\p{N}]+`, and the pattern has no look-behind). Both need only the bytes
// next to the cut, so a cut found in a prefix of a text holds for the whole text. nullopt when text
// has none after `from` (a cut needs its right neighbour in text).
std::optional<std::size_t> safe_text_cut(std::string_view text, std::size_t from);

class TextChunkReader {
 public:
  // Opens path (a regular file; the error names `what` and the path) for chunks of about
  // chunk_bytes (>= 1).
  TextChunkReader(const std::string& path, std::size_t chunk_bytes, const std::string& what);

  std::int64_t size() const { return size_; }    // bytes, as opened
  std::int64_t offset() const { return read_ - static_cast<std::int64_t>(pending_.size()); }   // bytes handed out

  // The next chunk into `chunk`; false (and chunk empty) at the end of the file. A chunk is the
  // rest of the file when that is at most chunk_bytes, else it ends at the first safe cut at or
  // after chunk_bytes (searched in windows of chunk_bytes: memory is a few chunks, more only for a
  // stretch of text with no cut at all, which is read whole). Throws InvalidArgument naming the file
  // when it cannot be read or shrinks while being read.
  bool next(std::string& chunk);

 private:
  // Reads until pending_ holds `want` bytes or the file ends.
  void fill(std::size_t want);

  std::string path_;
  io::UniqueFd fd_;
  std::size_t chunk_bytes_;
  std::int64_t size_ = 0;
  std::int64_t read_ = 0;   // bytes of the file read into pending_ so far
  std::string pending_;
};

}  // namespace meshgrad::data
