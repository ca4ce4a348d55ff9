// Byte-level data: deterministic batches from (seed, step), targets shifted by one, dp shards that
// cover the batch, and errors naming the file.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "meshgrad/ops/ops.hpp"
#include "meshgrad/train/data.hpp"

namespace meshgrad::train {
namespace {

TEST(Data, BatchesAreDeterministicAndShiftedByOne) {
  ByteDataset a("", 4, 16, 7), b("", 4, 16, 7), other_seed("", 4, 16, 8);
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
  ByteDataset d(path.string(), 3, 8, 1);
  const nn::Batch x = d.next_batch(0);
  for (std::int64_t r = 0; r < 3; ++r) {
    EXPECT_EQ(x.inputs.at({r, 0}), 'a');
    EXPECT_EQ(x.targets.at({r, 7}), 'i');
  }
  std::filesystem::remove(path);
}

TEST(Data, DpShardsCoverTheBatchInRankOrder) {
  ByteDataset d("", 7, 5, 3);
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
    ByteDataset d(missing, 2, 8, 0);
    ADD_FAILURE() << "a missing file was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
  const auto path = std::filesystem::temp_directory_path() / "meshgrad_test_data_short.txt";
  { std::ofstream(path) << "short"; }
  try {
    ByteDataset d(path.string(), 2, 8, 0);
    ADD_FAILURE() << "a file shorter than T + 1 bytes was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("5 bytes"), std::string::npos) << e.what();
  }
  std::filesystem::remove(path);
  const std::string dir = std::filesystem::temp_directory_path().string();
  try {
    ByteDataset d(dir, 2, 8, 0);
    ADD_FAILURE() << "a directory was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'" + dir + "' is a directory"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace meshgrad::train
