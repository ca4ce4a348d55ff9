#include "meshgrad/data/shards.hpp"

#include <glob.h>

#include <algorithm>
#include <filesystem>
#include <map>

#include "meshgrad/io/xxh128.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad::data {

namespace fs = std::filesystem;

namespace {

constexpr int kShardDigits = 6;

// A name's stem split into the text before its trailing digits and the number they spell
// ("fineweb_train_000003.bin" -> {"fineweb_train_", 3}); nullopt without trailing digits.
std::optional<std::pair<std::string, std::int64_t>> trailing_number(const std::string& file_name) {
  const std::string stem = fs::path(file_name).stem().string();
  std::size_t digits = 0;
  while (digits < stem.size() && digits < 18 && std::isdigit(static_cast<unsigned char>(stem[stem.size() - 1 - digits]))) {
    ++digits;
  }
  if (digits == 0) return std::nullopt;
  return std::make_pair(stem.substr(0, stem.size() - digits), std::stoll(stem.substr(stem.size() - digits)));
}

}  // namespace

std::string shard_file_name(const std::string& split, std::int64_t index) {
  return fmt::format("{}_{:0{}}.bin", split, index, kShardDigits);
}

std::optional<std::int64_t> shard_index(const std::string& split, const std::string& file_name) {
  const std::size_t prefix = split.size() + 1;
  if (file_name.size() != prefix + kShardDigits + 4 || file_name.compare(0, split.size(), split) != 0 ||
      file_name[split.size()] != '_' || file_name.compare(prefix + kShardDigits, 4, ".bin") != 0) {
    return std::nullopt;
  }
  std::int64_t index = 0;
  for (std::size_t i = prefix; i < prefix + kShardDigits; ++i) {
    if (!std::isdigit(static_cast<unsigned char>(file_name[i]))) return std::nullopt;
    index = 10 * index + (file_name[i] - '0');
  }
  return index;
}

std::vector<std::string> list_shards(const std::string& dir, const std::string& split) {
  std::map<std::int64_t, std::string> found;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (const auto index = shard_index(split, name)) found[*index] = entry.path().string();
  }
  MG_CHECK(!ec, "data '{}': cannot list the directory: {}", dir, ec.message());
  std::vector<std::string> paths;
  for (const auto& [index, path] : found) {
    const auto expected = static_cast<std::int64_t>(paths.size());
    MG_CHECK(index == expected, "data '{}' has {}{} but no {}: a split's shards are numbered from {} without a gap "
             "(a shard is missing; prepare the directory again)", dir,
             expected > 0 ? shard_file_name(split, expected - 1) + " and " : std::string(), shard_file_name(split, index),
             shard_file_name(split, expected), shard_file_name(split, 0));
    paths.push_back(path);
  }
  return paths;
}

bool has_glob_characters(const std::string& path) { return path.find_first_of("*?[") != std::string::npos; }

std::vector<std::string> expand_glob(const std::string& pattern, const std::string& what) {
  glob_t matches{};
  const int rc = ::glob(pattern.c_str(), 0, nullptr, &matches);
  std::vector<std::string> paths;
  for (std::size_t i = 0; rc == 0 && i < matches.gl_pathc; ++i) paths.emplace_back(matches.gl_pathv[i]);
  ::globfree(&matches);
  MG_CHECK(rc != GLOB_NOSPACE, "{} '{}': out of memory expanding the pattern", what, pattern);
  MG_CHECK(!paths.empty(), "{} '{}': the pattern matches no file", what, pattern);
  std::sort(paths.begin(), paths.end());
  for (const std::string& path : paths) {
    std::error_code ec;
    MG_CHECK(fs::is_regular_file(path, ec), "{} '{}' matches '{}', which is not a regular file (a directory, FIFO or "
             "device; symlinks are followed)", what, pattern, path);
  }
  // Names that end in numbers with one prefix are shards: a number skipped is a missing file.
  std::vector<std::pair<std::string, std::int64_t>> numbers;
  for (const std::string& path : paths) {
    const auto number = trailing_number(fs::path(path).filename().string());
    if (!number || (!numbers.empty() && number->first != numbers.front().first)) return paths;
    numbers.push_back(*number);
  }
  for (std::size_t i = 1; i < numbers.size(); ++i) {
    MG_CHECK(numbers[i].second == numbers[i - 1].second + 1, "{} '{}': {} is followed by {}: the matched shards' "
             "numbers must be consecutive in name order (a shard is missing, or the numbers are not zero-padded)",
             what, pattern, fs::path(paths[i - 1]).filename().string(), fs::path(paths[i]).filename().string());
  }
  return paths;
}

std::string hash_of_hashes(const std::vector<std::string>& hashes) {
  io::Xxh128 hash;
  for (const std::string& h : hashes) hash.update(h.data(), h.size());
  return hash.hex();
}

}  // namespace meshgrad::data
