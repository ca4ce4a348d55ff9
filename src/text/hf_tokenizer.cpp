// Hugging Face tokenizer.json (byte-level BPE): reading the file and encoding as Hugging Face's
// tokenizers (Rust) does. What is read, by key:
//   model              {"type": "BPE"} with "vocab" {symbol: id}, "merges" (["a b", ...] or
//                      [["a", "b"], ...], best first), "ignore_merges" (a piece that is a vocabulary
//                      symbol is that one token, merges or not: Llama 3). Refused: another "type"
//                      (WordPiece, Unigram, WordLevel), "dropout" not null, "continuing_subword_prefix"
//                      or "end_of_word_suffix" not null or "", "byte_fallback" true.
//   normalizer         null, {"type": "NFC"}, or {"type": "Sequence", "normalizers": [those]}.
//   pre_tokenizer      "Split" ({"Regex": ...} or {"String": ...}, "behavior": "Isolated", "invert":
//                      false), "Digits" ("individual_digits": each \p{N} alone, else runs of them),
//                      "ByteLevel" ("add_prefix_space", "use_regex": GPT-2's pattern; trim_offsets
//                      only moves offsets), or a "Sequence" ("pretokenizers") of them with exactly one
//                      ByteLevel, the last (what makes the vocabulary byte-level).
//   added_tokens       [{"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"}]:
//                      matched in the text before the pre-tokenizer, never split (special or not).
//   post_processor     null, "ByteLevel", "TemplateProcessing" (the special tokens of "single" before
//                      $A are the BOS), or a "Sequence" ("processors") of them.
//   decoder            "ByteLevel" (symbols back to bytes; a token with a character outside the byte
//                      alphabet decodes to its own UTF-8, as Hugging Face's decoder does).
// Anything else under these keys is refused naming the key and the value. "truncation" and
// "padding" (batch encoding options) are not read.
//
// Regex patterns: \s and \S are rewritten to Unicode White_Space (text::detail::white_space_as_unicode),
// the \s of Oniguruma, which Hugging Face's tokenizers use, and of Python's `regex`.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>

#include "meshgrad/tensor/error.hpp"
#include "meshgrad/text/normalize.hpp"
#include "meshgrad/text/tokenizer.hpp"
#include "tokenizer_impl.hpp"

namespace meshgrad::text {

namespace fs = std::filesystem;
using nlohmann::json;

namespace detail {

HfPipeline::~HfPipeline() {
  for (PreStep& s : steps) {
    if (s.match) pcre2_match_data_free(s.match);
    if (s.code) pcre2_code_free(s.code);
  }
  if (word_match) pcre2_match_data_free(word_match);
  if (word_char) pcre2_code_free(word_char);
}

}  // namespace detail

namespace {

using detail::AddedToken;
using detail::PreStep;

// ---- reading ---------------------------------------------------------------------------------------

// Messages name the file and the key path ("pre_tokenizer.pretokenizers[0].type").
struct Where {
  const std::string& file;
  std::string key;
  Where at(const std::string& k) const { return {file, key.empty() ? k : key + "." + k}; }
  Where index(std::size_t i) const { return {file, fmt::format("{}[{}]", key, i)}; }
};

std::string shown(const json& v) {
  std::string s = v.dump();
  return s.size() <= 80 ? s : s.substr(0, 80) + "...";
}

const json& member(const json& obj, [[maybe_unused]] const Where& w, const std::string& key) {
  static const json null_value;
  if (!obj.is_object()) return null_value;
  const auto it = obj.find(key);
  return it == obj.end() ? null_value : *it;
}

bool bool_member(const json& obj, const Where& w, const std::string& key, bool fallback) {
  const json& v = member(obj, w, key);
  if (v.is_null()) return fallback;
  MG_CHECK(v.is_boolean(), "tokenizer.json '{}': \"{}\" must be true or false, got {}", w.file, w.at(key).key, shown(v));
  return v.get<bool>();
}

std::string type_of(const json& obj, const Where& w) {
  MG_CHECK(obj.is_object(), "tokenizer.json '{}': \"{}\" must be an object, got {}", w.file, w.key, shown(obj));
  const json& t = member(obj, w, "type");
  MG_CHECK(t.is_string(), "tokenizer.json '{}': \"{}.type\" must be a string, got {}", w.file, w.key, shown(t));
  return t.get<std::string>();
}

[[noreturn]] void refuse(const Where& w, const std::string& value, const std::string& why) {
  throw InvalidArgument(fmt::format("tokenizer.json '{}': \"{}\" is {}: {}", w.file, w.key, value, why));
}

json parse_json_file(const std::string& path, const char* what) {
  const std::string text = detail::read_file(path, what);
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    throw InvalidArgument(fmt::format("tokenizer {} '{}': not valid JSON at byte offset {}: {}", what, path,
                                      e.byte > 0 ? e.byte - 1 : 0, e.what()));
  }
}

// A literal string as a PCRE2 pattern: every character that is not a letter or digit escaped.
std::string quote_literal(const std::string& s) {
  std::string out;
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x80 && !std::isalnum(u)) out += '\\';
    out += c;
  }
  return out;
}

PreStep split_step(const std::string& pattern, const std::string& what) {
  PreStep s;
  s.kind = PreStep::Kind::kSplit;
  s.code = detail::compile_pattern(pattern, what);
  s.match = pcre2_match_data_create_from_pattern(s.code, nullptr);
  MG_CHECK(s.match != nullptr, "tokenizer: out of memory creating PCRE2 match data");
  return s;
}

void read_pre_tokenizer(const json& node, const Where& w, std::vector<PreStep>& steps) {
  const std::string type = type_of(node, w);
  if (type == "Sequence") {
    const json& list = member(node, w, "pretokenizers");
    MG_CHECK(list.is_array(), "tokenizer.json '{}': \"{}.pretokenizers\" must be an array, got {}", w.file, w.key,
             shown(list));
    for (std::size_t i = 0; i < list.size(); ++i) read_pre_tokenizer(list[i], w.at("pretokenizers").index(i), steps);
  } else if (type == "Split") {
    const json& behavior = member(node, w, "behavior");
    if (behavior != "Isolated") refuse(w.at("behavior"), shown(behavior), "only \"Isolated\" is implemented");
    if (bool_member(node, w, "invert", false)) refuse(w.at("invert"), "true", "only false is implemented");
    const json& pattern = member(node, w, "pattern");
    std::string regex;
    if (pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string()) {
      regex = detail::white_space_as_unicode(pattern["Regex"].get<std::string>());
    } else if (pattern.is_object() && pattern.contains("String") && pattern["String"].is_string()) {
      regex = quote_literal(pattern["String"].get<std::string>());
    } else {
      refuse(w.at("pattern"), shown(pattern), "expected {\"Regex\": \"...\"} or {\"String\": \"...\"}");
    }
    steps.push_back(split_step(regex, fmt::format("tokenizer.json '{}': \"{}.pattern\"", w.file, w.key)));
  } else if (type == "Digits") {
    // Rust's char::is_numeric (Nd, Nl, No) is \p{N}; each alone or in runs.
    const bool individual = bool_member(node, w, "individual_digits", false);
    steps.push_back(split_step(individual ? "\\p{N}" : "\\p{N}+", "tokenizer.json Digits"));
  } else if (type == "ByteLevel") {
    PreStep s;
    s.kind = PreStep::Kind::kByteLevel;
    s.add_prefix_space = bool_member(node, w, "add_prefix_space", true);
    s.use_regex = bool_member(node, w, "use_regex", true);
    steps.push_back(std::move(s));
  } else {
    refuse(w.at("type"), fmt::format("\"{}\"", type), "not implemented (Split, Digits, ByteLevel and Sequence are)");
  }
}

void read_normalizer(const json& node, const Where& w, bool& nfc) {
  if (node.is_null()) return;
  const std::string type = type_of(node, w);
  if (type == "NFC") {
    nfc = true;
  } else if (type == "Sequence") {
    const json& list = member(node, w, "normalizers");
    MG_CHECK(list.is_array(), "tokenizer.json '{}': \"{}.normalizers\" must be an array, got {}", w.file, w.key,
             shown(list));
    for (std::size_t i = 0; i < list.size(); ++i) read_normalizer(list[i], w.at("normalizers").index(i), nfc);
  } else {
    refuse(w.at("type"), fmt::format("\"{}\"", type), "not implemented (NFC and a Sequence of it are)");
  }
}

// The special tokens a TemplateProcessing puts before $A (bos) and after it (suffix).
void read_post_processor(const json& node, const Where& w, std::vector<TokenId>& bos, std::vector<TokenId>& suffix) {
  if (node.is_null()) return;
  const std::string type = type_of(node, w);
  if (type == "ByteLevel") return;   // offsets only
  if (type == "Sequence") {
    const json& list = member(node, w, "processors");
    MG_CHECK(list.is_array(), "tokenizer.json '{}': \"{}.processors\" must be an array", w.file, w.key);
    for (std::size_t i = 0; i < list.size(); ++i) read_post_processor(list[i], w.at("processors").index(i), bos, suffix);
    return;
  }
  if (type != "TemplateProcessing") {
    refuse(w.at("type"), fmt::format("\"{}\"", type), "not implemented (ByteLevel, TemplateProcessing and Sequence are)");
  }
  const json& single = member(node, w, "single");
  const json& specials = member(node, w, "special_tokens");
  MG_CHECK(single.is_array(), "tokenizer.json '{}': \"{}.single\" must be an array", w.file, w.key);
  bool after = false;
  for (std::size_t i = 0; i < single.size(); ++i) {
    const json& piece = single[i];
    if (piece.is_object() && piece.contains("Sequence")) {
      after = true;
      continue;
    }
    const json& special = member(piece, w, "SpecialToken");
    MG_CHECK(special.is_object() && special.contains("id") && special["id"].is_string(), "tokenizer.json '{}': "
             "\"{}.single[{}]\" is {}: expected {{\"Sequence\": ...}} or {{\"SpecialToken\": {{\"id\": ...}}}}",
             w.file, w.key, i, shown(piece));
    const std::string name = special["id"].get<std::string>();
    const json& entry = member(specials, w, name);
    MG_CHECK(entry.is_object() && entry.contains("ids") && entry["ids"].is_array(), "tokenizer.json '{}': \"{}"
             ".special_tokens\" has no \"ids\" for \"{}\"", w.file, w.key, name);
    for (const json& id : entry["ids"]) {
      MG_CHECK(id.is_number_unsigned(), "tokenizer.json '{}': \"{}.special_tokens.{}.ids\" holds {}", w.file, w.key,
               name, shown(id));
      (after ? suffix : bos).push_back(id.get<TokenId>());
    }
  }
}

// ---- the model -------------------------------------------------------------------------------------

// The bytes a vocabulary symbol or added token decodes to (Hugging Face's ByteLevel decoder): its
// symbols mapped back to bytes, or its own UTF-8 when a character is outside the byte alphabet.
std::string decoded_bytes(const std::string& symbol) {
  std::optional<std::string> bytes = detail::symbol_to_bytes(symbol);
  return bytes ? *bytes : symbol;
}

void set_id(Tokenizer::Impl& impl, TokenId id, const std::string& bytes) {
  if (id >= impl.id_to_bytes.size()) {
    impl.id_to_bytes.resize(static_cast<std::size_t>(id) + 1);
    impl.valid.resize(static_cast<std::size_t>(id) + 1, false);
  }
  impl.id_to_bytes[id] = bytes;
  impl.valid[id] = true;
}

// model: vocabulary and merges into impl; returns symbol -> id (for added tokens and the config).
std::unordered_map<std::string, TokenId> read_model(const json& model, const Where& w, Tokenizer::Impl& impl) {
  const std::string type = model.is_object() && model.contains("type") ? type_of(model, w) : "BPE";
  if (type != "BPE") {
    refuse(w.at("type"), fmt::format("\"{}\"", type), "only byte-level \"BPE\" models are implemented");
  }
  if (const json& d = member(model, w, "dropout"); !d.is_null()) {
    refuse(w.at("dropout"), shown(d), "BPE dropout is not implemented (prepared data needs the same ids every time)");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const json& v = member(model, w, key);
    if (!v.is_null() && v != "") refuse(w.at(key), shown(v), "not implemented (byte-level BPE has none: null or \"\")");
  }
  if (bool_member(model, w, "byte_fallback", false)) {
    refuse(w.at("byte_fallback"), "true", "byte fallback (<0x..> tokens, SentencePiece BPE) is not implemented");
  }
  impl.hf.ignore_merges = bool_member(model, w, "ignore_merges", false);

  const json& vocab = member(model, w, "vocab");
  MG_CHECK(vocab.is_object() && !vocab.empty(), "tokenizer.json '{}': \"{}.vocab\" must be a non-empty object "
           "{{\"symbol\": id}}", w.file, w.key);
  std::unordered_map<std::string, TokenId> symbols;
  symbols.reserve(vocab.size());
  for (const auto& [symbol, value] : vocab.items()) {
    MG_CHECK(value.is_number_unsigned() && value.get<std::uint64_t>() < (std::uint64_t{1} << 31), "tokenizer.json "
             "'{}': \"{}.vocab\": the id of \"{}\" must be an integer in [0, 2^31), got {}", w.file, w.key,
             detail::excerpt(symbol), shown(value));
    const auto id = value.get<TokenId>();
    MG_CHECK(id >= impl.valid.size() || !impl.valid[id], "tokenizer.json '{}': \"{}.vocab\": id {} is given to both "
             "\"{}\" and another symbol", w.file, w.key, id, detail::excerpt(symbol));
    set_id(impl, id, decoded_bytes(symbol));
    symbols.emplace(symbol, id);
    // Symbols outside the byte alphabet decode (as Hugging Face's do) but BPE never makes them.
    if (detail::symbol_to_bytes(symbol)) impl.bytes_to_id.emplace(impl.id_to_bytes[id], id);
  }
  const auto enc = detail::byte_to_codepoint();
  for (int b = 0; b < 256; ++b) {
    const auto it = impl.bytes_to_id.find(std::string(1, static_cast<char>(b)));
    MG_CHECK(it != impl.bytes_to_id.end(), "tokenizer.json '{}': \"{}.vocab\": byte 0x{:02X} (symbol U+{:04X}) has "
             "no id; a byte-level vocabulary needs all 256 single bytes", w.file, w.key, b,
             static_cast<std::uint32_t>(enc[static_cast<std::size_t>(b)]));
    impl.byte_id[static_cast<std::size_t>(b)] = it->second;
  }

  const json& merges = member(model, w, "merges");
  MG_CHECK(merges.is_array(), "tokenizer.json '{}': \"{}.merges\" must be an array, got {}", w.file, w.key,
           shown(merges));
  for (std::size_t rank = 0; rank < merges.size(); ++rank) {
    const json& m = merges[rank];
    std::string parts[2];
    if (m.is_string()) {
      const std::string& line = m.get_ref<const std::string&>();
      const std::size_t space = line.find(' ');
      MG_CHECK(space != std::string::npos && line.find(' ', space + 1) == std::string::npos, "tokenizer.json '{}': "
               "\"{}.merges[{}]\" is {}: expected two symbols separated by one space", w.file, w.key, rank, shown(m));
      parts[0] = line.substr(0, space), parts[1] = line.substr(space + 1);
    } else {
      MG_CHECK(m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string(), "tokenizer.json '{}': \"{}"
               ".merges[{}]\" is {}: expected \"a b\" or [\"a\", \"b\"]", w.file, w.key, rank, shown(m));
      parts[0] = m[0].get<std::string>(), parts[1] = m[1].get<std::string>();
    }
    TokenId ids[2];
    for (int k = 0; k < 2; ++k) {
      const auto it = symbols.find(parts[k]);
      MG_CHECK(it != symbols.end(), "tokenizer.json '{}': \"{}.merges[{}]\": symbol \"{}\" is not in the vocabulary",
               w.file, w.key, rank, detail::excerpt(parts[k]));
      ids[k] = it->second;
    }
    const auto merged = symbols.find(parts[0] + parts[1]);
    MG_CHECK(merged != symbols.end(), "tokenizer.json '{}': \"{}.merges[{}]\": the merge of \"{}\" and \"{}\" is not in "
             "the vocabulary", w.file, w.key, rank, detail::excerpt(parts[0]), detail::excerpt(parts[1]));
    impl.merges.insert_or_assign(detail::pair_key(ids[0], ids[1]),
                                 Merge{static_cast<std::uint32_t>(rank), merged->second});
  }
  return symbols;
}

void read_added_tokens(const json& list, const Where& w, Tokenizer::Impl& impl) {
  if (list.is_null()) return;
  MG_CHECK(list.is_array(), "tokenizer.json '{}': \"added_tokens\" must be an array, got {}", w.file, shown(list));
  for (std::size_t i = 0; i < list.size(); ++i) {
    const json& t = list[i];
    const Where at = w.index(i);
    const json& id = member(t, at, "id");
    const json& content = member(t, at, "content");
    MG_CHECK(id.is_number_unsigned() && id.get<std::uint64_t>() < (std::uint64_t{1} << 31), "tokenizer.json '{}': "
             "\"{}.id\" must be an integer in [0, 2^31), got {}", w.file, at.key, shown(id));
    MG_CHECK(content.is_string() && !content.get_ref<const std::string&>().empty(), "tokenizer.json '{}': \"{}"
             ".content\" must be a non-empty string, got {}", w.file, at.key, shown(content));
    AddedToken a;
    a.id = id.get<TokenId>();
    a.content = content.get<std::string>();
    a.single_word = bool_member(t, at, "single_word", false);
    a.lstrip = bool_member(t, at, "lstrip", false);
    a.rstrip = bool_member(t, at, "rstrip", false);
    const bool special = bool_member(t, at, "special", false);
    a.normalized = bool_member(t, at, "normalized", !special);
    set_id(impl, a.id, decoded_bytes(a.content));
    impl.hf.added.push_back(std::move(a));
  }
}

// Per first byte, the added tokens of one set (normalized or not), longest first.
void index_added(detail::HfPipeline& hf) {
  for (std::size_t i = 0; i < hf.added.size(); ++i) {
    AddedToken& a = hf.added[i];
    if (a.normalized && hf.nfc) a.content = nfc(a.content);   // matched in the normalized text
    auto& table = a.normalized ? hf.normalized_by_byte : hf.raw_by_byte;
    table[static_cast<unsigned char>(a.content[0])].push_back(static_cast<std::uint32_t>(i));
    (a.normalized ? hf.has_normalized : hf.has_raw) = true;
  }
  for (auto* table : {&hf.raw_by_byte, &hf.normalized_by_byte}) {
    for (auto& list : *table) {
      std::stable_sort(list.begin(), list.end(), [&](std::uint32_t a, std::uint32_t b) {
        return hf.added[a].content.size() > hf.added[b].content.size();
      });
    }
  }
  // \w of the Rust regex crate (Unicode: Alphabetic, marks, decimal digits, connector punctuation,
  // Join_Control), which single_word tests next to a match.
  hf.word_char = detail::compile_pattern("[\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{200C}\\x{200D}]", "single_word \\w");
  hf.word_match = pcre2_match_data_create_from_pattern(hf.word_char, nullptr);
}

// tokenizer_config.json's bos_token / eos_token: a string, {"content": ...}, or null.
std::optional<std::string> config_token(const json& config, const std::string& path, const std::string& key) {
  const auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) return (*it)["content"].get<std::string>();
  throw InvalidArgument(fmt::format("tokenizer_config.json '{}': \"{}\" must be a string, {{\"content\": ...}} or null, "
                                    "got {}", path, key, shown(*it)));
}

void read_bos_eos(const std::string& config_path, const std::unordered_map<std::string, TokenId>& symbols,
                  const std::vector<TokenId>& template_bos, const std::vector<TokenId>& template_suffix,
                  Tokenizer::Impl& impl) {
  auto id_of = [&](const std::string& content) -> std::optional<TokenId> {
    for (const AddedToken& a : impl.hf.added) {
      if (a.content == content) return a.id;
    }
    const auto it = symbols.find(content);
    return it == symbols.end() ? std::nullopt : std::optional<TokenId>(it->second);
  };
  impl.bos = template_bos;
  if (!template_suffix.empty()) impl.eos = template_suffix.back();
  if (!impl.eos) impl.eos = id_of("<|endoftext|>");
  if (config_path.empty()) return;
  const json config = parse_json_file(config_path, "config");
  MG_CHECK(config.is_object(), "tokenizer_config.json '{}' must be a JSON object", config_path);
  std::optional<TokenId> ids[2];
  const char* keys[2] = {"bos_token", "eos_token"};
  for (int k = 0; k < 2; ++k) {
    if (const auto content = config_token(config, config_path, keys[k])) {
      ids[k] = id_of(*content);
      MG_CHECK(ids[k].has_value(), "tokenizer_config.json '{}': \"{}\" is \"{}\", which is neither an added token nor "
               "in the vocabulary of the tokenizer.json beside it", config_path, keys[k], *content);
    }
  }
  if (ids[1]) impl.eos = ids[1];
  if (const auto it = config.find("add_bos_token"); it != config.end() && !it->is_null()) {
    MG_CHECK(it->is_boolean(), "tokenizer_config.json '{}': \"add_bos_token\" must be true or false, got {}",
             config_path, shown(*it));
    if (!it->get<bool>()) {
      impl.bos.clear();
    } else {
      MG_CHECK(ids[0].has_value(), "tokenizer_config.json '{}': \"add_bos_token\" is true but there is no "
               "\"bos_token\"", config_path);
      impl.bos = {*ids[0]};
    }
  }
}

}  // namespace

Tokenizer Tokenizer::from_hf_json(const std::string& json_path, const std::string& config_path) {
  auto impl = std::make_unique<Impl>();
  const json root = parse_json_file(json_path, "tokenizer.json");
  MG_CHECK(root.is_object() && root.contains("model"), "tokenizer.json '{}' is not a Hugging Face tokenizer.json (a "
           "JSON object with \"model\")", json_path);
  const Where top{json_path, ""};
  detail::HfPipeline& hf = impl->hf;
  hf.enabled = true;
  // Everything refusable is read before the model's vocabulary and merges, the bulk of the file.
  read_normalizer(root.value("normalizer", json()), top.at("normalizer"), hf.nfc);
  const json& pre = member(root, top, "pre_tokenizer");
  if (pre.is_null()) refuse(top.at("pre_tokenizer"), "null", "a byte-level BPE needs a ByteLevel pre-tokenizer");
  read_pre_tokenizer(pre, top.at("pre_tokenizer"), hf.steps);
  for (std::size_t i = 0; i < hf.steps.size(); ++i) {
    const bool byte_level = hf.steps[i].kind == PreStep::Kind::kByteLevel;
    MG_CHECK(byte_level == (i + 1 == hf.steps.size()), "tokenizer.json '{}': \"pre_tokenizer\" must end with its one "
             "ByteLevel (the step that maps bytes to the vocabulary's alphabet); step {} of {} is {}", json_path,
             i + 1, hf.steps.size(), byte_level ? "ByteLevel" : "not");
  }
  const json& decoder = member(root, top, "decoder");
  if (type_of(decoder, top.at("decoder")) != "ByteLevel") {
    refuse(top.at("decoder").at("type"), shown(decoder["type"]), "only the ByteLevel decoder is implemented");
  }
  std::vector<TokenId> template_bos, template_suffix;
  read_post_processor(member(root, top, "post_processor"), top.at("post_processor"), template_bos, template_suffix);

  const auto symbols = read_model(member(root, top, "model"), top.at("model"), *impl);
  read_added_tokens(member(root, top, "added_tokens"), top.at("added_tokens"), *impl);
  index_added(hf);
  read_bos_eos(config_path, symbols, template_bos, template_suffix, *impl);
  impl->eot = impl->eos;
  impl->compile();
  impl->kind = "Hugging Face tokenizer.json (byte-level BPE)";
  impl->sources = {json_path};
  if (!config_path.empty()) impl->sources.push_back(config_path);
  return Tokenizer(std::move(impl));
}

Tokenizer load_tokenizer(const std::string& path) {
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) {
    const fs::path config = fs::path(path).parent_path() / "tokenizer_config.json";
    return Tokenizer::from_hf_json(path, fs::is_regular_file(config, ec) ? config.string() : std::string());
  }
  MG_CHECK(fs::is_directory(path, ec), "tokenizer '{}' is neither a tokenizer.json file nor a directory", path);
  if (const fs::path j = fs::path(path) / "tokenizer.json"; fs::is_regular_file(j, ec)) return load_tokenizer(j.string());
  return Tokenizer::from_directory(path);
}

}  // namespace meshgrad::text
