// Hugging Face GPT-2 directories in and out (contract in include/meshgrad/interop/hf_io.hpp).
#include "meshgrad/interop/hf_io.hpp"
#include "meshgrad/checkpoint/directory.hpp"
#include "meshgrad/checkpoint/reader.hpp"
#include "meshgrad/interop/checkpoint_model.hpp"
#include "meshgrad/io/sha256.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>

#include "meshgrad/tensor/error.hpp"
#include "meshgrad/text/tokenizer.hpp"
#include "meshgrad/checkpoint/parameter_file.hpp"
#include "meshgrad/data/dataset.hpp"
#include "meshgrad/interop/gpt2_config.hpp"
#include "meshgrad/interop/hf_config.hpp"
#include "meshgrad/interop/model_tensors.hpp"
#include "meshgrad/io/json_input.hpp"
#include "meshgrad/io/atomic_commit.hpp"
#include "meshgrad/io/file_io.hpp"
#include "meshgrad/io/output_path.hpp"
#include "meshgrad/data/prepare.hpp"

namespace meshgrad::interop {

namespace fs = std::filesystem;

namespace {

constexpr const char* kPrefix = "transformer.";

std::string join(const std::vector<std::string>& items, std::size_t max_items = 8) {
  std::string out;
  for (std::size_t i = 0; i < items.size() && i < max_items; ++i) out += (i ? ", '" : "'") + items[i] + "'";
  if (items.size() > max_items) out += fmt::format(" and {} more", items.size() - max_items);
  return out;
}

// "h.<i>.<rest>" -> i, for names of blocks; nullopt for anything else.
std::optional<std::int64_t> block_index(const std::string& name) {
  if (!name.starts_with("h.")) return std::nullopt;
  const std::size_t dot = name.find('.', 2);
  if (dot == std::string::npos || dot == 2 || dot > 12) return std::nullopt;
  std::int64_t i = 0;
  for (std::size_t k = 2; k < dot; ++k) {
    if (name[k] < '0' || name[k] > '9') return std::nullopt;
    i = i * 10 + (name[k] - '0');
  }
  return i;
}

// The prefix of a GPT-2 weights file: "" or "transformer.", from where its wte.weight is.
std::string detect_prefix(const WeightFiles& f) {
  const bool plain = f.contains("wte.weight");
  const bool prefixed = f.contains(std::string(kPrefix) + "wte.weight");
  MG_CHECK(!(plain && prefixed), "weights '{}' hold both 'wte.weight' and '{}wte.weight': which one is the model is "
           "ambiguous", f.origin(), kPrefix);
  if (plain || prefixed) return prefixed ? kPrefix : "";
  const std::vector<std::string> names = f.names();
  throw InvalidArgument(fmt::format("weights '{}' have no 'wte.weight' (nor '{}wte.weight'): not GPT-2 weights (the "
                                    "file has {} tensors{}{})",
                                    f.origin(), kPrefix, names.size(), names.empty() ? "" : ", e.g. ",
                                    names.empty() ? "" : "'" + names.front() + "'"));
}

// A directory holding config.json and model.safetensors (or a sharded set's index); the message says
// what is missing.
void check_hf_dir(const std::string& dir, const char* option) {
  struct stat st {};
  MG_CHECK(!dir.empty(), "{}: the path is empty", option);
  MG_CHECK(::stat(dir.c_str(), &st) == 0, "{} '{}': {}", option, dir, std::strerror(errno));
  MG_CHECK(S_ISDIR(st.st_mode), "{} '{}' is not a directory: give a Hugging Face directory ({} + {})", option, dir,
           kHfConfigFile, kHfWeightsFile);
  const fs::path d(dir);
  MG_CHECK(fs::is_regular_file(d / kHfConfigFile), "{} '{}' has no {}: a Hugging Face directory holds {} and {} (what "
           "save_pretrained or `meshgrad export` writes)", option, dir, kHfConfigFile, kHfConfigFile, kHfWeightsFile);
  MG_CHECK(fs::is_regular_file(d / kHfWeightsFile) || fs::is_regular_file(d / kHfIndexFile), "{} '{}' has no {} (nor "
           "a sharded set's {}): a Hugging Face directory holds {} and its weights (pytorch_model.bin is not read)",
           option, dir, kHfWeightsFile, kHfIndexFile, kHfConfigFile);
}

std::string describe(const nn::ModelConfig& c) {
  if (c.kind == "llama")
    return fmt::format("{}: num_hidden_layers {}, hidden_size {}, num_attention_heads {}, num_key_value_heads {}, "
                       "vocab_size {}, max_position_embeddings {}", c.model_type, c.layers, c.hidden, c.heads,
                       c.kv_head_count(), c.vocab, c.n_positions());
  return fmt::format("n_layer {}, n_embd {}, n_head {}, vocab_size {}, n_positions {}", c.layers, c.hidden, c.heads,
                     c.vocab, c.n_positions());
}

}  // namespace

nn::ModelConfig read_model_config(const std::string& path) {
  const nlohmann::json j = nlohmann::json::parse(io::read_small_file(path, kMaxConfigBytes, "config.json"), nullptr, false);
  if (j.is_object() && !j.contains("model_type")) return read_gpt2_config(path);
  return read_hf_config(path);
}

namespace {

// The configuration of a Hugging Face directory's model with the run's own sizes (seq, batch,
// dropout, dtype) from `run`.
nn::ModelConfig with_run_sizes(const nn::ModelConfig& file, const nn::ModelConfig& run) {
  if (file.kind == "gpt") return run.with_shape_of(file);
  nn::ModelConfig c = file;
  c.seq = run.seq;
  c.batch = run.batch;
  c.dtype = run.dtype;
  c.dropout = run.dropout;
  c.capacity_factor = run.capacity_factor;   // a run option, not the file's
  return c;
}

}  // namespace

// ---- in -------------------------------------------------------------------------------------------

HfWeights check_hf_weights(const WeightFiles& f, const nn::ModelConfig& config, const std::string& config_origin) {
  HfWeights out;
  out.prefix = detect_prefix(f);
  std::vector<std::string> missing;
  std::set<std::string> expected;
  for (const auto& [name, shape] : gpt2_parameter_shapes(config)) {
    const std::string stored = out.prefix + name;
    expected.insert(stored);
    if (!f.contains(stored)) {
      missing.push_back(stored);
      continue;
    }
    const io::SafetensorsEntry& e = f.entry(stored);
    MG_CHECK(e.shape == shape, "weights '{}': tensor '{}' has shape {} but config '{}' ({}) gives it {}", f.file_of(stored),
             stored, shape_str(e.shape), config_origin, describe(config), shape_str(shape));
    MG_CHECK(e.readable && e.dtype != DType::Int64, "weights '{}': tensor '{}' is {}; a parameter must be F32, F64, "
             "F16 or BF16", f.origin(), stored, e.stored);
    if (std::find(out.dtypes.begin(), out.dtypes.end(), e.stored) == out.dtypes.end()) out.dtypes.push_back(e.stored);
  }
  MG_CHECK(missing.empty(), "weights '{}' miss {} tensor{} of the GPT-2 that config '{}' describes ({}): {}", f.origin(),
           missing.size(), missing.size() == 1 ? "" : "s", config_origin, describe(config), join(missing));
  for (const std::string& name : f.names()) {
    if (expected.count(name) || !name.starts_with(out.prefix)) continue;
    const std::optional<std::int64_t> block = block_index(name.substr(out.prefix.size()));
    MG_CHECK(!block || *block < config.layers, "weights '{}' hold '{}' but config '{}' has n_layer = {} (blocks h.0 "
             "to h.{})", f.origin(), name, config_origin, config.layers, config.layers - 1);
  }
  // GPT2LMHeadModel's head is tied to wte; a file may still carry it (older save_pretrained,
  // torch.save of the state dict). Loading wte alone is right only when the two are the same.
  for (const std::string& head : {std::string("lm_head.weight"), out.prefix + "lm_head.weight"}) {
    if (!f.contains(head) || out.tied_head) continue;
    const std::string wte = out.prefix + "wte.weight";
    const io::SafetensorsEntry& e = f.entry(head);
    MG_CHECK(e.shape == f.entry(wte).shape, "weights '{}': '{}' has shape {} but '{}' has {}: meshgrad's output layer "
             "is the token embedding, tied", f.origin(), head, shape_str(e.shape), wte, shape_str(f.entry(wte).shape));
    // Compared as read (float32 for F32 / F16 / BF16): equal values, whatever the two dtypes.
    Tensor h = f.get(head), w = f.get(wte);
    if (h.dtype() != w.dtype()) {
      h = h.to(DType::Float64);
      w = w.to(DType::Float64);
    }
    const std::int64_t cols = e.shape.size() == 2 ? e.shape[1] : 1;
    dispatch_floating(h.dtype(), "check_hf_weights", [&]<class T>() {
      const T* hp = h.data<T>();
      const T* wp = w.data<T>();
      for (std::int64_t i = 0; i < h.numel(); ++i) {
        MG_CHECK(hp[i] == wp[i] || (std::isnan(hp[i]) && std::isnan(wp[i])),
                 "weights '{}': '{}' differs from '{}' (first at [{}, {}]: {} vs {}): an untied output layer, which "
                 "meshgrad's GPT-2 (output = wte transposed) cannot hold",
                 f.origin(), head, wte, i / cols, i % cols, hp[i], wp[i]);
      }
    });
    out.tied_head = true;
  }
  return out;
}

HfWeights check_hf_weights(const io::SafetensorsFile& f, const nn::ModelConfig& config, const std::string& config_origin) {
  return check_hf_weights(WeightFiles::open_file(f.path()), config, config_origin);
}

HfWeights check_model_weights(const WeightFiles& f, const nn::ModelConfig& config, const std::string& config_origin) {
  if (config.kind == "gpt") return check_hf_weights(f, config, config_origin);
  HfWeights out;
  out.dtypes = check_llama_weights(f, config, config_origin);
  out.tied_head = config.tie_word_embeddings && f.contains("lm_head.weight");
  return out;
}

nn::ModelConfig hf_init_config(const std::string& dir, const nn::ModelConfig& requested, bool report) {
  check_hf_dir(dir, "--init-from");
  const std::string config_path = (fs::path(dir) / kHfConfigFile).string();
  const nn::ModelConfig file = read_model_config(config_path);
  const bool gpt = file.kind == "gpt";
  MG_CHECK(requested.kind == file.kind || requested.kind == "gpt", "--init-from '{}': --model {} disagrees with '{}', "
           "a {} model", dir, requested.kind, config_path, file.model_type);
  const auto agree = [&](const char* option, int wanted, int found, const char* key) {
    MG_CHECK(wanted <= 0 || wanted == found, "--init-from '{}': {} {} disagrees with {} = {} in '{}' (leave {} out "
             "to take the file's)", dir, option, wanted, key, found, config_path, option);
  };
  agree("--layers", requested.layers, file.layers, gpt ? "n_layer" : "num_hidden_layers");
  agree("--hidden", requested.hidden, file.hidden, gpt ? "n_embd" : "hidden_size");
  agree("--heads", requested.heads, file.heads, gpt ? "n_head" : "num_attention_heads");
  agree("--vocab", requested.vocab, file.vocab, "vocab_size");
  agree("--positions", requested.positions, file.positions, gpt ? "n_positions" : "max_position_embeddings");
  agree("--ffn", requested.ffn, file.ffn_size(), gpt ? "n_inner" : "intermediate_size");
  if (!gpt) {
    agree("--kv-heads", requested.kv_heads, file.kv_head_count(), "num_key_value_heads");
    agree("--head-dim", requested.head_dim, file.head_size(), "head_dim");
  }
  const nn::ModelConfig c = with_run_sizes(file, requested);
  MG_CHECK(c.seq <= c.positions, "--init-from '{}': --seq {} exceeds {} = {} in '{}'", dir, c.seq,
           gpt ? "n_positions" : "max_position_embeddings", c.positions, config_path);
  const WeightFiles weights = WeightFiles::open_directory(dir, "--init-from");
  const HfWeights w = check_model_weights(weights, c, config_path);
  if (report) {
    std::string dtypes;
    for (const auto& d : w.dtypes) dtypes += (dtypes.empty() ? "" : "/") + d;
    const std::string head = gpt ? "lm_head.weight tied to wte.weight" : "lm_head.weight tied to model.embed_tokens.weight";
    fmt::print(stderr, "meshgrad train: starting from '{}': {} {}, {} weights{}{}, loaded as {}\n", dir,
               gpt ? "GPT-2" : "Hugging Face", describe(c), dtypes, w.prefix.empty() ? "" : " named 'transformer.*'",
               w.tied_head ? fmt::format(" ({}, not loaded)", head) : "", dtype_name(c.dtype));
  }
  return c;
}

void hf_load_parameters(const std::string& dir, const std::vector<nn::Parameter*>& params, const dist::ProcessGroup&) {
  const nn::ModelConfig config = read_model_config((fs::path(dir) / kHfConfigFile).string());
  const WeightFiles weights = WeightFiles::open_directory(dir, "--init-from");
  load_model_parameters(weights, config, params, config.kind == "gpt" ? detect_prefix(weights) : "");
}

// ---- out ------------------------------------------------------------------------------------------

std::map<std::string, std::string> hf_checkpoint_metadata(const nn::ModelConfig& config, const data::TokenDataset& data) {
  std::map<std::string, std::string> m{{"format", "pt"},
                                       {"producer", "meshgrad train"},
                                       {"data", data.source()},
                                       {"data_tokens", data.description()}};
  if (config.kind == "gpt") m["gpt2_config"] = gpt2_config_json(config);
  else if (config.kind == "llama") m[kHfConfigMetadata] = hf_config_json(config);
  else m["model"] = config.kind;   // a registered model (nn::register_model): no file layout of Hugging Face's
  for (const std::string& f : data.input_files()) {
    if (fs::path(f).filename() == "meta.json") m["data_meta"] = fs::absolute(f).lexically_normal().string();
  }
  return m;
}

namespace {

// The "gpt2_config" or "hf_config" metadata of a checkpoint, or a config.json, as the model's
// configuration; the dropout recorded in resid_pdrop is kept (parse_gpt2_config leaves it out).
nn::ModelConfig checkpoint_config(const std::map<std::string, std::string>& metadata, const std::string& path,
                                  const std::string& config_path) {
  if (!config_path.empty()) return read_model_config(config_path);
  const auto gpt = metadata.find("gpt2_config");
  const auto hf = metadata.find(kHfConfigMetadata);
  MG_CHECK(gpt != metadata.end() || hf != metadata.end(), "checkpoint '{}' has no \"gpt2_config\" metadata (nor \"{}\": "
           "written by an older meshgrad, or not by `meshgrad train --save`): give the model's config.json "
           "with --config", path, kHfConfigMetadata);
  const auto it = gpt != metadata.end() ? gpt : hf;
  const std::string origin = fmt::format("'{}' metadata \"{}\"", path, it->first);
  nn::ModelConfig c = gpt != metadata.end() ? parse_gpt2_config(it->second, origin) : parse_hf_config(it->second, origin);
  const nlohmann::json j = io::parse_untrusted_json(it->second, kMaxConfigDepth);
  if (j.contains("resid_pdrop") && j.at("resid_pdrop").is_number()) c.dropout = j.at("resid_pdrop").get<double>();
  if (j.contains("torch_dtype") && j.at("torch_dtype") == "float64") c.dtype = DType::Float64;
  return c;
}

// Tokenizer files and meta.json are read whole, bounded (io::read_small_file).
constexpr std::uint64_t kMaxSmallFileBytes = std::uint64_t{64} << 20;

struct TokenizerFiles {
  std::string vocab, merges;   // paths; empty when there is no tokenizer (or it is a tokenizer.json)
  std::string from;            // for the report
  std::string note;            // why there is none
  std::string hf_json;         // a Hugging Face tokenizer.json, copied as it is
  std::string hf_config;       // its tokenizer_config.json, when there is one
  bool any() const { return !vocab.empty() || !hf_json.empty(); }
};

TokenizerFiles files_at(std::string vocab, std::string merges, std::string from) {
  TokenizerFiles files;
  files.vocab = std::move(vocab);
  files.merges = std::move(merges);
  files.from = std::move(from);
  return files;
}

TokenizerFiles no_tokenizer(std::string why) {
  TokenizerFiles none;
  none.note = std::move(why);
  return none;
}

// A Hugging Face tokenizer.json (+ tokenizer_config.json), else vocab.json + merges.txt, or OpenAI's
// encoder.json + vocab.bpe (the same formats), in dir (text::load_tokenizer's order).
TokenizerFiles tokenizer_in(const std::string& dir, const std::string& from) {
  const fs::path d(dir);
  if (fs::is_regular_file(d / "tokenizer.json")) {
    TokenizerFiles files;
    files.hf_json = (d / "tokenizer.json").string();
    if (fs::is_regular_file(d / "tokenizer_config.json")) files.hf_config = (d / "tokenizer_config.json").string();
    files.from = from;
    return files;
  }
  for (const auto& [v, m] : {std::pair{"vocab.json", "merges.txt"}, std::pair{"encoder.json", "vocab.bpe"}}) {
    if (fs::is_regular_file(d / v) && fs::is_regular_file(d / m))
      return files_at((d / v).string(), (d / m).string(), from);
  }
  throw InvalidArgument(fmt::format("{} '{}' has no tokenizer.json, vocab.json + merges.txt or encoder.json + vocab.bpe",
                                    from, dir));
}

// The id of tokenizer_config.json's `key` ("bos_token": a string or {"content": ...}) in tokenizer
// t: the token the text encodes to when it is one token (an added token is), else none. What
// config.json's bos_token_id names, whether or not the tokenizer adds it to each document.
std::optional<std::int64_t> config_token_id(text::Tokenizer& t, const std::string& config_path, const char* key) {
  if (config_path.empty()) return std::nullopt;
  nlohmann::json c;
  try {
    c = io::parse_untrusted_json(io::read_small_file(config_path, kMaxSmallFileBytes, "tokenizer_config.json"), 16);
  } catch (const io::JsonInputError& e) {
    throw InvalidArgument(fmt::format("tokenizer_config.json '{}' is not valid: {}", config_path, e.what()));
  }
  if (!c.is_object() || !c.contains(key)) return std::nullopt;
  const nlohmann::json& v = c[key];
  const nlohmann::json* text = v.is_string() ? &v : v.is_object() && v.contains("content") ? &v["content"] : nullptr;
  if (text == nullptr || !text->is_string()) return std::nullopt;
  std::vector<text::TokenId> ids;
  t.encode(text->get<std::string>(), ids, /*text_start=*/true);
  if (ids.size() != 1) return std::nullopt;
  return ids[0];
}

// Where the tokenizer of a checkpoint is: --tokenizer, else the prepared data recorded in its
// metadata (data_meta: the copies `meshgrad prepare` made, checked against meta.json's sha256).
TokenizerFiles find_tokenizer(const std::string& tokenizer_dir, const std::map<std::string, std::string>& metadata) {
  if (!tokenizer_dir.empty()) {
    MG_CHECK(fs::is_directory(tokenizer_dir), "--tokenizer '{}' is not a directory", tokenizer_dir);
    return tokenizer_in(tokenizer_dir, "--tokenizer");
  }
  const auto meta_it = metadata.find("data_meta");
  if (meta_it == metadata.end()) {
    const auto tokens = metadata.find("data_tokens");
    if (tokens != metadata.end() && tokens->second == "bytes")
      return no_tokenizer("the model was trained on bytes (token i is byte i): it has no BPE tokenizer");
    return no_tokenizer("the checkpoint records no prepared data (meta.json) to take the tokenizer from; "
                        "give --tokenizer DIR");
  }
  const std::string& meta_path = meta_it->second;
  if (!fs::is_regular_file(meta_path))
    return no_tokenizer(fmt::format("the run's data description '{}' is gone; give --tokenizer DIR", meta_path));
  const nlohmann::json meta = [&] {
    try {
      return io::parse_untrusted_json(io::read_small_file(meta_path, kMaxSmallFileBytes, "meta.json"), 8);
    } catch (const io::JsonInputError& e) {
      throw InvalidArgument(fmt::format("meta.json '{}' is not valid: {}", meta_path, e.what()));
    }
  }();
  const fs::path dir = fs::path(meta_path).parent_path();
  TokenizerFiles files;
  files.from = fmt::format("the prepared data '{}'", dir.string());
  if (meta.is_object() && meta.contains("tokenizer") && meta["tokenizer"].is_object() &&
      meta["tokenizer"].value("kind", std::string()) == "tokenizer.json") {
    // The copies, each checked against its recorded SHA-256 (throws naming the file otherwise).
    const data::PreparedTokenizer prepared = data::load_prepared_tokenizer(dir.string());
    files.hf_json = prepared.files.at(0);
    if (prepared.files.size() > 1) files.hf_config = prepared.files[1];
    return files;
  }
  for (const char* key : {"vocab", "merges"}) {
    const bool described = meta.is_object() && meta.contains("tokenizer") && meta["tokenizer"].is_object() &&
                           meta["tokenizer"].contains(key) && meta["tokenizer"][key].is_object() &&
                           meta["tokenizer"][key].contains("copy") && meta["tokenizer"][key]["copy"].is_string();
    if (!described)
      return no_tokenizer(fmt::format("'{}' names no tokenizer {} copy; give --tokenizer DIR", meta_path, key));
    const std::string path = (dir / meta["tokenizer"][key]["copy"].get<std::string>()).string();
    if (!fs::is_regular_file(path))
      return no_tokenizer(fmt::format("the tokenizer file '{}' of the run's data is gone; give --tokenizer DIR", path));
    const nlohmann::json& sha = meta["tokenizer"][key].value("sha256", nlohmann::json());
    MG_CHECK(sha.is_string() && sha.get<std::string>() == io::sha256_file(path),
             "the tokenizer file '{}' does not match the sha256 '{}' recorded when the data was prepared (was it "
             "replaced?); give --tokenizer DIR", path, io::json_excerpt(sha));
    (std::string(key) == "vocab" ? files.vocab : files.merges) = path;
  }
  return files;
}

// The files of the export, written into a stage beside the target (io::StagedDirectory) and renamed
// onto it at the end: the target is absent or an empty directory, and a directory that appeared there
// meanwhile with files in it is never replaced. Removed on failure. Errors name --out.
class ExportDirectory {
 public:
  explicit ExportDirectory(const std::string& target) : staged_(create_stage(target)) {}

  std::string path(const std::string& leaf) {
    leaves_.push_back(leaf);
    return (fs::path(staged_.path()) / leaf).string();
  }
  void write(const std::string& leaf, const std::string& bytes) {
    io::AtomicFileWriter w(path(leaf));
    w.write(bytes.data(), bytes.size(), leaf);
    w.commit();
  }
  void commit() {
    try {
      staged_.commit(io::ExistingTarget::kReplaceFileOrEmptyDirectory, io::ParentFlush::kIfPossible);
    } catch (const io::FileIoError& e) {
      if (e.op() != io::FileIoError::Op::rename) throw InvalidArgument(fmt::format("--out '{}': {}", staged_.target(), e.what()));
      throw InvalidArgument(fmt::format("--out '{}': cannot move the finished export '{}' into place: {} (nothing was changed "
                                        "at '{}')", staged_.target(), staged_.path(), e.reason(), staged_.target()));
    }
  }
  const std::vector<std::string>& leaves() const { return leaves_; }

 private:
  static io::StagedDirectory create_stage(const std::string& target) {
    try {
      return io::StagedDirectory::create_beside(target);
    } catch (const io::FileIoError& e) {
      throw InvalidArgument(fmt::format("--out '{}': {}", target, e.what()));
    }
  }
  io::StagedDirectory staged_;
  std::vector<std::string> leaves_;
};

// --out must be absent or an empty directory (not a link), in a writable directory.
void check_export_target(const std::string& out) {
  MG_CHECK(!out.empty(), "--out: the path is empty");
  struct stat st {};
  if (::lstat(out.c_str(), &st) == 0) {
    MG_CHECK(!S_ISLNK(st.st_mode), "--out '{}' is a symbolic link; meshgrad does not write through links (give the "
             "path of its target)", out);
    MG_CHECK(S_ISDIR(st.st_mode), "--out '{}' exists and is not a directory: export writes a new directory", out);
    MG_CHECK(fs::is_empty(out), "--out '{}' is a directory that is not empty: export never overwrites files (give a "
             "new or empty directory)", out);
  } else {
    MG_CHECK(errno == ENOENT, "--out '{}': cannot check it: {}", out, std::strerror(errno));
  }
  const fs::path parent = io::directory_path(out).parent_path();   // "hf/" is the directory hf
  const std::string dir = parent.empty() ? "." : parent.string();
  MG_CHECK(fs::is_directory(dir), "--out '{}': its parent '{}' is not a directory", out, dir);
  MG_CHECK(::access(dir.c_str(), W_OK | X_OK) == 0, "--out '{}': its parent '{}' is not writable: {}", out, dir,
           std::strerror(errno));
}

std::string tokenizer_config_json(std::int64_t max_length, bool has_eot) {
  const nlohmann::json eot = has_eot ? nlohmann::json("<|endoftext|>") : nlohmann::json(nullptr);
  const nlohmann::json j = {{"add_bos_token", false},  {"add_prefix_space", false}, {"bos_token", eot},
                            {"eos_token", eot},        {"errors", "replace"},       {"model_max_length", max_length},
                            {"pad_token", nullptr},    {"tokenizer_class", "GPT2Tokenizer"},
                            {"unk_token", eot}};
  return j.dump(2) + "\n";
}

}  // namespace

FullParameters read_full_parameters(const std::string& checkpoint, const std::string& config_path) {
  struct stat st {};
  MG_CHECK(::stat(checkpoint.c_str(), &st) == 0, "--checkpoint '{}': {}", checkpoint, std::strerror(errno));
  FullParameters out;
  if (S_ISDIR(st.st_mode) && !checkpoint::is_checkpoint_path(checkpoint)) {
    MG_CHECK(fs::is_regular_file(fs::path(checkpoint) / kHfConfigFile), "--checkpoint '{}' is a directory but not a "
             "training checkpoint (no manifest.json, no step_XXXXXXXX/ in it) nor a Hugging Face directory (no {}); "
             "export reads those or a safetensors file written by `meshgrad train --save`", checkpoint, kHfConfigFile);
    // A Hugging Face directory: its config.json (or --config) and its weights, whole or sharded.
    const std::string config_file = config_path.empty() ? (fs::path(checkpoint) / kHfConfigFile).string() : config_path;
    out.config = read_model_config(config_file);
    const WeightFiles f = WeightFiles::open_directory(checkpoint, "--checkpoint");
    const HfWeights w = check_model_weights(f, out.config, config_file);
    out.tensors = read_model_tensors(f, out.config, w.prefix);
    if (!out.tensors.empty()) out.config.dtype = out.tensors.front().second.dtype();
    return out;
  }
  if (S_ISDIR(st.st_mode)) {
    // A sharded training checkpoint: every parameter's full tensor from its pieces.
    const std::string dir = checkpoint::resolve_checkpoint(checkpoint);
    const checkpoint::Manifest manifest = checkpoint::read_manifest(dir);
    out.config = config_path.empty() ? checkpoint_model_config(manifest, dir) : read_model_config(config_path);
    out.metadata = checkpoint_data_metadata(manifest);
    out.tensors = checkpoint::read_full_tensors(dir, manifest, model_parameter_shapes(out.config));
    return out;
  }
  MG_CHECK(S_ISREG(st.st_mode), "--checkpoint '{}' is not a regular file", checkpoint);
  const WeightFiles f = WeightFiles::open_file(checkpoint);
  out.config = checkpoint_config(f.metadata(), checkpoint, config_path);
  out.metadata = f.metadata();
  const HfWeights w = check_model_weights(f, out.config, config_path.empty() ? checkpoint + " metadata" : config_path);
  out.tensors = read_model_tensors(f, out.config, w.prefix);
  return out;
}

ExportResult export_hf(const ExportOptions& o) {
  const io::FloatStorage storage = io::parse_float_storage(o.dtype);
  check_export_target(o.out_dir);
  FullParameters ck = read_full_parameters(o.checkpoint, o.config);

  ExportResult result;
  const TokenizerFiles tok = find_tokenizer(o.tokenizer, ck.metadata);
  std::optional<std::int64_t> eot, bos;   // config.json's eos / bos token ids
  if (tok.any()) {
    text::Tokenizer t = tok.hf_json.empty() ? text::Tokenizer::from_files(tok.vocab, tok.merges)
                                            : text::Tokenizer::from_hf_json(tok.hf_json, tok.hf_config);
    MG_CHECK(t.vocab_size() <= ck.config.vocab, "the tokenizer of {} has {} ids but the model's vocabulary is {}: not "
             "this model's tokenizer", tok.from, t.vocab_size(), ck.config.vocab);
    if (tok.hf_json.empty()) {
      if (t.eot_id()) eot = bos = *t.eot_id();   // GPT-2's <|endoftext|> is both
    } else {
      if (t.eos_id()) eot = *t.eos_id();
      bos = !t.bos_ids().empty() ? std::optional<std::int64_t>(t.bos_ids().front())
                                 : config_token_id(t, tok.hf_config, "bos_token");
      if (!bos) bos = eot;   // GPT-2's tokenizer.json: <|endoftext|> is both
      MG_CHECK(ck.config.kind != "gpt" || bos == eot, "export: a GPT-2 config.json has one <|endoftext|> for bos and "
               "eos, and the tokenizer of {} has bos {} and eos {}", tok.from, bos.value_or(-1), eot.value_or(-1));
    }
    result.tokenizer = tok.from;
  } else {
    result.note = tok.note;
  }

  std::vector<std::pair<std::string, Tensor>> tensors;
  for (auto& [name, t] : ck.tensors) {
    result.parameters += t.numel();
    // float32: converted (a float64 run rounds to nearest); half: rounded once from the checkpoint's values.
    tensors.emplace_back(name, storage == io::FloatStorage::Native ? t.to(DType::Float32) : t);
  }
  ck.tensors.clear();

  ExportDirectory staged(o.out_dir);
  staged.write(kHfConfigFile, hf_config_json(ck.config, {o.dtype, bos, eot}));
  write_model_tensors(staged.path(kHfWeightsFile), ck.config, tensors, {{"format", "pt"}}, storage);
  if (!tok.hf_json.empty()) {   // copied byte for byte: Hugging Face reads them as they are
    staged.write("tokenizer.json", io::read_small_file(tok.hf_json, kMaxSmallFileBytes, "tokenizer file"));
    if (!tok.hf_config.empty()) {
      staged.write("tokenizer_config.json", io::read_small_file(tok.hf_config, kMaxSmallFileBytes, "tokenizer file"));
    }
  }
  if (!tok.vocab.empty()) {
    staged.write("vocab.json", io::read_small_file(tok.vocab, kMaxSmallFileBytes, "tokenizer file"));
    staged.write("merges.txt", io::read_small_file(tok.merges, kMaxSmallFileBytes, "tokenizer file"));
    staged.write("tokenizer_config.json", tokenizer_config_json(ck.config.n_positions(), eot.has_value()));
  }
  staged.commit();
  result.files = staged.leaves();
  return result;
}

}  // namespace meshgrad::interop
