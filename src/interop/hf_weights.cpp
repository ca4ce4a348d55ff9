// A model's tensors in Hugging Face files (contract in include/meshgrad/interop/hf_weights.hpp).
#include "meshgrad/interop/hf_weights.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <filesystem>
#include <optional>
#include <regex>
#include <set>

#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/checkpoint/parameter_file.hpp"
#include "meshgrad/interop/gpt2_config.hpp"
#include "meshgrad/interop/model_tensors.hpp"
#include "meshgrad/io/file_io.hpp"
#include "meshgrad/io/json_input.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad::interop {

namespace fs = std::filesystem;

namespace {

// An index.json is a few hundred KB for the largest models (one line per tensor).
constexpr std::uint64_t kMaxIndexBytes = std::uint64_t{64} << 20;

std::string join_quoted(const std::vector<std::string>& items, std::size_t max_items = 8) {
  std::string out;
  for (std::size_t i = 0; i < items.size() && i < max_items; ++i) out += (i ? ", '" : "'") + items[i] + "'";
  if (items.size() > max_items) out += fmt::format(" and {} more", items.size() - max_items);
  return out;
}

// The index's weight_map as (tensor, shard file) pairs, every file a plain name in the directory.
std::map<std::string, std::string> read_weight_map(const std::string& index_path, const std::string& option,
                                                   std::map<std::string, std::string>& metadata) {
  nlohmann::json j;
  try {
    j = io::parse_untrusted_json(io::read_small_file(index_path, kMaxIndexBytes, "model.safetensors.index.json"), 8);
  } catch (const io::JsonInputError& e) {
    throw InvalidArgument(fmt::format("{}: index '{}' is not valid JSON: {}", option, index_path, e.what()));
  }
  MG_CHECK(j.is_object() && j.contains("weight_map") && j.at("weight_map").is_object(), "{}: index '{}' has no "
           "\"weight_map\" object (a sharded Hugging Face directory's index maps every tensor to its shard file)",
           option, index_path);
  std::map<std::string, std::string> map;
  for (const auto& [name, file] : j.at("weight_map").items()) {
    MG_CHECK(file.is_string(), "{}: index '{}': \"weight_map\" gives tensor '{}' the file {}, not a file name", option,
             index_path, name, io::json_excerpt(file));
    const std::string leaf = file.get<std::string>();
    MG_CHECK(!leaf.empty() && leaf.find('/') == std::string::npos && leaf != "." && leaf != "..", "{}: index '{}': "
             "tensor '{}' is in '{}', which is not a file name in the directory (shards lie beside the index)", option,
             index_path, name, leaf);
    map.emplace(name, leaf);
  }
  MG_CHECK(!map.empty(), "{}: index '{}' has an empty \"weight_map\"", option, index_path);
  if (j.contains("metadata") && j.at("metadata").is_object()) {
    for (const auto& [key, value] : j.at("metadata").items()) metadata[key] = value.is_string() ? value.get<std::string>() : value.dump();
  }
  return map;
}

// "model.layers.<i>.<rest>" -> i; nullopt for other names.
std::optional<std::int64_t> llama_layer(const std::string& name) {
  static const std::regex layer(R"(^model\.layers\.(\d{1,9})\..*)");
  std::smatch m;
  if (!std::regex_match(name, m, layer)) return std::nullopt;
  return std::stoll(m[1].str());
}

// Whether two tensors read from files hold the same values (compared in float64: exact for every
// dtype meshgrad reads).
bool same_values(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape()) return false;
  const Tensor x = a.to(DType::Float64).contiguous(), y = b.to(DType::Float64).contiguous();
  const double* xp = x.data<double>();
  const double* yp = y.data<double>();
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    if (xp[i] != yp[i]) return false;
  }
  return true;
}

const ModelTensor* find_spec(const std::vector<ModelTensor>& specs, const std::string& name) {
  const auto it = std::find_if(specs.begin(), specs.end(), [&](const ModelTensor& t) { return t.name == name; });
  return it == specs.end() ? nullptr : &*it;
}

}  // namespace

// ---- WeightFiles ----------------------------------------------------------------------------------

WeightFiles WeightFiles::open_file(const std::string& path) {
  WeightFiles w;
  w.origin_ = path;
  w.files_.emplace_back(path);
  for (const std::string& name : w.files_.front().names()) w.where_.emplace(name, 0);
  w.metadata_ = w.files_.front().metadata();
  return w;
}

WeightFiles WeightFiles::open_directory(const std::string& dir, const std::string& option) {
  const fs::path d(dir);
  if (fs::is_regular_file(d / "model.safetensors")) return open_file((d / "model.safetensors").string());
  const std::string index_path = (d / kHfIndexFile).string();
  MG_CHECK(fs::is_regular_file(index_path), "{} '{}' has neither model.safetensors nor {} (a Hugging Face directory "
           "holds one of them; pytorch_model.bin is not read)", option, dir, kHfIndexFile);
  WeightFiles w;
  w.origin_ = index_path;
  const std::map<std::string, std::string> map = read_weight_map(index_path, option, w.metadata_);
  std::map<std::string, std::size_t> file_index;   // shard leaf -> files_ index
  for (const auto& [name, leaf] : map) {
    if (file_index.count(leaf)) continue;
    MG_CHECK(fs::is_regular_file(d / leaf), "{}: index '{}' puts tensor '{}' in '{}', which is not a file in '{}'",
             option, index_path, name, leaf, dir);
    file_index.emplace(leaf, w.files_.size());
    w.files_.emplace_back((d / leaf).string());
  }
  static const std::regex shard(R"(^model-\d+-of-\d+\.safetensors$)");
  for (const fs::directory_entry& e : fs::directory_iterator(d)) {
    const std::string leaf = e.path().filename().string();
    MG_CHECK(!std::regex_match(leaf, shard) || file_index.count(leaf), "{}: '{}' is a shard file in '{}' that index "
             "'{}' does not name: the directory mixes two models' shards, or the index is stale", option, leaf, dir,
             index_path);
  }
  // Every tensor of every shard is in exactly one shard and where the map says.
  std::map<std::string, std::string> held;   // tensor -> the shard holding it
  for (const auto& [leaf, i] : file_index) {
    for (const std::string& name : w.files_[i].names()) {
      const auto [it, fresh] = held.emplace(name, leaf);
      MG_CHECK(fresh, "{}: tensor '{}' is in two shards of '{}', '{}' and '{}': which one is the model is ambiguous",
               option, name, dir, it->second, leaf);
    }
  }
  for (const auto& [name, leaf] : map) {
    const auto it = held.find(name);
    MG_CHECK(it != held.end() && it->second == leaf, "{}: index '{}' puts tensor '{}' in '{}', but {}", option,
             index_path, name, leaf, it == held.end() ? "no shard holds it" : "it is in '" + it->second + "'");
    w.where_.emplace(name, file_index.at(leaf));
  }
  return w;
}

std::vector<std::string> WeightFiles::names() const {
  std::vector<std::string> out;
  for (const auto& [name, i] : where_) out.push_back(name);
  return out;
}

const io::SafetensorsEntry& WeightFiles::entry(const std::string& name) const {
  const auto it = where_.find(name);
  MG_CHECK(it != where_.end(), "weights '{}' hold no tensor '{}'", origin_, name);
  return files_[it->second].entry(name);
}

const std::string& WeightFiles::file_of(const std::string& name) const {
  const auto it = where_.find(name);
  MG_CHECK(it != where_.end(), "weights '{}' hold no tensor '{}'", origin_, name);
  return files_[it->second].path();
}

Tensor WeightFiles::get(const std::string& name) const {
  const auto it = where_.find(name);
  MG_CHECK(it != where_.end(), "weights '{}' hold no tensor '{}'", origin_, name);
  return files_[it->second].get(name);
}

// ---- checks and loading -----------------------------------------------------------------------------

std::vector<std::string> check_llama_weights(const WeightFiles& f, const nn::ModelConfig& config,
                                             const std::string& config_origin) {
  const std::string model = fmt::format("the {} that config '{}' describes ({} layers, hidden {}, {} heads, {} kv "
                                        "heads, vocab {})", config.model_type, config_origin, config.layers,
                                        config.hidden, config.heads, config.kv_head_count(), config.vocab);
  std::vector<std::string> missing, dtypes;
  for (const ModelTensor& t : model_tensors(config)) {
    for (const std::string& name : t.file_names()) {
      if (!f.contains(name)) {
        missing.push_back(name);
        continue;
      }
      const io::SafetensorsEntry& e = f.entry(name);
      MG_CHECK(e.shape == t.file_shape(), "weights '{}': tensor '{}' has shape {} but {} gives it {}{}", f.file_of(name),
               name, shape_str(e.shape), model, shape_str(t.file_shape()),
               t.transposed ? " (a torch.nn.Linear weight, [out, in])" : "");
      MG_CHECK(e.readable && e.dtype != DType::Int64, "weights '{}': tensor '{}' is {}; a parameter must be F32, F64, "
               "F16 or BF16", f.file_of(name), name, e.stored);
      if (std::find(dtypes.begin(), dtypes.end(), e.stored) == dtypes.end()) dtypes.push_back(e.stored);
    }
  }
  MG_CHECK(missing.empty(), "weights '{}' miss {} tensor{} of {}: {}", f.origin(), missing.size(),
           missing.size() == 1 ? "" : "s", model, join_quoted(missing));
  for (const std::string& name : f.names()) {
    const std::optional<std::int64_t> layer = llama_layer(name);
    MG_CHECK(!layer || *layer < config.layers, "weights '{}' hold '{}' but config '{}' has num_hidden_layers = {}",
             f.file_of(name), name, config_origin, config.layers);
  }
  if (config.tie_word_embeddings && f.contains("lm_head.weight")) {
    MG_CHECK(same_values(f.get("lm_head.weight"), f.get("model.embed_tokens.weight")), "weights '{}': 'lm_head.weight' "
             "differs from 'model.embed_tokens.weight' but config '{}' has tie_word_embeddings true: the output layer "
             "is the embedding, and loading it would drop this head (set tie_word_embeddings false to train it)",
             f.file_of("lm_head.weight"), config_origin);
  }
  return dtypes;
}

std::vector<std::pair<std::string, Tensor>> read_model_tensors(const WeightFiles& files, const nn::ModelConfig& config,
                                                               const std::string& prefix) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const ModelTensor& t : model_tensors(config)) {
    out.emplace_back(t.name, from_file_tensors(t, [&](const std::string& name) { return files.get(prefix + name); }));
  }
  return out;
}

void load_model_parameters(const WeightFiles& files, const nn::ModelConfig& config,
                           const std::vector<nn::Parameter*>& params, const std::string& prefix) {
  const std::vector<ModelTensor> specs = model_tensors(config);
  // Pass 1: every parameter is the model's and in the files with its file shape.
  for (const nn::Parameter* p : params) {
    MG_CHECK(p != nullptr, "load_model_parameters: a null parameter");
    const ModelTensor* spec = find_spec(specs, p->name);
    MG_CHECK(spec != nullptr, "load_model_parameters: parameter '{}' is not one of the {} model's", p->name,
             config.kind);
    MG_CHECK(spec->shape == p->full_shape, "load_model_parameters: parameter '{}' has full shape {} but the model's is "
             "{}", p->name, shape_str(p->full_shape), shape_str(spec->shape));
    for (const std::string& name : spec->file_names()) {
      const std::string stored = prefix + name;
      MG_CHECK(files.contains(stored), "weights '{}' hold no tensor '{}' for parameter '{}'", files.origin(), stored,
               p->name);
      const io::SafetensorsEntry& e = files.entry(stored);
      MG_CHECK(e.shape == spec->file_shape(), "weights '{}': tensor '{}' has shape {}, expected {}",
               files.file_of(stored), stored, shape_str(e.shape), shape_str(spec->file_shape()));
      MG_CHECK(e.readable && e.dtype != DType::Int64, "weights '{}': tensor '{}' is {}; a parameter must be F32, F64, "
               "F16 or BF16", files.file_of(stored), stored, e.stored);
    }
  }
  // Pass 2: read, lay out as meshgrad does, convert, keep this rank's piece (see load_parameters).
  autograd::NoGradGuard no_grad;
  for (nn::Parameter* p : params) {
    const ModelTensor& spec = *find_spec(specs, p->name);
    const Tensor full =
        from_file_tensors(spec, [&](const std::string& name) { return files.get(prefix + name); }).to(p->value.dtype());
    p->value.detach().copy_from(nn::take_shard(full, *p));
  }
}

void write_model_tensors(const std::string& path, const nn::ModelConfig& config,
                         const std::vector<std::pair<std::string, Tensor>>& tensors,
                         const std::map<std::string, std::string>& metadata, io::FloatStorage storage) {
  const std::vector<ModelTensor> specs = model_tensors(config);
  MG_CHECK(tensors.size() == specs.size(), "write_model_tensors '{}': {} tensors for a model of {}", path,
           tensors.size(), specs.size());
  std::vector<std::pair<std::string, Tensor>> file;
  file.reserve(specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    MG_CHECK(tensors[i].first == specs[i].name, "write_model_tensors '{}': tensor #{} is '{}', the model's is '{}'", path,
             i, tensors[i].first, specs[i].name);
    for (auto& piece : to_file_tensors(specs[i], tensors[i].second)) file.push_back(std::move(piece));
  }
  io::write_safetensors(path, file, metadata, storage);
}

void save_model_parameters(const std::string& path, const nn::ModelConfig& config,
                           const std::vector<nn::Parameter*>& params, const dist::ProcessGroup& group,
                           const std::map<std::string, std::string>& metadata, const dist::ProcessGroup* stages) {
  // GPT-2's file layout is meshgrad's (the bytes its --save always wrote), and a registered model
  // (nn::register_model) has no other: its parameters under their own names.
  if (config.kind != "llama") {
    checkpoint::save_parameters(path, params, group, 0, metadata, stages);
    return;
  }
  const std::vector<std::pair<std::string, Tensor>> full = checkpoint::gather_full_parameters(params, group, 0, stages);
  const bool writes = group.rank() == 0 && (stages == nullptr || stages->rank() == 0);
  if (writes) write_model_tensors(path, config, full, metadata);
}

}  // namespace meshgrad::interop
