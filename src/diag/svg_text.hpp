// Text inside the SVG files diag writes (plots, trace timelines): the characters XML reserves,
// escaped, so a run name, tensor name or title holding them draws as itself.
#pragma once

#include <string>
#include <string_view>

namespace meshgrad::diag {

// `text` with &, <, > and " replaced by their XML entities (the rest, UTF-8 included, as it is).
inline std::string svg_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

}  // namespace meshgrad::diag
