// Sharded token data: the names `meshgrad prepare --shard-tokens` gives its files, and the lists of
// shards a dataset reads (the shards of a prepared directory, or the files a glob matches).
//
// A split's shards are SPLIT_NNNNNN.bin (six digits, from 000000, consecutive): train_000000.bin,
// train_000001.bin, ... and val_000000.bin, ... Read in name order they are one token stream.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace meshgrad::data {

// "train_000003.bin" for ("train", 3).
std::string shard_file_name(const std::string& split, std::int64_t index);

// The index of a shard file name of split ("train_000003.bin" -> 3), nullopt for any other name
// (other splits, other digit counts, other extensions).
std::optional<std::int64_t> shard_index(const std::string& split, const std::string& file_name);

// The paths of dir's shards of split, in index order; empty when it has none. Throws
// InvalidArgument naming dir and the missing name when the numbers do not run 000000, 000001, ...
// without a gap ("data 'd' has train_000000.bin and train_000002.bin but no train_000001.bin").
std::vector<std::string> list_shards(const std::string& dir, const std::string& split);

// Whether path has a glob(3) metacharacter (*, ? or [).
bool has_glob_characters(const std::string& path);

// The regular files matching pattern (glob(3), no brace or tilde expansion), sorted by name (byte
// order, whatever the locale). Throws InvalidArgument naming `what` and the pattern when nothing
// matches, or when a match is not a regular file; and when the matches' names end in numbers that
// are not consecutive in that order (a missing shard: "fineweb_train_000001.bin is followed by
// fineweb_train_000003.bin"). Names without a trailing number are not checked.
std::vector<std::string> expand_glob(const std::string& pattern, const std::string& what);

// The identity of a list of files: XXH3-128 of their XXH3-128 hex digests, concatenated in order
// (a shard replaced, added, removed or reordered changes it).
std::string hash_of_hashes(const std::vector<std::string>& hashes);

}  // namespace meshgrad::data
