// Streaming UTF-8 validation (contract in include/meshgrad/text/utf8.hpp). The well-formed byte
// sequences are those of the Unicode standard's table 3-7:
//   00..7F | C2..DF 80..BF | E0 A0..BF 80..BF | E1..EC 80..BF 80..BF | ED 80..9F 80..BF
//   | EE..EF 80..BF 80..BF | F0 90..BF 80..BF 80..BF | F1..F3 80..BF 80..BF 80..BF | F4 80..8F 80..BF 80..BF
#include "meshgrad/text/utf8.hpp"

#include <cstdint>

namespace meshgrad::text {
namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";   // U+FFFD

// Length of the sequence a lead byte starts (0: not a lead byte) and the allowed range of its
// second byte.
struct Lead {
  int length = 0;
  std::uint8_t lo = 0x80, hi = 0xBF;
};

Lead lead(std::uint8_t b) {
  if (b < 0x80) return {1};
  if (b >= 0xC2 && b <= 0xDF) return {2};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};
  if (b >= 0xE1 && b <= 0xEF) return {3};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b >= 0xF1 && b <= 0xF3) return {4};
  if (b == 0xF4) return {4, 0x80, 0x8F};
  return {};
}

// The length of the well-formed character at bytes[i], or 0 when an ill-formed subpart starts there;
// *subpart gets that subpart's length then (1 to 3 bytes: a lead byte and the continuation bytes that fit).
std::size_t character_at(std::string_view bytes, std::size_t i, std::size_t* subpart) {
  const Lead l = lead(static_cast<std::uint8_t>(bytes[i]));
  std::size_t n = 1;
  if (l.length > 0) {
    while (static_cast<int>(n) < l.length && i + n < bytes.size()) {
      const auto c = static_cast<std::uint8_t>(bytes[i + n]);
      if (!(n == 1 ? (c >= l.lo && c <= l.hi) : (c >= 0x80 && c <= 0xBF))) break;
      ++n;
    }
    if (static_cast<int>(n) == l.length) return n;
  }
  *subpart = n;
  return 0;
}

}  // namespace

std::optional<std::size_t> invalid_utf8_offset(std::string_view bytes) {
  std::size_t i = 0, subpart = 0;
  while (i < bytes.size()) {
    const std::size_t n = character_at(bytes, i, &subpart);
    if (n == 0) return i;
    i += n;
  }
  return std::nullopt;
}

std::string escape_invalid_utf8(std::string_view bytes) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  std::size_t i = 0, subpart = 0;
  while (i < bytes.size()) {
    const std::size_t n = character_at(bytes, i, &subpart);
    if (n > 0) {
      out.append(bytes, i, n);
      i += n;
      continue;
    }
    for (std::size_t k = 0; k < subpart; ++k) {
      const auto b = static_cast<std::uint8_t>(bytes[i + k]);
      out += "\\x";
      out += kHex[b >> 4];
      out += kHex[b & 15];
    }
    i += subpart;
  }
  return out;
}

std::string Utf8Stream::push(std::string_view bytes) {
  std::string in = pending_;
  in.append(bytes);
  pending_.clear();
  std::string out;
  out.reserve(in.size());
  std::size_t i = 0;
  while (i < in.size()) {
    const auto b = static_cast<std::uint8_t>(in[i]);
    const Lead l = lead(b);
    if (l.length == 0) {   // a continuation byte or C0, C1, F5..FF on its own
      out += kReplacement;
      ++i;
      continue;
    }
    // Take the continuation bytes that fit; stop at the first that does not.
    std::size_t n = 1;
    bool broken = false;
    while (static_cast<int>(n) < l.length && i + n < in.size()) {
      const auto c = static_cast<std::uint8_t>(in[i + n]);
      const bool ok = n == 1 ? (c >= l.lo && c <= l.hi) : (c >= 0x80 && c <= 0xBF);
      if (!ok) {
        broken = true;
        break;
      }
      ++n;
    }
    if (static_cast<int>(n) == l.length) {
      out.append(in, i, n);
    } else if (!broken) {   // the input ends inside the character: wait for the rest
      pending_ = in.substr(i);
      break;
    } else {                // a maximal ill-formed subpart: one replacement, resume at the bad byte
      out += kReplacement;
    }
    i += n;
  }
  return out;
}

std::string Utf8Stream::finish() {
  const bool any = !pending_.empty();
  pending_.clear();
  return any ? std::string(kReplacement) : std::string();
}

std::string to_valid_utf8(std::string_view bytes) {
  Utf8Stream s;
  std::string out = s.push(bytes);
  out += s.finish();
  return out;
}

}  // namespace meshgrad::text
