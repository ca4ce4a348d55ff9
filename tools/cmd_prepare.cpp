// `meshgrad prepare`: tokenizes text files with GPT-2's BPE or a Hugging Face tokenizer.json into a
// data directory for
// `meshgrad train --data DIR` (llm.c token files train.bin / val.bin, or train_NNNNNN.bin /
// val_NNNNNN.bin shards with --shard-tokens; meta.json; data/prepare.hpp). Streams: memory is the
// tokenizer's and a few chunks of at most max(2 x --chunk-bytes, 64 KiB), whatever the inputs' size.
//   meshgrad prepare --vocab vocab.json --merges merges.txt --out data/ book1.txt book2.txt
//   meshgrad prepare --vocab encoder.json --merges vocab.bpe --out data/ --val-fraction 0.05 *.txt
//   meshgrad prepare --vocab encoder.json --merges vocab.bpe --out web/ --shard-tokens 100000000 web-*.txt
//   meshgrad prepare --tokenizer Llama-3-8B/ --out data/ book.txt      (tokenizer.json + tokenizer_config.json)
#include <fmt/core.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <memory>

#include "command.hpp"
#include "meshgrad/data/prepare.hpp"
#include "options.hpp"

namespace meshgrad::tools::cmd_prepare {
namespace {

struct PrepareArgs {
  data::PrepareOptions options;
  bool quiet = false;
};

// A bar on stderr: redrawn in place on a terminal (at most ~10 times a second), else a line every
// 5% (logs stay readable).
class ByteProgress {
 public:
  ByteProgress() : tty_(::isatty(::fileno(stderr)) != 0), start_(std::chrono::steady_clock::now()) {}
  void operator()(std::int64_t done, std::int64_t total) {
    if (done == 0) start_ = std::chrono::steady_clock::now();   // encoding starts (tokenizer loaded)
    const double fraction = total > 0 ? static_cast<double>(done) / static_cast<double>(total) : 1.0;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    const std::string stats = fmt::format("{:5.1f}% | {:.1f} / {:.1f} MB | {:.1f} MB/s | {:.1f}s", 100 * fraction,
                                          static_cast<double>(done) / 1e6, static_cast<double>(total) / 1e6,
                                          s > 0 ? static_cast<double>(done) / 1e6 / s : 0.0, s);
    if (tty_) {
      if (done != total && done != 0 && s - last_draw_ < 0.1) return;
      last_draw_ = s;
      constexpr int width = 24;
      const auto filled = static_cast<std::size_t>(width * fraction);
      fmt::print(stderr, "\r[{:<{}}] {}\033[K{}", std::string(filled, '='), width, stats, done == total ? "\n" : "");
    } else if (const int step = static_cast<int>(20 * fraction); step > last_step_ || done == total) {
      last_step_ = step;
      fmt::print(stderr, "{}\n", stats);
    }
    std::fflush(stderr);
  }

 private:
  bool tty_;
  std::chrono::steady_clock::time_point start_;
  int last_step_ = -1;
  double last_draw_ = -1;
};

int run(PrepareArgs& a) {
  if (!a.quiet) a.options.progress = ByteProgress();
  const data::PrepareResult r = data::prepare_dataset(a.options);
  const std::string shards =
      a.options.shard_tokens > 0 ? fmt::format(" in {} + {} shard(s)", r.train_shards, r.val_shards) : std::string();
  // P2: a split without tokens is said plainly, on the summary line and why.
  fmt::print("prepared {}: {} train + {} val tokens{}{} (vocab {}) from {} input file(s), {:.1f} MB\n",
             a.options.out_dir, r.train_tokens, r.val_tokens, r.val_tokens == 0 ? " (no validation split)" : "", shards,
             r.vocab_size, a.options.inputs.size(), static_cast<double>(r.bytes) / 1e6);
  std::fflush(stdout);   // the summary before the notes and warnings, also when both go to one pipe
  for (const std::string& note : r.notes) fmt::print(stderr, "note: {}\n", note);
  if (r.val_tokens == 0 && a.options.val_fraction > 0) {
    if (a.options.shard_tokens > 0) {
      fmt::print(stderr, "warning: 0 val tokens: no validation split: the inputs give too few chunks of --chunk-bytes "
                 "{} for --val-fraction {} (every 1/fraction-th chunk is validation); give a smaller --chunk-bytes\n",
                 a.options.chunk_bytes, a.options.val_fraction);
    } else {
      fmt::print(stderr, "warning: 0 val tokens: no validation split: floor({} tokens x --val-fraction {}) is 0 (give "
                 "more text or a larger --val-fraction)\n", r.train_tokens, a.options.val_fraction);
    }
  }
  if (r.forced_cuts > 0) {
    fmt::print(stderr, "warning: {} chunk(s) cut inside a pre-token: max(2 x --chunk-bytes {}, 64 KiB) of text held "
               "no place where the pre-tokenizer splits (a run of letters, digits or symbols that long, or text "
               "without ASCII); the tokens next to each such cut may differ from encoding the input whole (meta.json: "
               "\"sources\" > \"forced_cuts\"); a larger --chunk-bytes cuts less often\n", r.forced_cuts,
               a.options.chunk_bytes);
  }
  return 0;
}

}  // namespace

MESHGRAD_REGISTER_COMMAND(
    prepare, {"", "prepare", "Tokenize text files with GPT-2 BPE or a Hugging Face tokenizer.json into train.bin / "
              "val.bin (or shards) / meta.json for train --data",
              [](CLI::App& app) -> std::function<int()> {
                auto a = std::make_shared<PrepareArgs>();
                auto& o = a->options;
                auto* vocab = app.add_option("--vocab", o.vocab, "vocab.json (Hugging Face) or encoder.json (OpenAI)");
                auto* merges = app.add_option("--merges", o.merges, "merges.txt (Hugging Face) or vocab.bpe (OpenAI)");
                auto* tokenizer = app.add_option(
                    "--tokenizer", o.tokenizer,
                    "A Hugging Face tokenizer.json of the byte-level BPE kind (GPT-2, Llama 3, Qwen2, SmolLM, OLMo), "
                    "or a directory holding it; tokenizer_config.json beside it gives BOS / EOS. Each input gets "
                    "BOS before it (when the tokenizer adds one) and EOS after it (when it has one)");
                vocab->needs(merges);
                merges->needs(vocab);
                tokenizer->excludes(vocab)->excludes(merges);
                app.add_option("--out", o.out_dir, "Output directory (created when missing; a dataset already "
                               "in it is refused unless --overwrite)")->required();
                app.add_flag("--overwrite", o.overwrite, "Replace the dataset files (train.bin, val.bin, "
                             "train_*.bin, val_*.bin, meta.json, vocab.json, merges.txt, tokenizer.json, "
                             "tokenizer_config.json) already in --out; those of them not written again are removed");
                app.add_option("--val-fraction", o.val_fraction,
                               "Fraction for validation, in [0, 1): without --shard-tokens the last tokens; with it, "
                               "every 1/fraction-th chunk of --chunk-bytes text (interleaved, so validation is the "
                               "same kind of text as training)")
                    ->capture_default_str();
                app.add_option("--shard-tokens", o.shard_tokens,
                               "Write train_000000.bin, train_000001.bin, ... and val_000000.bin, ... of this many "
                               "tokens each (the last may be shorter) instead of train.bin / val.bin; "
                               "llm.c uses 100000000")
                    ->check(at_least(1, INT32_MAX));
                app.add_option("--chunk-bytes", o.chunk_bytes,
                               "Text is read and encoded in chunks of about this many bytes, cut where the "
                               "pre-tokenizer splits anyway; with --shard-tokens the unit of the validation split")
                    ->capture_default_str()
                    ->check(at_least(1, INT64_MAX));
                app.add_flag("--quiet", a->quiet, "No progress bar");
                app.add_option("files", o.inputs, "Text files, encoded in this order")->required();
                return [a] { return run(*a); };
              }});

}  // namespace meshgrad::tools::cmd_prepare
