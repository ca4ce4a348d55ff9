// Training data: byte-level tokens (vocabulary 256, token = byte value) of a text file, or of a
// built-in English corpus when no file is given.
//
// Batches are drawn deterministically from (seed, step): row b of step s starts at a window offset
// given by the counter-based generator random::uniform(seed, s * B + b), so every rank draws the
// same global batch without communicating, and a run resumes exactly by step number.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "meshgrad/nn/model.hpp"

namespace meshgrad::train {

// The built-in corpus: a few KB of plain English prose (written for meshgrad; public domain).
std::string_view builtin_corpus();

class ByteDataset {
 public:
  // Tokens of the file at path, or of builtin_corpus() when path is empty. Throws InvalidArgument
  // naming the file when it cannot be read, and naming it (or "the built-in corpus") with both
  // lengths when it has fewer than seq + 1 bytes (one window needs T inputs and T targets).
  ByteDataset(const std::string& path, int batch, int seq, std::uint64_t seed);

  // The global batch of a step: inputs and targets int64 [B, T], targets[b, t] = inputs[b, t + 1]
  // in the text (both windows of the same bytes, shifted by one). Identical on every rank.
  nn::Batch next_batch(std::int64_t step) const;

  std::int64_t size() const { return static_cast<std::int64_t>(tokens_.size()); }
  const std::string& source() const { return source_; }   // the path or "built-in corpus"
  int batch() const { return batch_; }
  int seq() const { return seq_; }

 private:
  std::vector<std::int64_t> tokens_;
  std::string source_;
  int batch_;
  int seq_;
  std::uint64_t seed_;
};

// Rows [offset, offset + size) of a global batch for dp rank `dp_rank` of `dp_size`, by the shard
// rule (B over dp: rank i gets B / dp rows, plus one if i < B % dp). The shards of all ranks,
// concatenated in rank order, are the batch. Packed copies, [rows, T].
nn::Batch dp_shard(const nn::Batch& batch, int dp_rank, int dp_size);

}  // namespace meshgrad::train
