#include "meshgrad/text/normalize.hpp"

#include <unicode/unorm2.h>
#include <unicode/ustring.h>

#include <algorithm>
#include <vector>

#include "meshgrad/tensor/error.hpp"
#include "meshgrad/text/utf8.hpp"

namespace meshgrad::text {

namespace {

const UNormalizer2* nfc_instance() {
  static const UNormalizer2* instance = [] {
    UErrorCode status = U_ZERO_ERROR;
    const UNormalizer2* n = unorm2_getNFCInstance(&status);
    MG_CHECK(U_SUCCESS(status) && n != nullptr, "NFC: ICU has no NFC normalizer: {}", u_errorName(status));
    return n;
  }();
  return instance;
}

// Appends the NFC form of valid UTF-8 to out.
void nfc_valid(std::string_view text, std::string& out) {
  if (std::none_of(text.begin(), text.end(), [](char c) { return static_cast<unsigned char>(c) >= 0xCC; })) {
    out += text;   // every code point < U+0300: NFC already
    return;
  }
  MG_CHECK(text.size() < static_cast<std::size_t>(INT32_MAX / 2), "NFC: {} bytes of text in one piece are more "
           "than ICU's int32 lengths hold", text.size());
  UErrorCode status = U_ZERO_ERROR;
  std::vector<UChar> utf16(text.size() + 1);
  int32_t n16 = 0;
  u_strFromUTF8(utf16.data(), static_cast<int32_t>(utf16.size()), &n16, text.data(), static_cast<int32_t>(text.size()),
                &status);
  MG_CHECK(U_SUCCESS(status), "NFC: ICU cannot read the text as UTF-8: {}", u_errorName(status));
  const UNormalizer2* n = nfc_instance();
  if (unorm2_spanQuickCheckYes(n, utf16.data(), n16, &status) == n16 && U_SUCCESS(status)) {
    out += text;
    return;
  }
  status = U_ZERO_ERROR;
  // NFC of UTF-16 is at most 3x its input (Unicode's bound for NFC); grow on U_BUFFER_OVERFLOW_ERROR anyway.
  std::vector<UChar> normalized(static_cast<std::size_t>(n16) * 3 + 16);
  int32_t nn = unorm2_normalize(n, utf16.data(), n16, normalized.data(), static_cast<int32_t>(normalized.size()), &status);
  if (status == U_BUFFER_OVERFLOW_ERROR) {
    status = U_ZERO_ERROR;
    normalized.resize(static_cast<std::size_t>(nn));
    nn = unorm2_normalize(n, utf16.data(), n16, normalized.data(), nn, &status);
  }
  MG_CHECK(U_SUCCESS(status), "NFC: ICU's normalizer failed: {}", u_errorName(status));
  const std::size_t at = out.size();
  out.resize(at + static_cast<std::size_t>(nn) * 3 + 4);
  int32_t n8 = 0;
  u_strToUTF8(out.data() + at, static_cast<int32_t>(out.size() - at), &n8, normalized.data(), nn, &status);
  MG_CHECK(U_SUCCESS(status), "NFC: ICU cannot write the normalized text as UTF-8: {}", u_errorName(status));
  out.resize(at + static_cast<std::size_t>(n8));
}

}  // namespace

std::string nfc(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  while (!text.empty()) {
    const std::optional<std::size_t> bad = invalid_utf8_offset(text);
    nfc_valid(text.substr(0, bad.value_or(text.size())), out);
    if (!bad) break;
    out += text[*bad];   // one ill-formed byte, kept; go on after it
    text.remove_prefix(*bad + 1);
  }
  return out;
}

}  // namespace meshgrad::text
