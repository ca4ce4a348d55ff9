#include "meshgrad/text/tokenizer.hpp"

#include "tokenizer_impl.hpp"

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "meshgrad/tensor/error.hpp"

namespace meshgrad::text {

namespace detail {

// ---- GPT-2's byte <-> unicode alphabet ------------------------------------------------------------
// Bytes '!'..'~', 0xA1..0xAC and 0xAE..0xFF stand for the code point of the same value; the other 68
// bytes (controls, space, 0x7F..0xA0, 0xAD), in increasing order, for U+0100, U+0101, ...
std::array<char32_t, 256> byte_to_codepoint() {
  std::array<char32_t, 256> map{};
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    map[static_cast<std::size_t>(b)] = printable ? static_cast<char32_t>(b) : next++;
  }
  return map;
}

// The bytes a vocabulary symbol (UTF-8 text in the byte alphabet) stands for; nullopt when the symbol
// is not valid UTF-8 or has a code point outside the alphabet.
std::optional<std::string> symbol_to_bytes(std::string_view symbol) {
  static const std::unordered_map<char32_t, char> decoder = [] {
    std::unordered_map<char32_t, char> d;
    const auto enc = byte_to_codepoint();
    for (int b = 0; b < 256; ++b) d[enc[static_cast<std::size_t>(b)]] = static_cast<char>(b);
    return d;
  }();
  std::string bytes;
  for (std::size_t i = 0; i < symbol.size();) {
    const auto c0 = static_cast<unsigned char>(symbol[i]);
    char32_t cp;
    std::size_t len;
    if (c0 < 0x80) {
      cp = c0, len = 1;
    } else if ((c0 & 0xE0) == 0xC0 && i + 1 < symbol.size()) {
      cp = ((c0 & 0x1Fu) << 6) | (static_cast<unsigned char>(symbol[i + 1]) & 0x3Fu), len = 2;
    } else {
      return std::nullopt;   // the alphabet ends at U+0143: one or two UTF-8 bytes
    }
    const auto it = decoder.find(cp);
    if (it == decoder.end()) return std::nullopt;
    bytes.push_back(it->second);
    i += len;
  }
  return bytes;
}

std::string read_file(const std::string& path, const char* what) {
  std::error_code ec;
  MG_CHECK(std::filesystem::is_regular_file(path, ec), "tokenizer {} '{}' is not a readable regular file{}", what,
           path, ec ? ": " + ec.message() : std::string());
  std::ifstream in(path, std::ios::binary);
  MG_CHECK(in.good(), "tokenizer {} '{}' cannot be opened for reading", what, path);
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  MG_CHECK(!in.bad(), "tokenizer {} '{}' could not be read to the end", what, path);
  return s;
}

// A printable excerpt of a symbol for messages (symbols are short; cap anyway).
std::string excerpt(std::string_view s) {
  return s.size() <= 40 ? std::string(s) : std::string(s.substr(0, 40)) + "...";
}

// ---- the pre-tokenizer pattern --------------------------------------------------------------------
// The pattern's \s, as a class body: exactly the 25 code points of Unicode's White_Space property
// (PropList.txt; unchanged since Unicode 6.3 took U+180E out), which is what \s matches in Python's
// `regex` module, the engine of OpenAI's GPT-2 encoder.py, and what Hugging Face's tokenizers and
// tiktoken use: TAB, LF, VT, FF, CR, SPACE, U+0085 (NEL), U+00A0, U+1680, U+2000..U+200A, U+2028,
// U+2029, U+202F, U+205F, U+3000. Written out rather than PCRE2's \s, whose UCP form also takes
// U+180E, or \p{White_Space}, which older PCRE2 versions lack. Not JavaScript's \s (gpt-3-encoder,
// the node reference of the tests), which lacks U+0085 and adds U+FEFF; nor Python `re`'s, which
// adds U+001C..U+001F. Tested against an encoder.py reimplementation under `regex` on every
// White_Space, Cf and Cc code point (tests/text/gpt2_reference.py).
#define MG_SPACE \
  "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"
constexpr const char* kSpaceClassBody = MG_SPACE;
constexpr const char* kPattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" MG_SPACE "\\p{L}\\p{N}]+|[" MG_SPACE
    "]+(?![^" MG_SPACE "])|[" MG_SPACE "]+";
#undef MG_SPACE

const std::string& gpt2_pattern() {
  static const std::string pattern = kPattern;
  return pattern;
}

std::string white_space_as_unicode(const std::string& pattern) {
  // A scan that knows escapes and character classes: \s outside a class -> [WS], \S -> [^WS], \s
  // inside a class -> WS (its body). \S inside a class has no such spelling and stays PCRE2's
  // (which differs from White_Space only in U+180E).
  std::string out;
  bool in_class = false;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[i + 1];
      ++i;
      if (e == 's') {
        out += in_class ? std::string(kSpaceClassBody) : "[" + std::string(kSpaceClassBody) + "]";
      } else if (e == 'S' && !in_class) {
        out += "[^" + std::string(kSpaceClassBody) + "]";
      } else {
        out += c;
        out += e;
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal member, not the end.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (in_class && c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {   // [:alpha:]
      const std::size_t end = pattern.find(":]", i + 2);
      if (end != std::string::npos) {
        out.append(pattern, i, end + 2 - i);
        i = end + 1;
        continue;
      }
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

pcre2_code* compile_pattern(const std::string& pattern, const std::string& what) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &error, &offset, nullptr);
  if (!code) {
    std::array<PCRE2_UCHAR, 256> msg{};
    pcre2_get_error_message(error, msg.data(), msg.size());
    throw InvalidArgument(fmt::format("{}: PCRE2 cannot compile the pattern at offset {}: {} (pattern \"{}\")", what,
                                      offset, reinterpret_cast<const char*>(msg.data()), pattern));
  }
  // JIT is an optimisation: PCRE2 built without it still matches (pcre2_match falls back itself).
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  return code;
}

}  // namespace detail

using detail::byte_to_codepoint;
using detail::excerpt;
using detail::kCacheMaxEntries;
using detail::kCacheMaxPieceBytes;
using detail::pair_key;
using detail::read_file;
using detail::symbol_to_bytes;

Tokenizer::Impl::~Impl() {
  if (match) pcre2_match_data_free(match);
  if (code) pcre2_code_free(code);
}

void Tokenizer::Impl::compile() {
  code = detail::compile_pattern(detail::gpt2_pattern(), "tokenizer (GPT-2 pattern)");
  match = pcre2_match_data_create_from_pattern(code, nullptr);
  MG_CHECK(match != nullptr, "tokenizer: out of memory creating PCRE2 match data");
}

void Tokenizer::Impl::bpe(std::string_view piece, std::vector<TokenId>& out) {
  MG_CHECK(piece.size() < static_cast<std::size_t>(INT32_MAX), "tokenizer: a single pre-token of {} bytes (a run of "
           "letters, digits or symbols with no space) is longer than the 2^31 - 1 bytes BPE handles", piece.size());
  const auto n = static_cast<std::int32_t>(piece.size());
  nodes.resize(static_cast<std::size_t>(n));
  for (std::int32_t i = 0; i < n; ++i) {
    nodes[static_cast<std::size_t>(i)] = {byte_id[static_cast<unsigned char>(piece[static_cast<std::size_t>(i)])],
                                          i - 1, i + 1 < n ? i + 1 : -1, true};
  }
  heap.clear();   // a min-heap on (rank, position) with std::push_heap / std::pop_heap
  auto push = [&](std::int32_t left) {
    if (left < 0) return;
    const Node& l = nodes[static_cast<std::size_t>(left)];
    if (l.next < 0) return;
    const TokenId r = nodes[static_cast<std::size_t>(l.next)].id;
    const Merge* m = merges.find(pair_key(l.id, r));
    if (!m) return;
    heap.push_back({m->rank, left, l.id, r});
    std::push_heap(heap.begin(), heap.end(), std::greater<>{});
  };
  auto current = [&](const Candidate& c) {
    const Node& l = nodes[static_cast<std::size_t>(c.left)];
    return l.alive && l.id == c.left_id && l.next >= 0 && nodes[static_cast<std::size_t>(l.next)].id == c.right_id;
  };
  for (std::int32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    // One round: every current occurrence of the lowest-ranked pair, left to right.
    const std::uint32_t rank = heap.front().rank;
    round.clear();
    while (!heap.empty() && heap.front().rank == rank) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<>{});
      round.push_back(heap.back());
      heap.pop_back();
    }
    bool merged = false;
    for (const Candidate& c : round) {   // popped in increasing position
      if (!current(c)) continue;         // stale, or its left symbol was consumed earlier this round
      Node& l = nodes[static_cast<std::size_t>(c.left)];
      Node& r = nodes[static_cast<std::size_t>(l.next)];
      l.id = merges.find(pair_key(c.left_id, c.right_id))->result;
      r.alive = false;
      l.next = r.next;
      if (r.next >= 0) nodes[static_cast<std::size_t>(r.next)].prev = c.left;
      merged = true;
    }
    if (!merged) continue;
    // New pairs around the merged symbols. Pushed after the round, so a pair of this same rank formed
    // by the round (impossible for a trained merge list, where a merge's result is longer than its
    // parts) would wait for the next round, as in the reference's single pass.
    for (const Candidate& c : round) {
      const Node& l = nodes[static_cast<std::size_t>(c.left)];
      if (!l.alive) continue;
      push(l.prev);
      push(c.left);
    }
  }
  for (std::int32_t i = 0; i >= 0 && i < n; i = nodes[static_cast<std::size_t>(i)].next) {
    out.push_back(nodes[static_cast<std::size_t>(i)].id);
  }
}

void Tokenizer::Impl::encode_piece(std::string_view piece, std::vector<TokenId>& out) {
  if (piece.size() == 1) {
    out.push_back(byte_id[static_cast<unsigned char>(piece[0])]);
    return;
  }
  if (!cache_enabled || piece.size() > kCacheMaxPieceBytes) {
    bpe(piece, out);
    return;
  }
  ++lookups;
  if (const auto it = cache.find(piece); it != cache.end()) {
    ++hits;
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  const std::size_t first = out.size();
  bpe(piece, out);
  if (cache.size() >= kCacheMaxEntries) cache.clear();
  cache.emplace(std::string(piece), std::vector<TokenId>(out.begin() + static_cast<std::ptrdiff_t>(first), out.end()));
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_files(const std::string& vocab_path, const std::string& merges_path) {
  auto impl = std::make_unique<Impl>();

  // ---- vocabulary: {"symbol": id, ...} ----
  const std::string vocab_text = read_file(vocab_path, "vocabulary");
  nlohmann::json vocab;
  try {
    vocab = nlohmann::json::parse(vocab_text);
  } catch (const nlohmann::json::parse_error& e) {
    throw InvalidArgument(fmt::format("tokenizer vocabulary '{}': not valid JSON at byte offset {}: {}", vocab_path,
                                      e.byte > 0 ? e.byte - 1 : 0, e.what()));
  }
  MG_CHECK(vocab.is_object() && !vocab.empty(),
           "tokenizer vocabulary '{}': expected a non-empty JSON object {{\"symbol\": id, ...}}, got {}", vocab_path,
           vocab.type_name());
  constexpr std::int64_t kMaxId = (std::int64_t{1} << 31) - 1;
  for (const auto& [symbol, value] : vocab.items()) {
    MG_CHECK(value.is_number_integer() && value.get<std::int64_t>() >= 0 && value.get<std::int64_t>() < kMaxId,
             "tokenizer vocabulary '{}': the id of symbol \"{}\" must be an integer in [0, 2^31 - 1), got {}",
             vocab_path, excerpt(symbol), value.is_number() ? value.dump() : value.type_name());
    const auto id = static_cast<std::size_t>(value.get<std::int64_t>());
    const std::optional<std::string> bytes = symbol_to_bytes(symbol);
    MG_CHECK(bytes.has_value() && !bytes->empty(),
             "tokenizer vocabulary '{}': symbol \"{}\" (id {}) is not spelled in GPT-2's byte alphabet", vocab_path,
             excerpt(symbol), id);
    if (id >= impl->id_to_bytes.size()) {
      impl->id_to_bytes.resize(id + 1);
      impl->valid.resize(id + 1, false);
    }
    MG_CHECK(!impl->valid[id], "tokenizer vocabulary '{}': id {} is given to both \"{}\" and \"{}\"", vocab_path, id,
             excerpt(symbol), excerpt(impl->id_to_bytes[id]));
    impl->id_to_bytes[id] = *bytes;
    impl->valid[id] = true;
    impl->bytes_to_id.emplace(*bytes, static_cast<TokenId>(id));
  }
  const auto enc = byte_to_codepoint();
  for (int b = 0; b < 256; ++b) {
    const auto it = impl->bytes_to_id.find(std::string(1, static_cast<char>(b)));
    MG_CHECK(it != impl->bytes_to_id.end(),
             "tokenizer vocabulary '{}': byte 0x{:02X} (symbol U+{:04X}) has no id; a byte-level vocabulary needs all "
             "256 single bytes", vocab_path, b, static_cast<std::uint32_t>(enc[static_cast<std::size_t>(b)]));
    impl->byte_id[static_cast<std::size_t>(b)] = it->second;
  }
  if (const auto it = impl->bytes_to_id.find(std::string_view("<|endoftext|>")); it != impl->bytes_to_id.end()) {
    impl->eot = it->second;
  }

  // ---- merges: "left right" per line, best first ----
  const std::string merges_text = read_file(merges_path, "merge list");
  std::size_t pos = 0, line_no = 0;
  std::uint32_t rank = 0;
  while (pos < merges_text.size()) {
    std::size_t end = merges_text.find('\n', pos);
    if (end == std::string::npos) end = merges_text.size();
    std::string_view line(merges_text.data() + pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line_no == 1 && line.starts_with("#version")) continue;
    if (line.empty() && pos >= merges_text.size()) break;   // the final newline
    const std::size_t space = line.find(' ');
    MG_CHECK(!line.empty() && space != std::string_view::npos && space > 0 && space + 1 < line.size() &&
                 line.find(' ', space + 1) == std::string_view::npos,
             "tokenizer merge list '{}' line {}: expected two symbols separated by one space, got \"{}\"", merges_path,
             line_no, excerpt(line));
    const std::string_view parts[2] = {line.substr(0, space), line.substr(space + 1)};
    TokenId ids[2];
    std::string merged;
    for (int k = 0; k < 2; ++k) {
      const std::optional<std::string> bytes = symbol_to_bytes(parts[k]);
      MG_CHECK(bytes.has_value(), "tokenizer merge list '{}' line {}: symbol \"{}\" is not spelled in GPT-2's byte "
               "alphabet", merges_path, line_no, excerpt(parts[k]));
      const auto it = impl->bytes_to_id.find(*bytes);
      MG_CHECK(it != impl->bytes_to_id.end(), "tokenizer merge list '{}' line {}: symbol \"{}\" is not in the "
               "vocabulary '{}'", merges_path, line_no, excerpt(parts[k]), vocab_path);
      ids[k] = it->second;
      merged += *bytes;
    }
    const auto it = impl->bytes_to_id.find(merged);
    MG_CHECK(it != impl->bytes_to_id.end(), "tokenizer merge list '{}' line {}: the merge of \"{}\" and \"{}\" is not "
             "in the vocabulary '{}'", merges_path, line_no, excerpt(parts[0]), excerpt(parts[1]), vocab_path);
    // A repeated pair takes its last rank, as the references' dict construction does.
    impl->merges.insert_or_assign(pair_key(ids[0], ids[1]), Merge{rank++, it->second});
  }
  // Without merges every token is one byte: not a BPE tokenizer, and never what a file given as one means.
  MG_CHECK(rank > 0, "tokenizer merge list '{}' holds no merges ({} bytes): a BPE merge list has one \"left right\" "
           "pair per line, best first (GPT-2's has 50,000)", merges_path, merges_text.size());
  impl->compile();
  impl->eos = impl->eot;
  impl->sources = {vocab_path, merges_path};
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_directory(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  MG_CHECK(fs::is_directory(dir, ec), "tokenizer: '{}' is not a directory", dir);
  for (const auto& [vocab, merges] : {std::pair{"vocab.json", "merges.txt"}, std::pair{"encoder.json", "vocab.bpe"}}) {
    const fs::path v = fs::path(dir) / vocab, m = fs::path(dir) / merges;
    if (fs::exists(v, ec) && fs::exists(m, ec)) return from_files(v.string(), m.string());
  }
  if (const fs::path j = fs::path(dir) / "tokenizer.json"; fs::is_regular_file(j, ec)) return load_tokenizer(j.string());
  throw InvalidArgument(fmt::format("tokenizer: directory '{}' has neither vocab.json + merges.txt (Hugging Face) nor "
                                    "encoder.json + vocab.bpe (OpenAI) nor tokenizer.json", dir));
}

void Tokenizer::encode(std::string_view text, std::vector<TokenId>& out) { encode(text, out, true); }

void Tokenizer::encode(std::string_view text, std::vector<TokenId>& out, bool text_start) {
  Impl& m = *impl_;
  if (m.hf.enabled) {
    m.hf_encode(text, out, text_start);
    return;
  }
  m.gpt2_encode(text, out);
}

void Tokenizer::Impl::gpt2_encode(std::string_view text, std::vector<TokenId>& out) {
  Impl& m = *this;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  PCRE2_SIZE pos = 0;
  while (pos < text.size()) {
    const int rc = pcre2_match(m.code, subject, text.size(), pos, 0, m.match, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) {   // only bytes of invalid UTF-8 remain
      m.encode_piece(text.substr(pos), out);
      break;
    }
    if (rc < 0) {
      std::array<PCRE2_UCHAR, 256> msg{};
      pcre2_get_error_message(rc, msg.data(), msg.size());
      throw Error(fmt::format("tokenizer: PCRE2 match failed at byte offset {}: {}", pos,
                              reinterpret_cast<const char*>(msg.data())));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(m.match);
    MG_CHECK(ov[1] > ov[0], "tokenizer: internal error: empty pre-token match at byte offset {}", ov[0]);
    if (ov[0] > pos) m.encode_piece(text.substr(pos, ov[0] - pos), out);   // a run of invalid UTF-8
    m.encode_piece(text.substr(ov[0], ov[1] - ov[0]), out);
    pos = ov[1];
  }
}

std::vector<TokenId> Tokenizer::encode(std::string_view text) {
  std::vector<TokenId> out;
  encode(text, out);
  return out;
}

const std::string& Tokenizer::token_bytes(TokenId id) const {
  MG_CHECK(id < impl_->id_to_bytes.size() && impl_->valid[id], "tokenizer: id {} is not in the vocabulary (size {})",
           id, impl_->id_to_bytes.size());
  return impl_->id_to_bytes[id];
}

std::string Tokenizer::decode(const std::vector<TokenId>& ids) const {
  std::string out;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const TokenId id = ids[i];
    MG_CHECK(id < impl_->id_to_bytes.size() && impl_->valid[id],
             "tokenizer decode: id {} at position {} is not in the vocabulary (size {})", id, i,
             impl_->id_to_bytes.size());
    out += impl_->id_to_bytes[id];
  }
  return out;
}

std::int64_t Tokenizer::vocab_size() const { return static_cast<std::int64_t>(impl_->id_to_bytes.size()); }
std::optional<TokenId> Tokenizer::eot_id() const { return impl_->eot; }
const std::vector<TokenId>& Tokenizer::bos_ids() const { return impl_->bos; }
std::optional<TokenId> Tokenizer::eos_id() const { return impl_->eos; }
const std::string& Tokenizer::kind() const { return impl_->kind; }
bool Tokenizer::is_hf_json() const { return impl_->hf.enabled; }
const std::vector<std::string>& Tokenizer::source_files() const { return impl_->sources; }
CutRules Tokenizer::cut_rules() const {
  if (!impl_->hf.enabled) return {};
  CutRules rules{true, true, false};
  // An added token holding the cut's character could span it; one that strips white space could take
  // it from the other side (lstrip the '\n' before, rstrip the ' ' after).
  for (const detail::AddedToken& t : impl_->hf.added) {
    if (t.content.find('\n') != std::string::npos || t.lstrip) rules.newline = false;
    if (t.content.find(' ') != std::string::npos || t.rstrip) rules.space = false;
  }
  return rules;
}
std::int64_t Tokenizer::cache_lookups() const { return impl_->lookups; }
std::int64_t Tokenizer::cache_hits() const { return impl_->hits; }
void Tokenizer::clear_cache() {
  impl_->cache.clear();
  impl_->lookups = impl_->hits = 0;
}
void Tokenizer::set_cache_enabled(bool enabled) { impl_->cache_enabled = enabled; }

std::vector<std::size_t> split_points(std::string_view text, std::size_t chunk) {
  std::vector<std::size_t> points;
  chunk = std::max<std::size_t>(chunk, 1);
  std::size_t from = chunk;
  while (from < text.size()) {
    // The first '\n' at or after `from` with a printable ASCII character other than space on both sides.
    auto printable = [](char c) { return static_cast<unsigned char>(c) > 0x20 && static_cast<unsigned char>(c) < 0x7F; };
    std::size_t nl = text.find('\n', from - 1);
    while (nl != std::string_view::npos && nl + 1 < text.size() && !(nl > 0 && printable(text[nl - 1]) && printable(text[nl + 1]))) {
      nl = text.find('\n', nl + 1);
    }
    if (nl == std::string_view::npos || nl + 1 >= text.size()) break;
    points.push_back(nl + 1);
    from = nl + 1 + chunk;
  }
  return points;
}

}  // namespace meshgrad::text
