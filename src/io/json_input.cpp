// Bounded, linear-time JSON reading (contract in include/meshgrad/io/json_input.hpp).
#include "meshgrad/io/json_input.hpp"

#include <fmt/format.h>

#include <utility>

namespace meshgrad::io {

using json = nlohmann::json;

JsonInputError::JsonInputError(Kind kind, std::string what, std::optional<std::uint64_t> byte,
                               std::vector<std::string> path, std::string key)
    : std::runtime_error(std::move(what)), kind_(kind), byte_(byte), path_(std::move(path)), key_(std::move(key)) {}

std::string json_quote(std::string_view s, std::size_t max_chars) {
  if (s.size() <= max_chars) return std::string(s);
  std::size_t cut = max_chars;
  // Back up over UTF-8 continuation bytes (10xxxxxx) so the cut falls between characters.
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
  return fmt::format("{}... ({} bytes)", s.substr(0, cut), s.size());
}

std::string json_path_text(const std::vector<std::string>& path) {
  if (path.empty()) return "the top level";
  std::string out;
  for (const auto& p : path) {
    if (!out.empty()) out += " > ";
    out += p.starts_with("[") ? p : "'" + p + "'";
  }
  return out;
}

namespace {

// Appends a compact rendering of v to out, stopping once out holds `budget` characters. Recursion
// is bounded by the budget: every level appends at least one character before descending.
void excerpt_into(const json& v, std::string& out, std::size_t budget) {
  if (out.size() >= budget) return;
  switch (v.type()) {
    case json::value_t::array: {
      out += '[';
      bool first = true;
      for (const auto& e : v) {
        if (out.size() >= budget) return;
        if (!first) out += ", ";
        first = false;
        excerpt_into(e, out, budget);
      }
      out += ']';
      return;
    }
    case json::value_t::object: {
      out += '{';
      bool first = true;
      for (const auto& [k, e] : v.items()) {
        if (out.size() >= budget) return;
        if (!first) out += ", ";
        first = false;
        out += json(json_quote(k, budget)).dump(-1, ' ', false, json::error_handler_t::replace);
        out += ": ";
        excerpt_into(e, out, budget);
      }
      out += '}';
      return;
    }
    case json::value_t::string:
      out += json(json_quote(v.get_ref<const std::string&>(), budget)).dump(-1, ' ', false, json::error_handler_t::replace);
      return;
    default: out += v.dump(); return;   // a scalar: short
  }
}

// Builds the document from SAX events. Keeps a stack of the open containers (pointers stay valid:
// a container's parent gets no new element while it is open) and, for messages, the key or index
// under which each sits.
class BoundedDomBuilder {
 public:
  explicit BoundedDomBuilder(int max_depth) : max_depth_(max_depth) {}

  bool null() { return add(json(nullptr)); }
  bool boolean(bool v) { return add(json(v)); }
  bool number_integer(json::number_integer_t v) { return add(json(v)); }
  bool number_unsigned(json::number_unsigned_t v) { return add(json(v)); }
  bool number_float(json::number_float_t v, const json::string_t&) { return add(json(v)); }
  bool string(json::string_t& v) { return add(json(std::move(v))); }
  bool binary(json::binary_t& v) { return add(json::binary(std::move(v))); }

  bool start_object(std::size_t) { return open(json::object()); }
  bool start_array(std::size_t) { return open(json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool key(json::string_t& k) {
    json& object = *stack_.back();
    if (object.contains(k)) {
      std::vector<std::string> path = where_;
      const std::string quoted = json_quote(k);
      error_.emplace(JsonInputError::Kind::DuplicateKey,
                     fmt::format("key '{}' appears more than once in the object at {}", quoted, json_path_text(path)),
                     std::nullopt, std::move(path), quoted);
      return false;
    }
    pending_key_ = json_quote(k);
    pending_ = &object[std::move(k)];
    return true;
  }

  bool parse_error(std::size_t position, const std::string& /*last_token*/, const nlohmann::detail::exception& ex) {
    // ex.what() is "[json.exception.parse_error.101] parse error at line 1, column 5: syntax error
    // ... last read: '<token>'"; the token is input and may be huge, so the text is cut.
    std::string message = ex.what();
    if (const auto pos = message.find("] "); message.starts_with("[json.exception") && pos != std::string::npos)
      message = message.substr(pos + 2);
    // position counts characters read, from 1.
    const std::uint64_t byte = position > 0 ? position - 1 : 0;
    error_.emplace(JsonInputError::Kind::Syntax, json_quote(message, 200), byte, where_, "");
    return false;
  }

  json take_root() { return std::move(root_); }
  std::optional<JsonInputError>& error() { return error_; }

 private:
  // Places v where the parser is (the root, the end of the open array, or under the last key) and
  // returns it.
  json* place(json&& v) {
    if (stack_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    json& top = *stack_.back();
    if (top.is_array()) {
      top.push_back(std::move(v));
      return &top.back();
    }
    *pending_ = std::move(v);
    return pending_;
  }
  bool add(json&& v) {
    place(std::move(v));
    return true;
  }
  bool open(json&& container) {
    std::string label;
    if (!stack_.empty()) label = stack_.back()->is_array() ? fmt::format("[{}]", stack_.back()->size()) : pending_key_;
    if (static_cast<int>(stack_.size()) >= max_depth_) {
      std::vector<std::string> path = where_;
      path.push_back(label);
      error_.emplace(JsonInputError::Kind::TooDeep,
                     fmt::format("nested deeper than {} levels (at {})", max_depth_, json_path_text(path)),
                     std::nullopt, std::move(path), "");
      return false;
    }
    json* placed = place(std::move(container));
    if (!stack_.empty()) where_.push_back(std::move(label));
    stack_.push_back(placed);
    return true;
  }
  bool close() {
    if (stack_.size() > 1) where_.pop_back();
    stack_.pop_back();
    return true;
  }

  int max_depth_;
  json root_;
  std::vector<json*> stack_;
  std::vector<std::string> where_;   // labels of stack_[1..]: where each nested container sits
  json* pending_ = nullptr;          // the value slot of the last key
  std::string pending_key_;
  std::optional<JsonInputError> error_;
};

}  // namespace

std::string json_excerpt(const json& value, std::size_t max_chars) {
  std::string text;
  excerpt_into(value, text, max_chars);
  if (text.size() >= max_chars) {
    text.resize(max_chars);
    while (!text.empty() && (static_cast<unsigned char>(text.back()) & 0xC0) == 0x80) text.pop_back();
    if (!text.empty() && (static_cast<unsigned char>(text.back()) & 0xC0) == 0xC0) text.pop_back();
    text += "...";
  }
  return fmt::format("{} {}", value.type_name(), text);
}

json parse_untrusted_json(std::string_view text, int max_depth) {
  BoundedDomBuilder builder(max_depth);
  const bool ok = json::sax_parse(text, &builder, json::input_format_t::json, /*strict=*/true);
  if (builder.error()) throw std::move(*builder.error());
  if (!ok) throw JsonInputError(JsonInputError::Kind::Syntax, "not valid JSON", std::nullopt, {}, "");
  return builder.take_root();
}

}  // namespace meshgrad::io
