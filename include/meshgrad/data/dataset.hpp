// Training data: token files opened once per process and shared by the rank threads, and
// deterministic batches drawn from them.
//
// What `--data PATH` may be (TokenDataset):
//   ""                the built-in English corpus, bytes as tokens (vocabulary 256)
//   a directory       written by `meshgrad prepare`: train.bin, val.bin (the validation split) and
//                     meta.json (vocab_size); tokens must be < vocab_size. Or, written by `prepare
//                     --shard-tokens`: train_000000.bin, train_000001.bin, ... and val_000000.bin, ...
//                     (data/shards.hpp; numbered from 000000 without a gap, the lists meta.json records
//                     if it records them), read as sharded data (below). Both train.bin and
//                     train_*.bin in one directory is refused (which would it be?).
//   a glob            a path with *, ? or [ that names no existing file, e.g. 'DIR/train_*.bin': the
//                     matching files (glob(3)) in name order, read as sharded data; all must be llm.c
//                     token files or all text; names ending in numbers must be numbered consecutively.
//                     No validation split of its own (see val_path). A meta.json beside the matches
//                     (all in one directory) gives the vocabulary and the hashes to check.
//   a token file      llm.c format (name ending in .bin, or any file starting with the magic): a header
//                     of 256 int32 (magic 20240520, version, token count), then count tokens, uint16
//                     (version 1) or uint32 (version 2);
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
// Batches of a single file (or the built-in corpus) are drawn deterministically from (seed, step):
// row b of step s starts at a window offset given by the counter-based generator
// random::uniform(seed, s * B + b), so every rank draws the same global batch without communicating,
// and a run resumes exactly by step number.
//
// Sharded data (a sharded directory or a glob; sequential()) is read IN ORDER, like llm.c's
// DataLoader, as one stream of the shards in name order. Each shard is cut into the windows of T + 1
// tokens starting at its offsets 0, T, 2T, ... (consecutive windows share one token: the last target
// of one is the first input of the next); a window never crosses a shard boundary: the < T + 1
// tokens left at a shard's end are skipped and reading goes on at the next shard's start. A shard
// shorter than T + 1 tokens is allowed (the last shard of a split usually is short) and gives no
// window; the shards together must give at least one. The windows of all shards, in order, are
// numbered 0 .. W - 1. The data position p counts the tokens consumed, T per window: row b of the
// batch at position p is window (p / T + b) mod W, so a step consumes B * T tokens and the next
// step's position is p + B * T (next_position); past window W - 1 the stream wraps to window 0 (the
// next epoch, epoch = (p / T) div W). next_batch(step) is batch_at_position(step * B * T).
//
// Identity of sharded data: the hash of the shards' XXH3-128 digests in order (hash_of_hashes), for
// the training and the validation split each.
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

// llm.c token file format: version 1 holds uint16 tokens (GPT-2), version 2 uint32 tokens (llm.c's
// Llama 3 files; what prepare writes for a vocabulary over 65,536 ids). Both little-endian.
inline constexpr std::int32_t kTokenFileMagic = 20240520;
inline constexpr std::int32_t kTokenFileVersion = 1;
inline constexpr std::int32_t kTokenFileVersionU32 = 2;
// The bytes of one token in a file of that version (2 or 4); 0 for another version.
inline constexpr std::int64_t token_file_token_bytes(std::int32_t version) {
  return version == kTokenFileVersion ? 2 : version == kTokenFileVersionU32 ? 4 : 0;
}
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
  // LlmC: bytes per token, 2 (version 1) or 4 (version 2); Bytes: 1.
  std::int64_t token_bytes() const { return token_bytes_; }
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
  std::int64_t token_bytes_ = 1;
  std::int64_t size_ = 0;
  std::int64_t max_token_ = -1;
  std::string content_hash_;
};

// Writes tokens (each < 65536) in the llm.c format to path (no temp file; callers rename). Returns
// the XXH3-128 of the file written (TokenFile::content_hash of it).
std::string write_token_file(const std::string& path, const std::vector<std::uint16_t>& tokens);
// The same with uint32 tokens (version 2).
std::string write_token_file(const std::string& path, const std::vector<std::uint32_t>& tokens);

// What data a run trains on, by content: the XXH3-128 of the training and validation files (of the
// built-in corpus's bytes; of the shards' digests for sharded data; "" for no validation split) and
// their token counts.
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
  // offset), fewer than seq + 1 training tokens (one window needs T inputs and T shifted targets;
  // sharded: no shard with seq + 1 tokens), a glob matching nothing, a gap in shard numbers.
  //
  // val_path (optional, "" for none): the validation split is its tokens instead of the data's own
  // (which is then not read). A directory gives its validation split (val.bin, or val_*.bin shards);
  // a file or a glob gives its tokens (so 'OTHER/train.bin' validates on another set's training
  // split). The vocabularies must agree: both known (a meta.json, or 256 for bytes) and different is
  // refused naming both; a side without meta.json (an llm.c file alone, vocabulary inferred as its
  // largest token + 1) takes the other side's vocabulary and must have its tokens below it.
  TokenDataset(const std::string& path, int batch, int seq, std::uint64_t seed, const std::string& val_path = "");

  // The global batch of a step from the training tokens: inputs and targets int64 [B, T],
  // targets[b, t] = inputs[b, t + 1] in the data (windows of T + 1 tokens). Identical on every rank.
  // Random windows from (seed, step); for sharded data batch_at_position(step * B * T).
  nn::Batch next_batch(std::int64_t step) const;

  // Whether the training data is read in order by data position (sharded data; see the top of
  // this file). A trainer with sequential data should keep the position (next_position) in its
  // checkpoints rather than derive it from the step, so a change of batch size on resume goes on
  // where the data stopped.
  bool sequential() const { return sequential_; }
  // The batch at data position p >= 0 (in order; for any data, sharded or not: a single file is
  // one shard). p need not be a multiple of T: the first row is window floor(p / T).
  nn::Batch batch_at_position(std::int64_t position) const;
  // The position after the batch at `position`: position + B * T.
  std::int64_t next_position(std::int64_t position) const;
  // Where position p reads, for checkpoints and logs: {"tokens": p, "epoch": e, "shard":
  // "train_000003.bin" (the file name), "offset": o (the token offset in that shard of the batch's
  // first window)}.
  nlohmann::json position_json(std::int64_t position) const;

  // The validation split (a prepared directory's val.bin or val_*.bin, or val_path's tokens).
  // has_validation(): it has at least one window of seq + 1 tokens. Its windows are the
  // non-overlapping ones starting at 0, T, 2T, ... in each file (W = sum of (size - 1) / T over the
  // files, as for sharded training data); row b of validation batch k is window (k * B + b) mod W, so batches
  // 0 .. validation_batches() - 1 cover every window once and are the same at every evaluation, on
  // every rank. validation_batch throws (naming the sizes) when there is no validation split.
  bool has_validation() const;
  std::int64_t validation_batches() const;   // ceil(W / B); 0 without validation
  nn::Batch validation_batch(std::int64_t index) const;

  std::int64_t vocab() const { return vocab_; }            // meta.json's vocab_size, the token range, or 256
  std::int64_t size() const { return train_.size(); }      // training tokens (all shards)
  std::int64_t validation_size() const { return val_.size(); }
  const std::string& source() const { return source_; }    // "'PATH'" or "the built-in corpus"
  const std::string& description() const { return description_; }   // e.g. "prepared directory, GPT-2 BPE"
  int batch() const { return batch_; }
  int seq() const { return seq_; }
  // The first training file (null for the built-in corpus): for tests of sharing.
  std::shared_ptr<const TokenFile> train_file() const { return train_.files.empty() ? nullptr : train_.files.front(); }
  // Throws InvalidArgument naming the file, the position and the byte offset of the first token
  // >= limit (train, then validation); `what` names the limit in the message ("the model's vocabulary 256").
  void require_tokens_below(std::int64_t limit, const std::string& what) const;
  // Every file this dataset reads (train.bin, val.bin or every shard, meta.json of a directory and of
  // val_path's; the file itself otherwise): what an output path must not be.
  std::vector<std::string> input_files() const;
  const DataIdentity& identity() const { return identity_; }

 private:
  // A run of tokens: files read one after another (one file, or shards in order), or the built-in
  // corpus; and its windows of T + 1 tokens at offsets 0, T, 2T, ... of each piece.
  struct Tokens {
    std::vector<std::shared_ptr<const TokenFile>> files;
    std::string_view bytes;   // the built-in corpus when files is empty
    bool sharded = false;     // identity: hash_of_hashes even for one file
    std::vector<std::int64_t> first_window;   // per piece, then the total W (set by index_windows)
    std::size_t pieces() const { return files.empty() ? 1 : files.size(); }
    std::int64_t piece_size(std::size_t i) const;
    std::int64_t size() const;
    void read(std::size_t piece, std::int64_t start, std::int64_t count, std::int64_t* out) const;
    void index_windows(std::int64_t seq);
    std::int64_t windows() const { return first_window.empty() ? 0 : first_window.back(); }
    std::pair<std::size_t, std::int64_t> window(std::int64_t k, std::int64_t seq) const;   // (piece, offset)
    std::string hash() const;
  };
  // Rows at (piece, offset) pairs.
  nn::Batch windows(const Tokens& tokens, const std::vector<std::pair<std::size_t, std::int64_t>>& starts) const;
  // The constructor's val_path; data_vocab_how says where vocab_ came from (for messages).
  void use_validation_data(const std::string& val_path, const std::string& data_vocab_how);
  // Throws naming the file, position and byte offset of the first token of `tokens` >= limit.
  void check_tokens_below(const Tokens& tokens, std::int64_t limit, const std::string& what) const;

  Tokens train_, val_;
  std::vector<std::string> metas_;   // the meta.json files read
  DataIdentity identity_;
  std::int64_t vocab_ = 256;
  bool vocab_known_ = true;   // false: inferred from an llm.c file's largest token
  bool sequential_ = false;
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
