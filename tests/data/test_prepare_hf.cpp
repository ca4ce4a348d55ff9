// `meshgrad prepare` with a Hugging Face tokenizer.json: documents framed by the tokenizer's BOS and
// EOS, uint32 token files (version 2) for Llama 3's 128,256 ids and uint16 (version 1) for GPT-2's
// tokenizer.json, chunked encoding equal to encoding each input whole (the cut rules of the Llama 3
// and Qwen2 patterns), the tokenizer recorded (copies + SHA-256) and found again by
// text::load_tokenizer and data::load_prepared_tokenizer (which checks the copies' SHA-256), the
// dataset reading the result; a tokenizer of a kind not implemented is refused before anything is
// written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "meshgrad/data/dataset.hpp"
#include "meshgrad/data/prepare.hpp"
#include "meshgrad/data/shards.hpp"
#include "meshgrad/data/text_chunks.hpp"
#include "meshgrad/io/sha256.hpp"
#include "meshgrad/tensor/error.hpp"
#include "meshgrad/text/tokenizer.hpp"
#include "text/hf_test_files.hpp"

namespace meshgrad::data::test_prepare_hf {
namespace {

namespace fs = std::filesystem;
using meshgrad::testing::file_bytes;
using meshgrad::testing::fresh_temp_dir;
using meshgrad::testing::hf_files_present;
using meshgrad::testing::llama3_dir;
using meshgrad::testing::qwen3_dir;
using meshgrad::testing::write_json;

// The tokens of an llm.c file of either version, checking the header against the file size.
std::vector<text::TokenId> read_any_tokens(const fs::path& p, std::int32_t expected_version) {
  const std::string bytes = file_bytes(p);
  std::int32_t header[3];
  std::memcpy(header, bytes.data(), sizeof header);
  EXPECT_EQ(header[0], 20240520) << p;
  EXPECT_EQ(header[1], expected_version) << p;
  const std::size_t width = header[1] == 2 ? 4 : 2;
  EXPECT_EQ(bytes.size(), 1024u + width * static_cast<std::size_t>(header[2])) << p;
  std::vector<text::TokenId> out(static_cast<std::size_t>(header[2]));
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (width == 4) {
      std::memcpy(&out[i], bytes.data() + 1024 + 4 * i, 4);
    } else {
      std::uint16_t t;
      std::memcpy(&t, bytes.data() + 1024 + 2 * i, 2);
      out[i] = t;
    }
  }
  return out;
}

// Lines in many scripts with digits, contractions, runs of white space, emoji and decomposed
// marks; long enough that small chunks cut it many times.
std::string multilingual_text(int lines) {
  const char* parts[] = {"The river's 12345 voices; don't STOP. ", "naïve café — “quoted” ", "Съешь ещё 2024 ",
                         "你好，世界！", " こんにちは ", "नमस्ते दुनिया ", "😀 👩‍💻 🇫🇷 ", "cafe\xcc\x81 ",
                         "x=(a+b)*c; ", "\t  tabs  ", "١٢٣ ", "I'LL we'VE ", "https://ex.am/p?q=1 "};
  std::string text;
  for (int i = 0; i < lines; ++i) {
    for (int k = 0; k < 6; ++k) text += parts[(i * 7 + k * 3) % std::size(parts)];
    text += i % 5 == 0 ? "\n\n" : "\n";
    if (i % 11 == 4) text += "   \n";
  }
  return text;
}

fs::path write_text(const fs::path& dir, const std::string& name, const std::string& text) {
  std::ofstream(dir / name, std::ios::binary) << text;
  return dir / name;
}

// A tokenizer directory: the file of `from` with a tokenizer_config.json edited by `edit`.
fs::path tokenizer_dir(const fs::path& dir, const std::string& from, const std::function<void(nlohmann::json&)>& edit) {
  fs::create_directories(dir);
  fs::copy_file(from + "/tokenizer.json", dir / "tokenizer.json", fs::copy_options::overwrite_existing);
  nlohmann::json config = nlohmann::json::parse(file_bytes(from + "/tokenizer_config.json"));
  edit(config);
  write_json(dir / "tokenizer_config.json", config);
  return dir;
}

TEST(PrepareHf, Llama3DocumentsAreFramedByBosAndEosInUint32Files) {
  ASSERT_TRUE(hf_files_present());
  const fs::path d = fresh_temp_dir("prepare_hf_llama");
  const fs::path tok_dir = tokenizer_dir(d / "tok", llama3_dir(), [](auto& c) { c["add_bos_token"] = true; });
  const std::string a = multilingual_text(40), b = "Second document <|eot_id|> with a special token.\n";
  PrepareOptions o;
  o.tokenizer = tok_dir.string();
  o.out_dir = (d / "out").string();
  o.inputs = {write_text(d, "a.txt", a).string(), write_text(d, "b.txt", b).string()};
  o.val_fraction = 0.25;
  o.chunk_bytes = 300;   // many chunks: the tokens must still be those of each input whole
  const PrepareResult r = prepare_dataset(o);
  EXPECT_EQ(r.vocab_size, 128256);
  EXPECT_EQ(r.forced_cuts, 0);

  text::Tokenizer tok = text::load_tokenizer(tok_dir.string());
  ASSERT_EQ(tok.bos_ids(), (std::vector<text::TokenId>{128000}));
  ASSERT_EQ(tok.eos_id(), std::optional<text::TokenId>(128001));
  std::vector<text::TokenId> expected{128000};
  tok.encode(a, expected);
  expected.insert(expected.end(), {128001, 128000});
  tok.encode(b, expected);
  expected.push_back(128001);
  std::vector<text::TokenId> got = read_any_tokens(d / "out/train.bin", 2);
  const std::vector<text::TokenId> val = read_any_tokens(d / "out/val.bin", 2);
  got.insert(got.end(), val.begin(), val.end());
  EXPECT_EQ(got, expected);
  EXPECT_NE(std::find(got.begin(), got.end(), 128009u), got.end()) << "<|eot_id|> in the text is the added token";

  // meta.json records the tokenizer; the directory alone gives it back; the dataset reads the files.
  const auto meta = nlohmann::json::parse(file_bytes(d / "out/meta.json"));
  EXPECT_EQ(meta["token_bytes"], 4);
  EXPECT_EQ(meta["vocab_size"], 128256);
  EXPECT_EQ(meta["tokenizer"]["kind"], "tokenizer.json");
  EXPECT_EQ(meta["tokenizer"]["bos"], nlohmann::json::array({128000}));
  EXPECT_EQ(meta["tokenizer"]["eos"], 128001);
  EXPECT_EQ(meta["tokenizer"]["tokenizer_json"]["sha256"], io::sha256_file((tok_dir / "tokenizer.json").string()));
  EXPECT_EQ(meta["tokenizer"]["tokenizer_config"]["sha256"],
            io::sha256_file((tok_dir / "tokenizer_config.json").string()));
  EXPECT_EQ(file_bytes(d / "out/tokenizer.json"), file_bytes(tok_dir / "tokenizer.json"));
  text::Tokenizer again = text::load_tokenizer((d / "out").string());
  EXPECT_TRUE(again.is_hf_json());
  EXPECT_EQ(again.bos_ids(), tok.bos_ids());
  EXPECT_EQ(again.decode(std::vector<text::TokenId>(expected.begin() + 1, expected.begin() + 1 + static_cast<std::ptrdiff_t>(tok.encode(a).size()))), a);
  // load_prepared_tokenizer: the copies, checked against meta.json's SHA-256.
  const PreparedTokenizer prepared = load_prepared_tokenizer((d / "out").string());
  EXPECT_TRUE(prepared.tokenizer.is_hf_json());
  EXPECT_EQ(prepared.files, (std::vector<std::string>{(d / "out/tokenizer.json").string(),
                                                      (d / "out/tokenizer_config.json").string()}));
  EXPECT_EQ(prepared.tokenizer.eos_id(), tok.eos_id());
  const TokenDataset data((d / "out").string(), 2, 16, 0);
  EXPECT_EQ(data.vocab(), 128256);
  EXPECT_EQ(data.size() + data.validation_size(), static_cast<std::int64_t>(expected.size()));
  fs::remove_all(d);
}

// Qwen3 (Qwen2's pattern, NFC, no BOS) sharded with small chunks, and a GPT-2 tokenizer.json (50,257
// ids: uint16 files as before): every input's tokens are those of encoding it whole, then its EOS.
TEST(PrepareHf, ShardedChunksGiveTheTokensOfEachInputWhole) {
  ASSERT_TRUE(hf_files_present());
  const fs::path d = fresh_temp_dir("prepare_hf_shards");
  fs::create_directories(d / "gpt2");
  write_json(d / "gpt2/tokenizer.json", meshgrad::testing::gpt2_tokenizer_json());
  const std::string a = multilingual_text(60), b = multilingual_text(7);
  const std::vector<std::string> inputs = {write_text(d, "a.txt", a).string(), write_text(d, "b.txt", b).string()};
  for (const auto& [tokenizer, version] : {std::pair{qwen3_dir(), 2}, std::pair{(d / "gpt2").string(), 1}}) {
    PrepareOptions o;
    o.tokenizer = tokenizer;
    o.out_dir = (d / "out").string();
    o.overwrite = true;
    o.inputs = inputs;
    o.shard_tokens = 500;
    o.chunk_bytes = 200;
    const PrepareResult r = prepare_dataset(o);
    EXPECT_EQ(r.forced_cuts, 0) << tokenizer;
    text::Tokenizer tok = text::load_tokenizer(tokenizer);
    ASSERT_TRUE(tok.eos_id().has_value());
    EXPECT_TRUE(tok.bos_ids().empty());
    std::vector<text::TokenId> expected;
    for (const std::string& t : {a, b}) {
      tok.encode(t, expected);
      expected.push_back(*tok.eos_id());
    }
    // Chunks are interleaved between the splits: the multiset of tokens and the total must agree,
    // and the training shards' tokens are a subsequence of the expected stream in chunk order.
    std::vector<text::TokenId> all;
    for (const char* split : {"train", "val"}) {
      for (const std::string& shard : list_shards((d / "out").string(), split)) {
        const auto t = read_any_tokens(shard, version);
        all.insert(all.end(), t.begin(), t.end());
      }
    }
    EXPECT_EQ(all.size(), expected.size()) << tokenizer;
    std::sort(all.begin(), all.end());
    std::vector<text::TokenId> sorted = expected;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(all, sorted) << tokenizer;
    // Unsharded with the same chunks: the exact stream.
    o.shard_tokens = 0;
    o.val_fraction = 0;
    prepare_dataset(o);
    EXPECT_EQ(read_any_tokens(d / "out/train.bin", version), expected) << tokenizer;
    EXPECT_FALSE(fs::exists(d / "out/vocab.json"));
    // A copy replaced after prepare is refused, naming it.
    std::ofstream(d / "out/tokenizer.json", std::ios::app) << " ";
    try {
      load_prepared_tokenizer((d / "out").string());
      ADD_FAILURE() << "a replaced tokenizer.json was not refused";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("tokenizer.json' has SHA-256"), std::string::npos) << e.what();
    }
  }
  fs::remove_all(d);
}

// Random text over the characters each pattern treats specially, chunked at the cuts the
// tokenizer's rules allow: the tokens of the whole text, for Llama 3 and Qwen3.
TEST(PrepareHf, CutRulesKeepTheTokensOfRandomTextForLlama3AndQwen) {
  ASSERT_TRUE(hf_files_present());
  const fs::path d = fresh_temp_dir("prepare_hf_random");
  const std::vector<std::string> alphabet = {"a", "b", "Z", "s", "t", "ll", "0", "7", "'", "'", "-", "=", "(", ".",
                                             " ", " ", "  ", "\n", "\r\n", "\t", "é", "e\xcc\x81", "中", "😀", "<|eot_id|>"};
  std::uint64_t state = 4242;
  auto next = [&] { return (state = state * 6364136223846793005ULL + 1442695040888963407ULL) >> 33; };
  for (const std::string& dir : {llama3_dir(), qwen3_dir()}) {
    text::Tokenizer tok = text::load_tokenizer(dir);
    const text::CutRules rules = tok.cut_rules();
    EXPECT_TRUE(rules.newline && rules.space && !rules.class_change) << dir;
    for (int round = 0; round < 8; ++round) {
      std::string text;
      for (int i = 0; i < 3000; ++i) text += alphabet[next() % alphabet.size()];
      const fs::path path = write_text(d, "r.txt", text);
      TextChunkReader reader(path.string(), 64, "test", rules);
      std::vector<text::TokenId> pieces;
      std::string chunk;
      bool first = true;
      while (reader.next(chunk)) {
        tok.encode(chunk, pieces, first);
        first = false;
      }
      EXPECT_EQ(pieces, tok.encode(text)) << dir << " round " << round << " forced cuts " << reader.forced_cuts();
    }
  }
  fs::remove_all(d);
}

TEST(PrepareHf, RefusedBeforeAnythingIsWritten) {
  ASSERT_TRUE(hf_files_present());
  const fs::path d = fresh_temp_dir("prepare_hf_refuse");
  nlohmann::json j = meshgrad::testing::gpt2_tokenizer_json();
  j["model"]["type"] = "WordPiece";
  write_json(d / "tokenizer.json", j);
  PrepareOptions o;
  o.tokenizer = (d / "tokenizer.json").string();
  o.out_dir = (d / "out").string();
  o.inputs = {write_text(d, "a.txt", "some text\n").string()};
  try {
    prepare_dataset(o);
    ADD_FAILURE() << "a WordPiece tokenizer.json was not refused";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("\"model.type\" is \"WordPiece\""), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(d / "out"));
  o.vocab = meshgrad::testing::gpt2_vocab();
  o.merges = meshgrad::testing::gpt2_merges();
  try {
    prepare_dataset(o);
    ADD_FAILURE() << "--tokenizer with --vocab was not refused";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("not both"), std::string::npos) << e.what();
  }
  // The GPT-2 files' prepared directory gives its tokenizer through the same function.
  o.tokenizer.clear();
  prepare_dataset(o);
  PreparedTokenizer prepared = load_prepared_tokenizer(o.out_dir);
  EXPECT_FALSE(prepared.tokenizer.is_hf_json());
  EXPECT_EQ(prepared.files, (std::vector<std::string>{(d / "out/vocab.json").string(), (d / "out/merges.txt").string()}));
  EXPECT_EQ(prepared.tokenizer.decode(prepared.tokenizer.encode("some text\n")), "some text\n");
  fs::remove_all(d);
}

}  // namespace
}  // namespace meshgrad::data::test_prepare_hf
