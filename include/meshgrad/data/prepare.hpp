// `meshgrad prepare`: text files -> a data directory for `meshgrad train --data DIR`.
//
// The inputs are read in chunks of about chunk_bytes (1 MiB), each cut where the tokenizer's
// pre-tokenizer splits anyway (data/text_chunks.hpp, text::Tokenizer::cut_rules), and encoded one
// chunk at a time: the tokens are those of encoding each input whole (except next to a forced cut:
// max(2 x chunk_bytes, 64 KiB) of text without a safe cut, which is cut inside a pre-token), memory
// is a few chunks whatever the inputs' size, and the tokens go to disk as they come.
//
// Each input file is one document. GPT-2 files (vocab + merges): <|endoftext|> before each, when the
// vocabulary has it (as in GPT-2's training data). A tokenizer.json: its BOS before each document
// when it adds one (tokenizer_config.json's add_bos_token, else its post_processor's template:
// Llama 3's <|begin_of_text|>), and its EOS after each when it has one (eos_token: Llama 3's
// <|end_of_text|>, Qwen2's <|endoftext|> or <|im_end|>), as a document is framed when the model reads
// it; the ids are in meta.json ("tokenizer" > "bos", "eos").
//
// Token width: vocabularies up to 65,536 ids are written as uint16 (llm.c version 1, as before); larger
// ones (Llama 3's 128,256, Qwen2's 151,936) as uint32 (version 2, llm.c's Llama 3 files). The header
// says which; meta.json's "token_bytes" too.
//
// Without shard_tokens (the layout checkpoints and older runs know):
//   DIR/train.bin, DIR/val.bin   llm.c token files (data/dataset.hpp), split by tokens: val.bin is
//                                the last floor(n * val_fraction) of the n tokens of the inputs in the
//                                order given (so it may be a different kind of text than training)
// With shard_tokens = N:
//   DIR/train_000000.bin, ...    llm.c token files of N tokens each (the last of a split may be
//   DIR/val_000000.bin, ...      shorter; none for a split without tokens). The split is interleaved,
//                                so validation is the same kind of text as training: the chunks are
//                                numbered 0, 1, 2, ... over all inputs, and chunk i goes to val when
//                                chunk_goes_to_validation(i, val_fraction) (for 0.1: chunks 4, 14, 24,
//                                ...; ~10% spread over the whole corpus, none when it has fewer than
//                                5 chunks: give a smaller chunk_bytes for a small corpus). Each
//                                split's tokens are its chunks' tokens in input order.
// Both:
//   DIR/vocab.json, merges.txt   copies of the tokenizer files, so DIR alone can decode its tokens
//   or DIR/tokenizer.json [+ tokenizer_config.json]   (text::load_tokenizer(DIR) reads them)
//   DIR/meta.json                {"vocab_size", "eot_token", "token_bytes", "tokenizer": {"kind", "vocab"/
//                                "merges" or "tokenizer_json"/"tokenizer_config": {"file", "copy", "sha256"},
//                                "bos", "eos"}, "sources": [{"file", "bytes", "tokens"}], "train_tokens",
//                                "val_tokens", "val_fraction", "files": {NAME: {"tokens", "xxh128"}},
//                                "format", "producer"}; sharded also "shard_tokens", "chunk_bytes",
//                                "chunks", "val_chunks" and "shards": {"train": [NAME...], "val": [...]}
// Every file is written to a temporary name in DIR and renamed into place, meta.json last, so a reader
// never sees a half-written file and a DIR with meta.json is complete.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "meshgrad/text/tokenizer.hpp"

namespace meshgrad::data {

struct PrepareOptions {
  std::string vocab;                 // vocab.json / encoder.json
  std::string merges;                // merges.txt / vocab.bpe
  // Or (not both): a Hugging Face tokenizer.json, or a directory holding one (text::load_tokenizer;
  // tokenizer_config.json beside it gives BOS / EOS).
  std::string tokenizer;
  std::string out_dir;               // created when missing
  // A dataset prepare writes (train.bin, val.bin, train_NNNNNN.bin, val_NNNNNN.bin, meta.json,
  // vocab.json, merges.txt) already in out_dir is refused unless overwrite: a run may be reading it,
  // and its tokens are the identity checkpoints record. With overwrite, prepare's own files are
  // replaced, and those of them it did not write this time (train.bin after a sharded prepare, a
  // shard past the new last one) are removed once the new dataset is in place; other files are kept.
  bool overwrite = false;
  double val_fraction = 0.1;         // in [0, 1)
  // Tokens per shard file (0: train.bin / val.bin). See the top of this file.
  std::int64_t shard_tokens = 0;
  // Bytes of text per chunk (cut at the next safe place at or after it); with shards, the unit of
  // the validation split. >= 1.
  std::int64_t chunk_bytes = std::int64_t{1} << 20;
  std::vector<std::string> inputs;   // text files (regular files)
  // Called as bytes are encoded (done, total); e.g. a progress bar. May be empty.
  std::function<void(std::int64_t done, std::int64_t total)> progress;
};

struct PrepareResult {
  std::int64_t vocab_size = 0;
  std::int64_t train_tokens = 0;
  std::int64_t val_tokens = 0;
  std::int64_t bytes = 0;            // of all inputs
  std::int64_t train_shards = 0;     // files written per split (0 without shard_tokens)
  std::int64_t val_shards = 0;
  // Chunks cut inside a pre-token (a window of max(2 x chunk_bytes, 64 KiB) without a safe cut,
  // data/text_chunks.hpp): the
  // tokens next to each such cut may differ from encoding the input whole. meta.json's "sources"
  // record them per input ("forced_cuts", only where there were any).
  std::int64_t forced_cuts = 0;
  // What a user should know that is not an error: an input named twice (encoded twice).
  std::vector<std::string> notes;
};

// With shards: whether chunk `chunk` (0, 1, ... over all inputs) goes to the validation split:
// floor((chunk + 1) * f + 1/2) > floor(chunk * f + 1/2), so chunks i with i * f ~ k + 1/2 (k = 0, 1,
// ...) do: a fraction f of the chunks, evenly spread, the first near chunk 1 / (2 f).
bool chunk_goes_to_validation(std::int64_t chunk, double val_fraction);

// The tokenizer of a directory `meshgrad prepare` wrote, for other code (sample, export): the copies
// its meta.json's "tokenizer" records (vocab.json + merges.txt, or tokenizer.json [+
// tokenizer_config.json]), each checked against its recorded SHA-256, loaded as one text::Tokenizer.
// files: the copies, in that order (what an export copies beside its weights). Throws
// InvalidArgument naming the file: no meta.json or no "tokenizer" in it, a copy missing, a copy whose
// SHA-256 is not the recorded one (replaced after prepare), a bad tokenizer file.
struct PreparedTokenizer {
  text::Tokenizer tokenizer;
  std::vector<std::string> files;
};
PreparedTokenizer load_prepared_tokenizer(const std::string& dir);

// Throws InvalidArgument before writing anything when: no inputs, shard_tokens < 0 or > 2^31 - 1 (the
// llm.c header's count), chunk_bytes < 1, an input is missing, unreadable or
// not a regular file (naming it and what it is), all inputs are empty, val_fraction is outside
// [0, 1), neither or both of tokenizer and vocab + merges, vocab + merges of more than 65,536 ids
// (their files stay uint16: a larger vocabulary is prepared from its tokenizer.json), the tokenizer files are bad or of a kind
// not implemented (naming file and line/offset, or the key and value), out_dir exists and is not a
// directory, or out_dir holds a file prepare writes (naming them) and not overwrite.
// After encoding: fewer than 2 training tokens.
// meta.json records each token file's XXH3-128 ("files"), which TokenDataset checks.
PrepareResult prepare_dataset(const PrepareOptions& options);

}  // namespace meshgrad::data
