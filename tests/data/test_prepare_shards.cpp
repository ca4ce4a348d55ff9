// `meshgrad prepare` streaming and sharded (prepare_dataset with shard_tokens): text read in chunks
// cut where the pre-tokenizer splits anyway gives the tokens of the whole text; shards of the right
// sizes and names whose tokens are the unsharded prepare's; the interleaved validation split; meta.json
// lists the shards with their hashes; the dataset reads the result; --overwrite leaves one layout.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "meshgrad/data/dataset.hpp"
#include "meshgrad/data/prepare.hpp"
#include "meshgrad/data/shards.hpp"
#include "meshgrad/data/text_chunks.hpp"
#include "meshgrad/text/tokenizer.hpp"
#include "text/gpt2_test_files.hpp"

namespace meshgrad::data::test_prepare_shards {
namespace {

namespace fs = std::filesystem;
using meshgrad::testing::file_bytes;
using meshgrad::testing::gpt2_files_present;
using meshgrad::testing::gpt2_merges;
using meshgrad::testing::gpt2_vocab;

std::vector<text::TokenId> read_tokens(const fs::path& p) {
  const std::string bytes = file_bytes(p);
  EXPECT_GE(bytes.size(), 1024u) << p;
  std::int32_t header[3];
  std::memcpy(header, bytes.data(), sizeof header);
  EXPECT_EQ(header[0], 20240520) << p;
  EXPECT_EQ(bytes.size(), 1024u + 2u * static_cast<std::size_t>(header[2])) << p;
  std::vector<text::TokenId> out(static_cast<std::size_t>(header[2]));
  for (std::size_t i = 0; i < out.size(); ++i) {
    std::uint16_t t;
    std::memcpy(&t, bytes.data() + 1024 + 2 * i, 2);
    out[i] = t;
  }
  return out;
}

// Prose with every kind of cut: short lines, one long line with spaces only (cut before a space),
// a long run without spaces or newlines (cut between characters of different classes: letter,
// digit, other), numbers, punctuation, contractions, non-ASCII.
std::string varied_text(int paragraphs) {
  std::string text;
  for (int p = 0; p < paragraphs; ++p) {
    text += fmt::format("Paragraph {}: the river's voice, 3 voices; naïve café — {}!\n", p, p * 7919 % 1000);
    text += "  indented line\twith a tab\n\nblank above.\n";
    if (p % 5 == 0) {
      for (int w = 0; w < 300; ++w) text += fmt::format("word{} ", w);   // ~2.5 KB without a newline
      text += "end.\n";
    }
    if (p % 17 == 3) {
      for (int i = 0; i < 200; ++i) text += fmt::format("x{}='it''s'+q{}[é]", i, i * 31);   // ~4 KB, no space
      text += "\n";
    }
  }
  return text;
}

fs::path write_text(const fs::path& dir, const std::string& name, const std::string& text) {
  std::ofstream(dir / name, std::ios::binary) << text;
  return dir / name;
}

PrepareOptions options(const fs::path& out, const std::vector<fs::path>& inputs) {
  PrepareOptions o;
  o.vocab = gpt2_vocab();
  o.merges = gpt2_merges();
  o.out_dir = out.string();
  for (const fs::path& p : inputs) o.inputs.push_back(p.string());
  return o;
}

std::vector<text::TokenId> concat_shards(const fs::path& dir, const std::string& split) {
  std::vector<text::TokenId> all;
  for (const std::string& shard : list_shards(dir.string(), split)) {
    const std::vector<text::TokenId> t = read_tokens(shard);
    all.insert(all.end(), t.begin(), t.end());
  }
  return all;
}

TEST(TextChunks, SafeCutsAreAtNewlinesOrBeforeSpaces) {
  EXPECT_EQ(safe_text_cut("ab\ncd\nef", 1), 3u) << "after a newline between printable characters";
  EXPECT_EQ(safe_text_cut("ab cd\nef", 1), 6u) << "a newline is preferred";
  EXPECT_EQ(safe_text_cut("ab cd ef", 3), 5u) << "else before a single space";
  EXPECT_EQ(safe_text_cut("ab  cd", 1), std::nullopt) << "not inside a run of spaces";
  EXPECT_EQ(safe_text_cut("ab\n\ncd", 1), std::nullopt) << "not between newlines";
  EXPECT_EQ(safe_text_cut("abcdef ", 1), std::nullopt) << "a cut needs its right neighbour";
}

TEST(TextChunks, ChunksEncodeToTheTokensOfTheWholeText) {
  ASSERT_TRUE(gpt2_files_present());
  const fs::path d = meshgrad::testing::fresh_temp_dir("text_chunks");
  const std::string text = varied_text(60);
  const fs::path path = write_text(d, "t.txt", text);
  text::Tokenizer tok = text::Tokenizer::from_files(gpt2_vocab(), gpt2_merges());
  const std::vector<text::TokenId> whole = tok.encode(text);
  for (std::size_t chunk_bytes : {std::size_t{100}, std::size_t{777}, std::size_t{4096}}) {
    TextChunkReader reader(path.string(), chunk_bytes, "test");
    std::vector<text::TokenId> pieces;
    std::string chunk, rejoined;
    int chunks = 0;
    while (reader.next(chunk)) {
      EXPECT_TRUE(chunk.size() >= chunk_bytes || reader.offset() == reader.size()) << chunk.size();
      tok.encode(chunk, pieces);
      rejoined += chunk;
      ++chunks;
    }
    EXPECT_EQ(rejoined, text);
    EXPECT_GT(chunks, static_cast<int>(text.size() / chunk_bytes / 3)) << chunk_bytes;
    EXPECT_EQ(pieces, whole) << "chunks of " << chunk_bytes << " bytes";
  }
  fs::remove_all(d);
}

// Random text over letters, digits, symbols, apostrophes (contractions), spaces, tabs, newlines and
// non-ASCII: every cut the reader makes (newline, space, change of class) keeps the tokens of the
// whole text, at chunk sizes small enough that cuts of every kind are taken.
TEST(TextChunks, CutsBetweenClassesKeepTheTokensOfRandomText) {
  ASSERT_TRUE(gpt2_files_present());
  const fs::path d = meshgrad::testing::fresh_temp_dir("text_chunks_random");
  text::Tokenizer tok = text::Tokenizer::from_files(gpt2_vocab(), gpt2_merges());
  const std::vector<std::string> alphabet = {"a", "b", "Z", "s", "t", "ll", "0", "7", "'", "'", "-", "=", "(", ".",
                                             " ", " ", "  ", "\n", "\t", "é", "—", "中", "\xff"};
  std::uint64_t state = 12345;
  auto next = [&] { return (state = state * 6364136223846793005ULL + 1442695040888963407ULL) >> 33; };
  int checked = 0;
  for (int round = 0; round < 20; ++round) {
    std::string text;
    while (text.size() < 6000) text += alphabet[next() % alphabet.size()];
    const fs::path path = write_text(d, "r.txt", text);
    const std::vector<text::TokenId> whole = tok.encode(text);
    for (std::size_t chunk_bytes : {std::size_t{20}, std::size_t{60}, std::size_t{100}}) {
      TextChunkReader reader(path.string(), chunk_bytes, "test");
      std::vector<text::TokenId> pieces;
      std::string chunk;
      while (reader.next(chunk)) tok.encode(chunk, pieces);
      EXPECT_EQ(reader.forced_cuts(), 0);
      EXPECT_EQ(pieces, whole) << "round " << round << ", chunks of " << chunk_bytes;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 60);
  fs::remove_all(d);
}

// reliability-3 P6: text with no safe cut (one run of letters) was read whole, so memory grew with the
// file (20 MB: 717 MB RSS). A chunk is now at most the window, max(2 x chunk_bytes, 64 KiB): without a
// safe cut in that much text it is cut at a UTF-8 character boundary, counted in forced_cuts().
TEST(TextChunks, TextWithoutACutIsCutAtACharacterBoundaryWithinTheWindow) {
  const fs::path d = meshgrad::testing::fresh_temp_dir("text_chunks_forced");
  std::string text = "start.\n";
  for (int i = 0; i < 100000; ++i) text += "é";   // 200,000 bytes of one pre-token (\p{L}+), 2 bytes a letter
  text += std::string(150001, 'q') + "\nend of it.\n";
  const fs::path path = write_text(d, "run.txt", text);
  for (std::size_t chunk_bytes : {std::size_t{100}, std::size_t{50000}}) {
    TextChunkReader reader(path.string(), chunk_bytes, "test");
    const std::size_t window = std::max<std::size_t>(2 * chunk_bytes, 65536);
    EXPECT_EQ(reader.window_bytes(), window);
    std::string chunk, rejoined;
    while (reader.next(chunk)) {
      EXPECT_LE(chunk.size(), window);
      EXPECT_NE(static_cast<unsigned char>(chunk.front()) & 0xC0, 0x80) << "a chunk starts a character";
      rejoined += chunk;
    }
    EXPECT_EQ(rejoined, text);
    EXPECT_GE(reader.forced_cuts(), static_cast<std::int64_t>(350000 / window)) << chunk_bytes;
  }
  fs::remove_all(d);
}

TEST(PrepareShards, ShardsHoldTheUnshardedTokensInFilesOfNTokens) {
  ASSERT_TRUE(gpt2_files_present());
  const fs::path d = meshgrad::testing::fresh_temp_dir("prepare_shards");
  const fs::path a = write_text(d, "a.txt", varied_text(40)), b = write_text(d, "b.txt", varied_text(7));
  PrepareOptions plain = options(d / "plain", {a, b});
  plain.val_fraction = 0;
  prepare_dataset(plain);
  PrepareOptions sharded = options(d / "sharded", {a, b});
  sharded.val_fraction = 0;
  sharded.shard_tokens = 1000;
  sharded.chunk_bytes = 512;
  const PrepareResult r = prepare_dataset(sharded);

  const std::vector<text::TokenId> expected = read_tokens(d / "plain" / "train.bin");
  ASSERT_GT(expected.size(), 3000u);
  const std::int64_t n = static_cast<std::int64_t>(expected.size());
  EXPECT_EQ(r.train_tokens, n);
  EXPECT_EQ(r.train_shards, (n + 999) / 1000);
  EXPECT_EQ(r.val_shards, 0);
  const std::vector<std::string> shards = list_shards((d / "sharded").string(), "train");
  ASSERT_EQ(static_cast<std::int64_t>(shards.size()), r.train_shards);
  const nlohmann::json meta = nlohmann::json::parse(file_bytes(d / "sharded" / "meta.json"));
  for (std::size_t s = 0; s < shards.size(); ++s) {
    const std::string name = shard_file_name("train", static_cast<std::int64_t>(s));
    EXPECT_EQ(fs::path(shards[s]).filename(), name);
    const std::int64_t size = std::min<std::int64_t>(1000, n - 1000 * static_cast<std::int64_t>(s));
    EXPECT_EQ(static_cast<std::int64_t>(read_tokens(shards[s]).size()), size) << name;
    EXPECT_EQ(meta["files"][name]["tokens"], size);
    EXPECT_EQ(meta["files"][name]["xxh128"], TokenFile::open(shards[s], TokenFile::Format::LlmC)->content_hash());
    EXPECT_EQ(meta["shards"]["train"][s], name);
  }
  EXPECT_EQ(concat_shards(d / "sharded", "train"), expected) << "the shards are train.bin cut every 1000 tokens";
  EXPECT_FALSE(fs::exists(d / "sharded" / "train.bin"));
  EXPECT_EQ(meta["shard_tokens"], 1000);
  EXPECT_EQ(meta["train_tokens"], n);
  // The dataset reads them in order as one stream.
  const TokenDataset data((d / "sharded").string(), 2, 8, 0);
  EXPECT_TRUE(data.sequential());
  EXPECT_EQ(data.size(), n);
  EXPECT_EQ(data.vocab(), 50257);
  EXPECT_EQ(data.batch_at_position(8).inputs.at({0, 0}), static_cast<std::int64_t>(expected[8]));
  fs::remove_all(d);
}

TEST(PrepareShards, ValidationIsEveryTenthChunkSpreadOverTheCorpus) {
  ASSERT_TRUE(gpt2_files_present());
  const fs::path d = meshgrad::testing::fresh_temp_dir("prepare_shards_val");
  const fs::path a = write_text(d, "a.txt", varied_text(50)), b = write_text(d, "b.txt", varied_text(30));
  PrepareOptions o = options(d / "out", {a, b});
  o.val_fraction = 0.1;
  o.shard_tokens = 700;
  o.chunk_bytes = 400;
  const PrepareResult r = prepare_dataset(o);

  // The expected split, chunk by chunk, with the reader prepare uses (its tokens are checked above).
  text::Tokenizer tok = text::Tokenizer::from_files(gpt2_vocab(), gpt2_merges());
  std::vector<text::TokenId> train, val;
  std::int64_t index = 0, val_chunks = 0, val_chunks_of_b = 0;
  for (const fs::path& input : {a, b}) {
    TextChunkReader reader(input.string(), 400, "test");
    std::string chunk;
    bool first = true;
    while (reader.next(chunk)) {
      std::vector<text::TokenId> ids;
      if (first) ids.push_back(50256);
      first = false;
      tok.encode(chunk, ids);
      const bool to_val = chunk_goes_to_validation(index++, 0.1);
      val_chunks += to_val ? 1 : 0;
      val_chunks_of_b += to_val && input == b ? 1 : 0;
      (to_val ? val : train).insert((to_val ? val : train).end(), ids.begin(), ids.end());
    }
  }
  ASSERT_GT(index, 100);
  EXPECT_EQ(val_chunks, (index + 5) / 10) << "chunks 4, 14, 24, ...";
  EXPECT_EQ(concat_shards(d / "out", "train"), train);
  EXPECT_EQ(concat_shards(d / "out", "val"), val);
  EXPECT_EQ(r.val_tokens, static_cast<std::int64_t>(val.size()));
  EXPECT_NEAR(static_cast<double>(val.size()) / static_cast<double>(val.size() + train.size()), 0.1, 0.03);
  EXPECT_GT(val_chunks_of_b, 0) << "the validation chunks are spread over every input";
  const nlohmann::json meta = nlohmann::json::parse(file_bytes(d / "out" / "meta.json"));
  EXPECT_EQ(meta["chunks"], index);
  EXPECT_EQ(meta["val_chunks"], val_chunks);
  EXPECT_EQ(meta["shards"]["val"].size(), static_cast<std::size_t>(r.val_shards));
  const TokenDataset data((d / "out").string(), 2, 16, 0);
  EXPECT_EQ(data.validation_size(), r.val_tokens);
  EXPECT_TRUE(data.has_validation());
  fs::remove_all(d);
}

TEST(PrepareShards, OverwriteLeavesOneLayoutAndRefusesWithout) {
  ASSERT_TRUE(gpt2_files_present());
  const fs::path d = meshgrad::testing::fresh_temp_dir("prepare_shards_overwrite");
  const fs::path a = write_text(d, "a.txt", varied_text(30));
  PrepareOptions o = options(d / "out", {a});
  prepare_dataset(o);
  o.shard_tokens = 500;
  std::string m;
  try {
    prepare_dataset(o);
  } catch (const InvalidArgument& e) {
    m = e.what();
  }
  EXPECT_NE(m.find("already holds a prepared dataset (merges.txt, meta.json, train.bin, val.bin, vocab.json)"),
            std::string::npos) << m;
  o.overwrite = true;
  const PrepareResult many = prepare_dataset(o);
  EXPECT_FALSE(fs::exists(d / "out" / "train.bin")) << "the unsharded files are removed";
  EXPECT_FALSE(fs::exists(d / "out" / "val.bin"));
  o.shard_tokens = 100000;
  const PrepareResult one = prepare_dataset(o);
  EXPECT_GT(many.train_shards, 1);
  EXPECT_EQ(one.train_shards, 1);
  EXPECT_FALSE(fs::exists(d / "out" / "train_000001.bin")) << "shards past the new last one are removed";
  EXPECT_NO_THROW(TokenDataset((d / "out").string(), 2, 8, 0));
  o.shard_tokens = 0;
  prepare_dataset(o);
  EXPECT_FALSE(fs::exists(d / "out" / "train_000000.bin"));
  EXPECT_NO_THROW(TokenDataset((d / "out").string(), 2, 8, 0));
  fs::remove_all(d);
}

// prepare commits through io/atomic_commit (issue 36): its temporaries are unique_temporary_path
// names, so a killed prepare's leftover (a dead process's temporary) is removed by the next one, and
// nothing but the prepared files is left in --out.
TEST(PrepareShards, CommitsThroughAtomicCommitRemovingADeadWritersTemporaries) {
  ASSERT_TRUE(gpt2_files_present());
  const fs::path d = meshgrad::testing::fresh_temp_dir("prepare_atomic_commit");
  const fs::path a = write_text(d, "a.txt", varied_text(10));
  fs::create_directories(d / "out");
  // A temporary of train.bin left by a process that is gone (pid beyond Linux's pid_max; no host:
  // written here).
  const fs::path stale = d / "out" / ".train.bin.tmp-4194305-5eed-0";
  std::ofstream(stale) << "half a token file";
  prepare_dataset(options(d / "out", {a}));
  EXPECT_FALSE(fs::exists(stale)) << "a dead writer's temporary is left behind";
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(d / "out")) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"merges.txt", "meta.json", "train.bin", "val.bin", "vocab.json"}));
  fs::remove_all(d);
}

}  // namespace
}  // namespace meshgrad::data::test_prepare_shards
