// Streaming bytes -> valid UTF-8, for printing text token by token: a token's bytes may end in the
// middle of a character (GPT-2's BPE splits multi-byte characters, a byte-level model emits one
// byte at a time), so the incomplete tail of a character is held back until its remaining bytes
// arrive. Bytes that cannot be part of valid UTF-8 become U+FFFD (the replacement character), one
// per maximal ill-formed subpart (the Unicode standard's "substitution of maximal subparts",
// Python's errors="replace"), so the output is always valid UTF-8.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace meshgrad::text {

class Utf8Stream {
 public:
  // Appends bytes; returns the text that is complete now (valid UTF-8, possibly empty).
  std::string push(std::string_view bytes);
  // End of input: a held-back incomplete character becomes U+FFFD. Returns the rest.
  std::string finish();
  // Bytes held back (0 to 3).
  std::size_t pending() const { return pending_.size(); }

 private:
  std::string pending_;
};

// The whole of bytes as valid UTF-8 (Utf8Stream over all of it).
std::string to_valid_utf8(std::string_view bytes);

// The offset of the first byte of `bytes` that is not part of well-formed UTF-8 (where its first
// ill-formed subpart starts; a character cut off by the end counts), or nullopt when all of it is
// valid. For refusing, before any work, text that a strict UTF-8 format (JSON) will be asked to hold.
std::optional<std::size_t> invalid_utf8_offset(std::string_view bytes);

// `bytes` for a message: its valid UTF-8 as is, every byte of an ill-formed subpart as \xHH, so the
// bad bytes show and the message stays printable (and can be written into a strict UTF-8 format).
std::string escape_invalid_utf8(std::string_view bytes);

}  // namespace meshgrad::text
