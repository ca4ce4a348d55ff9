// GPT-2 BPE against two references run at test time: an encoder.py reimplementation under Python's
// `regex` (tests/text/gpt2_reference.py, the semantics of OpenAI's encoder, Hugging Face and tiktoken,
// which the tokenizer follows) on ordinary text and on every Unicode space, format and control
// character, and the JavaScript encoder of the npm package gpt-3-encoder (node) where JavaScript and
// Python agree. Also exact round trips on any bytes (invalid UTF-8 included), chunking, and errors that
// name the file and line or offset.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "meshgrad/tensor/error.hpp"
#include "meshgrad/text/tokenizer.hpp"
#include "text/gpt2_test_files.hpp"

namespace meshgrad::text::test_tokenizer {
namespace {

namespace fs = std::filesystem;
using meshgrad::testing::gpt2_dir;
using meshgrad::testing::gpt2_files_present;
using meshgrad::testing::gpt2_merges;
using meshgrad::testing::gpt2_vocab;

fs::path temp_dir(const std::string& name) { return meshgrad::testing::fresh_temp_dir("tok_" + name); }
std::string read_text(const fs::path& p) { return meshgrad::testing::file_bytes(p); }

void write_text(const fs::path& p, const std::string& s) { std::ofstream(p, std::ios::binary) << s; }

// The code points where the two references' \s differ, as UTF-8: U+0085 (NEL) is whitespace in
// Python's `regex` (White_Space, and so in the tokenizer) but not in JavaScript; U+FEFF (BOM, ZWNBSP)
// is whitespace in JavaScript only (it is a format character, Cf). All other code points agree (every
// White_Space, Cf and Cc one is checked below through both references).
const std::vector<std::string> kJsPythonDifferences = {"\u0085", "\ufeff"};

// The text without the characters of kJsPythonDifferences: what the node reference is run on.
std::string where_js_and_python_agree(std::string s) {
  for (const std::string& c : kJsPythonDifferences) {
    for (std::size_t at = s.find(c); at != std::string::npos; at = s.find(c, at)) s.erase(at, c.size());
  }
  return s;
}

// The JavaScript reference's ids for each text (valid UTF-8), by running node over Encoder.js. Fails
// the test (an empty result plus ADD_FAILURE) when node cannot run it.
std::vector<std::vector<TokenId>> js_reference_encode(const std::vector<std::string>& texts) {
  const fs::path dir = temp_dir("ref");
  write_text(dir / "in.json", nlohmann::json(texts).dump());
  write_text(dir / "ref.js",
             "const {encode} = require(process.argv[2] + '/Encoder.js');\n"
             "const fs = require('fs');\n"
             "const texts = JSON.parse(fs.readFileSync(process.argv[3], 'utf8'));\n"
             "fs.writeFileSync(process.argv[4], JSON.stringify(texts.map(encode)));\n");
  const std::string cmd = fmt::format("node '{}' '{}' '{}' '{}' 2> '{}'", (dir / "ref.js").string(), gpt2_dir(),
                                      (dir / "in.json").string(), (dir / "out.json").string(),
                                      (dir / "err.txt").string());
  const int rc = std::system(cmd.c_str());
  if (rc != 0) {
    ADD_FAILURE() << "the reference encoder did not run (exit status " << rc << "): `" << cmd << "`\n"
                  << read_text(dir / "err.txt")
                  << "\nInstall node (Debian: nodejs npm; scripts/install-deps.sh does it) and fetch the package "
                     "with scripts/fetch-test-data.sh.";
    return {};
  }
  const auto out = nlohmann::json::parse(read_text(dir / "out.json")).get<std::vector<std::vector<TokenId>>>();
  fs::remove_all(dir);
  return out;
}

// Runs tests/text/gpt2_reference.py under the Python that python3-regex installs into (see
// tests/text/extra.cmake) with the given arguments after the GPT-2 directory. False plus ADD_FAILURE
// with the script's message when it fails: a missing `regex` module is a failure, never a skip.
bool run_python_reference(const std::string& args, const fs::path& dir) {
  const std::string cmd = fmt::format("'{}' '{}' '{}' {} 2> '{}'", MESHGRAD_TEST_PYTHON,
                                      (fs::path(MESHGRAD_SOURCE_DIR) / "tests/text/gpt2_reference.py").string(),
                                      gpt2_dir(), args, (dir / "err.txt").string());
  const int rc = std::system(cmd.c_str());
  if (rc != 0) {
    ADD_FAILURE() << "the Python reference encoder did not run (exit status " << rc << "): `" << cmd << "`\n"
                  << read_text(dir / "err.txt")
                  << "\nIt needs the Python module regex (Debian: python3-regex; scripts/install-deps.sh installs it).";
    return false;
  }
  return true;
}

// The Python reference's ids for each text (valid UTF-8). Empty plus ADD_FAILURE when it cannot run.
std::vector<std::vector<TokenId>> python_reference_encode(const std::vector<std::string>& texts) {
  const fs::path dir = temp_dir("pyref");
  write_text(dir / "in.json", nlohmann::json(texts).dump());
  if (!run_python_reference(fmt::format("encode '{}' '{}'", (dir / "in.json").string(), (dir / "out.json").string()),
                            dir)) {
    return {};
  }
  const auto out = nlohmann::json::parse(read_text(dir / "out.json")).get<std::vector<std::vector<TokenId>>>();
  fs::remove_all(dir);
  return out;
}

// Texts the Python reference generates from its Unicode tables: each code point of `regex`'s \s and
// White_Space, of general category Cf and of Cc in several contexts (cp set), then all of them
// together and mixed with ordinary text (cp unset), with the reference's ids.
struct UnicodeCase {
  std::optional<std::uint32_t> cp;
  std::string text;
  std::vector<TokenId> ids;
};
struct UnicodeCases {
  std::vector<std::uint32_t> space, format, control;
  std::vector<UnicodeCase> cases;
};
UnicodeCases python_unicode_cases() {
  const fs::path dir = temp_dir("pyuni");
  UnicodeCases u;
  if (!run_python_reference(fmt::format("unicode '{}'", (dir / "out.json").string()), dir)) return u;
  const auto j = nlohmann::json::parse(read_text(dir / "out.json"));
  u.space = j.at("space").get<std::vector<std::uint32_t>>();
  u.format = j.at("format").get<std::vector<std::uint32_t>>();
  u.control = j.at("control").get<std::vector<std::uint32_t>>();
  for (const auto& c : j.at("cases")) {
    u.cases.push_back({c.at("cp").is_null() ? std::nullopt : std::optional(c.at("cp").get<std::uint32_t>()),
                       c.at("text").get<std::string>(), c.at("ids").get<std::vector<TokenId>>()});
  }
  fs::remove_all(dir);
  return u;
}

// "U+0085" for 0x85.
std::string code_point_name(std::uint32_t cp) { return fmt::format("U+{:04X}", cp); }

// A text with its control and non-ASCII characters as \u escapes, for messages.
// (A cut character of an excerpt becomes U+FFFD.)
std::string escaped(const std::string& text) {
  return nlohmann::json(text).dump(-1, ' ', true, nlohmann::json::error_handler_t::replace);
}

Tokenizer& gpt2() {
  static Tokenizer t = Tokenizer::from_files(gpt2_vocab(), gpt2_merges());
  return t;
}

std::string readme() { return read_text(fs::path(MESHGRAD_SOURCE_DIR) / "README.md"); }

// Texts that exercise every alternative of the pattern and the Unicode classes.
std::vector<std::string> reference_texts() {
  std::vector<std::string> t = {
      "Hello, world! This is a test.",
      // CJK, Hangul, full-width punctuation
      "日本語のテキストと中文文本，还有한국어 텍스트。「引用」",
      // emoji: skin tone, ZWJ family, flags, keycap
      "👋🏽 emoji 🎉🎉 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 keycap 1️⃣",
      // combining marks (decomposed accents, stacked marks)
      "cafe\u0301 n\u0303o\u0308 Z\u0351\u0300a\u0302l\u0327g\u0310o\u0316 \u0301alone",
      // right-to-left scripts, Arabic digits
      "مرحبا بالعالم ١٢٣ שלום עולם",
      // whitespace runs: spaces, tabs, newlines, trailing and leading, CRLF, Unicode spaces
      "a  b   c\t\td\n\n\ne   \n  f \t \nend   ",
      "   leading and trailing   \n\n",
      "windows\r\nline\r\n\r\nends\r\n",
      "nbsp\u00a0x\u00a0\u00a0y ideographic\u3000space en\u2002quad line\u2028sep bom\ufeffz",
      // Whitespace to Python's `re` or PCRE2 but not to `regex` (FS..US, U+180E), and NEL (whitespace to
      // `regex`, not to JavaScript: the node comparison runs without it)
      "nel\u0085x  fs\x1cy  mvs\u180ez \u0085 \x1c\x1d ",
      "\t\t\tindented\n    code\n\n\n\n",
      // contractions, lower and upper case, and near-misses
      "I'm you're we've they'll he'd it's can't",
      "I'M YOU'RE WE'VE THEY'LL HE'D IT'S CAN'T",
      "'s's 're're 'x ''s 'S 'Ll rock'n'roll",
      // numbers in several scripts and forms
      "123 4567890 3.14159 1,000,000 -42 0x1F ٣٤٥ ⅫⅣ ½ ² 10e10 2024-05-20",
      // punctuation runs and symbols
      "!!! ??? ... --- *** ### $$$ ((())) {}[]<> ~~~ ``` ;;; :: @@ ^^^ €£¥ ©®™ →⇒∀∃",
      "int main() { return 0; }\n\tif (x != y) { x += 1; } // done\n",
      "<|endoftext|> is plain text here",
      // long pieces: the heap-based BPE against the reference's quadratic one
      std::string(3000, 'a') + std::string(2000, 'b') + " " + std::string(1000, ' ') + "x",
      "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa abababababababababababab",
  };
  t.push_back(readme());
  // Random strings over a pool that mixes every class the pattern distinguishes (letters of several
  // scripts, marks, digits, JS and non-JS whitespace, apostrophes, symbols, 4-byte characters).
  const std::vector<std::string> pool = {
      "a", "Z", "s", "t", "re", "ll", "'", "'", " ", " ", "  ", "\t", "\n", "\r\n", "0", "7", "42", ".", ",", "!",
      "-", "_", "(", "\"", "é", "\u0301", "ß", "日", "本", "한", "ا", "١", "क", "\u094d", "Ω", "ж", "👍", "🏽",
      "\u200d", "\u00a0", "\u2028", "\u0085", "\ufeff", "\u3000", "\u180e", "½", "€", "\x1f", "\x7f"};
  std::mt19937 rng(2024);
  for (int i = 0; i < 40; ++i) {
    std::string s;
    for (int k = 0; k < 120; ++k) s += pool[rng() % pool.size()];
    t.push_back(s);
  }
  return t;
}

TEST(Tokenizer, MatchesThePythonReference) {
  ASSERT_TRUE(gpt2_files_present());
  const std::vector<std::string> texts = reference_texts();
  const auto expected = python_reference_encode(texts);
  ASSERT_EQ(expected.size(), texts.size());
  ASSERT_GT(readme().size(), 2000u) << "README.md should give a few KB of text";
  for (std::size_t i = 0; i < texts.size(); ++i) {
    const std::vector<TokenId> got = gpt2().encode(texts[i]);
    EXPECT_EQ(got, expected[i]) << "text " << i << ": " << escaped(texts[i].substr(0, 80));
    EXPECT_EQ(gpt2().decode(got), texts[i]) << "text " << i;
  }
}

TEST(Tokenizer, MatchesThePythonReferenceOnEveryUnicodeSpaceFormatAndControlCharacter) {
  ASSERT_TRUE(gpt2_files_present());
  const UnicodeCases u = python_unicode_cases();
  ASSERT_FALSE(u.cases.empty());
  // The generated sets are the ones meant: `regex`'s \s is White_Space (25 code points, with NEL),
  // U+FEFF and U+180E are format characters, U+001C is a control.
  EXPECT_EQ(u.space.size(), 25u);
  EXPECT_NE(std::find(u.space.begin(), u.space.end(), 0x85u), u.space.end());
  EXPECT_EQ(std::find(u.space.begin(), u.space.end(), 0xFEFFu), u.space.end());
  for (std::uint32_t cp : {0xFEFFu, 0x180Eu, 0x200Du}) {
    EXPECT_NE(std::find(u.format.begin(), u.format.end(), cp), u.format.end()) << code_point_name(cp);
  }
  EXPECT_GE(u.format.size(), 150u);
  EXPECT_NE(std::find(u.control.begin(), u.control.end(), 0x1Cu), u.control.end());
  // Every text: the ids exactly, and the code points whose texts differ named once each.
  std::set<std::string> differing;
  std::string names;   // differing, in order of the cases (by code point)
  std::string first_differences;
  std::size_t n_differ = 0;
  for (const UnicodeCase& c : u.cases) {
    const std::vector<TokenId> got = gpt2().encode(c.text);
    EXPECT_EQ(gpt2().decode(got), c.text) << escaped(c.text);
    if (got == c.ids) continue;
    ++n_differ;
    const std::string name = c.cp ? code_point_name(*c.cp) : "(texts mixing them)";
    if (differing.insert(name).second) names += (names.empty() ? "" : ", ") + name;
    if (n_differ <= 5) {
      first_differences += fmt::format("\n  {}: meshgrad {} Python {}", escaped(c.text.substr(0, 200)),
                                       nlohmann::json(got).dump(), nlohmann::json(c.ids).dump());
    }
  }
  EXPECT_EQ(n_differ, 0u) << n_differ << " of " << u.cases.size() << " texts differ from the Python reference, "
                          << "with: " << names << first_differences;
  // Chunking at split_points does not change the ids of these texts either.
  std::string joined;
  for (const UnicodeCase& c : u.cases) joined += c.text + "x\ny";
  const std::vector<std::size_t> points = split_points(joined, 1000);
  ASSERT_GE(points.size(), 20u);
  std::vector<TokenId> chunked;
  std::size_t from = 0;
  for (std::size_t p : points) {
    gpt2().encode(std::string_view(joined).substr(from, p - from), chunked);
    from = p;
  }
  gpt2().encode(std::string_view(joined).substr(from), chunked);
  EXPECT_EQ(chunked, gpt2().encode(joined));
}

// The node reference on the same texts, without the characters where JavaScript's \s and Python's
// differ (kJsPythonDifferences): checks the Python reference's BPE and classes against an encoder
// written by others, and the tokenizer against both.
TEST(Tokenizer, MatchesTheJavaScriptReferenceWhereItAgreesWithPython) {
  ASSERT_TRUE(gpt2_files_present());
  std::vector<std::string> texts;
  for (const std::string& t : reference_texts()) texts.push_back(where_js_and_python_agree(t));
  const UnicodeCases u = python_unicode_cases();   // a failure of its own when Python cannot run
  EXPECT_FALSE(u.cases.empty());
  const std::size_t n_ordinary = texts.size();
  for (const UnicodeCase& c : u.cases) texts.push_back(where_js_and_python_agree(c.text));
  const auto expected = js_reference_encode(texts);
  ASSERT_EQ(expected.size(), texts.size());
  std::size_t n_differ = 0;
  for (std::size_t i = 0; i < texts.size(); ++i) {
    const std::vector<TokenId> got = gpt2().encode(texts[i]);
    if (i < n_ordinary || n_differ < 5) {
      EXPECT_EQ(got, expected[i]) << "text " << i << ": " << escaped(texts[i].substr(0, 80));
    }
    n_differ += got != expected[i] ? 1 : 0;
  }
  EXPECT_EQ(n_differ, 0u) << "texts that differ from the JavaScript reference, of " << texts.size();
  // A few ids known independently of both encoders (GPT-2's vocabulary): "Hello" 15496, "," 11.
  const std::vector<TokenId> hello = gpt2().encode("Hello,");
  EXPECT_EQ(hello, (std::vector<TokenId>{15496, 11}));
  EXPECT_EQ(gpt2().vocab_size(), 50257);
  EXPECT_EQ(gpt2().eot_id(), std::optional<TokenId>(50256));
}

TEST(Tokenizer, HuggingFaceFileNamesGiveTheSameTokenizer) {
  ASSERT_TRUE(gpt2_files_present());
  const fs::path d = temp_dir("hf");
  fs::copy_file(gpt2_vocab(), d / "vocab.json");
  fs::copy_file(gpt2_merges(), d / "merges.txt");
  Tokenizer hf = Tokenizer::from_directory(d.string());
  Tokenizer openai = Tokenizer::from_directory(gpt2_dir());
  const std::string text = readme();
  EXPECT_EQ(hf.encode(text), openai.encode(text));
  fs::remove_all(d);
}

TEST(Tokenizer, RoundTripsAnyBytesIncludingInvalidUtf8) {
  ASSERT_TRUE(gpt2_files_present());
  Tokenizer& t = gpt2();
  const std::vector<std::string> awkward = {
      "",
      std::string("\xff"),
      std::string("a\xff" "b"),
      std::string("trunc\xe6\x97"),                  // a 3-byte character cut short at the end
      std::string("\xe6\x97 mid"),                     // ... and at the start
      std::string("over\xc0\xaf" "long"),              // overlong encoding of '/'
      std::string("surr\xed\xa0\x80ogate"),            // a UTF-16 surrogate in UTF-8
      std::string("nul\0inside", 10),
      std::string("  \xff\xfe  x"),
  };
  for (const std::string& s : awkward) EXPECT_EQ(t.decode(t.encode(s)), s) << "bytes of size " << s.size();
  std::mt19937 rng(12345);
  for (int i = 0; i < 200; ++i) {
    std::string s(rng() % 300, '\0');
    for (char& c : s) c = static_cast<char>(rng() % 256);
    ASSERT_EQ(t.decode(t.encode(s)), s) << "random bytes, case " << i;
  }
}

TEST(Tokenizer, InvalidUtf8RunsArePiecesOfTheirOwn) {
  // The documented rule: bytes of invalid UTF-8 are never part of a pattern match; each maximal run
  // between matches is encoded alone. So "a\xff\xfeb" encodes as "a", "\xff\xfe", "b".
  ASSERT_TRUE(gpt2_files_present());
  Tokenizer& t = gpt2();
  std::vector<TokenId> expected = t.encode("a");
  for (TokenId id : t.encode(std::string("\xff\xfe"))) expected.push_back(id);
  for (TokenId id : t.encode("b")) expected.push_back(id);
  EXPECT_EQ(t.encode(std::string("a\xff\xfe" "b")), expected);
  // Each of 0xFF and 0xFE is its own single-byte token, so the run is two ids.
  EXPECT_EQ(t.encode(std::string("\xff\xfe")).size(), 2u);
}

TEST(Tokenizer, CacheAndChunkingDoNotChangeTheResult) {
  ASSERT_TRUE(gpt2_files_present());
  Tokenizer cached = Tokenizer::from_files(gpt2_vocab(), gpt2_merges());
  Tokenizer uncached = Tokenizer::from_files(gpt2_vocab(), gpt2_merges());
  uncached.set_cache_enabled(false);
  std::string text;
  for (const std::string& s : reference_texts()) text += s + "\n";
  text += text;   // the second copy hits the cache
  const std::vector<TokenId> whole = cached.encode(text);
  EXPECT_GT(cached.cache_hits(), 0);
  EXPECT_EQ(uncached.encode(text), whole);
  EXPECT_EQ(uncached.cache_lookups(), 0);
  const std::vector<std::size_t> points = split_points(text, 500);
  ASSERT_GE(points.size(), 5u) << "the text should have boundaries every ~500 bytes";
  std::vector<TokenId> chunked;
  std::size_t from = 0;
  for (std::size_t p : points) {
    ASSERT_GT(p, from);
    cached.encode(std::string_view(text).substr(from, p - from), chunked);
    from = p;
  }
  cached.encode(std::string_view(text).substr(from), chunked);
  EXPECT_EQ(chunked, whole);
  // A boundary never falls after whitespace: "x  \nY" must stay whole ("  " and "\n" are two pieces
  // only when something follows).
  EXPECT_TRUE(split_points("x  \nY", 1).empty());
  EXPECT_EQ(split_points("ab\ncd\nef", 1), (std::vector<std::size_t>{3, 6}));
}

// ---- errors name the file and the line or offset ---------------------------------------------------

// A tiny valid byte-level vocabulary: the 256 byte symbols (ids 0..255) plus extra symbols.
std::string byte_vocab_json(const std::vector<std::pair<std::string, int>>& extra) {
  nlohmann::json j = nlohmann::json::object();
  // The same alphabet as the tokenizer, written out independently: printable Latin-1 bytes stand for
  // themselves, the rest for U+0100 upwards in byte order.
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    const int cp = printable ? b : next++;
    std::string utf8;
    if (cp < 0x80) {
      utf8 = std::string(1, static_cast<char>(cp));
    } else {
      utf8 = {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
    }
    j[utf8] = b;
  }
  for (const auto& [s, id] : extra) j[s] = id;
  return j.dump();
}

std::string expect_error(const std::string& vocab, const std::string& merges) {
  const fs::path d = temp_dir("err");
  write_text(d / "vocab.json", vocab);
  write_text(d / "merges.txt", merges);
  std::string message;
  try {
    Tokenizer::from_files((d / "vocab.json").string(), (d / "merges.txt").string());
    ADD_FAILURE() << "accepted: vocab " << vocab.substr(0, 60) << " merges " << merges;
  } catch (const InvalidArgument& e) {
    message = e.what();
  }
  fs::remove_all(d);
  return message;
}

TEST(Tokenizer, SmallVocabularyMergesByRank) {
  // "ab" (rank 0) before "bc" (rank 1): "abc" -> "ab" + "c"; and "abab" merges both occurrences.
  const fs::path d = temp_dir("small");
  write_text(d / "vocab.json", byte_vocab_json({{"ab", 256}, {"bc", 257}, {"abab", 258}}));
  write_text(d / "merges.txt", "#version: 0.2\na b\nb c\nab ab\n");
  Tokenizer t = Tokenizer::from_files((d / "vocab.json").string(), (d / "merges.txt").string());
  EXPECT_EQ(t.encode("abc"), (std::vector<TokenId>{256, 'c'}));
  EXPECT_EQ(t.encode("bc"), (std::vector<TokenId>{257}));
  EXPECT_EQ(t.encode("ababab"), (std::vector<TokenId>{258, 256}));
  EXPECT_EQ(t.vocab_size(), 259);
  EXPECT_FALSE(t.eot_id().has_value());
  fs::remove_all(d);
}

TEST(Tokenizer, BadFilesAreRefusedNamingFileAndPlace) {
  std::string m = expect_error("{\"a\": 1,\n \"b\": }", "");
  EXPECT_NE(m.find("vocab.json"), std::string::npos) << m;
  EXPECT_NE(m.find("byte offset 15"), std::string::npos) << m;

  m = expect_error("[1, 2]", "");
  EXPECT_NE(m.find("JSON object"), std::string::npos) << m;

  m = expect_error(byte_vocab_json({{"ab", -3}}), "");
  EXPECT_NE(m.find("\"ab\""), std::string::npos) << m;

  m = expect_error(byte_vocab_json({{"ab", 7}}), "");   // id 7 is byte 7's
  EXPECT_NE(m.find("id 7 is given to both"), std::string::npos) << m;

  m = expect_error(byte_vocab_json({{"a b", 300}}), "");   // ' ' is not in the alphabet (it is U+0120)
  EXPECT_NE(m.find("byte alphabet"), std::string::npos) << m;

  nlohmann::json missing_byte = nlohmann::json::parse(byte_vocab_json({}));
  missing_byte.erase("A");
  m = expect_error(missing_byte.dump(), "");
  EXPECT_NE(m.find("byte 0x41"), std::string::npos) << m;

  m = expect_error(byte_vocab_json({{"ab", 256}}), "#version: 0.2\na b\nab\n");
  EXPECT_NE(m.find("merges.txt' line 3"), std::string::npos) << m;
  EXPECT_NE(m.find("two symbols"), std::string::npos) << m;

  m = expect_error(byte_vocab_json({{"ab", 256}}), "a b\nab zz\n");
  EXPECT_NE(m.find("line 2"), std::string::npos) << m;
  EXPECT_NE(m.find("\"zz\" is not in the vocabulary"), std::string::npos) << m;

  m = expect_error(byte_vocab_json({{"ab", 256}}), "a b\nb c\n");
  EXPECT_NE(m.find("line 2: the merge of \"b\" and \"c\" is not in the vocabulary"), std::string::npos) << m;

  // A merge list without merges (empty, or only its version line) would make a byte tokenizer.
  for (const std::string empty : {"", "#version: 0.2\n", "\n"}) {
    m = expect_error(byte_vocab_json({{"ab", 256}}), empty);
    EXPECT_NE(m.find("holds no merges"), std::string::npos) << "merges \"" << empty << "\": " << m;
  }

  try {
    Tokenizer::from_files("/nonexistent/vocab.json", "/nonexistent/merges.txt");
    ADD_FAILURE() << "a missing file was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/vocab.json"), std::string::npos) << e.what();
  }
  try {
    Tokenizer::from_directory(fs::temp_directory_path().string());
    ADD_FAILURE() << "a directory without tokenizer files was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("encoder.json + vocab.bpe"), std::string::npos) << e.what();
  }
}

TEST(Tokenizer, DecodeRefusesUnknownIdsNamingThePosition) {
  ASSERT_TRUE(gpt2_files_present());
  try {
    (void)gpt2().decode({15496, 11, 50257});
    ADD_FAILURE() << "id 50257 was decoded";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("id 50257 at position 2"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace meshgrad::text::test_tokenizer
