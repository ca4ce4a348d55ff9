// `train --sample-every`: a one-rank copy of the training model generates from the gathered weights
// (contract in train_sampler.hpp).
#include "train_sampler.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <optional>
#include <memory>

#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/comm/threads.hpp"
#include "meshgrad/generate/sample.hpp"
#include "meshgrad/nn/layers.hpp"
#include "meshgrad/tensor/error.hpp"
#include "meshgrad/text/utf8.hpp"

namespace meshgrad::launch {

namespace fs = std::filesystem;

namespace {

// The folder whose meta.json describes the data's tokenizer, or "" (bytes, the built-in corpus).
std::string tokenizer_folder(const std::string& data_path) {
  if (data_path.empty()) return "";
  fs::path p(data_path);
  if (!fs::is_directory(p)) p = p.parent_path();   // a token file, or a glob of shards
  if (p.empty()) p = ".";
  return fs::is_regular_file(p / "meta.json") ? p.string() : std::string();
}

struct SamplerState {
  std::optional<generate::SampleTokenizer> tokenizer;   // empty: bytes
  std::string tokenizer_description = "bytes";
  std::vector<std::int64_t> prompt;
  std::string prompt_text;
  std::string data;   // for messages: "the data 'PATH'" or "the built-in corpus"
  int tokens = 64;
  std::uint64_t seed = 0;
};

// What the sampler needs of the trained model: a tokenizer for its vocabulary (bytes: 256 tokens).
void check_model(const SamplerState& st, const nn::ModelConfig& trained) {
  const std::shared_ptr<const nn::ModelKind> registered = nn::registered_model(trained.kind);
  MG_CHECK(!registered || registered->decodes, "train: --sample-every: model '{}' does not decode (its blocks have no "
           "cached decoding, e.g. blocks written in Python), so it cannot sample: leave --sample-every out",
           trained.kind);
  MG_CHECK(st.tokenizer.has_value() || trained.vocab == 256,
           "train: --sample-every: the model's vocabulary has {} tokens but {} has no tokenizer beside it "
           "(a meta.json from `meshgrad prepare`): only a 256-token model samples bytes", trained.vocab, st.data);
  MG_CHECK(!st.tokenizer || st.tokenizer->vocab_size() <= trained.vocab, "train: --sample-every: the tokenizer ({}) "
           "has {} tokens, more than the model's vocabulary of {}", st.tokenizer_description,
           st.tokenizer ? st.tokenizer->vocab_size() : 0, trained.vocab);
}

std::string sample_text(const SamplerState& st, const nn::ModelConfig& trained,
                        const std::vector<std::pair<std::string, Tensor>>& full, int step) {
  check_model(st, trained);
  nn::ModelConfig config = trained;
  config.dropout = 0;
  config.batch = 1;
  std::vector<std::int64_t> prompt = st.prompt;
  // A prompt longer than the model's positions: the model sees its first n_positions tokens, and the
  // text shows those (not the whole prompt, which the continuation does not follow).
  const bool cut = static_cast<int>(prompt.size()) > config.n_positions();
  if (cut) prompt.resize(static_cast<std::size_t>(config.n_positions()));
  std::string text;
  comm::run_ranks(1, [&](const comm::CommunicatorPtr& world) {
    const auto mesh = std::make_shared<const dist::DeviceMesh>(world, std::vector<dist::MeshAxis>{{"tp", 1}});
    std::unique_ptr<nn::Model> model = nn::make_model(config, nn::ParallelConfig{}, mesh, 0);
    model->set_training(false);
    autograd::NoGradGuard no_grad;
    for (nn::Parameter* p : model->parameters()) {
      const auto it = std::find_if(full.begin(), full.end(), [&](const auto& e) { return e.first == p->name; });
      MG_CHECK(it != full.end(), "train: --sample-every: the gathered parameters lack {}", p->name);
      p->value.detach().copy_from(it->second);
    }
    generate::GenerateOptions g;
    g.tokens = st.tokens;
    g.sampling.temperature = 1.0;
    g.sampling.seed = st.seed + static_cast<std::uint64_t>(step);
    g.allowed_vocab = st.tokenizer ? st.tokenizer->vocab_size() : 256;
    const generate::Generation out = generate::generate(*model, prompt, g);
    const auto token_bytes = [&](std::int64_t id) {
      return st.tokenizer ? st.tokenizer->token_bytes(id) : std::string(1, static_cast<char>(id));
    };
    std::string bytes = cut ? std::string() : st.prompt_text;
    if (cut) {
      for (std::int64_t id : prompt) bytes += token_bytes(id);
    }
    for (std::int64_t id : out.tokens) bytes += token_bytes(id);
    text = text::to_valid_utf8(bytes);
  });
  return text;
}

}  // namespace

void set_train_sampler(train::TrainOptions& options) {
  auto st = std::make_shared<SamplerState>();
  st->data = options.data_path.empty() ? "the built-in corpus" : "the data '" + options.data_path + "'";
  st->tokens = options.sample_tokens;
  st->seed = options.seed;
  st->prompt_text = options.sample_prompt;
  MG_CHECK(!options.sample_prompt.empty(), "train: --sample-prompt is empty: give at least one character");
  if (const std::string dir = tokenizer_folder(options.data_path); !dir.empty()) {
    generate::SampleWeights any_vocab;   // the model's vocabulary is checked by check_sampler, before step 1
    any_vocab.model.vocab = 1 << 30;
    any_vocab.config_source = "the training run";
    st->tokenizer = generate::resolve_sample_tokenizer(dir, any_vocab);
    st->prompt = st->tokenizer->encode(options.sample_prompt);
    st->tokenizer_description = st->tokenizer->description();
  } else {
    for (unsigned char c : options.sample_prompt) st->prompt.push_back(c);
  }
  const int positions = options.model.n_positions();   // 0 sizes with --init-from: known at the first sample
  if (options.progress && positions > 0 && static_cast<int>(st->prompt.size()) > positions) {
    fmt::print(stderr, "meshgrad train: note: --sample-prompt is {} tokens and the model has {} positions: the samples "
               "continue its first {} tokens (and show only those)\n", st->prompt.size(), positions, positions);
  }
  options.sampler = [st](const nn::ModelConfig& model, const std::vector<std::pair<std::string, Tensor>>& full, int step) {
    return sample_text(*st, model, full, step);
  };
  options.check_sampler = [st](const nn::ModelConfig& model) { check_model(*st, model); };
}

}  // namespace meshgrad::launch
