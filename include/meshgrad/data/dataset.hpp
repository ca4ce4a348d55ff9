// Training data: token files mapped into memory once per process and shared by the rank threads, and
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
// message naming the path and what it is: those cannot be mapped, and reading them could block or
// never end (/dev/zero).
//
// Sharing: TokenFile::open maps a file once per process (keyed by device, inode, size and mtime) and
// hands every caller the same read-only mapping, so P rank threads cost one mapping of the file, not
// P copies. Text is used in place (one byte per token), never converted to int64. A mapped file must
// not be truncated while it is in use (reading a page past the new end raises SIGBUS): outputs of a
// run (metrics, checkpoints) must never be one of input_files().
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

// The tokens of one file, mapped once per process.
class TokenFile {
 public:
  enum class Format { Bytes, LlmC };
  // The process's mapping of path (created on first use; shared while anyone holds it). Format::LlmC
  // validates the header: the error names the file and the byte offset of the bad field (magic at 0,
  // version at 4, token count at 8 against the file size).
  static std::shared_ptr<const TokenFile> open(const std::string& path, Format format);

  const std::string& path() const { return file_.path(); }
  Format format() const { return format_; }
  std::int64_t size() const { return size_; }           // tokens
  std::int64_t token(std::int64_t i) const {            // 0 <= i < size()
    if (format_ == Format::Bytes) return static_cast<unsigned char>(tokens_[i]);
    std::uint16_t t;
    std::memcpy(&t, tokens_ + 2 * i, 2);   // little-endian, as llm.c writes it (x86, arm64)
    return t;
  }
  // LlmC: the largest token (one scan at open); Bytes: 255. -1 when empty.
  std::int64_t max_token() const { return max_token_; }
  // Position of the first token >= limit, if any (a scan; for error messages).
  std::optional<std::int64_t> first_token_at_least(std::int64_t limit) const;
  // Byte offset in the file of token i (for messages).
  std::int64_t byte_offset(std::int64_t i) const;

  TokenFile(const std::string& path, Format format);   // use open()

 private:
  MappedFile file_;
  Format format_;
  const char* tokens_ = nullptr;
  std::int64_t size_ = 0;
  std::int64_t max_token_ = -1;
};

// Writes tokens (each < 65536) in the llm.c format to path (no temp file; callers rename).
void write_token_file(const std::string& path, const std::vector<std::uint16_t>& tokens);

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

 private:
  // A run of tokens: a mapped file, or the built-in corpus.
  struct Tokens {
    std::shared_ptr<const TokenFile> file;
    std::string_view bytes;   // the built-in corpus when file is null
    std::int64_t size() const { return file ? file->size() : static_cast<std::int64_t>(bytes.size()); }
    std::int64_t at(std::int64_t i) const { return file ? file->token(i) : static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)]); }
  };
  nn::Batch windows(const Tokens& tokens, const std::vector<std::int64_t>& starts) const;

  Tokens train_, val_;
  std::string meta_;   // the meta.json read, if any
  std::int64_t vocab_ = 256;
  std::string source_, description_;
  int batch_;
  int seq_;
  std::uint64_t seed_;
};

// Rows [offset, offset + size) of a global batch for dp rank `dp_rank` of `dp_size`, by the shard
// rule (B over dp: rank i gets B / dp rows, plus one if i < B % dp). The shards of all ranks,
// concatenated in rank order, are the batch. Packed copies, [rows, T].
nn::Batch dp_shard(const nn::Batch& batch, int dp_rank, int dp_size);

}  // namespace meshgrad::data
