// `meshgrad prepare`: tokenizes text files with GPT-2's BPE into a data directory for
// `meshgrad train --data DIR` (llm.c token files train.bin / val.bin, meta.json; data/prepare.hpp).
//   meshgrad prepare --vocab vocab.json --merges merges.txt --out data/ book1.txt book2.txt
//   meshgrad prepare --vocab encoder.json --merges vocab.bpe --out data/ --val-fraction 0.05 *.txt
#include <fmt/core.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>

#include "command.hpp"
#include "meshgrad/data/prepare.hpp"

namespace meshgrad::tools {
namespace {

struct PrepareArgs {
  data::PrepareOptions options;
  bool quiet = false;
};

// A bar on stderr: redrawn in place on a terminal, else a line every ~10% (logs stay readable).
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
      constexpr int width = 24;
      const auto filled = static_cast<std::size_t>(width * fraction);
      fmt::print(stderr, "\r[{:<{}}] {}\033[K{}", std::string(filled, '='), width, stats, done == total ? "\n" : "");
    } else if (const int decile = static_cast<int>(10 * fraction); decile > last_decile_ || done == total) {
      last_decile_ = decile;
      fmt::print(stderr, "{}\n", stats);
    }
    std::fflush(stderr);
  }

 private:
  bool tty_;
  std::chrono::steady_clock::time_point start_;
  int last_decile_ = -1;
};

int run(PrepareArgs& a) {
  if (!a.quiet) a.options.progress = ByteProgress();
  const data::PrepareResult r = data::prepare_dataset(a.options);
  fmt::print("prepared {}: {} train + {} val tokens (vocab {}) from {} input file(s), {:.1f} MB\n", a.options.out_dir,
             r.train_tokens, r.val_tokens, r.vocab_size, a.options.inputs.size(), static_cast<double>(r.bytes) / 1e6);
  return 0;
}

}  // namespace

MESHGRAD_REGISTER_COMMAND(
    prepare, {"", "prepare", "Tokenize text files with GPT-2 BPE into train.bin / val.bin / meta.json for train --data",
              [](CLI::App& app) -> std::function<int()> {
                auto a = std::make_shared<PrepareArgs>();
                auto& o = a->options;
                app.add_option("--vocab", o.vocab, "vocab.json (Hugging Face) or encoder.json (OpenAI)")->required();
                app.add_option("--merges", o.merges, "merges.txt (Hugging Face) or vocab.bpe (OpenAI)")->required();
                app.add_option("--out", o.out_dir, "Output directory (created when missing; a dataset already "
                               "in it is refused unless --overwrite)")->required();
                app.add_flag("--overwrite", o.overwrite, "Replace the dataset files (train.bin, val.bin, meta.json, "
                             "vocab.json, merges.txt) already in --out");
                app.add_option("--val-fraction", o.val_fraction,
                               "Fraction of the tokens, at the end, for validation; in [0, 1)")
                    ->capture_default_str();
                app.add_flag("--quiet", a->quiet, "No progress bar");
                app.add_option("files", o.inputs, "Text files, encoded in this order")->required();
                return [a] { return run(*a); };
              }});

}  // namespace meshgrad::tools
