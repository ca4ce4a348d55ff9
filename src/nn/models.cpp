// ModelConfig, the pipeline's stage split, the defaults of Model, and make_model: the registry of
// the model kinds (a decoder family runs through decoder_lm.cpp; the MLP stack is mlp_stack.cpp).
#include <fmt/ranges.h>

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

std::unique_ptr<Model> make_model(const ModelConfig& config, const ParallelConfig& parallel,
                                  dist::DeviceMeshPtr mesh, std::uint64_t seed) {
  MG_CHECK(config.layers >= 1 && config.hidden >= 1 && config.heads >= 1 && config.vocab >= 1,
           "model: layers, hidden, heads and vocab must be positive (got {}, {}, {}, {})", config.layers, config.hidden,
           config.heads, config.vocab);
  if (config.kind == "gpt") return make_decoder_lm(config, parallel, std::move(mesh), seed, make_gpt2_family);
  if (config.kind == "llama") return make_decoder_lm(config, parallel, std::move(mesh), seed, make_llama_family);
  if (config.kind == "mlp") return make_mlp_stack(config, parallel, std::move(mesh), seed);
  throw InvalidArgument(fmt::format("model: unknown kind '{}' (expected gpt, llama or mlp)", config.kind));
}

}  // namespace meshgrad::nn
