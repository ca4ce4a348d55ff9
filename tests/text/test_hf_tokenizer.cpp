// Hugging Face tokenizer.json (byte-level BPE): ids equal to an independent Python reference
// (tests/text/hf_reference.py: `regex` + unicodedata NFC + encoder.py's BPE) on a Unicode corpus for
// the real Llama 3 and Qwen3 (Qwen2's pattern, NFC) files and GPT-2's; GPT-2's tokenizer.json gives
// the ids of encoder.json + vocab.bpe; added-token options (lstrip, rstrip, single_word, normalized),
// Digits and add_prefix_space against the reference; BOS / EOS; what is not implemented is refused
// naming the key and the value.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "meshgrad/tensor/error.hpp"
#include "meshgrad/text/normalize.hpp"
#include "meshgrad/text/tokenizer.hpp"
#include "text/hf_test_files.hpp"

namespace meshgrad::text::test_hf_tokenizer {
namespace {

namespace fs = std::filesystem;
using meshgrad::testing::file_bytes;
using meshgrad::testing::fresh_temp_dir;
using meshgrad::testing::gpt2_tokenizer_json;
using meshgrad::testing::hf_files_present;
using meshgrad::testing::llama3_dir;
using meshgrad::testing::qwen3_dir;
using meshgrad::testing::write_json;

// Text in many scripts with what each pattern treats specially: contractions in both cases, digit
// runs of every length (Llama 3 groups by 3, Qwen2 takes each alone), non-ASCII digits, runs of
// spaces, tabs and newlines (CRLF too), Unicode spaces, emoji (ZWJ sequences, flags, skin tones),
// combining marks written decomposed (NFC composes them: e + U+0301, Hangul jamo, A + ring), marks
// that do not compose (Devanagari, Thai), and the added tokens of each file in the text.
std::vector<std::string> unicode_corpus() {
  return {
      "Hello world! It's a test: don't, won't, I'LL, she'S, they'Re, we'VE, I'M, he'D.",
      "The year 2024 had 365 days; 1234567890 and 12 and 123 and 1234. Pi is 3.14159, e=2.71828.",
      "   leading spaces, trailing spaces   \n\n\nthree newlines\r\nCRLF\r\n\ttab\t\ttabs  \t \n x",
      "Ünïcödé: naïve café résumé — “quotes” ‘single’ « guillemets » … ellipsis",
      "Decomposed: cafe\xcc\x81 (e + U+0301), A\xcc\x8a (A + ring), \xe1\x84\x92\xe1\x85\xa1\xe1\x86\xab (Hangul jamo)",
      "Русский текст: Съешь же ещё этих мягких французских булок. Ελληνικά: Γειά σου Κόσμε.",
      "中文文本：你好，世界！日本語：こんにちは、世界。한국어: 안녕하세요 세계",
      "हिन्दी: नमस्ते दुनिया। ไทย: สวัสดีชาวโลก עברית: שלום עולם العربية: مرحبا بالعالم ١٢٣٤٥",
      "Emoji: 😀😃 👩‍💻 👨‍👩‍👧‍👦 🇫🇷🇯🇵 👍🏽 ❤️ ✨🎉 and symbols ∑∫√∞ ≠ ≤ ≥ ← → ©®™",
      "Full-width: ＡＢＣ１２３ and\xc2\xa0no-break\xe3\x80\x80ideographic\xe2\x80\x83" "em space",
      "code: def f(x):\n    return x**2 + 1  # comment\n\nif __name__ == '__main__':\n    print(f(3))\n",
      "Mixed<|endoftext|>special tokens <|begin_of_text|> and <|end_of_text|>, <|im_start|>user\nhi<|im_end|>",
      "<tool_call>{\"name\": \"f\"}</tool_call> and <|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
      "Punctuation!!! ??? ... --- *** ((nested)) [brackets] {braces} @user #tag $100 50% a&b a|b",
      "URLs: https://example.com/path?q=1&r=2 emails: a.b@example.org numbers: 1,000,000.50 v1.2.3",
      "Repeated: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa bbbbbbbbbbbbbbbbb 00000000000000000000000000",
      "Tiếng Việt: nhiều việc hợp điều. Čeština: jeho. فارسی: ایران",   // Llama 3 words only ignore_merges makes one token
      "\n", " ", "  ", "a", "1", "'s", "", "\t\n \t\n", "x \n", "trailing newline\n",
  };
}

// unicode_corpus, meshgrad's README and docs/data.md (prose, code, tables), and random strings over
// a multi-script alphabet with the characters the patterns treat specially (each a fixed draw).
std::vector<std::string> large_corpus() {
  std::vector<std::string> texts = unicode_corpus();
  for (const char* doc : {"README.md", "docs/data.md"}) {
    texts.push_back(file_bytes(fs::path(MESHGRAD_SOURCE_DIR) / doc));
    EXPECT_GT(texts.back().size(), 1000u) << doc;
  }
  const std::vector<std::string> alphabet = {
      "a", "Z", "s", "t", "ll", "'", "'", "0", "7", "42", "1234", " ", " ", "  ", "\n", "\r\n", "\t", "-", "=", "(",
      ".", "é", "e\xcc\x81", "ß", "Ж", "λ", "中", "日本", "한", "\xe1\x84\x92\xe1\x85\xa1", "ि", "ก", "ע", "ع",
      "٣", "１", "😀", "👩‍💻", "🇫🇷", "\xc2\xa0", "\xe3\x80\x80", "<|endoftext|>", "<|eot_id|>", "<|im_end|>"};
  std::uint64_t state = 20240520;
  auto next = [&] { return (state = state * 6364136223846793005ULL + 1442695040888963407ULL) >> 33; };
  for (int i = 0; i < 30; ++i) {
    std::string text;
    for (int k = 0; k < 400; ++k) text += alphabet[next() % alphabet.size()];
    texts.push_back(std::move(text));
  }
  return texts;
}

// Runs a reference's command, which writes dir/out.json (an array of id arrays); its ids, or empty
// plus a failure naming the command, its stderr (dir/err.txt) and `hint` when it cannot run.
std::vector<std::vector<TokenId>> run_reference(const std::string& cmd, const fs::path& dir, const char* what,
                                                const char* hint) {
  const int rc = std::system(cmd.c_str());
  if (rc != 0) {
    ADD_FAILURE() << what << " did not run (exit status " << rc << "): `" << cmd << "`\n"
                  << file_bytes(dir / "err.txt") << "\n" << hint;
    return {};
  }
  auto ids = nlohmann::json::parse(file_bytes(dir / "out.json")).get<std::vector<std::vector<TokenId>>>();
  fs::remove_all(dir);
  return ids;
}

// Runs hf_reference.py on texts; the reference's ids (empty plus a failure when it cannot run).
std::vector<std::vector<TokenId>> python_ids(const std::string& tokenizer_json, const std::vector<std::string>& texts) {
  const fs::path dir = fresh_temp_dir("hfref");
  write_json(dir / "in.json", nlohmann::json(texts));
  const std::string cmd = fmt::format("'{}' '{}' '{}' '{}' > '{}' 2> '{}'", MESHGRAD_TEST_PYTHON,
                                      (fs::path(MESHGRAD_SOURCE_DIR) / "tests/text/hf_reference.py").string(),
                                      tokenizer_json, (dir / "in.json").string(), (dir / "out.json").string(),
                                      (dir / "err.txt").string());
  return run_reference(cmd, dir, "the Python reference", "It needs python3-regex (scripts/install-deps.sh installs it).");
}

// Compares meshgrad's ids with the reference's for every text; returns how many ids were compared.
std::size_t expect_same_ids(const std::string& tokenizer_json, const std::vector<std::string>& texts,
                            const std::string& config = "") {
  Tokenizer t = Tokenizer::from_hf_json(tokenizer_json, config);
  const auto expected = python_ids(tokenizer_json, texts);
  if (expected.size() != texts.size()) {
    ADD_FAILURE() << "the reference gave " << expected.size() << " results for " << texts.size() << " texts";
    return 0;
  }
  std::size_t compared = 0;
  for (std::size_t i = 0; i < texts.size(); ++i) {
    EXPECT_EQ(t.encode(texts[i]), expected[i]) << tokenizer_json << ": text " << i << ": \"" << texts[i] << "\"";
    compared += expected[i].size();
  }
  return compared;
}

TEST(HfTokenizer, MatchesThePythonReferenceForLlama3Qwen2AndGpt2Patterns) {
  ASSERT_TRUE(hf_files_present());
  const fs::path dir = fresh_temp_dir("hf_gpt2");
  write_json(dir / "tokenizer.json", gpt2_tokenizer_json());
  auto corpus = large_corpus();
  // Where \s engines differ (JavaScript's lacks U+0085 and has U+FEFF; PCRE2's has U+180E): the
  // patterns' \s must be White_Space, as in Hugging Face's Oniguruma and Python's `regex`.
  for (const char* ws : {"\xc2\x85", "\xe1\xa0\x8e", "\xef\xbb\xbf", "\xe2\x80\xa8", "\xc2\xa0"}) {
    corpus.push_back(fmt::format("a{0}b {0} c{0}{0}\n{0}'s 12{0}34 !{0}\r\n{0}", ws));
  }
  const std::size_t llama = expect_same_ids(llama3_dir() + "/tokenizer.json", corpus);
  const std::size_t qwen = expect_same_ids(qwen3_dir() + "/tokenizer.json", corpus);
  const std::size_t gpt2 = expect_same_ids((dir / "tokenizer.json").string(), corpus);
  // The figure docs/data.md cites: ids compared per pattern on this corpus.
  std::printf("[ ids ] compared with the Python reference: Llama 3 %zu, Qwen3 (Qwen2 pattern, NFC) %zu, GPT-2 %zu "
              "on %zu texts\n", llama, qwen, gpt2, corpus.size());
  EXPECT_GT(llama, 10000u);
  EXPECT_GT(qwen, 10000u);
  EXPECT_GT(gpt2, 10000u);
  fs::remove_all(dir);
}

// The ids of @lenml/tokenizers (transformers.js's tokenizer code, run with node) for each text.
std::vector<std::vector<TokenId>> javascript_ids(const std::string& tokenizer_json, const std::vector<std::string>& texts) {
  const fs::path dir = fresh_temp_dir("hfjs");
  write_json(dir / "in.json", nlohmann::json(texts));
  std::ofstream(dir / "ref.js")
      << "const { TokenizerLoader } = require(process.argv[2]);\n"
         "const fs = require('fs');\n"
         "const tok = TokenizerLoader.fromPreTrained({tokenizerJSON: JSON.parse(fs.readFileSync(process.argv[3], "
         "'utf8')), tokenizerConfig: {}});\n"
         "const texts = JSON.parse(fs.readFileSync(process.argv[4], 'utf8'));\n"
         "fs.writeFileSync(process.argv[5], JSON.stringify(texts.map(t => tok.encode(t, {add_special_tokens: false}))));\n";
  const std::string cmd = fmt::format("node '{}' '{}' '{}' '{}' '{}' 2> '{}'", (dir / "ref.js").string(),
                                      meshgrad::testing::lenml_tokenizers_js(), tokenizer_json,
                                      (dir / "in.json").string(), (dir / "out.json").string(), (dir / "err.txt").string());
  return run_reference(cmd, dir, "the JavaScript reference",
                       "It needs node (scripts/install-deps.sh) and scripts/fetch-test-data.sh.");
}

// A second, independent reference: transformers.js's tokenizer (the @lenml/tokenizers fork) on the
// same corpus and files.
TEST(HfTokenizer, MatchesTheJavaScriptReference) {
  ASSERT_TRUE(hf_files_present());
  const fs::path dir = fresh_temp_dir("hf_js");
  write_json(dir / "tokenizer.json", gpt2_tokenizer_json());
  const auto corpus = large_corpus();
  std::size_t compared = 0;
  for (const std::string& file : {llama3_dir() + "/tokenizer.json", qwen3_dir() + "/tokenizer.json",
                                  (dir / "tokenizer.json").string()}) {
    Tokenizer t = Tokenizer::from_hf_json(file);
    const auto expected = javascript_ids(file, corpus);
    ASSERT_EQ(expected.size(), corpus.size()) << file;
    for (std::size_t i = 0; i < corpus.size(); ++i) {
      EXPECT_EQ(t.encode(corpus[i]), expected[i]) << file << ": text " << i << ": \"" << corpus[i] << "\"";
      compared += expected[i].size();
    }
  }
  std::printf("[ ids ] compared with the JavaScript reference: %zu\n", compared);
  EXPECT_GT(compared, 30000u);
  fs::remove_all(dir);
}

TEST(HfTokenizer, Gpt2TokenizerJsonGivesTheIdsOfTheGpt2Files) {
  ASSERT_TRUE(hf_files_present());
  const fs::path dir = fresh_temp_dir("hf_gpt2_same");
  write_json(dir / "tokenizer.json", gpt2_tokenizer_json());
  Tokenizer files = Tokenizer::from_files(meshgrad::testing::gpt2_vocab(), meshgrad::testing::gpt2_merges());
  Tokenizer json = load_tokenizer(dir.string());
  EXPECT_TRUE(json.is_hf_json());
  EXPECT_FALSE(files.is_hf_json());
  for (const std::string& text : unicode_corpus()) {
    if (text.find("<|endoftext|>") != std::string::npos) continue;   // an added token only in tokenizer.json
    EXPECT_EQ(json.encode(text), files.encode(text)) << text;
    EXPECT_EQ(json.decode(json.encode(text)), text);
  }
  // The added token is matched in the text (the GPT-2 files spell it as ordinary pieces).
  EXPECT_EQ(json.encode("a<|endoftext|>b"), (std::vector<TokenId>{64, 50256, 65}));
  EXPECT_GT(files.encode("a<|endoftext|>b").size(), 3u);
  EXPECT_EQ(json.eos_id(), std::optional<TokenId>(50256));
  EXPECT_TRUE(json.bos_ids().empty());
  EXPECT_EQ(json.vocab_size(), 50257);
  fs::remove_all(dir);
}

TEST(HfTokenizer, RealFilesDecodeWhatTheyEncodeAndKnowTheirBosEos) {
  ASSERT_TRUE(hf_files_present());
  Tokenizer llama = load_tokenizer(llama3_dir());
  Tokenizer qwen = load_tokenizer(qwen3_dir() + "/tokenizer.json");   // the config beside it is read too
  EXPECT_EQ(llama.vocab_size(), 128256);
  EXPECT_EQ(qwen.vocab_size(), 151669);
  for (const std::string& text : unicode_corpus()) {
    EXPECT_EQ(llama.decode(llama.encode(text)), text);
    EXPECT_EQ(qwen.decode(qwen.encode(text)), nfc(text));   // Qwen normalizes to NFC first
  }
  EXPECT_NE(nfc("cafe\xcc\x81"), "cafe\xcc\x81");
  EXPECT_EQ(qwen.encode("cafe\xcc\x81"), qwen.encode("caf\xc3\xa9"));
  EXPECT_NE(llama.encode("cafe\xcc\x81"), llama.encode("caf\xc3\xa9"));
  // Llama 3: eos_token <|end_of_text|>; this file's post_processor adds no BOS and its config says nothing.
  EXPECT_EQ(llama.eos_id(), std::optional<TokenId>(128001));
  EXPECT_TRUE(llama.bos_ids().empty());
  EXPECT_EQ(llama.encode("<|begin_of_text|>Hi"), (std::vector<TokenId>{128000, 13347}));
  // ignore_merges: " việc" is a Llama 3 token its merges never build (they give 3 pieces).
  EXPECT_EQ(llama.encode(" việc"), (std::vector<TokenId>{100769}));
  // Qwen3: eos_token <|im_end|>, bos_token null.
  EXPECT_EQ(qwen.eos_id(), std::optional<TokenId>(151645));
  EXPECT_TRUE(qwen.bos_ids().empty());
}

TEST(HfTokenizer, BosComesFromTheConfigOrTheTemplate) {
  ASSERT_TRUE(hf_files_present());
  const fs::path dir = fresh_temp_dir("hf_bos");
  nlohmann::json config = nlohmann::json::parse(file_bytes(llama3_dir() + "/tokenizer_config.json"));
  config["add_bos_token"] = true;
  write_json(dir / "config.json", config);
  EXPECT_EQ(Tokenizer::from_hf_json(llama3_dir() + "/tokenizer.json", (dir / "config.json").string()).bos_ids(),
            (std::vector<TokenId>{128000}));
  // Hugging Face's Llama 3 post_processor: ByteLevel then a template with <|begin_of_text|> before $A.
  nlohmann::json j = gpt2_tokenizer_json();
  j["post_processor"] = {{"type", "Sequence"},
                         {"processors",
                          {{{"type", "ByteLevel"}},
                           {{"type", "TemplateProcessing"},
                            {"single", {{{"SpecialToken", {{"id", "<|endoftext|>"}, {"type_id", 0}}}},
                                        {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
                            {"special_tokens", {{"<|endoftext|>", {{"id", "<|endoftext|>"}, {"ids", {50256}}}}}}}}}};
  write_json(dir / "tokenizer.json", j);
  EXPECT_EQ(Tokenizer::from_hf_json((dir / "tokenizer.json").string()).bos_ids(), (std::vector<TokenId>{50256}));
  config = {{"add_bos_token", false}, {"eos_token", {{"content", "<|endoftext|>"}}}};
  write_json(dir / "tokenizer_config.json", config);
  Tokenizer t = load_tokenizer(dir.string());
  EXPECT_TRUE(t.bos_ids().empty());
  EXPECT_EQ(t.eos_id(), std::optional<TokenId>(50256));
  fs::remove_all(dir);
}

// GPT-2's vocabulary under other pipelines: Digits + ByteLevel (SmolLM's), add_prefix_space, NFC,
// ignore_merges, and added tokens with every option, against the reference.
TEST(HfTokenizer, AddedTokenOptionsDigitsAndPrefixSpaceMatchThePythonReference) {
  ASSERT_TRUE(hf_files_present());
  const fs::path dir = fresh_temp_dir("hf_options");
  nlohmann::json j = gpt2_tokenizer_json();
  auto added = [](int id, const std::string& content, bool lstrip, bool rstrip, bool single_word, bool normalized) {
    return nlohmann::json{{"id", id}, {"content", content}, {"lstrip", lstrip}, {"rstrip", rstrip},
                          {"single_word", single_word}, {"normalized", normalized}, {"special", !normalized}};
  };
  j["added_tokens"].push_back(added(50257, "<mask>", true, false, false, false));
  j["added_tokens"].push_back(added(50258, "<sep>", false, true, false, false));
  j["added_tokens"].push_back(added(50259, "word", false, false, true, true));
  j["added_tokens"].push_back(added(50260, "cafe\xcc\x81", false, false, false, true));   // matched as NFC "café"
  j["added_tokens"].push_back(added(50261, "<mask><sep>", false, false, false, false));   // longest wins
  j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}}}};
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers",
                         {{{"type", "Digits"}, {"individual_digits", true}},
                          {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}}}}};
  j["model"]["ignore_merges"] = true;
  write_json(dir / "tokenizer.json", j);
  std::vector<std::string> texts = unicode_corpus();
  for (const char* s : {"a <mask> b", "a   <mask>b", "<sep>   x", "a<sep>\n\n y", "word words sword word_ word.",
                        "(word) 1word word1 wordé", "un café and a cafe\xcc\x81", "x <mask><sep> y <mask> <sep>",
                        "12345 and ٣٤", "hello", " hello", "<mask>"}) {
    texts.emplace_back(s);
  }
  EXPECT_GT(expect_same_ids((dir / "tokenizer.json").string(), texts), 500u);
  Tokenizer t = Tokenizer::from_hf_json((dir / "tokenizer.json").string());
  // Spot checks that the options did something (the reference agreeing is the main check).
  EXPECT_EQ(t.encode("a   <mask>").back(), 50257u);
  EXPECT_EQ(t.encode("a   <mask>").size(), 2u);                       // " a" then the token with its spaces
  EXPECT_EQ(t.encode("x <mask><sep> y")[2], 50261u);                 // " x", " " (not lstrip), the longest
  const auto sword = t.encode("sword");
  EXPECT_EQ(std::count(sword.begin(), sword.end(), 50259u), 0);        // single_word: not inside a word
  EXPECT_EQ(t.encode("un cafe\xcc\x81").back(), 50260u);
  // add_prefix_space applies at the text start, not to a continuation, when ByteLevel is the only
  // step (after a Split every piece gets it, continuation or not).
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
  write_json(dir / "tokenizer.json", j);
  Tokenizer prefix = Tokenizer::from_hf_json((dir / "tokenizer.json").string());
  std::vector<TokenId> whole, cont, after_split;
  prefix.encode("hello", whole, true);
  prefix.encode("hello", cont, false);
  t.encode("hello", after_split, false);
  EXPECT_EQ(whole, (std::vector<TokenId>{23748}));   // " hello"
  EXPECT_EQ(cont, (std::vector<TokenId>{31373}));    // "hello"
  EXPECT_EQ(after_split, whole);
  fs::remove_all(dir);
}

// Each refusal names the key path and the value.
TEST(HfTokenizer, RefusesWhatIsNotImplementedNamingKeyAndValue) {
  ASSERT_TRUE(hf_files_present());
  const fs::path dir = fresh_temp_dir("hf_refuse");
  struct Case {
    std::function<void(nlohmann::json&)> edit;
    std::vector<std::string> expected;
  };
  // A Split (pattern, behavior, invert) before the ByteLevel.
  auto split = [](std::string pattern, std::string behavior, bool invert) {
    return [=](nlohmann::json& j) {
      j["pre_tokenizer"] = {{"type", "Sequence"},
                            {"pretokenizers", {{{"type", "Split"}, {"pattern", {{"Regex", pattern}}},
                                                {"behavior", behavior}, {"invert", invert}},
                                               {{"type", "ByteLevel"}}}}};
    };
  };
  const std::vector<Case> cases = {
      {[](auto& j) { j["model"]["type"] = "WordPiece"; }, {"model.type", "WordPiece"}},
      {[](auto& j) { j["model"]["type"] = "Unigram"; }, {"model.type", "Unigram"}},
      {[](auto& j) { j["model"]["dropout"] = 0.1; }, {"model.dropout", "0.1"}},
      {[](auto& j) { j["model"]["byte_fallback"] = true; }, {"model.byte_fallback", "true"}},
      {[](auto& j) { j["model"]["continuing_subword_prefix"] = "##"; }, {"model.continuing_subword_prefix", "##"}},
      {[](auto& j) { j["model"]["end_of_word_suffix"] = "</w>"; }, {"model.end_of_word_suffix", "</w>"}},
      {[](auto& j) { j["normalizer"] = {{"type", "NFKC"}}; }, {"normalizer.type", "NFKC"}},
      {[](auto& j) { j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "Lowercase"}}}}}; },
       {"normalizer.normalizers[0].type", "Lowercase"}},
      {[](auto& j) { j["pre_tokenizer"] = {{"type", "Whitespace"}}; }, {"pre_tokenizer.type", "Whitespace"}},
      {[](auto& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}}; }, {"pre_tokenizer.type", "Metaspace"}},
      {[](auto& j) { j["pre_tokenizer"] = nullptr; }, {"pre_tokenizer", "null"}},
      {split("\\s+", "Removed", false), {"pre_tokenizer.pretokenizers[0].behavior", "Removed"}},
      {split("\\s+", "Isolated", true), {"pre_tokenizer.pretokenizers[0].invert", "true"}},
      {split("(unclosed", "Isolated", false), {"pre_tokenizer.pretokenizers[0].pattern", "(unclosed"}},
      {[](auto& j) { j["decoder"] = {{"type", "WordPiece"}}; }, {"decoder.type", "WordPiece"}},
      {[](auto& j) { j["post_processor"] = {{"type", "RobertaProcessing"}}; }, {"post_processor.type", "RobertaProcessing"}},
      {[](auto& j) { j["model"]["merges"][0] = "a b c"; }, {"model.merges[0]", "a b c"}},
  };
  for (const Case& c : cases) {
    nlohmann::json j = gpt2_tokenizer_json();
    c.edit(j);
    write_json(dir / "tokenizer.json", j);
    try {
      (void)Tokenizer::from_hf_json((dir / "tokenizer.json").string());
      ADD_FAILURE() << "not refused: " << c.expected[0];
    } catch (const InvalidArgument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find((dir / "tokenizer.json").string()), std::string::npos) << what;
      for (const std::string& part : c.expected) EXPECT_NE(what.find(part), std::string::npos) << part << " in " << what;
    }
  }
  // A config whose eos_token is not a token of the tokenizer.
  write_json(dir / "tokenizer.json", gpt2_tokenizer_json());
  write_json(dir / "tokenizer_config.json", {{"eos_token", "<|nope|>"}});
  try {
    (void)load_tokenizer(dir.string());
    ADD_FAILURE() << "unknown eos_token not refused";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("eos_token"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("<|nope|>"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace meshgrad::text::test_hf_tokenizer
