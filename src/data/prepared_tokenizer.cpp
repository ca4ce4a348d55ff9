// data::load_prepared_tokenizer (data/prepare.hpp): the tokenizer a prepared directory records.
#include <filesystem>
#include <nlohmann/json.hpp>

#include "meshgrad/data/prepare.hpp"
#include "meshgrad/io/file_io.hpp"
#include "meshgrad/io/json_input.hpp"
#include "meshgrad/io/sha256.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad::data {

namespace fs = std::filesystem;

PreparedTokenizer load_prepared_tokenizer(const std::string& dir) {
  const std::string meta_path = (fs::path(dir) / "meta.json").string();
  nlohmann::json meta;
  try {
    meta = io::parse_untrusted_json(io::read_small_file(meta_path, std::uint64_t{64} << 20, "prepared data: meta.json"), 16);
  } catch (const io::JsonInputError& e) {
    throw InvalidArgument(fmt::format("prepared data: '{}' is not valid JSON: {}", meta_path, e.what()));
  }
  const nlohmann::json* t = meta.is_object() && meta.contains("tokenizer") ? &meta["tokenizer"] : nullptr;
  MG_CHECK(t != nullptr && t->is_object(), "prepared data: '{}' has no \"tokenizer\" object (is it a meta.json written "
           "by `meshgrad prepare`?)", meta_path);
  const bool hf = t->value("kind", std::string()) == "tokenizer.json";
  // Keys in load order; the second of a tokenizer.json is optional (no tokenizer_config.json).
  const std::vector<std::string> keys = hf ? std::vector<std::string>{"tokenizer_json", "tokenizer_config"}
                                           : std::vector<std::string>{"vocab", "merges"};
  std::vector<std::string> files;
  for (const std::string& key : keys) {
    const auto entry = t->find(key);
    if (entry == t->end() && hf && key == "tokenizer_config") continue;
    MG_CHECK(entry != t->end() && entry->is_object() && entry->contains("copy") && (*entry)["copy"].is_string() &&
                 entry->contains("sha256") && (*entry)["sha256"].is_string(),
             "prepared data: '{}' has no \"tokenizer\" > \"{}\" with a \"copy\" and its \"sha256\"", meta_path, key);
    const std::string path = (fs::path(dir) / (*entry)["copy"].get<std::string>()).string();
    MG_CHECK(fs::is_regular_file(path), "prepared data: the tokenizer file '{}' that '{}' records is gone", path,
             meta_path);
    const std::string recorded = (*entry)["sha256"].get<std::string>();
    const std::string actual = io::sha256_file(path);
    MG_CHECK(actual == recorded, "prepared data: the tokenizer file '{}' has SHA-256 {} but '{}' records {}: it was "
             "replaced after prepare, so it may not be the tokenizer of these tokens", path, actual, meta_path, recorded);
    files.push_back(path);
  }
  text::Tokenizer tokenizer = hf ? text::Tokenizer::from_hf_json(files[0], files.size() > 1 ? files[1] : "")
                                 : text::Tokenizer::from_files(files[0], files[1]);
  return {std::move(tokenizer), std::move(files)};
}

}  // namespace meshgrad::data
