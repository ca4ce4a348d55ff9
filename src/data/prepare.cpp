#include "meshgrad/data/prepare.hpp"

#include <unistd.h>

#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "meshgrad/tensor/error.hpp"
#include "meshgrad/text/tokenizer.hpp"
#include "meshgrad/data/dataset.hpp"
#include "meshgrad/io/sha256.hpp"

namespace meshgrad::data {

namespace fs = std::filesystem;

namespace {

// What prepare writes into --out.
constexpr const char* kPreparedFiles[] = {"train.bin", "val.bin", "meta.json", "vocab.json", "merges.txt"};

// Files written to a temporary name in the output directory and renamed into place by commit();
// whatever was not committed is removed when this goes out of scope (an error mid-way).
class StagedFiles {
 public:
  explicit StagedFiles(fs::path dir) : dir_(std::move(dir)) {}
  ~StagedFiles() {
    std::error_code ec;
    for (const auto& [tmp, final_name] : staged_) fs::remove(tmp, ec);
  }
  StagedFiles(const StagedFiles&) = delete;
  StagedFiles& operator=(const StagedFiles&) = delete;

  // The temporary path to write `name` to.
  std::string stage(const std::string& name) {
    const fs::path tmp = dir_ / fmt::format(".{}.tmp-{}", name, ::getpid());
    staged_.emplace_back(tmp, dir_ / name);
    return tmp.string();
  }
  // Renames every staged file into place, in the order staged.
  void commit() {
    for (const auto& [tmp, final_name] : staged_) {
      std::error_code ec;
      fs::rename(tmp, final_name, ec);
      MG_CHECK(!ec, "prepare: cannot rename '{}' to '{}': {}", tmp.string(), final_name.string(), ec.message());
    }
    staged_.clear();
  }

 private:
  fs::path dir_;
  std::vector<std::pair<fs::path, fs::path>> staged_;
};

}  // namespace

PrepareResult prepare_dataset(const PrepareOptions& o) {
  // ---- everything a user can get wrong, before any work ----
  MG_CHECK(!o.inputs.empty(), "prepare: no input files (give one or more text files)");
  MG_CHECK(std::isfinite(o.val_fraction) && o.val_fraction >= 0 && o.val_fraction < 1,
           "prepare: --val-fraction must be in [0, 1), got {}", o.val_fraction);
  MG_CHECK(!o.out_dir.empty(), "prepare: --out must name a directory");
  std::error_code ec;
  MG_CHECK(!fs::exists(o.out_dir, ec) || fs::is_directory(o.out_dir, ec), "prepare: --out '{}' exists and is not a "
           "directory", o.out_dir);
  if (!o.overwrite) {
    std::vector<std::string> existing;
    for (const char* name : kPreparedFiles) {
      if (fs::exists(fs::path(o.out_dir) / name, ec) || fs::is_symlink(fs::path(o.out_dir) / name, ec)) existing.push_back(name);
    }
    MG_CHECK(existing.empty(), "prepare: --out '{}' already holds a prepared dataset ({}): prepare refuses to replace "
             "it, since a run or a checkpoint may depend on those tokens; choose another --out, or add --overwrite",
             o.out_dir, fmt::join(existing, ", "));
  }
  std::vector<std::unique_ptr<MappedFile>> inputs;
  std::int64_t total = 0;
  for (const std::string& path : o.inputs) {
    inputs.push_back(std::make_unique<MappedFile>(path, "prepare: input"));
    total += static_cast<std::int64_t>(inputs.back()->bytes().size());
  }
  MG_CHECK(total > 0, "prepare: the input files ({}) are all empty", fmt::join(o.inputs, ", "));
  text::Tokenizer tokenizer = text::Tokenizer::from_files(o.vocab, o.merges);
  MG_CHECK(tokenizer.vocab_size() <= 65536, "prepare: the vocabulary '{}' has {} ids; the llm.c token format stores "
           "uint16 (ids 0 .. 65535)", o.vocab, tokenizer.vocab_size());

  // ---- encode, in chunks at safe boundaries so progress can be shown ----
  std::vector<std::uint16_t> tokens;
  tokens.reserve(static_cast<std::size_t>(total / 3));
  nlohmann::json sources = nlohmann::json::array();
  std::vector<text::TokenId> ids;
  std::int64_t done = 0;
  if (o.progress) o.progress(0, total);
  for (const auto& input : inputs) {
    const std::string_view text = input->bytes();
    const std::size_t before = tokens.size();
    if (const auto eot = tokenizer.eot_id()) tokens.push_back(static_cast<std::uint16_t>(*eot));
    std::size_t from = 0;
    std::vector<std::size_t> points = text::split_points(text, std::size_t{1} << 20);
    points.push_back(text.size());
    for (std::size_t to : points) {
      ids.clear();
      tokenizer.encode(text.substr(from, to - from), ids);
      for (text::TokenId id : ids) tokens.push_back(static_cast<std::uint16_t>(id));
      done += static_cast<std::int64_t>(to - from);
      from = to;
      if (o.progress) o.progress(done, total);
    }
    sources.push_back({{"file", fs::absolute(input->path()).string()},
                       {"bytes", text.size()},
                       {"tokens", tokens.size() - before}});
  }
  const auto n = static_cast<std::int64_t>(tokens.size());
  const auto n_val = static_cast<std::int64_t>(std::floor(static_cast<double>(n) * o.val_fraction));
  const std::int64_t n_train = n - n_val;
  MG_CHECK(n_train >= 2, "prepare: the inputs give {} tokens, {} of them for training; training needs at least 2",
           n, n_train);

  // ---- write: temporaries in DIR, renamed into place, meta.json last ----
  fs::create_directories(o.out_dir, ec);
  MG_CHECK(!ec, "prepare: cannot create the output directory '{}': {}", o.out_dir, ec.message());
  StagedFiles staged{fs::path(o.out_dir)};
  const std::string train_hash = write_token_file(
      staged.stage("train.bin"), std::vector<std::uint16_t>(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(n_train)));
  const std::string val_hash = write_token_file(
      staged.stage("val.bin"), std::vector<std::uint16_t>(tokens.begin() + static_cast<std::ptrdiff_t>(n_train), tokens.end()));
  fs::copy_file(o.vocab, staged.stage("vocab.json"), fs::copy_options::overwrite_existing);
  fs::copy_file(o.merges, staged.stage("merges.txt"), fs::copy_options::overwrite_existing);
  nlohmann::json meta = {
      {"format", "llm.c token files: 256 x int32 header (magic 20240520, version 1, token count), then uint16 tokens"},
      {"producer", "meshgrad prepare"},
      {"vocab_size", tokenizer.vocab_size()},
      {"eot_token", tokenizer.eot_id() ? nlohmann::json(*tokenizer.eot_id()) : nlohmann::json(nullptr)},
      {"tokenizer",
       {{"vocab", {{"file", fs::absolute(o.vocab).string()}, {"copy", "vocab.json"}, {"sha256", io::sha256_file(o.vocab)}}},
        {"merges",
         {{"file", fs::absolute(o.merges).string()}, {"copy", "merges.txt"}, {"sha256", io::sha256_file(o.merges)}}}}},
      {"sources", sources},
      {"train_tokens", n_train},
      {"val_tokens", n_val},
      // The token files' content hashes (XXH3-128 of the whole file, `xxhsum -H2`): the data's identity.
      {"files", {{"train.bin", {{"tokens", n_train}, {"xxh128", train_hash}}}, {"val.bin", {{"tokens", n_val}, {"xxh128", val_hash}}}}},
      {"val_fraction", o.val_fraction},
  };
  {
    const std::string path = staged.stage("meta.json");
    std::ofstream out(path);
    out << meta.dump(2) << "\n";
    out.close();
    MG_CHECK(out.good(), "prepare: cannot write '{}'", path);
  }
  staged.commit();
  return {tokenizer.vocab_size(), n_train, n_val, total};
}

}  // namespace meshgrad::data
