// `meshgrad prepare`: text files -> a data directory for `meshgrad train --data DIR`.
//
//   DIR/train.bin, DIR/val.bin   llm.c token files (data/dataset.hpp): the tokens of the inputs, in the
//                                order given, each input preceded by <|endoftext|> when the vocabulary
//                                has it (documents are separated as in GPT-2's training data); split
//                                by tokens: val.bin is the last floor(n * val_fraction) tokens
//   DIR/vocab.json, merges.txt   copies of the tokenizer files, so DIR alone can decode its tokens
//   DIR/meta.json                {"vocab_size", "eot_token", "tokenizer": {"vocab"/"merges": {"file",
//                                "sha256"}}, "sources": [{"file", "bytes", "tokens"}], "train_tokens",
//                                "val_tokens", "val_fraction", "format", "producer"}
// Every file is written to a temporary name in DIR and renamed into place, meta.json last, so a reader
// never sees a half-written file and a DIR with meta.json is complete.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace meshgrad::data {

struct PrepareOptions {
  std::string vocab;                 // vocab.json / encoder.json
  std::string merges;                // merges.txt / vocab.bpe
  std::string out_dir;               // created when missing
  // A dataset prepare writes (train.bin, val.bin, meta.json, vocab.json, merges.txt) already in
  // out_dir is refused unless overwrite: a run may be reading it, and its tokens are the identity
  // checkpoints record. With overwrite, prepare's own files are replaced (other files are kept).
  bool overwrite = false;
  double val_fraction = 0.1;         // in [0, 1)
  std::vector<std::string> inputs;   // text files (regular files)
  // Called as bytes are encoded (done, total); e.g. a progress bar. May be empty.
  std::function<void(std::int64_t done, std::int64_t total)> progress;
};

struct PrepareResult {
  std::int64_t vocab_size = 0;
  std::int64_t train_tokens = 0;
  std::int64_t val_tokens = 0;
  std::int64_t bytes = 0;            // of all inputs
};

// Throws InvalidArgument before writing anything when: no inputs, an input is missing, unreadable or
// not a regular file (naming it and what it is), all inputs are empty, val_fraction is outside
// [0, 1), the vocabulary has more than 65536 ids (tokens are uint16), the tokenizer files are bad
// (naming file and line/offset), out_dir exists and is not a directory, or out_dir holds a file
// prepare writes (naming them) and not overwrite. After encoding: fewer than 2 training tokens.
// meta.json records each token file's XXH3-128 ("files"), which TokenDataset checks.
PrepareResult prepare_dataset(const PrepareOptions& options);

}  // namespace meshgrad::data
