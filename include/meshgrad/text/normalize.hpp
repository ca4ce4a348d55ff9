// Unicode normalization for the normalizers of Hugging Face tokenizer.json files.
#pragma once

#include <string>
#include <string_view>

namespace meshgrad::text {

// The NFC form of text (ICU's normalizer, the Unicode version of the system's ICU). Bytes that are
// not well-formed UTF-8 are kept as they are and split the text: the valid runs between them are
// normalized each on their own (Hugging Face's tokenizers never see such bytes: they take strings).
// Text whose bytes are all below 0xCC (every code point below U+0300, where NFC changes nothing) is
// returned unchanged without calling ICU.
std::string nfc(std::string_view text);

}  // namespace meshgrad::text
