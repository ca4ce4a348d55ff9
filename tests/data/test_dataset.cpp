// Training data: deterministic batches from (seed, step), targets shifted by one, dp shards that
// cover the batch; llm.c token files and prepared directories (header validation naming the offset,
// tokens below the vocabulary, the validation split); one reader per process whatever the number of
// rank threads; paths that are not regular files refused naming what they are; the data's identity
// (content hashes) checked against meta.json and agreed between ranks; a file that shrinks under a
// run is an error; sharded data (prepared shard directories, globs) read in order with wrap and
// shard-boundary skip, its errors, and validation data from another path.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <barrier>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "meshgrad/ops/ops.hpp"
#include "meshgrad/comm/threads.hpp"
#include "meshgrad/data/dataset.hpp"
#include "meshgrad/data/shards.hpp"
#include "meshgrad/tensor/random.hpp"
#include "meshgrad/io/xxh128.hpp"
#include "text/gpt2_test_files.hpp"

namespace meshgrad::data::test_dataset {
namespace {

TEST(Data, BatchesAreDeterministicAndShiftedByOne) {
  TokenDataset a("", 4, 16, 7), b("", 4, 16, 7), other_seed("", 4, 16, 8);
  ASSERT_GT(a.size(), 2000) << "the built-in corpus should be a few KB";
  const nn::Batch x = a.next_batch(3);
  EXPECT_EQ(x.inputs.shape(), (Shape{4, 16}));
  EXPECT_EQ(x.inputs.dtype(), DType::Int64);
  EXPECT_TRUE(bitwise_equal(x.inputs, b.next_batch(3).inputs));
  EXPECT_TRUE(bitwise_equal(x.targets, b.next_batch(3).targets));
  EXPECT_FALSE(bitwise_equal(x.inputs, a.next_batch(4).inputs));
  EXPECT_FALSE(bitwise_equal(x.inputs, other_seed.next_batch(3).inputs));
  const std::string_view text = builtin_corpus();
  for (std::int64_t r = 0; r < 4; ++r) {
    std::string row;
    for (std::int64_t t = 0; t < 16; ++t) row.push_back(static_cast<char>(x.inputs.at({r, t})));
    row.push_back(static_cast<char>(x.targets.at({r, 15})));
    EXPECT_NE(text.find(row), std::string_view::npos) << "row " << r << " is not a window of the text: " << row;
    for (std::int64_t t = 0; t + 1 < 16; ++t) EXPECT_EQ(x.inputs.at({r, t + 1}), x.targets.at({r, t}));
  }
}

TEST(Data, WindowsReachTheEndOfTheText) {
  // A 9-byte file with T = 8 has exactly one window: inputs bytes 0..7, targets 1..8.
  const auto path = std::filesystem::temp_directory_path() / "meshgrad_test_data_small.txt";
  { std::ofstream(path) << "abcdefghi"; }
  TokenDataset d(path.string(), 3, 8, 1);
  const nn::Batch x = d.next_batch(0);
  for (std::int64_t r = 0; r < 3; ++r) {
    EXPECT_EQ(x.inputs.at({r, 0}), 'a');
    EXPECT_EQ(x.targets.at({r, 7}), 'i');
  }
  std::filesystem::remove(path);
}

TEST(Data, DpShardsCoverTheBatchInRankOrder) {
  TokenDataset d("", 7, 5, 3);
  const nn::Batch x = d.next_batch(11);
  for (int dp : {1, 2, 3, 7}) {
    TensorList inputs, targets;
    for (int r = 0; r < dp; ++r) {
      const nn::Batch s = dp_shard(x, r, dp);
      EXPECT_EQ(s.inputs.size(0), shard_range(7, dp, r).size);
      inputs.push_back(s.inputs);
      targets.push_back(s.targets);
    }
    EXPECT_TRUE(bitwise_equal(cat(inputs, 0), x.inputs)) << "dp=" << dp;
    EXPECT_TRUE(bitwise_equal(cat(targets, 0), x.targets)) << "dp=" << dp;
  }
  EXPECT_THROW(dp_shard(x, 0, 8), InvalidArgument);   // more replicas than rows
}

TEST(Data, ErrorsNameTheFile) {
  const std::string missing = "/nonexistent/meshgrad/corpus.txt";
  try {
    TokenDataset d(missing, 2, 8, 0);
    ADD_FAILURE() << "a missing file was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
  const auto path = std::filesystem::temp_directory_path() / "meshgrad_test_data_short.txt";
  { std::ofstream(path) << "short"; }
  try {
    TokenDataset d(path.string(), 2, 8, 0);
    ADD_FAILURE() << "a file shorter than T + 1 bytes was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("5 bytes"), std::string::npos) << e.what();
  }
  std::filesystem::remove(path);
}

namespace fs = std::filesystem;

fs::path fresh_dir(const std::string& name) { return meshgrad::testing::fresh_temp_dir("data_" + name); }

// An llm.c token file written by hand (independently of write_token_file): header then uint16.
void write_llmc(const fs::path& p, const std::vector<std::uint16_t>& tokens, std::int32_t magic = 20240520,
                std::int32_t version = 1, std::int64_t count = -1, std::size_t header_bytes = 1024) {
  std::vector<std::int32_t> header(256, 0);
  header[0] = magic;
  header[1] = version;
  header[2] = static_cast<std::int32_t>(count < 0 ? static_cast<std::int64_t>(tokens.size()) : count);
  std::ofstream out(p, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header.data()), static_cast<std::streamsize>(header_bytes));
  out.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(2 * tokens.size()));
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  ADD_FAILURE() << "no InvalidArgument was thrown";
  return "";
}

std::vector<std::uint16_t> iota_tokens(std::size_t n, std::uint16_t mod) {
  std::vector<std::uint16_t> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = static_cast<std::uint16_t>((i * 7 + 3) % mod);
  return t;
}

TEST(Data, LlmcTokenFileGivesWindowsOfItsTokens) {
  const fs::path d = fresh_dir("llmc");
  const std::vector<std::uint16_t> tokens = iota_tokens(500, 50000);
  write_llmc(d / "toks.bin", tokens);
  TokenDataset data((d / "toks.bin").string(), 4, 8, 5);
  EXPECT_EQ(data.size(), 500);
  EXPECT_EQ(data.vocab(), *std::max_element(tokens.begin(), tokens.end()) + 1) << "no meta.json: the token range";
  EXPECT_EQ(data.description(), "llm.c tokens");
  const nn::Batch x = data.next_batch(2);
  for (std::int64_t r = 0; r < 4; ++r) {
    // Find the window: tokens are distinct enough ((7i + 3) mod 50000 over 500 positions).
    const auto first = static_cast<std::uint16_t>(x.inputs.at({r, 0}));
    const auto start = static_cast<std::size_t>(std::find(tokens.begin(), tokens.end(), first) - tokens.begin());
    ASSERT_LT(start + 8, tokens.size());
    for (std::int64_t t = 0; t < 8; ++t) {
      EXPECT_EQ(x.inputs.at({r, t}), tokens[start + static_cast<std::size_t>(t)]);
      EXPECT_EQ(x.targets.at({r, t}), tokens[start + static_cast<std::size_t>(t) + 1]);
    }
  }
  // The same file under another name (no .bin) is recognised by its magic.
  fs::copy_file(d / "toks.bin", d / "toks.data");
  EXPECT_EQ(TokenDataset((d / "toks.data").string(), 4, 8, 5).size(), 500);
  // write_token_file gives the same bytes as the hand-written file.
  write_token_file((d / "again.bin").string(), tokens);
  std::ifstream a(d / "toks.bin", std::ios::binary), b(d / "again.bin", std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(a), {}), std::string(std::istreambuf_iterator<char>(b), {}));
  fs::remove_all(d);
}

TEST(Data, BadTokenFileHeadersNameTheFileAndOffset) {
  const fs::path d = fresh_dir("header");
  const std::vector<std::uint16_t> tokens = iota_tokens(100, 1000);
  const auto open = [&](const char* name) { return [&d, name] { TokenDataset((d / name).string(), 1, 4, 0); }; };
  write_llmc(d / "magic.bin", tokens, 12345);
  std::string m = error_of(open("magic.bin"));
  EXPECT_NE(m.find("magic.bin': byte offset 0: magic 12345"), std::string::npos) << m;
  write_llmc(d / "version.bin", tokens, 20240520, 3);
  m = error_of(open("version.bin"));
  EXPECT_NE(m.find("byte offset 4: version 3"), std::string::npos) << m;
  // Version 2 is uint32 tokens: 100 uint16 tokens are 50 of them, not the 100 the header says.
  write_llmc(d / "v2.bin", tokens, 20240520, 2);
  m = error_of(open("v2.bin"));
  EXPECT_NE(m.find("the header says 100 tokens (400 bytes) but the file has 200 bytes after the header (version 2: "
                   "4-byte tokens)"), std::string::npos) << m;
  write_llmc(d / "count.bin", tokens, 20240520, 1, 101);
  m = error_of(open("count.bin"));
  EXPECT_NE(m.find("byte offset 8: the header says 101 tokens (202 bytes) but the file has 200 bytes"),
            std::string::npos) << m;
  write_llmc(d / "short.bin", {}, 20240520, 1, 0, 1000);
  m = error_of(open("short.bin"));
  EXPECT_NE(m.find("1000 bytes, shorter than the 1024-byte header"), std::string::npos) << m;
  fs::remove_all(d);
}

TEST(Data, PathsThatAreNotRegularFilesAreRefusedNamingWhatTheyAre) {
  const fs::path d = fresh_dir("kinds");
  const auto open = [](const std::string& p) { return [p] { TokenDataset(p, 1, 4, 0); }; };
  std::string m = error_of(open("/dev/zero"));   // read naively, it never ends
  EXPECT_NE(m.find("data '/dev/zero' is a character device"), std::string::npos) << m;
  m = error_of(open(d.string()));
  EXPECT_NE(m.find("is a directory without train.bin"), std::string::npos) << m;
  ASSERT_EQ(::mkfifo((d / "fifo").c_str(), 0600), 0);
  m = error_of(open((d / "fifo").string()));   // must not block waiting for a writer
  EXPECT_NE(m.find("fifo' is a pipe or FIFO"), std::string::npos) << m;
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const std::string pipe_path = fmt::format("/dev/fd/{}", fds[0]);   // what `--data <(cmd)` passes
  m = error_of(open(pipe_path));
  EXPECT_NE(m.find(fmt::format("'{}' is a pipe or FIFO", pipe_path)), std::string::npos) << m;
  ::close(fds[0]);
  ::close(fds[1]);
  m = error_of(open((d / "missing.txt").string()));
  EXPECT_NE(m.find("missing.txt' cannot be opened for reading: No such file"), std::string::npos) << m;
  fs::remove_all(d);
}

// A prepared directory written by hand: train.bin, val.bin, meta.json.
fs::path prepared_dir(const std::string& name, const std::vector<std::uint16_t>& train_tokens,
                      const std::vector<std::uint16_t>& val_tokens, std::int64_t vocab) {
  const fs::path d = fresh_dir(name);
  write_llmc(d / "train.bin", train_tokens);
  write_llmc(d / "val.bin", val_tokens);
  std::ofstream(d / "meta.json") << nlohmann::json{{"vocab_size", vocab}}.dump();
  return d;
}

TEST(Data, PreparedDirectoryVocabularyAndValidationSplit) {
  std::vector<std::uint16_t> val(101);
  for (std::size_t i = 0; i < val.size(); ++i) val[i] = static_cast<std::uint16_t>(i);
  const fs::path d = prepared_dir("prepared", iota_tokens(300, 77), val, 1000);
  TokenDataset data(d.string(), 3, 10, 1);
  EXPECT_EQ(data.vocab(), 1000) << "meta.json's vocab_size, not the token range";
  EXPECT_EQ(data.input_files(), (std::vector<std::string>{(d / "train.bin").string(), (d / "val.bin").string(),
                                                          (d / "meta.json").string()}));
  EXPECT_EQ(data.validation_size(), 101);
  ASSERT_TRUE(data.has_validation());
  // W = (101 - 1) / 10 = 10 windows starting at 0, 10, ..., 90; batches of 3 rows: ceil(10 / 3) = 4.
  EXPECT_EQ(data.validation_batches(), 4);
  std::vector<int> seen(10, 0);
  for (std::int64_t k = 0; k < 4; ++k) {
    const nn::Batch v = data.validation_batch(k);
    EXPECT_TRUE(bitwise_equal(v.inputs, data.validation_batch(k).inputs)) << "deterministic";
    for (std::int64_t r = 0; r < 3; ++r) {
      const std::int64_t start = v.inputs.at({r, 0});   // val token i == i
      EXPECT_EQ(start % 10, 0);
      EXPECT_EQ(start / 10, (k * 3 + r) % 10);
      EXPECT_EQ(v.targets.at({r, 9}), start + 10);
      if (k * 3 + r < 10) ++seen[static_cast<std::size_t>(start / 10)];
    }
  }
  EXPECT_EQ(seen, std::vector<int>(10, 1)) << "the batches cover every window once";
  // A token file alone has no validation split.
  const TokenDataset alone((d / "train.bin").string(), 3, 10, 1);
  EXPECT_FALSE(alone.has_validation());
  EXPECT_EQ(alone.validation_batches(), 0);
  EXPECT_EQ(alone.vocab(), 1000) << "meta.json beside a .bin gives its vocabulary";
  const std::string m = error_of([&] { alone.validation_batch(0); });
  EXPECT_NE(m.find("no validation split"), std::string::npos) << m;
  fs::remove_all(d);
}

TEST(Data, TokensAtOrAboveTheVocabularyAreRefusedNamingThePosition) {
  std::vector<std::uint16_t> train = iota_tokens(300, 50);
  train[123] = 50;   // == vocab_size
  const fs::path d = prepared_dir("vocab", train, iota_tokens(50, 50), 50);
  const std::string m = error_of([&] { TokenDataset(d.string(), 2, 8, 0); });
  EXPECT_NE(m.find("train.bin': token 50 at position 123 (byte offset 1270) is not below the vocabulary size 50"),
            std::string::npos) << m;
  fs::remove_all(d);
  const fs::path missing_val = prepared_dir("noval", iota_tokens(300, 50), {}, 50);
  fs::remove(missing_val / "val.bin");
  const std::string m2 = error_of([&] { TokenDataset(missing_val.string(), 2, 8, 0); });
  EXPECT_NE(m2.find("without val.bin"), std::string::npos) << m2;
  fs::remove_all(missing_val);
}

// Version 2 token files (uint32, what prepare writes for Llama 3's 128,256 ids): read back exactly,
// ids past 65,535 included; the byte offsets in errors count 4 bytes a token; the model's vocabulary
// check sees the wide ids.
TEST(Data, Uint32TokenFilesCarryVocabulariesOver65536) {
  const fs::path d = fresh_dir("u32");
  std::vector<std::uint32_t> train(400), val(60);
  for (std::size_t i = 0; i < train.size(); ++i) train[i] = static_cast<std::uint32_t>(65530 + i * 157 % 62000);
  for (std::size_t i = 0; i < val.size(); ++i) val[i] = static_cast<std::uint32_t>(128255 - i);
  const std::string train_hash = write_token_file((d / "train.bin").string(), train);
  write_token_file((d / "val.bin").string(), val);
  std::ofstream(d / "meta.json") << nlohmann::json{{"vocab_size", 128256}}.dump();
  const TokenDataset data(d.string(), 2, 8, 0);
  EXPECT_EQ(data.vocab(), 128256);
  EXPECT_EQ(data.size(), 400);
  EXPECT_EQ(data.train_file()->token_bytes(), 4);
  EXPECT_EQ(data.train_file()->content_hash(), train_hash);
  std::vector<std::int64_t> back(400);
  data.train_file()->read(0, 400, back.data());
  EXPECT_TRUE(std::equal(back.begin(), back.end(), train.begin()));
  EXPECT_EQ(data.train_file()->max_token(), *std::max_element(train.begin(), train.end()));
  const nn::Batch v = data.validation_batch(0);
  EXPECT_EQ(v.inputs.at({0, 0}), 128255);
  // A model with a smaller vocabulary (GPT-2's) is refused naming the first id past it.
  const std::string m = error_of([&] { data.require_tokens_below(50257, "the model's vocabulary 50257"); });
  EXPECT_NE(m.find("train.bin': token 65530 at position 0 (byte offset 1024)"), std::string::npos) << m;
  train[3] = 128256;   // == vocab_size: refused, at byte offset 1024 + 4 * 3
  write_token_file((d / "train.bin").string(), train);
  std::ofstream(d / "meta.json") << nlohmann::json{{"vocab_size", 128256}}.dump();
  const std::string m2 = error_of([&] { TokenDataset(d.string(), 2, 8, 0); });
  EXPECT_NE(m2.find("token 128256 at position 3 (byte offset 1036) is not below the vocabulary size 128256"),
            std::string::npos) << m2;
  fs::remove_all(d);
}

// Open descriptors of this process on `path`.
int descriptors_of(const fs::path& path) {
  int n = 0;
  for (const auto& fd : fs::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const fs::path target = fs::read_symlink(fd.path(), ec);
    if (!ec && target == fs::absolute(path)) ++n;
  }
  return n;
}

TEST(Data, RankThreadsShareOneReaderOfTheFile) {
  const fs::path d = prepared_dir("shared", iota_tokens(100000, 50000), iota_tokens(1000, 50000), 50257);
  const fs::path text = d / "text.txt";
  { std::ofstream(text) << std::string(100000, 'x'); }
  for (const fs::path& path : {d, text}) {
    const fs::path opened = path == d ? d / "train.bin" : text;
    constexpr int kRanks = 4;
    std::vector<std::shared_ptr<const TokenFile>> files(kRanks);
    std::vector<int> descriptors(kRanks, -1);
    std::barrier sync(kRanks);
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] {
        const TokenDataset data(path.string(), 2, 16, 0);
        files[static_cast<std::size_t>(r)] = data.train_file();
        sync.arrive_and_wait();   // every rank holds its dataset
        descriptors[static_cast<std::size_t>(r)] = descriptors_of(opened);
        sync.arrive_and_wait();
      });
    }
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < kRanks; ++r) {
      EXPECT_EQ(files[static_cast<std::size_t>(r)].get(), files[0].get()) << "rank " << r << ", " << path;
      EXPECT_EQ(descriptors[static_cast<std::size_t>(r)], 1) << "rank " << r << " sees the file open "
                                                              << descriptors[static_cast<std::size_t>(r)] << " times";
    }
    files.clear();
    EXPECT_EQ(descriptors_of(opened), 0) << "closed when the last user lets go";
  }
  fs::remove_all(d);
}

// The whole file's XXH3-128, by reading it here (io::xxh128_hex over its bytes).
std::string file_hash(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return io::xxh128_hex(bytes.data(), bytes.size());
}

TEST(Data, IdentityIsTheContentHashOfTheFiles) {
  const fs::path a = prepared_dir("identity_a", iota_tokens(300, 77), iota_tokens(40, 77), 100);
  std::vector<std::uint16_t> other = iota_tokens(300, 77);
  other[150] = static_cast<std::uint16_t>((other[150] + 1) % 77);   // one token differs, same count
  const fs::path b = prepared_dir("identity_b", other, iota_tokens(40, 77), 100);
  const DataIdentity ia = TokenDataset(a.string(), 2, 8, 0).identity();
  const DataIdentity ib = TokenDataset(b.string(), 2, 8, 0).identity();
  EXPECT_EQ(ia.train_hash, file_hash(a / "train.bin"));
  EXPECT_EQ(ia.val_hash, file_hash(a / "val.bin"));
  EXPECT_EQ(ia.train_tokens, 300);
  EXPECT_EQ(ia.val_tokens, 40);
  EXPECT_EQ(ib.train_tokens, ia.train_tokens);
  EXPECT_NE(ib.train_hash, ia.train_hash) << "same count, other content";
  EXPECT_EQ(ib.val_hash, ia.val_hash);
  EXPECT_EQ(DataIdentity::from_json(ia.to_json()), ia);
  // The built-in corpus: its bytes' hash, no validation split.
  const DataIdentity builtin = TokenDataset("", 2, 8, 0).identity();
  EXPECT_EQ(builtin.train_hash, io::xxh128_hex(builtin_corpus().data(), builtin_corpus().size()));
  EXPECT_EQ(builtin.val_hash, "");
  fs::remove_all(a);
  fs::remove_all(b);
}

TEST(Data, ATokenFileThatIsNotTheOneMetaJsonDescribesIsRefused) {
  const fs::path d = prepared_dir("meta_hash", iota_tokens(300, 77), iota_tokens(40, 77), 100);
  const std::string train_hash = file_hash(d / "train.bin"), val_hash = file_hash(d / "val.bin");
  const auto write_meta = [&](const std::string& train) {
    std::ofstream(d / "meta.json") << nlohmann::json{
        {"vocab_size", 100},
        {"files", {{"train.bin", {{"xxh128", train}}}, {"val.bin", {{"xxh128", val_hash}}}}}}.dump();
  };
  write_meta(train_hash);
  EXPECT_EQ(TokenDataset(d.string(), 2, 8, 0).identity().train_hash, train_hash) << "the recorded hash matches";
  write_meta(std::string(32, '0'));
  const std::string m = error_of([&] { TokenDataset(d.string(), 2, 8, 0); });
  EXPECT_NE(m.find("train.bin' is not the file its meta.json"), std::string::npos) << m;
  EXPECT_NE(m.find(train_hash), std::string::npos) << m;
  EXPECT_NE(m.find(std::string(32, '0')), std::string::npos) << m;
  fs::remove_all(d);
}

// reliability-2 D9: a data file truncated under a run was SIGBUS (it was mapped); now the read that
// finds it shorter is an error naming the file.
TEST(Data, AFileThatShrinksUnderARunIsAnErrorNotACrash) {
  const fs::path d = fresh_dir("shrink");
  const fs::path text = d / "text.txt";
  { std::ofstream(text) << std::string(20000, 'a'); }
  const TokenDataset data(text.string(), 4, 16, 0);
  data.next_batch(0);
  fs::resize_file(text, 100);
  const std::string m = error_of([&] {
    for (int step = 1; step < 100; ++step) data.next_batch(step);   // a window past byte 100 comes at once
  });
  EXPECT_NE(m.find("data '" + text.string() + "' ends before byte offset"), std::string::npos) << m;
  EXPECT_NE(m.find("shrank while the run was reading it"), std::string::npos) << m;
  fs::remove_all(d);
}

// reliability-2 M3: ranks whose --data path holds different bytes (another host's copy) are refused
// at start-up, on every rank, naming the rank that differs.
TEST(Data, RanksWithDifferentDataAreRefusedNamingTheRank) {
  const fs::path a = prepared_dir("agree_a", iota_tokens(300, 77), iota_tokens(40, 77), 100);
  std::vector<std::uint16_t> other = iota_tokens(300, 77);
  other[0] = 76;
  const fs::path b = prepared_dir("agree_b", other, iota_tokens(40, 77), 100);
  std::vector<std::string> errors(3);
  comm::run_ranks(3, [&](const comm::CommunicatorPtr& world) {
    const TokenDataset data((world->rank() == 2 ? b : a).string(), 2, 8, 0);
    try {
      agree_on_data(*world, data.identity(), "'data'");
    } catch (const InvalidArgument& e) {
      errors[static_cast<std::size_t>(world->rank())] = e.what();
    }
  });
  const std::string expected_b = TokenDataset(b.string(), 2, 8, 0).identity().str();
  for (int r = 0; r < 3; ++r) {
    const std::string& m = errors[static_cast<std::size_t>(r)];
    EXPECT_NE(m.find("the ranks read different data from --data 'data'"), std::string::npos) << "rank " << r << ": " << m;
    EXPECT_NE(m.find("but rank 2 has " + expected_b), std::string::npos) << "rank " << r << ": " << m;
  }
  // The same data everywhere passes.
  comm::run_ranks(2, [&](const comm::CommunicatorPtr& world) {
    const TokenDataset data(a.string(), 2, 8, 0);
    agree_on_data(*world, data.identity(), "'data'");
  });
  fs::remove_all(a);
  fs::remove_all(b);
}

// ---- sharded data ------------------------------------------------------------------------------

namespace sharded {

// Shard s holds tokens 100 * s + i (i = 0, 1, ...), so a token tells its shard and offset.
std::vector<std::uint16_t> shard_tokens(int shard, std::size_t n) {
  std::vector<std::uint16_t> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = static_cast<std::uint16_t>(100 * shard + static_cast<int>(i));
  return t;
}

// A sharded prepared directory written by hand: train shards of the given sizes, one val shard of
// `val` tokens (none for 0), meta.json with the vocabulary and the shard lists (and no hashes).
fs::path sharded_dir(const std::string& name, const std::vector<std::size_t>& sizes, std::size_t val = 0) {
  const fs::path d = fresh_dir(name);
  nlohmann::json train = nlohmann::json::array(), vals = nlohmann::json::array();
  for (std::size_t s = 0; s < sizes.size(); ++s) {
    write_llmc(d / shard_file_name("train", static_cast<std::int64_t>(s)), shard_tokens(static_cast<int>(s), sizes[s]));
    train.push_back(shard_file_name("train", static_cast<std::int64_t>(s)));
  }
  if (val > 0) {
    write_llmc(d / "val_000000.bin", shard_tokens(9, val));
    vals.push_back("val_000000.bin");
  }
  std::ofstream(d / "meta.json") << nlohmann::json{{"vocab_size", 1000}, {"shards", {{"train", train}, {"val", vals}}}}.dump();
  return d;
}

// The first input token of each row.
std::vector<std::int64_t> row_starts(const nn::Batch& x) {
  std::vector<std::int64_t> starts;
  for (std::int64_t r = 0; r < x.inputs.size(0); ++r) starts.push_back(x.inputs.at({r, 0}));
  return starts;
}

}  // namespace sharded

TEST(Data, ShardsAreReadInOrderSkippingShardEndsAndWrapping) {
  using namespace sharded;
  // T = 4: shard 0 (25 tokens) has windows at 0, 4, ..., 20 (6; the last ends at token 24), shard 1
  // (12 tokens) at 0 and 4 (its last 3 tokens are skipped: a window does not cross into shard 2),
  // shard 2 (3 tokens) none. W = 8.
  const fs::path d = sharded_dir("sharded_order", {25, 12, 3});
  const TokenDataset data(d.string(), 3, 4, 0);
  EXPECT_TRUE(data.sequential());
  EXPECT_EQ(data.size(), 40);
  EXPECT_EQ(data.vocab(), 1000);
  EXPECT_FALSE(data.has_validation()) << "no val shards";
  EXPECT_EQ(row_starts(data.batch_at_position(0)), (std::vector<std::int64_t>{0, 4, 8}));
  EXPECT_EQ(data.next_position(0), 12);
  EXPECT_EQ(row_starts(data.batch_at_position(12)), (std::vector<std::int64_t>{12, 16, 20}));
  EXPECT_EQ(row_starts(data.batch_at_position(24)), (std::vector<std::int64_t>{100, 104, 0}))
      << "shard 1's windows, then the wrap to the start (shard 2 has no window)";
  const nn::Batch x = data.batch_at_position(24);
  EXPECT_EQ(x.targets.at({0, 3}), 104) << "targets are the inputs shifted by one";
  EXPECT_EQ(x.targets.at({1, 3}), 108) << "the last window of shard 1 ends at its token 8";
  for (std::int64_t step : {0, 1, 2, 5}) {
    EXPECT_TRUE(bitwise_equal(data.next_batch(step).inputs, data.batch_at_position(step * 12).inputs)) << step;
  }
  EXPECT_EQ(data.position_json(24), (nlohmann::json{{"tokens", 24}, {"epoch", 0}, {"shard", "train_000001.bin"}, {"offset", 0}}));
  EXPECT_EQ(data.position_json(36), (nlohmann::json{{"tokens", 36}, {"epoch", 1}, {"shard", "train_000000.bin"}, {"offset", 4}}));
  EXPECT_EQ(row_starts(data.batch_at_position(32 + 12)), row_starts(data.batch_at_position(12))) << "epoch 2 = epoch 1";
  EXPECT_EQ(row_starts(data.batch_at_position(13)), row_starts(data.batch_at_position(12))) << "floor(p / T)";
  // Identity: the hash of the shard hashes in order; every shard and meta.json are inputs.
  std::vector<std::string> hashes, files;
  for (int s = 0; s < 3; ++s) {
    const fs::path shard = d / shard_file_name("train", s);
    hashes.push_back(TokenFile::open(shard.string(), TokenFile::Format::LlmC)->content_hash());
    files.push_back(shard.string());
  }
  files.push_back((d / "meta.json").string());
  EXPECT_EQ(data.identity().train_hash, hash_of_hashes(hashes));
  EXPECT_EQ(data.identity().train_tokens, 40);
  EXPECT_EQ(data.identity().val_hash, "");
  EXPECT_EQ(data.input_files(), files);
  fs::remove_all(d);
}

TEST(Data, AGlobOfShardsIsTheSameStreamAsTheirDirectory) {
  using namespace sharded;
  const fs::path d = sharded_dir("sharded_glob", {30, 17, 21}, 40);
  const TokenDataset dir(d.string(), 4, 5, 0), glob((d / "train_*.bin").string(), 4, 5, 0);
  EXPECT_TRUE(glob.sequential());
  EXPECT_EQ(glob.vocab(), 1000) << "meta.json beside the matches";
  EXPECT_EQ(glob.identity().train_hash, dir.identity().train_hash);
  for (std::int64_t step = 0; step < 6; ++step) {
    EXPECT_TRUE(bitwise_equal(dir.next_batch(step).inputs, glob.next_batch(step).inputs)) << step;
    EXPECT_TRUE(bitwise_equal(dir.next_batch(step).targets, glob.next_batch(step).targets)) << step;
  }
  EXPECT_TRUE(dir.has_validation());
  EXPECT_FALSE(glob.has_validation()) << "a glob names training data only";
  // Part of the shards: a glob matching two of them.
  const TokenDataset part((d / "train_00000[01].bin").string(), 4, 5, 0);
  EXPECT_EQ(part.size(), 47);
  fs::remove_all(d);
}

// reliability-3 N94: a shard that meta.json does not list joined training silently through a glob
// (the directory refused it). Every path kind checks its files against meta.json's lists: a glob, a
// file named beside meta.json, and the directory itself.
TEST(Data, AFileMetaJsonDoesNotListIsRefusedForEveryPathKind) {
  const fs::path d = sharded::sharded_dir("sharded_stray", {30, 17}, 10);
  write_llmc(d / "train_000002.bin", sharded::shard_tokens(7, 20));   // not in meta.json's shard lists
  auto message = [](const std::string& path) {
    try {
      TokenDataset data(path, 4, 5, 0);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const std::string stray = "data '" + (d / "train_000002.bin").string() + "' is not one of the files its meta.json '" +
                            (d / "meta.json").string() + "' lists (train_000000.bin, train_000001.bin, val_000000.bin)";
  EXPECT_NE(message((d / "train_*.bin").string()).find(stray), std::string::npos) << message((d / "train_*.bin").string());
  EXPECT_NE(message((d / "train_000002.bin").string()).find(stray), std::string::npos);
  EXPECT_NE(message(d.string()).find("holds 3 train shard(s)"), std::string::npos) << message(d.string());
  // The listed shards alone are fine, by a glob that leaves the stray one out.
  EXPECT_EQ(TokenDataset((d / "train_00000[01].bin").string(), 4, 5, 0).size(), 47);
  fs::remove_all(d);
}

TEST(Data, ShardErrorsNameTheFile) {
  using namespace sharded;
  std::string m = error_of([] { TokenDataset("/nonexistent/meshgrad/train_*.bin", 2, 4, 0); });
  EXPECT_NE(m.find("data '/nonexistent/meshgrad/train_*.bin': the pattern matches no file"), std::string::npos) << m;

  const fs::path both = sharded_dir("sharded_both", {30});
  write_llmc(both / "train.bin", shard_tokens(0, 30));
  m = error_of([&] { TokenDataset(both.string(), 2, 4, 0); });
  EXPECT_NE(m.find("has both train.bin and train_*.bin shards (train_000000.bin"), std::string::npos) << m;

  const fs::path gap = sharded_dir("sharded_gap", {30, 30, 30});
  fs::remove(gap / "train_000001.bin");
  m = error_of([&] { TokenDataset(gap.string(), 2, 4, 0); });
  EXPECT_NE(m.find("has train_000000.bin and train_000002.bin but no train_000001.bin"), std::string::npos) << m;
  m = error_of([&] { TokenDataset((gap / "train_*.bin").string(), 2, 4, 0); });
  EXPECT_NE(m.find("train_000000.bin is followed by train_000002.bin"), std::string::npos) << m;

  const fs::path header = sharded_dir("sharded_header", {30, 30});
  write_llmc(header / "train_000001.bin", shard_tokens(1, 30), 1234);
  m = error_of([&] { TokenDataset(header.string(), 2, 4, 0); });
  EXPECT_NE(m.find((header / "train_000001.bin").string() + "': byte offset 0: magic 1234"), std::string::npos) << m;

  const fs::path vocab = sharded_dir("sharded_vocab", {30, 30});
  std::vector<std::uint16_t> bad = shard_tokens(1, 30);
  bad[7] = 1000;
  write_llmc(vocab / "train_000001.bin", bad);
  m = error_of([&] { TokenDataset(vocab.string(), 2, 4, 0); });
  EXPECT_NE(m.find("train_000001.bin': token 1000 at position 7 (byte offset 1038) is not below the vocabulary size 1000"),
            std::string::npos) << m;

  const fs::path shorts = sharded_dir("sharded_short", {4, 4});
  m = error_of([&] { TokenDataset(shorts.string(), 2, 4, 0); });
  EXPECT_NE(m.find("none of its 2 training shard(s) has a window of seq + 1 = 5 tokens (the largest has 4)"),
            std::string::npos) << m;

  const fs::path extra = sharded_dir("sharded_extra", {30});
  write_llmc(extra / "train_000001.bin", shard_tokens(1, 30));
  m = error_of([&] { TokenDataset(extra.string(), 2, 4, 0); });
  EXPECT_NE(m.find("holds 2 train shard(s) (train_000000.bin, train_000001.bin) but its meta.json lists 1"),
            std::string::npos) << m;
  for (const fs::path& p : {both, gap, header, vocab, shorts, extra}) fs::remove_all(p);
}

TEST(Data, AChangedShardIsRefusedLikeAChangedTrainBin) {
  using namespace sharded;
  const fs::path d = sharded_dir("sharded_hash", {30, 30});
  nlohmann::json meta = nlohmann::json::parse(meshgrad::testing::file_bytes(d / "meta.json"));
  for (int s = 0; s < 2; ++s) {
    const std::string name = shard_file_name("train", s);
    meta["files"][name] = {{"xxh128", TokenFile::open((d / name).string(), TokenFile::Format::LlmC)->content_hash()}};
  }
  std::ofstream(d / "meta.json") << meta.dump();
  EXPECT_NO_THROW(TokenDataset(d.string(), 2, 4, 0));
  std::vector<std::uint16_t> changed = shard_tokens(1, 30);
  changed[3] = 5;
  write_llmc(d / "train_000001.bin", changed);
  const std::string m = error_of([&] { TokenDataset(d.string(), 2, 4, 0); });
  EXPECT_NE(m.find((d / "train_000001.bin").string() + "' is not the file its meta.json"), std::string::npos) << m;
  fs::remove_all(d);
}

TEST(Data, ValidationDataFromAnotherPath) {
  using namespace sharded;
  const fs::path d = sharded_dir("val_data", {30, 30}, 41);
  const fs::path other = sharded_dir("val_other", {30}, 21);
  // A directory: its validation split (val_000000.bin), in place of the data's own.
  const TokenDataset a(d.string(), 2, 4, 0, other.string());
  EXPECT_EQ(a.validation_size(), 21);
  EXPECT_EQ(a.validation_batches(), 3) << "W = (21 - 1) / 4 = 5 windows, batches of 2";
  EXPECT_EQ(row_starts(a.validation_batch(0)), (std::vector<std::int64_t>{900, 904}));
  EXPECT_EQ(a.identity().val_hash, hash_of_hashes({TokenFile::open((other / "val_000000.bin").string(),
                                                                    TokenFile::Format::LlmC)->content_hash()}));
  const std::vector<std::string> inputs = a.input_files();
  EXPECT_NE(std::find(inputs.begin(), inputs.end(), (other / "meta.json").string()), inputs.end());
  EXPECT_NE(std::find(inputs.begin(), inputs.end(), (other / "val_000000.bin").string()), inputs.end());
  EXPECT_EQ(std::find(inputs.begin(), inputs.end(), (d / "val_000000.bin").string()), inputs.end());
  // A file: its tokens (another set's training split); a glob likewise.
  const TokenDataset b(d.string(), 2, 4, 0, (other / "train_000000.bin").string());
  EXPECT_EQ(b.validation_size(), 30);
  EXPECT_EQ(row_starts(b.validation_batch(1)), (std::vector<std::int64_t>{8, 12}));
  const TokenDataset c(d.string(), 2, 4, 0, (other / "train_*.bin").string());
  EXPECT_EQ(c.identity().val_tokens, 30);
  // A llm.c file without meta.json: its tokens must be below the data's vocabulary.
  const fs::path loose = fresh_dir("val_loose");
  write_llmc(loose / "ok.bin", shard_tokens(5, 20));
  EXPECT_EQ(TokenDataset(d.string(), 2, 4, 0, (loose / "ok.bin").string()).vocab(), 1000);
  std::vector<std::uint16_t> big = shard_tokens(5, 20);
  big[2] = 1200;
  write_llmc(loose / "big.bin", big);
  std::string m = error_of([&] { TokenDataset(d.string(), 2, 4, 0, (loose / "big.bin").string()); });
  EXPECT_NE(m.find("big.bin': token 1200 at position 2 (byte offset 1028) is not below the data's vocabulary"),
            std::string::npos) << m;
  // Both vocabularies known and different: refused naming both.
  { std::ofstream(loose / "text.txt") << "some validation text, bytes as tokens"; }
  m = error_of([&] { TokenDataset(d.string(), 2, 4, 0, (loose / "text.txt").string()); });
  EXPECT_NE(m.find("validation data '" + (loose / "text.txt").string() + "' has vocabulary 256 (bytes as tokens), data '" +
                   d.string() + "' has the vocabulary size 1000 of '" + (d / "meta.json").string() + "'"),
            std::string::npos) << m;
  m = error_of([&] { TokenDataset(d.string(), 2, 4, 0, (loose / "nothing_*.bin").string()); });
  EXPECT_NE(m.find("validation data '" + (loose / "nothing_*.bin").string() + "': the pattern matches no file"),
            std::string::npos) << m;
  for (const fs::path& p : {d, other, loose}) fs::remove_all(p);
}

TEST(Data, ASingleFileStaysRandomAccess) {
  // Not sharded: next_batch draws random windows from (seed, step), as before shards existed.
  const TokenDataset corpus("", 4, 16, 7);
  EXPECT_FALSE(corpus.sequential());
  const std::int64_t starts = corpus.size() - 16;
  const nn::Batch x = corpus.next_batch(5);
  for (std::int64_t b = 0; b < 4; ++b) {
    const double u = random::uniform(7, static_cast<std::uint64_t>(5 * 4 + b));
    const auto start = std::min(starts - 1, static_cast<std::int64_t>(u * static_cast<double>(starts)));
    EXPECT_EQ(x.inputs.at({b, 0}), static_cast<unsigned char>(builtin_corpus()[static_cast<std::size_t>(start)])) << b;
    EXPECT_EQ(x.targets.at({b, 15}), static_cast<unsigned char>(builtin_corpus()[static_cast<std::size_t>(start + 16)])) << b;
  }
}

}  // namespace
}  // namespace meshgrad::data::test_dataset
