// `meshgrad bench sample`: tokens per second of generation with the key/value cache and without it
// (the whole sequence recomputed for every new token), at several context lengths, on a randomly
// initialised GPT. With the cache a token costs O(T) (its attention reads the T cached keys); without
// it O(T^2) attention and O(T) of every other layer. The q.k column counts the attention scores rank 0
// computed per token (KvCache::attention_scores), the cost the timing reflects.
//   meshgrad bench sample                                   4 layers, hidden 256, contexts 64 .. 1024
//   meshgrad bench sample --mesh tp=2 --contexts 128,512 --tokens 32
#include <fmt/core.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <sstream>

#include "command.hpp"
#include "meshgrad/launch/launch.hpp"
#include "meshgrad/nn/model.hpp"
#include "meshgrad/tensor/random.hpp"
#include "options.hpp"

namespace meshgrad::tools::cmd_bench_sample {
namespace {

struct BenchSampleArgs {
  std::string mesh = "tp=1";
  std::string backend = "threads";
  std::string dtype = "float32";
  std::vector<int> contexts = {64, 128, 256, 512, 1024};
  int tokens = 16;   // timed new tokens per context and mode
  int repeats = 3;   // the best of these (a shared machine's noise only slows a run down)
  nn::ModelConfig model = nn::ModelConfig::gpt(/*layers=*/4, /*hidden=*/256, /*heads=*/8, /*vocab=*/256);
};

struct Row {
  int context = 0;
  double cached_tps = 0, full_tps = 0;
  double cached_scores = 0, full_scores = 0;   // per token, rank 0
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

Tensor ids_of(const std::vector<std::int64_t>& ids) {
  return Tensor::from_int64(ids, {1, static_cast<std::int64_t>(ids.size())});
}

int run(BenchSampleArgs& a) {
  MG_CHECK(!a.contexts.empty(), "bench sample: --contexts is empty");
  int longest = 0;
  for (int c : a.contexts) {
    MG_CHECK(c >= 1, "bench sample: --contexts must be >= 1, got {}", c);
    longest = std::max(longest, c);
  }
  a.model.dtype = parse_dtype(a.dtype);
  a.model.positions = longest + a.tokens;
  a.model.seq = a.model.positions;
  a.model.batch = 1;
  std::vector<Row> rows;
  std::string mesh_name;
  std::mutex mu;
  launch::mesh_runner(a.backend, a.mesh)([&](const dist::DeviceMeshPtr& mesh) {
    auto model = nn::make_model(a.model, {}, mesh, 1);
    model->set_training(false);
    const std::vector<std::int64_t> all = random::randint({a.model.positions}, 7, a.model.vocab).to_int64_vector();
    std::vector<Row> mine;
    for (int context : a.contexts) {
      Row row;
      row.context = context;
      const auto prefix = [&](std::int64_t n) { return std::vector<std::int64_t>(all.begin(), all.begin() + n); };
      for (int r = 0; r < a.repeats; ++r) {
        // With the cache: the prompt once (not timed), then one position per token.
        nn::KvCache cache = model->new_cache(1);
        model->decode(ids_of(prefix(context)), cache);
        const std::int64_t before = cache.attention_scores;
        mesh->world()->barrier();
        auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < a.tokens; ++i) model->decode(ids_of({all[static_cast<std::size_t>(context + i)]}), cache);
        row.cached_tps = std::max(row.cached_tps, a.tokens / seconds_since(t0));
        row.cached_scores = static_cast<double>(cache.attention_scores - before) / a.tokens;
        // Without: the whole sequence for every token.
        std::int64_t scores = 0;
        mesh->world()->barrier();
        t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < a.tokens; ++i) {
          nn::KvCache fresh = model->new_cache(1);
          model->decode(ids_of(prefix(context + i + 1)), fresh);
          scores += fresh.attention_scores;
        }
        row.full_tps = std::max(row.full_tps, a.tokens / seconds_since(t0));
        row.full_scores = static_cast<double>(scores) / a.tokens;
      }
      mine.push_back(row);
    }
    if (mesh->rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      rows = mine;
      mesh_name = mesh->str();
    }
  });
  if (rows.empty()) return 0;   // an mpi process without rank 0
  fmt::print("meshgrad bench sample: gpt layers={} hidden={} heads={} vocab={} {} on {}, {} new tokens per row, "
             "batch 1, best of {}\n\n",
             a.model.layers, a.model.hidden, a.model.heads, a.model.vocab, a.dtype, mesh_name, a.tokens, a.repeats);
  fmt::print("{:>8} {:>14} {:>14} {:>8} {:>16} {:>16}\n", "context", "cache tok/s", "no-cache tok/s", "speedup",
             "q.k/token cache", "q.k/token none");
  for (const Row& r : rows) {
    fmt::print("{:>8} {:>14.1f} {:>14.1f} {:>7.1f}x {:>16.0f} {:>16.0f}\n", r.context, r.cached_tps, r.full_tps,
               r.cached_tps / r.full_tps, r.cached_scores, r.full_scores);
  }
  fmt::print("\nq.k: attention scores rank 0 computed per new token (all blocks, its heads): with the cache about "
             "layers x heads x T, without it about layers x heads x T^2 / 2 (plus the masked halves of diagonal "
             "tiles)\n");
  return 0;
}

MESHGRAD_REGISTER_COMMAND(bench_sample, {"bench", "sample",
    "Generation tokens/s with and without the key/value cache at several context lengths",
    [](CLI::App& app) -> std::function<int()> {
      auto a = std::make_shared<BenchSampleArgs>();
      app.add_option("--mesh", a->mesh, "Mesh axes dp and tp, e.g. tp=2 or tp=2x2")->capture_default_str();
      app.add_option("--backend", a->backend, "threads (rank threads) or mpi (under mpirun)")
          ->check(CLI::IsMember({"threads", "mpi"}))
          ->capture_default_str();
      app.add_option("--contexts", a->contexts, "Context lengths (tokens before the timed ones)")
          ->delimiter(',')
          ->capture_default_str();
      app.add_option("--tokens", a->tokens, "Timed new tokens per context and mode")
          ->check(at_least(1))
          ->capture_default_str();
      app.add_option("--repeats", a->repeats, "Timed repeats of each row; the best is shown")
          ->check(at_least(1))
          ->capture_default_str();
      app.add_option("--layers", a->model.layers, "Transformer blocks")->check(at_least(1))->capture_default_str();
      app.add_option("--hidden", a->model.hidden, "Model width")->check(at_least(1))->capture_default_str();
      app.add_option("--heads", a->model.heads, "Attention heads")->check(at_least(1))->capture_default_str();
      app.add_option("--vocab", a->model.vocab, "Vocabulary size")->check(at_least(1))->capture_default_str();
      app.add_option("--dtype", a->dtype, "float32 or float64")
          ->check(CLI::IsMember({"float32", "float64"}))
          ->capture_default_str();
      return [a] { return run(*a); };
    }});

}  // namespace
}  // namespace meshgrad::tools::cmd_bench_sample
