// Training data: token files opened once per process and shared by the rank threads, and
// deterministic batches drawn from them.
//
// What `--data PATH` may be (TokenDataset):
//   ""                the built-in English corpus, bytes as tokens (vocabulary 256)
//   a directory       written by `meshgrad prepare`: train.bin, val.bin (the validation split) and
//                     meta.json (vocab_size); tokens must be < vocab_size
//   a token file      llm.c format (name ending in .bin, or any file starting with the magic): a header
//                     of 256 int32 (magic 20240520, version 1, token count), then count uint16 tokens;
//                     vocabulary: meta.json's vocab_size when a meta.json sits beside it, else the
//                     largest token + 1
//   any other file    its bytes are the tokens (vocabulary 256)
// Anything else (a pipe, FIFO, device, socket, a directory without train.bin) is refused with a
// message naming the path and what it is: reading them could block or never end (/dev/zero).
//
// Sharing: TokenFile::open opens a file once per process (keyed by device, inode, size and mtime) and
// hands every caller the same reader, so P rank threads read and hash it once. The tokens stay in the
// file (the page cache holds them once per machine); a batch reads its windows with pread, so a
// file truncated under a run is an error naming it, not SIGBUS. Outputs of a run (metrics,
// checkpoints) must never be one of input_files().
//
// Identity: every file's XXH3-128 is taken when it is opened (DataIdentity). The ranks of a run
// agree on it at start-up (agree_on_data: two hosts whose --data holds different bytes are refused),
// a checkpoint records it and a resume compares it, and `meshgrad prepare` writes it into meta.json,
// which the dataset checks (a train.bin replaced after prepare is refused).
//
// Batches are drawn deterministically from (seed, step): row b of step s starts at a window offset
// given by the counter-based generator random::uniform(seed, s * B + b), so every rank draws the
// same global batch without communicating, and a run resumes exactly by step number.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "meshgrad/comm/communicator.hpp"
#include "meshgrad/io/file_io.hpp"
#include "meshgrad/nn/model.hpp"

namespace meshgrad::data {

// The built-in corpus: a few KB of plain English prose (written for meshgrad; public domain).
std::string_view builtin_corpus();

// llm.c token file format (version 1: GPT-2 uint16 tokens).
inline constexpr std::int32_t kTokenFileMagic = 20240520;
inline constexpr std::int32_t kTokenFileVersion = 1;
inline constexpr std::int64_t kTokenFileHeaderBytes = 256 * 4;

// Throws InvalidArgument unless path names a regular file (symlinks followed): "data '/dev/zero' is
// a character device, not a regular file ..." with `what` in place of "data".
void require_regular_file(const std::string& path, const std::string& what);

// A whole file mapped read-only (an empty file has an empty view and no mapping).
class MappedFile {
 public:
  // Throws InvalidArgument naming `what` and the path when it is not a regular file or cannot be
  // opened or mapped.
  MappedFile(const std::string& path, const std::string& what);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  std::string_view bytes() const { return {static_cast<const char*>(data_), size_}; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  void* data_ = nullptr;
  std::size_t size_ = 0;
};

// The tokens of one file, opened once per process and read with pread (not mapped: a mapped file
// that shrinks under a run kills it with SIGBUS; a short read is an error naming the file).
class TokenFile {
 public:
  enum class Format { Bytes, LlmC };
  // The process's open file for path (created on first use; shared while anyone holds it). Opening
  // reads the whole file once: its content hash and, for LlmC, the largest token. Format::LlmC
  // validates the header: the error names the file and the byte offset of the bad field (magic at 0,
  // version at 4, token count at 8 against the file size).
  static std::shared_ptr<const TokenFile> open(const std::string& path, Format format);

  const std::string& path() const { return path_; }
  Format format() const { return format_; }
  std::int64_t size() const { return size_; }           // tokens
  // Tokens [start, start + count) into out (0 <= start, start + count <= size()). Thread-safe. Throws
  // InvalidArgument naming the file when it has shrunk since it was opened: a data file must not
  // change while a run reads it.
  void read(std::int64_t start, std::int64_t count, std::int64_t* out) const;
  // LlmC: the largest token (one scan at open); Bytes: 255. -1 when empty.
  std::int64_t max_token() const { return max_token_; }
  // XXH3-128 of the whole file as opened (header included: what `xxhsum -H2 FILE` prints).
  const std::string& content_hash() const { return content_hash_; }
  // Position of the first token >= limit, if any (a scan; for error messages).
  std::optional<std::int64_t> first_token_at_least(std::int64_t limit) const;
  // Byte offset in the file of token i (for messages).
  std::int64_t byte_offset(std::int64_t i) const;

  TokenFile(const std::string& path, Format format);   // use open()
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

 private:
  // Bytes [offset, offset + n) of the file; a short read is the "file shrank" error.
  void read_file_bytes(std::int64_t offset, std::int64_t n, void* out) const;

  std::string path_;
  io::UniqueFd fd_;
  Format format_;
  std::int64_t size_ = 0;
  std::int64_t max_token_ = -1;
  std::string content_hash_;
};

// Writes tokens (each < 65536) in the llm.c format to path (no temp file; callers rename). Returns
// the XXH3-128 of the file written (TokenFile::content_hash of it).
std::string write_token_file(const std::string& path, const std::vector<std::uint16_t>& tokens);

// What data a run trains on, by content: the XXH3-128 of the training and validation files (of the
// built-in corpus's bytes; "" for no validation split) and their token counts.
struct DataIdentity {
  std::string train_hash, val_hash;
  std::int64_t train_tokens = 0, val_tokens = 0;
  bool operator==(const DataIdentity&) const = default;
  // {"train_xxh128", "val_xxh128", "train_tokens", "val_tokens"} (how checkpoints record it).
  nlohmann::json to_json() const;
  // The fields of to_json(); a missing or mistyped hash reads as "" (checkpoints older than it).
  static DataIdentity from_json(const nlohmann::json& j);
  // "14648 training tokens (XXH3-128 0123...), 1600 validation tokens (XXH3-128 4567...)".
  std::string str() const;
};

class TokenDataset {
 public:
  // The data of path as described at the top of this file, for global batches of `batch` rows of
  // `seq` tokens. Throws InvalidArgument naming the path: unreadable or not a regular file / prepared
  // directory, a bad token-file header, a token >= the vocabulary (naming its position and byte
  // offset), fewer than seq + 1 training tokens (one window needs T inputs and T shifted targets).
  TokenDataset(const std::string& path, int batch, int seq, std::uint64_t seed);

  // The global batch of a step from the training tokens: inputs and targets int64 [B, T],
  // targets[b, t] = inputs[b, t + 1] in the data (windows of T + 1 tokens). Identical on every rank.
  nn::Batch next_batch(std::int64_t step) const;

  // The validation split (a prepared directory's val.bin). has_validation(): it holds at least one
  // window of seq + 1 tokens. Its windows are the non-overlapping ones starting at 0, T, 2T, ...
  // (W = (size - 1) / T of them); row b of validation batch k is window (k * B + b) mod W, so batches
  // 0 .. validation_batches() - 1 cover every window once and are the same at every evaluation, on
  // every rank. validation_batch throws (naming the sizes) when there is no validation split.
  bool has_validation() const;
  std::int64_t validation_batches() const;   // ceil(W / B); 0 without validation
  nn::Batch validation_batch(std::int64_t index) const;

  std::int64_t vocab() const { return vocab_; }            // meta.json's vocab_size, the token range, or 256
  std::int64_t size() const { return train_.size(); }      // training tokens
  std::int64_t validation_size() const { return val_.size(); }
  const std::string& source() const { return source_; }    // "'PATH'" or "the built-in corpus"
  const std::string& description() const { return description_; }   // e.g. "prepared directory, GPT-2 BPE"
  int batch() const { return batch_; }
  int seq() const { return seq_; }
  // The mapped files (null for the built-in corpus / no validation): for tests of sharing.
  const std::shared_ptr<const TokenFile>& train_file() const { return train_.file; }
  // Throws InvalidArgument naming the file, the position and the byte offset of the first token
  // >= limit (train, then validation); `what` names the limit in the message ("the model's vocabulary 256").
  void require_tokens_below(std::int64_t limit, const std::string& what) const;
  // Every file this dataset reads (train.bin, val.bin, meta.json of a directory; the file itself
  // otherwise): what an output path must not be.
  std::vector<std::string> input_files() const;
  const DataIdentity& identity() const { return identity_; }

 private:
  // A run of tokens: a mapped file, or the built-in corpus.
  struct Tokens {
    std::shared_ptr<const TokenFile> file;
    std::string_view bytes;   // the built-in corpus when file is null
    std::int64_t size() const { return file ? file->size() : static_cast<std::int64_t>(bytes.size()); }
    void read(std::int64_t start, std::int64_t count, std::int64_t* out) const;
  };
  nn::Batch windows(const Tokens& tokens, const std::vector<std::int64_t>& starts) const;

  Tokens train_, val_;
  std::string meta_;   // the meta.json read, if any
  DataIdentity identity_;
  std::int64_t vocab_ = 256;
  std::string source_, description_;
  int batch_;
  int seq_;
  std::uint64_t seed_;
};

// Collective over comm: every rank passes its dataset's identity; throws InvalidArgument on every rank
// when they differ, naming the first rank that differs from rank 0 and both identities (same --data
// path, different bytes: another host's copy of the file).
void agree_on_data(comm::Communicator& comm, const DataIdentity& mine, const std::string& source);

// Rows [offset, offset + size) of a global batch for dp rank `dp_rank` of `dp_size`, by the shard
// rule (B over dp: rank i gets B / dp rows, plus one if i < B % dp). The shards of all ranks,
// concatenated in rank order, are the batch. Packed copies, [rows, T].
nn::Batch dp_shard(const nn::Batch& batch, int dp_rank, int dp_size);

}  // namespace meshgrad::data
