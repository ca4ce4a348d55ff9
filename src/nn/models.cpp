// ModelConfig, the pipeline's stage split, the defaults of Model, and make_model: the registry of
// the model kinds (a decoder family runs through decoder_lm.cpp; the MLP stack is mlp_stack.cpp).
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <map>
#include <mutex>

#include "meshgrad/nn/decoder_lm.hpp"
#include "mlp_stack.hpp"

namespace meshgrad::nn {

ModelConfig ModelConfig::gpt(int layers, int hidden, int heads, int vocab, int seq, int batch, DType dtype) {
  ModelConfig c;
  c.kind = "gpt";
  c.layers = layers;
  c.hidden = hidden;
  c.heads = heads;
  c.vocab = vocab;
  c.seq = seq;
  c.batch = batch;
  c.dtype = dtype;
  return c;
}

ModelConfig ModelConfig::with_shape_of(const ModelConfig& shape) const {
  ModelConfig c = *this;
  c.kind = "gpt";
  c.layers = shape.layers;
  c.hidden = shape.hidden;
  c.ffn = shape.ffn;
  c.heads = shape.heads;
  c.vocab = shape.vocab;
  c.positions = shape.positions;
  c.layer_norm_epsilon = shape.layer_norm_epsilon;
  return c;
}

std::vector<int> stage_layer_counts(int layers, int stages, const std::vector<int>& requested) {
  MG_CHECK(stages >= 1, "pipeline: {} stages", stages);
  MG_CHECK(stages <= layers, "--mesh pp={}: a pipeline of {} stages needs at least {} transformer blocks, and the model "
           "has {} (--layers): use pp <= {}", stages, stages, stages, layers, layers);
  if (requested.empty()) {
    std::vector<int> counts;
    for (int s = 0; s < stages; ++s) counts.push_back(static_cast<int>(shard_range(layers, stages, s).size));
    return counts;
  }
  const std::string given = fmt::format("{}", fmt::join(requested, ","));
  MG_CHECK(static_cast<int>(requested.size()) == stages, "--pp-layers {}: {} counts for a pipeline of {} stages (pp={})",
           given, requested.size(), stages, stages);
  std::int64_t sum = 0;   // of up to kMaxMeshRanks ints: no overflow in 64 bits
  for (const int n : requested) {
    MG_CHECK(n >= 1, "--pp-layers {}: every stage needs at least one transformer block", given);
    sum += n;
  }
  MG_CHECK(sum == layers, "--pp-layers {}: the counts add up to {} blocks, and the model has {} (--layers)", given, sum,
           layers);
  return requested;
}

Tensor Model::forward_stage(const Batch& batch, const Tensor& input, std::int64_t global_tokens) {
  // A model without pipeline stages is one stage: its forward is its loss.
  MG_CHECK(!input.defined() && stage().count == 1, "model '{}' has no pipeline stages: only gpt has", config().kind);
  return loss(batch, global_tokens);
}

Shape Model::stage_input_shape(const Batch&) const {
  throw InvalidArgument(fmt::format("model '{}' has no pipeline stages: only gpt has", config().kind));
}

KvCache Model::new_cache(std::int64_t) {
  throw InvalidArgument(fmt::format("model '{}' has no incremental decoding (new_cache): only gpt has", config().kind));
}

Tensor Model::decode(const Tensor&, KvCache&, bool) {
  throw InvalidArgument(fmt::format("model '{}' has no incremental decoding (decode): only gpt has", config().kind));
}

namespace {

// The registered kinds by name. Entries are shared so a model being built keeps its factory alive
// while another thread unregisters the kind.
struct Registry {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<const ModelKind>> kinds;
};
Registry& registry() {
  static Registry r;
  return r;
}
constexpr std::array<const char*, 3> kBuiltInKinds = {"gpt", "llama", "mlp"};
bool built_in(const std::string& kind) {
  return std::find(kBuiltInKinds.begin(), kBuiltInKinds.end(), kind) != kBuiltInKinds.end();
}

}  // namespace

void register_model(const std::string& kind, ModelKind model) {
  const bool well_formed = !kind.empty() && kind.size() <= 64 && std::all_of(kind.begin(), kind.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-';
  });
  MG_CHECK(well_formed, "register_model: kind '{}' must be 1 to 64 letters, digits, '_' or '-'", kind);
  MG_CHECK(!built_in(kind), "register_model: '{}' is a built-in model kind ({}); give yours another name", kind,
           fmt::join(kBuiltInKinds, ", "));
  MG_CHECK(static_cast<bool>(model.build), "register_model: kind '{}' has no factory", kind);
  MG_CHECK(model.counts_like.empty() || model.counts_like == "gpt",
           "register_model: kind '{}' counts like '{}': give \"gpt\" (GPT-2's embedding and head) or \"\"", kind,
           model.counts_like);
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  MG_CHECK(!r.kinds.count(kind), "register_model: kind '{}' is registered already (unregister_model it first)", kind);
  r.kinds.emplace(kind, std::make_shared<const ModelKind>(std::move(model)));
}

bool unregister_model(const std::string& kind) {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  return r.kinds.erase(kind) > 0;
}

std::shared_ptr<const ModelKind> registered_model(const std::string& kind) {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  const auto it = r.kinds.find(kind);
  return it == r.kinds.end() ? nullptr : it->second;
}

std::vector<std::string> model_kinds() {
  std::vector<std::string> kinds(kBuiltInKinds.begin(), kBuiltInKinds.end());
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  for (const auto& entry : r.kinds) kinds.push_back(entry.first);
  return kinds;
}

std::unique_ptr<Model> make_model(const ModelConfig& config, const ParallelConfig& parallel,
                                  dist::DeviceMeshPtr mesh, std::uint64_t seed) {
  MG_CHECK(config.layers >= 1 && config.hidden >= 1 && config.heads >= 1 && config.vocab >= 1,
           "model: layers, hidden, heads and vocab must be positive (got {}, {}, {}, {})", config.layers, config.hidden,
           config.heads, config.vocab);
  if (config.kind == "gpt") return make_decoder_lm(config, parallel, std::move(mesh), seed, make_gpt2_family);
  if (config.kind == "llama") return make_decoder_lm(config, parallel, std::move(mesh), seed, make_llama_family);
  if (config.kind == "mlp") return make_mlp_stack(config, parallel, std::move(mesh), seed);
  if (const std::shared_ptr<const ModelKind> kind = registered_model(config.kind)) {
    std::unique_ptr<Model> model = kind->build(config, parallel, std::move(mesh), seed);
    MG_CHECK(model != nullptr, "model: the factory of kind '{}' returned no model", config.kind);
    return model;
  }
  throw InvalidArgument(fmt::format("model: unknown kind '{}' (expected one of {}; a program adds its own with "
                                    "nn::register_model)", config.kind, fmt::join(model_kinds(), ", ")));
}

}  // namespace meshgrad::nn
