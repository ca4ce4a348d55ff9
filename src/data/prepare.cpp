#include "meshgrad/data/prepare.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "meshgrad/data/dataset.hpp"
#include "meshgrad/data/shards.hpp"
#include "meshgrad/data/text_chunks.hpp"
#include "meshgrad/io/atomic_commit.hpp"
#include "meshgrad/io/file_io.hpp"
#include "meshgrad/io/sha256.hpp"
#include "meshgrad/tensor/error.hpp"
#include "meshgrad/text/tokenizer.hpp"

namespace meshgrad::data {

namespace fs = std::filesystem;

namespace {

// What prepare writes into --out (besides the shards, train_NNNNNN.bin and val_NNNNNN.bin).
constexpr const char* kPreparedFiles[] = {"train.bin",  "val.bin",        "meta.json",
                                          "vocab.json", "merges.txt",     "tokenizer.json",
                                          "tokenizer_config.json"};

bool is_prepared_file(const std::string& name) {
  for (const char* prepared : kPreparedFiles) {
    if (name == prepared) return true;
  }
  return shard_index("train", name).has_value() || shard_index("val", name).has_value();
}

// Files written to a temporary name in the output directory (io::unique_temporary_path: the next
// writer of the same name removes what a killed one left) and committed by commit(): each flushed to
// disk, renamed into place through io::rename_into_place (atomic_commit.hpp, the one way meshgrad
// commits a file), the directory flushed last. Whatever was not committed is removed when this goes
// out of scope (an error mid-way).
class StagedFiles {
 public:
  explicit StagedFiles(fs::path dir) : dir_(std::move(dir)) {}
  ~StagedFiles() {
    std::error_code ec;
    for (const auto& [tmp, final_name] : staged_) fs::remove(tmp, ec);
  }
  StagedFiles(const StagedFiles&) = delete;
  StagedFiles& operator=(const StagedFiles&) = delete;

  // The temporary path to write `name` to.
  std::string stage(const std::string& name) {
    const std::string target = (dir_ / name).string();
    io::remove_stale_temporaries(target);
    const std::string tmp = io::unique_temporary_path(target);
    staged_.emplace_back(tmp, target);
    names_.insert(name);
    return tmp;
  }
  // Flushes every staged file, renames each into place in the order staged, then flushes the
  // directory: a kill leaves each file old or complete, and what commit() reported is on disk.
  void commit() {
    for (const auto& [tmp, final_name] : staged_) {
      const io::UniqueFd fd(::open(tmp.c_str(), O_RDONLY | O_CLOEXEC));
      MG_CHECK(fd.get() >= 0, "prepare: cannot open '{}' to flush it: {}", tmp, io::errno_text(errno));
      io::fsync_file(fd.get(), tmp);
    }
    for (const auto& [tmp, final_name] : staged_) {
      io::rename_into_place(tmp, final_name, io::ExistingTarget::kReplaceFileOrEmptyDirectory);
    }
    if (!staged_.empty()) io::flush_directory_of(staged_.front().second, io::ParentFlush::kRequired);
    staged_.clear();
  }
  // The names staged so far (committed or not).
  const std::set<std::string>& names() const { return names_; }

 private:
  fs::path dir_;
  std::vector<std::pair<std::string, std::string>> staged_;   // (temporary, target)
  std::set<std::string> names_;
};

// An llm.c token file written as its tokens come: a zero header first, the tokens through a buffer,
// the real header (the version and count) last. width: bytes per token, 2 (version 1, uint16) or 4
// (version 2, uint32).
class TokenFileWriter {
 public:
  TokenFileWriter(std::string path, int width) : path_(std::move(path)), width_(width) {
    fd_ = io::UniqueFd(::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0666));
    MG_CHECK(fd_.get() >= 0, "prepare: cannot create '{}': {}", path_, io::errno_text(errno));
    const std::array<std::int32_t, 256> header{};
    io::write_all(fd_.get(), header.data(), sizeof header, path_);
    buffer_.reserve(kBufferTokens);
  }
  void append(const std::vector<text::TokenId>& tokens) {
    buffer_.insert(buffer_.end(), tokens.begin(), tokens.end());
    count_ += static_cast<std::int64_t>(tokens.size());
    if (buffer_.size() >= kBufferTokens) flush();
  }
  std::int64_t tokens() const { return count_; }
  // Appends tokens [from, tokens()) of this file to `out` (read back in pieces).
  void copy_tail_to(std::int64_t from, TokenFileWriter& out) {
    flush();
    std::vector<unsigned char> bytes;
    std::vector<text::TokenId> piece;
    for (std::int64_t at = from; at < count_; at += kBufferTokens) {
      piece.resize(static_cast<std::size_t>(std::min<std::int64_t>(kBufferTokens, count_ - at)));
      bytes.resize(piece.size() * static_cast<std::size_t>(width_));
      io::read_exact(fd_.get(), bytes.data(), bytes.size(), static_cast<std::uint64_t>(kTokenFileHeaderBytes + width_ * at),
                     path_);
      for (std::size_t i = 0; i < piece.size(); ++i) {   // little-endian, as flush() wrote them
        text::TokenId t = 0;
        for (int b = width_ - 1; b >= 0; --b) t = (t << 8) | bytes[i * static_cast<std::size_t>(width_) + static_cast<std::size_t>(b)];
        piece[i] = t;
      }
      out.append(piece);
    }
  }
  // Ends the file after its first `keep` tokens, writes the header and closes it. Returns the
  // file's XXH3-128, read back through TokenFile (which checks the header too).
  std::string finish(std::int64_t keep) {
    MG_CHECK(keep <= INT32_MAX, "prepare: '{}' would hold {} tokens, more than the llm.c header's int32 count "
             "holds; use --shard-tokens", path_, keep);
    flush();
    MG_CHECK(::ftruncate(fd_.get(), kTokenFileHeaderBytes + width_ * keep) == 0, "prepare: cannot truncate '{}': {}",
             path_, io::errno_text(errno));
    const std::array<std::int32_t, 3> header{kTokenFileMagic, width_ == 4 ? kTokenFileVersionU32 : kTokenFileVersion,
                                             static_cast<std::int32_t>(keep)};
    MG_CHECK(::pwrite(fd_.get(), header.data(), sizeof header, 0) == static_cast<ssize_t>(sizeof header),
             "prepare: writing the header of '{}' failed: {}", path_, io::errno_text(errno));
    MG_CHECK(::close(fd_.release()) == 0, "prepare: closing '{}' failed: {}", path_, io::errno_text(errno));
    return TokenFile(path_, TokenFile::Format::LlmC).content_hash();
  }

 private:
  static constexpr std::size_t kBufferTokens = std::size_t{1} << 20;
  void flush() {
    if (width_ == 4) {
      io::write_all(fd_.get(), buffer_.data(), 4 * buffer_.size(), path_);   // little-endian in memory
    } else {
      narrow_.assign(buffer_.begin(), buffer_.end());   // every token < 65536: prepare checked the vocabulary
      io::write_all(fd_.get(), narrow_.data(), 2 * narrow_.size(), path_);
    }
    buffer_.clear();
  }
  std::string path_;
  int width_;
  io::UniqueFd fd_;
  std::vector<text::TokenId> buffer_;
  std::vector<std::uint16_t> narrow_;
  std::int64_t count_ = 0;
};

struct WrittenFile {
  std::string name;
  std::int64_t tokens = 0;
  std::string hash;
};

// One split's shards: SPLIT_000000.bin, ... of shard_tokens tokens each, started only when a token
// comes for them (no empty shard).
class ShardWriter {
 public:
  ShardWriter(StagedFiles& staged, std::string split, std::int64_t shard_tokens, int width)
      : staged_(staged), split_(std::move(split)), shard_tokens_(shard_tokens), width_(width) {}
  void append(const std::vector<text::TokenId>& tokens) {
    for (std::size_t from = 0; from < tokens.size();) {
      if (!file_) {
        const std::string name = shard_file_name(split_, static_cast<std::int64_t>(written_.size()));
        file_ = std::make_unique<TokenFileWriter>(staged_.stage(name), width_);
        written_.push_back({name, 0, ""});
      }
      const auto n = static_cast<std::size_t>(std::min<std::int64_t>(shard_tokens_ - file_->tokens(),
                                                                      static_cast<std::int64_t>(tokens.size() - from)));
      file_->append(std::vector<text::TokenId>(tokens.begin() + static_cast<std::ptrdiff_t>(from),
                                               tokens.begin() + static_cast<std::ptrdiff_t>(from + n)));
      from += n;
      if (file_->tokens() == shard_tokens_) close_shard();
    }
  }
  // Closes the last shard; the shards written, in order.
  const std::vector<WrittenFile>& finish() {
    if (file_) close_shard();
    return written_;
  }
  std::int64_t tokens() const {
    std::int64_t n = file_ ? file_->tokens() : 0;
    for (const WrittenFile& f : written_) n += f.tokens;
    return n;
  }

 private:
  void close_shard() {
    written_.back().tokens = file_->tokens();
    written_.back().hash = file_->finish(file_->tokens());
    file_.reset();
  }
  StagedFiles& staged_;
  std::string split_;
  std::int64_t shard_tokens_;
  int width_;
  std::unique_ptr<TokenFileWriter> file_;
  std::vector<WrittenFile> written_;
};

// Every check of the options that needs no encoding; returns the inputs' sizes.
std::vector<std::int64_t> check_options(const PrepareOptions& o) {
  MG_CHECK(!o.inputs.empty(), "prepare: no input files (give one or more text files)");
  MG_CHECK(o.tokenizer.empty() != (o.vocab.empty() && o.merges.empty()), "prepare: give either --tokenizer "
           "(tokenizer.json or a directory holding it) or --vocab and --merges (GPT-2 files), {}",
           o.tokenizer.empty() ? "got none" : "not both");
  MG_CHECK(!o.tokenizer.empty() || (!o.vocab.empty() && !o.merges.empty()), "prepare: --vocab and --merges go "
           "together (got only {})", o.vocab.empty() ? "--merges" : "--vocab");
  MG_CHECK(std::isfinite(o.val_fraction) && o.val_fraction >= 0 && o.val_fraction < 1,
           "prepare: --val-fraction must be in [0, 1), got {}", o.val_fraction);
  MG_CHECK(o.shard_tokens >= 0 && o.shard_tokens <= INT32_MAX, "prepare: --shard-tokens must be in [1, {}] (the "
           "llm.c header's int32 count), got {}", INT32_MAX, o.shard_tokens);
  MG_CHECK(o.chunk_bytes >= 1, "prepare: --chunk-bytes must be >= 1, got {}", o.chunk_bytes);
  MG_CHECK(!o.out_dir.empty(), "prepare: --out must name a directory");
  std::error_code ec;
  MG_CHECK(!fs::exists(o.out_dir, ec) || fs::is_directory(o.out_dir, ec), "prepare: --out '{}' exists and is not a "
           "directory", o.out_dir);
  if (!o.overwrite && fs::is_directory(o.out_dir, ec)) {
    std::vector<std::string> existing;
    for (const auto& entry : fs::directory_iterator(o.out_dir, ec)) {
      if (is_prepared_file(entry.path().filename().string())) existing.push_back(entry.path().filename().string());
    }
    std::sort(existing.begin(), existing.end());
    if (existing.size() > 6) existing.resize(6), existing.back() = "...";
    MG_CHECK(existing.empty(), "prepare: --out '{}' already holds a prepared dataset ({}): prepare refuses to replace "
             "it, since a run or a checkpoint may depend on those tokens; choose another --out, or add --overwrite",
             o.out_dir, fmt::join(existing, ", "));
  }
  std::vector<std::int64_t> sizes;
  for (const std::string& path : o.inputs) {
    require_regular_file(path, "prepare: input");   // "... is a directory, not a regular file"
    std::uint64_t size = 0;
    try {
      io::open_regular_file(path, &size);   // readable (permissions)
    } catch (const io::FileIoError& e) {
      throw InvalidArgument(fmt::format("prepare: input: {}", e.what()));
    }
    sizes.push_back(static_cast<std::int64_t>(size));
  }
  return sizes;
}

// Inputs named more than once (the same file by (device, inode): another spelling, a link) are
// encoded each time they are named; said in a note, since repeating a file can be meant (to weight it).
std::vector<std::string> repeated_inputs(const std::vector<std::string>& inputs) {
  std::map<std::pair<dev_t, ino_t>, std::size_t> first;
  std::vector<std::string> notes;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    struct stat st {};
    if (::stat(inputs[i].c_str(), &st) != 0) continue;   // checked before: it was readable
    const auto [it, inserted] = first.emplace(std::pair{st.st_dev, st.st_ino}, i);
    if (inserted) continue;
    notes.push_back(fmt::format("input '{}' (file {}) is input '{}' (file {}) again: its text is encoded twice", inputs[i],
                                i + 1, inputs[it->second], it->second + 1));
  }
  return notes;
}

// Encodes the inputs chunk by chunk, calling on_chunk(index, tokens) for each (index 0, 1, ... over
// all inputs). Each input is a document (data/prepare.hpp): GPT-2 files put <|endoftext|> at the
// front of its first chunk; a tokenizer.json puts its BOS there and its EOS at the end of the
// input's last chunk. An empty input still gives its separators (a chunk of them). Returns
// meta.json's "sources".
nlohmann::json encode_inputs(const PrepareOptions& o, text::Tokenizer& tokenizer, std::int64_t total,
                             const std::function<void(std::int64_t, const std::vector<text::TokenId>&)>& on_chunk) {
  nlohmann::json sources = nlohmann::json::array();
  std::vector<text::TokenId> ids, held;   // held: the last chunk's tokens, sent when the next one comes
  std::string chunk;
  std::int64_t done = 0, index = 0, held_bytes = 0;
  if (o.progress) o.progress(0, total);
  std::vector<text::TokenId> starts = tokenizer.bos_ids();
  std::optional<text::TokenId> end;
  if (tokenizer.is_hf_json()) {
    end = tokenizer.eos_id();
  } else if (tokenizer.eot_id()) {
    starts = {*tokenizer.eot_id()};
  }
  for (const std::string& path : o.inputs) {
    TextChunkReader reader(path, static_cast<std::size_t>(o.chunk_bytes), "prepare: input", tokenizer.cut_rules());
    std::int64_t input_tokens = 0;
    bool first = true, have_held = false;
    auto send = [&] {
      on_chunk(index++, held);
      input_tokens += static_cast<std::int64_t>(held.size());
      done += held_bytes;
      if (o.progress) o.progress(done, total);
    };
    while (reader.next(chunk) || first) {
      ids.clear();
      if (first) ids = starts;
      tokenizer.encode(chunk, ids, first);
      first = false;
      if (ids.empty()) continue;
      if (have_held) send();
      held.swap(ids);
      held_bytes = static_cast<std::int64_t>(chunk.size());
      have_held = true;
    }
    if (end) {
      if (!have_held) held.clear(), held_bytes = 0;
      held.push_back(*end);
      have_held = true;
    }
    if (have_held) send();
    sources.push_back({{"file", fs::absolute(path).string()}, {"bytes", reader.size()}, {"tokens", input_tokens}});
    // Cuts inside a pre-token (data/text_chunks.hpp): recorded only where there were any.
    if (reader.forced_cuts() > 0) sources.back()["forced_cuts"] = reader.forced_cuts();
  }
  return sources;
}

nlohmann::json files_json(const std::vector<WrittenFile>& files) {
  nlohmann::json j = nlohmann::json::object();
  for (const WrittenFile& f : files) j[f.name] = {{"tokens", f.tokens}, {"xxh128", f.hash}};
  return j;
}

nlohmann::json names_json(const std::vector<WrittenFile>& files) {
  nlohmann::json j = nlohmann::json::array();
  for (const WrittenFile& f : files) j.push_back(f.name);
  return j;
}

// What the layouts write: the token files (train first) and meta.json's fields about them.
struct Layout {
  std::vector<WrittenFile> train, val;
  nlohmann::json meta = nlohmann::json::object();
};

// Bytes per token in the files: 2 (uint16, version 1) up to 65,536 ids, else 4 (uint32, version 2).
int token_width(const text::Tokenizer& tokenizer) { return tokenizer.vocab_size() <= 65536 ? 2 : 4; }

Layout write_unsharded(const PrepareOptions& o, text::Tokenizer& tokenizer, std::int64_t total, StagedFiles& staged,
                       nlohmann::json& sources) {
  // Every token to train.bin's temporary; then the last fraction moves to val.bin and train.bin is cut.
  TokenFileWriter train(staged.stage("train.bin"), token_width(tokenizer));
  sources = encode_inputs(o, tokenizer, total, [&](std::int64_t, const std::vector<text::TokenId>& t) { train.append(t); });
  const std::int64_t n = train.tokens();
  const auto n_val = static_cast<std::int64_t>(std::floor(static_cast<double>(n) * o.val_fraction));
  const std::int64_t n_train = n - n_val;
  MG_CHECK(n_train >= 2, "prepare: the inputs give {} tokens, {} of them for training; training needs at least 2",
           n, n_train);
  TokenFileWriter val(staged.stage("val.bin"), token_width(tokenizer));
  train.copy_tail_to(n_train, val);
  Layout layout;
  layout.train.push_back({"train.bin", n_train, train.finish(n_train)});
  layout.val.push_back({"val.bin", n_val, val.finish(n_val)});
  return layout;
}

Layout write_sharded(const PrepareOptions& o, text::Tokenizer& tokenizer, std::int64_t total, StagedFiles& staged,
                     nlohmann::json& sources) {
  ShardWriter train(staged, "train", o.shard_tokens, token_width(tokenizer));
  ShardWriter val(staged, "val", o.shard_tokens, token_width(tokenizer));
  std::int64_t chunks = 0, val_chunks = 0;
  sources = encode_inputs(o, tokenizer, total, [&](std::int64_t index, const std::vector<text::TokenId>& t) {
    const bool to_val = chunk_goes_to_validation(index, o.val_fraction);
    (to_val ? val : train).append(t);
    ++chunks;
    val_chunks += to_val ? 1 : 0;
  });
  MG_CHECK(train.tokens() >= 2, "prepare: the inputs give {} tokens, {} of them for training; training needs at "
           "least 2", train.tokens() + val.tokens(), train.tokens());
  Layout layout{train.finish(), val.finish()};
  layout.meta = {{"shard_tokens", o.shard_tokens},
                 {"chunk_bytes", o.chunk_bytes},
                 {"chunks", chunks},
                 {"val_chunks", val_chunks},
                 {"split", "interleaved: chunk i (about chunk_bytes of text, cut at a pre-token boundary; counted over "
                           "all inputs) is validation when floor((i + 1) * val_fraction + 0.5) > "
                           "floor(i * val_fraction + 0.5)"},
                 {"shards", {{"train", names_json(layout.train)}, {"val", names_json(layout.val)}}}};
  return layout;
}

std::int64_t total_tokens(const std::vector<WrittenFile>& files) {
  std::int64_t n = 0;
  for (const WrittenFile& f : files) n += f.tokens;
  return n;
}

// meta.json's "tokenizer": each file the tokenizer was read from, with its copy in the directory
// and SHA-256; "kind" says which (text::load_tokenizer finds the copies).
nlohmann::json tokenizer_json(const text::Tokenizer& tokenizer) {
  nlohmann::json j = {{"kind", tokenizer.is_hf_json() ? "tokenizer.json" : "gpt2"}, {"description", tokenizer.kind()}};
  const auto& files = tokenizer.source_files();
  const std::vector<std::pair<const char*, const char*>> names =
      tokenizer.is_hf_json() ? std::vector<std::pair<const char*, const char*>>{{"tokenizer_json", "tokenizer.json"},
                                                                                  {"tokenizer_config", "tokenizer_config.json"}}
                             : std::vector<std::pair<const char*, const char*>>{{"vocab", "vocab.json"}, {"merges", "merges.txt"}};
  for (std::size_t i = 0; i < files.size() && i < names.size(); ++i) {
    j[names[i].first] = {{"file", fs::absolute(files[i]).string()}, {"copy", names[i].second},
                         {"sha256", io::sha256_file(files[i])}};
  }
  if (tokenizer.is_hf_json()) {
    j["bos"] = tokenizer.bos_ids();
    j["eos"] = tokenizer.eos_id() ? nlohmann::json(*tokenizer.eos_id()) : nlohmann::json(nullptr);
  }
  return j;
}

void write_meta(const PrepareOptions& o, const text::Tokenizer& tokenizer, const nlohmann::json& sources,
                const Layout& layout, StagedFiles& staged) {
  nlohmann::json files = files_json(layout.train);
  files.update(files_json(layout.val));
  const bool wide = token_width(tokenizer) == 4;
  nlohmann::json meta = {
      {"format", fmt::format("llm.c token files: 256 x int32 header (magic 20240520, version {}, token count), then {} "
                             "tokens", wide ? 2 : 1, wide ? "uint32" : "uint16")},
      {"token_bytes", wide ? 4 : 2},
      {"producer", "meshgrad prepare"},
      {"vocab_size", tokenizer.vocab_size()},
      {"eot_token", tokenizer.eot_id() ? nlohmann::json(*tokenizer.eot_id()) : nlohmann::json(nullptr)},
      {"documents", tokenizer.is_hf_json() ? "each input file: the tokenizer's BOS (when it adds one), its tokens, its "
                                             "EOS (when it has one)"
                                           : "each input file: <|endoftext|> (when the vocabulary has it), its tokens"},
      {"tokenizer", tokenizer_json(tokenizer)},
      {"sources", sources},
      {"train_tokens", total_tokens(layout.train)},
      {"val_tokens", total_tokens(layout.val)},
      // The token files' content hashes (XXH3-128 of the whole file, `xxhsum -H2`): the data's identity.
      {"files", files},
      {"val_fraction", o.val_fraction},
  };
  meta.update(layout.meta);
  const std::string path = staged.stage("meta.json");
  std::ofstream out(path);
  out << meta.dump(2) << "\n";
  out.close();
  MG_CHECK(out.good(), "prepare: cannot write '{}'", path);
}

// After an --overwrite: prepare's files in dir that this run did not write (the other layout's, or
// shards past the new last one) are removed, so the directory holds one dataset.
void remove_stale_files(const std::string& dir, const std::set<std::string>& written) {
  std::error_code ec;
  std::vector<fs::path> stale;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (is_prepared_file(name) && !written.contains(name)) stale.push_back(entry.path());
  }
  for (const fs::path& p : stale) {
    fs::remove(p, ec);
    MG_CHECK(!ec, "prepare: cannot remove '{}' (left from an earlier prepare): {}", p.string(), ec.message());
  }
}

}  // namespace

bool chunk_goes_to_validation(std::int64_t chunk, double val_fraction) {
  const auto c = static_cast<double>(chunk);
  return std::floor((c + 1) * val_fraction + 0.5) > std::floor(c * val_fraction + 0.5);
}

PrepareResult prepare_dataset(const PrepareOptions& o) {
  // ---- everything a user can get wrong, before any work ----
  const std::vector<std::int64_t> sizes = check_options(o);
  std::int64_t total = 0;
  for (std::int64_t size : sizes) total += size;
  MG_CHECK(total > 0, "prepare: the input files ({}) are all empty", fmt::join(o.inputs, ", "));
  text::Tokenizer tokenizer = o.tokenizer.empty() ? text::Tokenizer::from_files(o.vocab, o.merges)
                                                  : text::load_tokenizer(o.tokenizer);
  // GPT-2 files keep their uint16 files (what older readers of prepared data expect); a larger
  // vocabulary comes as a tokenizer.json, whose files are uint32 past 65,536 ids.
  MG_CHECK(!o.tokenizer.empty() || tokenizer.vocab_size() <= 65536, "prepare: the vocabulary '{}' has {} ids; the "
           "llm.c token format of vocab + merges files stores uint16 (ids 0 .. 65535); a larger vocabulary is "
           "prepared from its tokenizer.json (--tokenizer), as uint32", o.vocab, tokenizer.vocab_size());

  // ---- encode and write: temporaries in DIR, renamed into place, meta.json last ----
  std::error_code ec;
  fs::create_directories(o.out_dir, ec);
  MG_CHECK(!ec, "prepare: cannot create the output directory '{}': {}", o.out_dir, ec.message());
  StagedFiles staged{fs::path(o.out_dir)};
  nlohmann::json sources;
  const Layout layout = o.shard_tokens > 0 ? write_sharded(o, tokenizer, total, staged, sources)
                                           : write_unsharded(o, tokenizer, total, staged, sources);
  const std::vector<std::string>& sources_of_tokenizer = tokenizer.source_files();
  const char* hf_copies[] = {"tokenizer.json", "tokenizer_config.json"};
  const char* gpt2_copies[] = {"vocab.json", "merges.txt"};
  for (std::size_t i = 0; i < sources_of_tokenizer.size() && i < 2; ++i) {
    const char* copy = tokenizer.is_hf_json() ? hf_copies[i] : gpt2_copies[i];
    fs::copy_file(sources_of_tokenizer[i], staged.stage(copy), fs::copy_options::overwrite_existing);
  }
  write_meta(o, tokenizer, sources, layout, staged);
  staged.commit();
  if (o.overwrite) remove_stale_files(o.out_dir, staged.names());
  PrepareResult r;
  r.vocab_size = tokenizer.vocab_size();
  r.train_tokens = total_tokens(layout.train);
  r.val_tokens = total_tokens(layout.val);
  r.bytes = total;
  r.notes = repeated_inputs(o.inputs);
  for (const auto& source : sources) r.forced_cuts += source.value("forced_cuts", std::int64_t{0});
  if (o.shard_tokens > 0) {
    r.train_shards = static_cast<std::int64_t>(layout.train.size());
    r.val_shards = static_cast<std::int64_t>(layout.val.size());
  }
  return r;
}

}  // namespace meshgrad::data
