// Text generation (contract in include/meshgrad/generate/sample.hpp).
#include "meshgrad/generate/sample.hpp"

#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/checkpoint/directory.hpp"
#include "meshgrad/checkpoint/reader.hpp"
#include "meshgrad/comm/agreement.hpp"
#include "meshgrad/interop/checkpoint_model.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <fstream>
#include <mutex>
#include <numeric>

#include "meshgrad/nn/layers.hpp"
#include "meshgrad/tensor/error.hpp"
#include "meshgrad/tensor/random.hpp"
#include "meshgrad/text/utf8.hpp"
#include "meshgrad/checkpoint/parameter_file.hpp"
#include "meshgrad/interop/gpt2_config.hpp"
#include "meshgrad/interop/hf_config.hpp"
#include "meshgrad/interop/hf_io.hpp"
#include "meshgrad/io/file_io.hpp"
#include "meshgrad/io/json_input.hpp"
#include "meshgrad/io/safetensors.hpp"

namespace meshgrad::generate {

namespace fs = std::filesystem;

namespace {

constexpr const char* kNotACheckpoint = "is not a safetensors file or model directory";

// The safetensors file at path, or an error saying what a checkpoint may be.
io::SafetensorsFile open_weights(const std::string& checkpoint, const std::string& path) {
  try {
    return io::SafetensorsFile(path);
  } catch (const io::SafetensorsError& e) {
    throw InvalidArgument(fmt::format("sample: checkpoint '{}' {} ({})", checkpoint, kNotACheckpoint, e.what()));
  }
}

// Whether dir holds a tokenizer's two files (either naming).
bool has_tokenizer_files(const fs::path& dir) {
  return (fs::is_regular_file(dir / "vocab.json") && fs::is_regular_file(dir / "merges.txt")) ||
         (fs::is_regular_file(dir / "encoder.json") && fs::is_regular_file(dir / "vocab.bpe")) ||
         fs::is_regular_file(dir / "tokenizer.json");
}

// A `meshgrad prepare` directory's tokenizer: meta.json's "tokenizer" names {"copy": a file in
// the directory, "file": the original}; the copy is preferred (the directory may have moved).
text::Tokenizer prepared_tokenizer(const fs::path& dir) {
  const fs::path meta_path = dir / "meta.json";
  nlohmann::json meta;
  try {
    meta = io::parse_untrusted_json(io::read_small_file(meta_path.string(), interop::kMaxConfigBytes, "sample: meta.json"), 16);
  } catch (const io::JsonInputError& e) {
    throw InvalidArgument(fmt::format("sample: --tokenizer: '{}' is not valid JSON: {}", meta_path.string(), e.what()));
  }
  std::string files[2];
  const char* keys[2] = {"vocab", "merges"};
  for (int i = 0; i < 2; ++i) {
    const nlohmann::json* entry = nullptr;
    if (meta.is_object() && meta.contains("tokenizer") && meta["tokenizer"].is_object() &&
        meta["tokenizer"].contains(keys[i]) && meta["tokenizer"][keys[i]].is_object()) {
      entry = &meta["tokenizer"][keys[i]];
    }
    MG_CHECK(entry != nullptr, "sample: --tokenizer: '{}' has no \"tokenizer\": {{\"{}\": {{...}}}} (is it a "
             "meta.json written by `meshgrad prepare`?)", meta_path.string(), keys[i]);
    for (const char* field : {"copy", "file"}) {
      if (!entry->contains(field) || !(*entry)[field].is_string()) continue;
      const fs::path p = std::string(field) == "copy" ? dir / (*entry)[field].get<std::string>()
                                                      : fs::path((*entry)[field].get<std::string>());
      if (fs::is_regular_file(p)) {
        files[i] = p.string();
        break;
      }
    }
    MG_CHECK(!files[i].empty(), "sample: --tokenizer: the {} file that '{}' names is neither in '{}' nor at its "
             "original path", keys[i], meta_path.string(), dir.string());
  }
  return text::Tokenizer::from_files(files[0], files[1]);
}

}  // namespace

// ---- weights ---------------------------------------------------------------------------------------

namespace {

// The model's dtype (its embedding's), the sizes sampling runs at, and the weights checked against
// the configuration before a model of its size is built.
SampleWeights finish_sample_weights(SampleWeights w, const interop::WeightFiles& files) {
  const std::string embedding = w.model.kind == "gpt" ? "wte.weight" : "model.embed_tokens.weight";
  MG_CHECK(files.contains(embedding), "sample: weights '{}' have no tensor '{}' (Hugging Face names expected, as "
           "`meshgrad train --save` and `meshgrad export` write them; the model is {})", files.origin(), embedding,
           w.config_source);
  w.model.dtype = files.entry(embedding).dtype;
  MG_CHECK(w.model.dtype != DType::Int64, "sample: weights '{}': {} is int64, expected float32 or float64",
           files.origin(), embedding);
  w.model.dropout = 0.0;
  w.model.batch = 1;
  w.model.seq = w.model.n_positions();
  if (w.model.kind == "gpt" && files.origin() == files.file_of(embedding)) {
    interop::check_gpt2_config_against_weights(w.model, w.config_source, io::SafetensorsFile(files.origin()));
  } else {
    (void)interop::check_model_weights(files, w.model, w.config_source);
  }
  return w;
}

}  // namespace

SampleWeights resolve_sample_weights(const std::string& checkpoint) {
  MG_CHECK(!checkpoint.empty(), "sample: --checkpoint is empty");
  std::error_code ec;
  const fs::file_status status = fs::status(checkpoint, ec);
  MG_CHECK(fs::exists(status), "sample: checkpoint '{}' does not exist", checkpoint);
  SampleWeights w;
  w.checkpoint = checkpoint;
  std::optional<io::SafetensorsFile> file;
  if (fs::is_directory(status) && checkpoint::is_checkpoint_path(checkpoint)) {
    // (c) A sharded training checkpoint (or a --checkpoint-dir: its newest): each rank reads its own
    // pieces; the sizes come from the saved configuration, the tokenizer from the run's prepared data.
    w.sharded_checkpoint = checkpoint::resolve_checkpoint(checkpoint);
    const checkpoint::Manifest manifest = checkpoint::read_manifest(w.sharded_checkpoint);
    w.weights = w.sharded_checkpoint;
    w.config_source = fmt::format("checkpoint '{}' configuration", w.sharded_checkpoint);
    w.model = interop::checkpoint_model_config(manifest, w.sharded_checkpoint);
    MG_CHECK(w.model.dtype != DType::Int64, "sample: checkpoint '{}': wte.weight is int64", w.sharded_checkpoint);
    const std::map<std::string, std::string> data = interop::checkpoint_data_metadata(manifest);
    const auto meta = data.find("data_meta");
    if (meta != data.end() && has_tokenizer_files(fs::path(meta->second).parent_path()))
      w.tokenizer_dir = fs::path(meta->second).parent_path().string();
    w.model.dropout = 0.0;
    w.model.batch = 1;
    w.model.seq = w.model.n_positions();
    return w;
  }
  if (fs::is_directory(status)) {
    // (b) Hugging Face layout, either family, its weights whole or sharded.
    const fs::path dir(checkpoint);
    MG_CHECK(fs::is_regular_file(dir / "config.json") &&
             (fs::is_regular_file(dir / "model.safetensors") || fs::is_regular_file(dir / interop::kHfIndexFile)),
             "sample: checkpoint '{}' {}: a model directory holds config.json and model.safetensors (or {} and its "
             "shards)", checkpoint, kNotACheckpoint, interop::kHfIndexFile);
    w.weights = dir.string();
    w.config_source = (dir / "config.json").string();
    w.model = interop::read_model_config(w.config_source);
    if (has_tokenizer_files(dir)) w.tokenizer_dir = dir.string();
    return finish_sample_weights(w, interop::WeightFiles::open_directory(checkpoint, "sample: checkpoint"));
  } else {
    MG_CHECK(fs::is_regular_file(status), "sample: checkpoint '{}' {} (it is neither a regular file nor a directory)",
             checkpoint, kNotACheckpoint);
    // (a) One file: the sizes from its own metadata (what `train --save` wrote beside the tensors),
    // else from a config.json beside it (a file written by other tools). The file's own description
    // wins: a config.json that happens to lie in the same folder must not change the model (with the
    // same shapes nothing would catch it).
    w.weights = checkpoint;
    file.emplace(open_weights(checkpoint, w.weights));
    const fs::path beside = fs::path(checkpoint).parent_path() / "config.json";
    const auto gpt = file->metadata().find("gpt2_config");
    const auto meta = gpt != file->metadata().end() ? gpt : file->metadata().find(interop::kHfConfigMetadata);
    if (meta != file->metadata().end()) {
      w.config_source = fmt::format("'{}' metadata \"{}\"", checkpoint, meta->first);
      w.model = meta == gpt ? interop::parse_gpt2_config(meta->second, w.config_source)
                            : interop::parse_hf_config(meta->second, w.config_source);
      if (fs::is_regular_file(beside)) w.ignored_config = beside.string();
    } else if (fs::is_regular_file(beside)) {
      w.config_source = beside.string();
      w.model = interop::read_model_config(w.config_source);
    } else {
      throw InvalidArgument(fmt::format(
          "sample: no model configuration for '{}': there is no config.json beside it ('{}') and its metadata has no "
          "\"gpt2_config\" nor \"hf_config\" (`meshgrad train --save` writes one; for other files put a Hugging "
          "Face config.json beside them)",
          checkpoint, beside.string()));
    }
    // The tokenizer: the training run's prepared data (metadata "data_meta": its meta.json, which
    // `train --save` records), else tokenizer files beside the file.
    const auto data_meta = file->metadata().find("data_meta");
    const fs::path folder = fs::path(checkpoint).parent_path().empty() ? fs::path(".") : fs::path(checkpoint).parent_path();
    if (data_meta != file->metadata().end() && has_tokenizer_files(fs::path(data_meta->second).parent_path())) {
      w.tokenizer_dir = fs::path(data_meta->second).parent_path().string();
    } else if (has_tokenizer_files(folder)) {
      w.tokenizer_dir = folder.string();
    }
  }
  return finish_sample_weights(w, interop::WeightFiles::open_file(w.weights));
}

void load_sample_weights(const SampleWeights& weights, const std::vector<nn::Parameter*>& params,
                         const dist::DeviceMesh& mesh) {
  if (weights.sharded_checkpoint.empty()) {
    const interop::WeightFiles files = fs::is_directory(weights.weights)
                                           ? interop::WeightFiles::open_directory(weights.weights, "sample: checkpoint")
                                           : interop::WeightFiles::open_file(weights.weights);
    interop::load_model_parameters(files, weights.model, params);
    return;
  }
  // Only this rank's pieces of the parameters (the optimizer state is not read), checked, then copied.
  const checkpoint::Manifest manifest = checkpoint::read_manifest(weights.sharded_checkpoint);
  std::vector<checkpoint::PieceRequest> requests;
  for (const nn::Parameter* p : params) requests.push_back({p->name, p->full_shape, p->layout(), p->value.dtype()});
  const std::vector<Tensor> pieces = checkpoint::read_pieces(weights.sharded_checkpoint, manifest, requests);
  autograd::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params.size(); ++i) params[i]->value.detach().copy_from(pieces[i]);
}

// ---- tokens ------------------------------------------------------------------------------------------

SampleTokenizer SampleTokenizer::bytes() {
  SampleTokenizer t;
  t.description_ = "bytes";
  return t;
}

SampleTokenizer SampleTokenizer::bpe(text::Tokenizer tokenizer, std::string source) {
  SampleTokenizer t;
  t.bpe_.emplace(std::move(tokenizer));
  t.description_ = t.bpe_->kind() + " from " + source;
  return t;
}

std::vector<std::int64_t> SampleTokenizer::encode(std::string_view text) {
  std::vector<std::int64_t> out;
  if (!bpe_) {
    for (char c : text) out.push_back(static_cast<unsigned char>(c));
    return out;
  }
  // A tokenizer that adds BOS (a tokenizer.json: Llama 3's <|begin_of_text|>) starts the prompt with it,
  // as prepare started each training document.
  for (text::TokenId id : bpe_->bos_ids()) out.push_back(id);
  for (text::TokenId id : bpe_->encode(text)) out.push_back(id);
  return out;
}

std::string SampleTokenizer::token_bytes(std::int64_t id) const {
  MG_CHECK(id >= 0 && id < vocab_size(), "sample: token id {} is outside the tokenizer's vocabulary [0, {})", id,
           vocab_size());
  if (!bpe_) return std::string(1, static_cast<char>(id));
  return bpe_->token_bytes(static_cast<text::TokenId>(id));
}

std::int64_t SampleTokenizer::vocab_size() const { return bpe_ ? bpe_->vocab_size() : 256; }

SampleTokenizer resolve_sample_tokenizer(const std::string& tokenizer_dir, const SampleWeights& weights) {
  const std::int64_t model_vocab = weights.model.vocab;
  SampleTokenizer t = SampleTokenizer::bytes();
  if (!tokenizer_dir.empty()) {
    const fs::path dir(tokenizer_dir);
    MG_CHECK(fs::is_directory(dir), "sample: --tokenizer '{}' is not a directory (expected one with vocab.json + "
             "merges.txt, encoder.json + vocab.bpe, or a `meshgrad prepare` output)", tokenizer_dir);
    if (!has_tokenizer_files(dir) && fs::is_regular_file(dir / "meta.json")) {
      t = SampleTokenizer::bpe(prepared_tokenizer(dir), tokenizer_dir);
    } else {
      t = SampleTokenizer::bpe(text::Tokenizer::from_directory(tokenizer_dir), tokenizer_dir);
    }
  } else if (!weights.tokenizer_dir.empty()) {
    t = SampleTokenizer::bpe(text::Tokenizer::from_directory(weights.tokenizer_dir), weights.tokenizer_dir);
  } else {
    MG_CHECK(model_vocab == 256, "sample: the model's vocabulary has {} tokens ({}), not the 256 of bytes: pass "
             "--tokenizer DIR (vocab.json + merges.txt, or the `meshgrad prepare` directory it was trained on)",
             model_vocab, weights.config_source);
  }
  MG_CHECK(t.vocab_size() <= model_vocab, "sample: the tokenizer ({}) has {} tokens, more than the model's vocabulary "
           "of {} ({}): it is not this model's tokenizer", t.description(), t.vocab_size(), model_vocab,
           weights.config_source);
  return t;
}

// ---- choosing a token ------------------------------------------------------------------------------

namespace {

// Hugging Face's TopPLogitsWarper on the kept ids and their weights (exp of the scaled logits, total
// their sum): in ascending order of weight (equal weights: the higher id first, so the lower ids
// rank as more likely), drop the tokens whose cumulative probability is <= 1 - top_p, never the
// last (the most likely). kept stays in id order; total becomes the sum of what is left.
void keep_nucleus(std::vector<std::int64_t>& kept, std::vector<double>& weight, double& total, double top_p) {
  std::vector<std::size_t> order(kept.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return weight[a] < weight[b] || (weight[a] == weight[b] && kept[a] > kept[b]);
  });
  std::vector<bool> drop(kept.size(), false);
  double cumulative = 0;
  for (std::size_t j = 0; j + 1 < order.size(); ++j) {
    cumulative += weight[order[j]] / total;
    if (cumulative > 1 - top_p) break;
    drop[order[j]] = true;
  }
  std::vector<std::int64_t> ids;
  std::vector<double> weights;
  total = 0;
  for (std::size_t j = 0; j < kept.size(); ++j) {
    if (drop[j]) continue;
    ids.push_back(kept[j]);
    weights.push_back(weight[j]);
    total += weight[j];
  }
  kept = std::move(ids);
  weight = std::move(weights);
}

}  // namespace

std::int64_t choose_token(std::span<const double> logits, const SamplingOptions& o, std::uint64_t step,
                          std::int64_t allowed) {
  const auto v = static_cast<std::int64_t>(logits.size());
  const std::int64_t n = allowed > 0 ? std::min(allowed, v) : v;
  MG_CHECK(n >= 1, "sample: no token to choose from (vocabulary of {})", v);
  MG_CHECK(o.temperature >= 0 && std::isfinite(o.temperature), "sample: --temperature must be >= 0, got {}",
           o.temperature);
  MG_CHECK(o.top_k >= 0, "sample: --top-k must be >= 0, got {}", o.top_k);
  MG_CHECK(o.top_p > 0 && o.top_p <= 1, "sample: --top-p must be in (0, 1] (1 = off), got {}", o.top_p);
  for (std::int64_t i = 0; i < n; ++i) {
    MG_CHECK(std::isfinite(logits[static_cast<std::size_t>(i)]), "sample: the logit of token {} at step {} is {}: "
             "the model's weights or activations are not finite", i, step, logits[static_cast<std::size_t>(i)]);
  }
  auto logit = [&](std::int64_t i) { return logits[static_cast<std::size_t>(i)]; };
  // Greedy: the first maximum in id order.
  if (o.temperature == 0) {
    std::int64_t best = 0;
    for (std::int64_t i = 1; i < n; ++i) {
      if (logit(i) > logit(best)) best = i;
    }
    return best;
  }
  std::vector<std::int64_t> kept(static_cast<std::size_t>(n));
  std::iota(kept.begin(), kept.end(), std::int64_t{0});
  if (o.top_k > 0 && o.top_k < n) {
    // The k largest; among equal values the lower ids. Then back to id order for the draw.
    const auto k = static_cast<std::ptrdiff_t>(o.top_k);
    std::partial_sort(kept.begin(), kept.begin() + k, kept.end(), [&](std::int64_t a, std::int64_t b) {
      return logit(a) > logit(b) || (logit(a) == logit(b) && a < b);
    });
    kept.resize(static_cast<std::size_t>(k));
    std::sort(kept.begin(), kept.end());
  }
  double max = -INFINITY;
  for (std::int64_t i : kept) max = std::max(max, logit(i));
  std::vector<double> weight(kept.size());
  double total = 0;
  for (std::size_t j = 0; j < kept.size(); ++j) {
    weight[j] = std::exp((logit(kept[j]) - max) / o.temperature);   // the max gives 1: total >= 1
    total += weight[j];
  }
  if (o.top_p < 1) keep_nucleus(kept, weight, total, o.top_p);
  const double u = random::uniform(o.seed, step) * total;
  double cumulative = 0;
  for (std::size_t j = 0; j < kept.size(); ++j) {
    cumulative += weight[j];
    if (u < cumulative) return kept[j];
  }
  return kept.back();   // u within rounding of the total
}

// ---- generation --------------------------------------------------------------------------------------

Generation generate(nn::Model& model, const std::vector<std::int64_t>& prompt, const GenerateOptions& o,
                    const std::function<void(std::int64_t)>& on_token) {
  const std::int64_t n_positions = model.config().n_positions();
  MG_CHECK(o.tokens >= 1, "sample: --tokens must be >= 1, got {}", o.tokens);
  MG_CHECK(!prompt.empty() && static_cast<std::int64_t>(prompt.size()) <= n_positions,
           "sample: the prompt has {} tokens; the model takes 1 to n_positions = {}", prompt.size(), n_positions);
  Generation g;
  std::vector<std::int64_t> sequence = prompt;
  nn::KvCache cache = model.new_cache(1);
  auto run = [&](const std::vector<std::int64_t>& ids) {
    return model.decode(Tensor::from_int64(ids, {1, static_cast<std::int64_t>(ids.size())}), cache).to_vector();
  };
  std::vector<double> logits = run(prompt);   // the prefill
  for (int i = 0;; ++i) {
    const std::int64_t id = choose_token(logits, o.sampling, static_cast<std::uint64_t>(i), o.allowed_vocab);
    g.tokens.push_back(id);
    sequence.push_back(id);
    if (on_token) on_token(id);
    if (i + 1 == o.tokens) break;
    // Feeding `id` back needs position sequence.size() - 1.
    if (static_cast<std::int64_t>(sequence.size()) > n_positions) {
      g.context_full = true;
      break;
    }
    if (o.use_cache) {
      logits = run({id});
    } else {
      g.attention_scores += cache.attention_scores;
      cache = model.new_cache(1);
      logits = run(sequence);
    }
  }
  g.attention_scores += cache.attention_scores;
  return g;
}

// ---- the job -----------------------------------------------------------------------------------------

void check_sample_job(const SampleJob& job) {
  MG_CHECK(!job.checkpoint.empty(), "sample: --checkpoint is empty");
  MG_CHECK(!job.prompt.empty(), "sample: --prompt is empty (give the text to continue)");
  MG_CHECK(job.tokens >= 1, "sample: --tokens must be >= 1, got {}", job.tokens);
  MG_CHECK(job.sampling.temperature >= 0 && std::isfinite(job.sampling.temperature),
           "sample: --temperature must be >= 0 (0 = greedy), got {}", job.sampling.temperature);
  MG_CHECK(job.sampling.top_k >= 0, "sample: --top-k must be >= 0 (0 = all tokens), got {}", job.sampling.top_k);
  MG_CHECK(job.sampling.top_p > 0 && job.sampling.top_p <= 1, "sample: --top-p must be in (0, 1] (1 = off), got {}",
           job.sampling.top_p);
}

SampleResult run_sample_job(const SampleJob& job, const dist::RunOnMesh& run_on_mesh) {
  check_sample_job(job);
  const SampleWeights weights = resolve_sample_weights(job.checkpoint);
  SampleTokenizer tokenizer = resolve_sample_tokenizer(job.tokenizer, weights);
  const std::vector<std::int64_t> prompt = tokenizer.encode(job.prompt);
  const std::int64_t n_positions = weights.model.n_positions();
  MG_CHECK(static_cast<std::int64_t>(prompt.size()) <= n_positions,
           "sample: the prompt is {} tokens ({}), longer than the model's context n_positions = {} ({})", prompt.size(),
           tokenizer.description(), n_positions, weights.config_source);
  GenerateOptions options;
  options.tokens = job.tokens;
  options.sampling = job.sampling;
  options.allowed_vocab = tokenizer.vocab_size();

  SampleResult result;
  result.prompt_tokens = prompt;
  result.n_positions = n_positions;
  result.tokenizer = tokenizer.description();
  result.config_source = weights.config_source;
  result.ignored_config = weights.ignored_config;
  std::mutex mu;
  bool have = false;
  run_on_mesh([&](const dist::DeviceMeshPtr& mesh) {
    MG_CHECK(!mesh->has_axis("pp") || mesh->axis_size("pp") == 1, "sample: the mesh {} is a pipeline, and sampling "
             "decodes with the whole model on every rank: give --mesh without pp (a pipeline's checkpoint samples on "
             "any such mesh)", mesh->str());
    nn::ParallelConfig parallel;
    if (job.tp_invariant) parallel.require(nn::Invariance::Tp);
    parallel.invariant_blocks = job.invariant_blocks;
    auto model = nn::make_model(weights.model, parallel, mesh, 0);
    model->set_training(false);
    // Every rank's pieces read and checked before any rank goes on: rank 0 prints the prompt next,
    // and a corrupt piece of another rank must stop the job before anything is printed (C3).
    comm::run_agreed(*mesh->world(), [&] { load_sample_weights(weights, model->parameters(), *mesh); });
    const bool printer = mesh->rank() == 0 && job.on_text;
    text::Utf8Stream stream;
    auto emit = [&](std::string_view bytes) {
      const std::string text = stream.push(bytes);
      if (!text.empty()) job.on_text(text);
    };
    if (printer) emit(job.prompt);
    const Generation g = generate(*model, prompt, options, [&](std::int64_t id) {
      if (printer) emit(tokenizer.token_bytes(id));
    });
    if (printer) {
      const std::string rest = stream.finish();
      if (!rest.empty()) job.on_text(rest);
    }
    // threads: rank 0's thread keeps the result; mpi: each process its own rank's (the same tokens).
    if (mesh->rank() == 0 || mesh->world()->backend() == "mpi") {
      std::lock_guard<std::mutex> lock(mu);
      result.new_tokens = g.tokens;
      result.context_full = g.context_full;
      result.mesh = mesh->str();
      result.leader = result.leader || mesh->rank() == 0;
      have = true;
    }
  });
  MG_CHECK(have, "sample: no rank returned a result");
  std::string bytes = job.prompt;
  for (std::int64_t id : result.new_tokens) bytes += tokenizer.token_bytes(id);
  result.text = text::to_valid_utf8(bytes);
  return result;
}

}  // namespace meshgrad::generate
