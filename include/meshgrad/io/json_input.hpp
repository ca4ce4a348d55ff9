// JSON from files meshgrad did not write (safetensors headers, config.json, and later checkpoint
// manifests), read so that no input can crash, hang or flood an error message:
//
// - Linear time: one SAX pass builds the document (nlohmann's parser is iterative); a key is
//   looked up once in its object's map when it arrives, so duplicates cost O(log n), not a scan.
// - Bounded nesting: a container deeper than `max_depth` stops the parse at once (the document is
//   never built that deep, so neither destroying nor printing it can recurse without bound).
// - No duplicate keys: nlohmann keeps the last of repeated keys silently; a format that names
//   things by key (tensor names) must refuse them instead.
// - Error text is bounded: keys, tokens and values quoted in messages are cut to a few dozen
//   characters (json_excerpt), never dump()ed whole.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace meshgrad::io {

// Why parse_untrusted_json refused a text. The reader that called it turns this into its own
// error naming the file (and adds its file offset to `byte`).
class JsonInputError : public std::runtime_error {
 public:
  enum class Kind {
    Syntax,         // not JSON (or trailing bytes after the value)
    TooDeep,        // a container nested deeper than max_depth
    DuplicateKey,   // a key given twice in one object
  };
  JsonInputError(Kind kind, std::string what, std::optional<std::uint64_t> byte, std::vector<std::string> path,
                 std::string key);
  Kind kind() const { return kind_; }
  // 0-based offset in the text, where the parser knows it (syntax errors).
  const std::optional<std::uint64_t>& byte() const { return byte_; }
  // Keys from the top-level value down to the object holding the problem ("[i]" for an array
  // element), each cut by json_quote; empty at the top level.
  const std::vector<std::string>& path() const { return path_; }
  // The duplicated key (cut by json_quote); "" for other kinds.
  const std::string& key() const { return key_; }

 private:
  Kind kind_;
  std::optional<std::uint64_t> byte_;
  std::vector<std::string> path_;
  std::string key_;
};

// Parses `text` as one JSON value (nothing but whitespace after it). The top-level value has depth
// 1, a container inside it depth 2, and so on; scalars add no depth. Throws JsonInputError.
nlohmann::json parse_untrusted_json(std::string_view text, int max_depth);

// At most max_chars characters of s (UTF-8 is not split mid-character), with "..." and the full
// length when cut. For quoting untrusted keys and strings in messages.
std::string json_quote(std::string_view s, std::size_t max_chars = 60);

// The JSON type and a prefix of its compact text of at most about max_chars characters, e.g.
// `array [[[[[[[[[[[[[[[[...` or `number 3.5`: safe for any value, however large or deep.
std::string json_excerpt(const nlohmann::json& value, std::size_t max_chars = 60);

// "'a' > 'b' > [3]", or "the top level" for an empty path.
std::string json_path_text(const std::vector<std::string>& path);

}  // namespace meshgrad::io
