// `meshgrad bench memory`: peak tensor memory per rank of GPT training steps at tp = 1, 2, 4, ... or
// on any meshes (fsdp, dp with --shard-optimizer), next to the ideal (parameters, gradients and
// AdamW's two moments divided by the ranks that shard them, plus the activations one step keeps for
// backward, from the formula below).
//
//   meshgrad bench memory --mesh tp=1,2,4 --layers 4 --hidden 256 --heads 8 --seq 128 --batch 8
//   meshgrad bench memory --mesh 'dp=2;dp=2+shard-optimizer;fsdp=2;fsdp=2,tp=2;dp=2,tp=2'
//
// Measured: every rank thread allocates in its own accounting domain of the caching allocator
// (tensor/allocator.hpp), so a rank's peak is the most bytes its tensors held at once (size-class
// bytes, as handed out) over model construction and --steps full training steps (loss, backward,
// gradient synchronisation, AdamW). The process's peak RSS (VmHWM, all ranks, allocator cache and
// everything else included) is shown beside it.
//
// Ideal per rank, es = bytes per element, N = parameters of the full model, S = B T / (dp fsdp cp)
// tokens (the rank's rows; under cp its two chunks of each), C = hidden, F = ffn, H = heads,
// V = vocab, L = layers, t = tp, f = fsdp, p = cp:
//   states      = 4 N es / (t f)    (parameters, gradients, AdamW m and v, each sharded 1/(t f); with
//                                    --shard-optimizer the last three 1/(t dp) instead)
//   activations = es [ L (4 S C + S (5 C + 2 F) / t + 4 S + S H / t) + 2 S C + S V / t + 3 S ]
//                 (with --checkpoint-blocks the L blocks keep their inputs, L S C, and one block's
//                 activations live again while it is recomputed)
// which is what the graph saves for backward (see docs/BENCHMARKS.md): per block the inputs of ln_1
// and ln_2 (x and h) and of c_attn and c_fc (their outputs), replicated [S, C] each, 2 x 2 S
// LayerNorm statistics; sharded over t: q, k, v and the attention output (4 S C / t; under cp the
// rank's own chunks of the keys: the whole sequence's are gathered again in backward), the merged
// heads for c_proj (S C / t), GELU's input and output (2 S F / t) and the attention's log-sum-exp
// (S H / t); after the
// blocks ln_f's input and output (2 S C), the logits shard (S V / t) and the loss's row statistics.
// With --sequence-parallel the LayerNorm inputs and statistics are sharded too (/ t); the column
// layers' gathered inputs are not.
#include <fmt/core.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "command.hpp"
#include "meshgrad/launch/launch.hpp"
#include "options.hpp"
#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/data/dataset.hpp"
#include "meshgrad/nn/model.hpp"
#include "meshgrad/tensor/allocator.hpp"
#include "meshgrad/tensor/random.hpp"
#include "meshgrad/optim/grad_sync.hpp"
#include "meshgrad/optim/adamw.hpp"
#include "meshgrad/train/trainer.hpp"

namespace meshgrad::tools::cmd_bench_memory {
namespace {

struct BenchMemoryOptions {
  std::string mesh = "tp=1,2,4";
  int layers = 4, hidden = 256, heads = 8, seq = 128, batch = 8, vocab = 256, steps = 2;
  std::string dtype = "float32";
  bool sequence_parallel = false;
  bool checkpoint_blocks = false;
};

// One mesh to measure: its spec and whether the optimizer is sharded over dp (--shard-optimizer).
struct MeshItem {
  std::string spec;
  bool shard_optimizer = false;
  std::string label() const { return shard_optimizer ? spec + " zero" : spec; }
};

// "tp=1,2,4" -> tp=1, tp=2, tp=4 (the tensor-parallel sweep); otherwise meshes separated by ';' or blanks, each
// with an optional "+shard-optimizer": "dp=2;dp=2+shard-optimizer;fsdp=2;fsdp=2,tp=2".
std::vector<MeshItem> parse_mesh_list(const std::string& spec) {
  std::vector<MeshItem> out;
  const std::string rest = spec.size() > 3 ? spec.substr(3) : "";
  const bool tp_sweep = spec.rfind("tp=", 0) == 0 && rest.find_first_of("=; ") == std::string::npos &&
                        (rest.find(',') != std::string::npos ||
                         std::all_of(rest.begin(), rest.end(), [](char c) { return c >= '0' && c <= '9'; }));
  if (tp_sweep) {
    std::stringstream ss(spec.substr(3));
    for (std::string item; std::getline(ss, item, ',');) {
      std::size_t used = 0;
      int v = 0;
      try {
        v = std::stoi(item, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      MG_CHECK(used == item.size() && !item.empty() && v >= 1 && v < memory::kMaxDomains,
               "bench memory: --mesh {}: '{}' is not a tp size (an integer from 1 to {})", spec, item,
               memory::kMaxDomains - 1);
      out.push_back({fmt::format("tp={}", v), false});
    }
    return out;
  }
  std::string items = spec;   // ';' or blanks between meshes
  std::replace(items.begin(), items.end(), ';', ' ');
  std::stringstream ss(items);
  for (std::string item; ss >> item;) {
    MeshItem m;
    const std::string suffix = "+shard-optimizer";
    if (item.size() > suffix.size() && item.compare(item.size() - suffix.size(), suffix.size(), suffix) == 0) {
      m.shard_optimizer = true;
      item.resize(item.size() - suffix.size());
    }
    const int ranks = dist::mesh_world_size(item);   // throws naming the spec and the valid axes
    MG_CHECK(ranks < memory::kMaxDomains, "bench memory: --mesh {}: {} ranks, at most {}", item, ranks,
             memory::kMaxDomains - 1);
    m.spec = item;
    out.push_back(m);
  }
  MG_CHECK(!out.empty(), "bench memory: --mesh names no mesh, e.g. tp=1,2,4 or 'dp=2;fsdp=2'");
  return out;
}

// Peak resident set of this process (VmHWM, bytes); 0 where /proc is missing.
std::size_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

// Starts a new VmHWM period (Linux >= 4.0: writing 5 to clear_refs resets the peak to the current RSS).
void reset_peak_rss() {
  if (std::FILE* f = std::fopen("/proc/self/clear_refs", "w")) {
    std::fputs("5", f);
    std::fclose(f);
  }
}

struct Ideal {
  double states = 0, activations = 0;
  double gradients = 0;   // part of states
  double total() const { return states + activations; }
};

// Per rank on a mesh of t = tp ranks (both grid axes for tp=RxC), d = dp, f = fsdp and p = cp: the
// batch rows split over d f, their sequences over p; parameters, gradients and moments split over t f (and, with the optimizer
// sharded over dp, gradients and moments over t d).
Ideal ideal_bytes(const nn::ModelConfig& c, double n_params, const MeshItem& item, bool sequence_parallel,
                  bool checkpoint_blocks) {
  int tp = 1, dp = 1, fsdp = 1, cp = 1;
  for (const dist::MeshAxis& a : dist::parse_mesh(item.spec)) {
    if (a.name == "dp") dp = a.size;
    else if (a.name == "fsdp") fsdp = a.size;
    else if (a.name == "cp") cp = a.size;
    else tp *= a.size;
  }
  const double es = static_cast<double>(dtype_size(c.dtype));
  const double rows = double(c.batch) / (dp * fsdp);
  // S: the rank's tokens (its rows; under cp its two chunks of each: attention gathers the whole
  // sequence's keys in forward and again in backward, and keeps only its own).
  const double S = double(c.seq) * rows / cp, C = c.hidden, F = c.ffn_size(), H = c.heads, V = c.vocab, t = tp;
  // Under sequence parallelism the LayerNorm inputs and statistics are sharded along the sequence;
  // the column layers still keep their gathered [S, C] inputs.
  const double sp = sequence_parallel ? t : 1;
  Ideal i;
  const double optimizer_shards = item.shard_optimizer ? t * dp : t * fsdp;
  i.states = n_params * es / (t * fsdp) + 3 * n_params * es / optimizer_shards;
  i.gradients = n_params * es / optimizer_shards;
  const double block = 2 * S * C / sp + 2 * S * C + S * (5 * C + 2 * F) / t + 4 * S / sp + S * H / t;
  // --checkpoint-blocks: each block keeps its input ([S, C], sharded under SP), and one block's
  // activations live again while its recomputation is backpropagated.
  const double blocks = checkpoint_blocks ? c.layers * S * C / sp + block : c.layers * block;
  i.activations = es * (blocks +
                        S * C / sp + S * C + S * V / t + 2 * S / sp + S);
  return i;
}

struct RankFigures {
  std::size_t params_bytes = 0;    // this rank's parameter shards (model just built)
  std::size_t resident_bytes = 0;  // held after the last step (parameters, gradients, AdamW moments)
  std::size_t peak_bytes = 0;      // the most held at once, whole run
  std::size_t saved_bytes = 0;     // last step: held after the forward pass minus before it (activations)
  std::size_t step_extra = 0;      // last step: its peak minus what it started with (parameters, m, v)
};

struct TpFigures {
  MeshItem mesh;
  double n_params = 0;
  std::vector<RankFigures> ranks;
  std::size_t peak_rss = 0;
};

TpFigures measure(const BenchMemoryOptions& o, const nn::ModelConfig& cfg, const MeshItem& item) {
  TpFigures fig;
  fig.mesh = item;
  const int ranks = dist::mesh_world_size(item.spec);
  fig.ranks.resize(static_cast<std::size_t>(ranks));
  memory::release_cached();   // RSS of this run should not include the previous run's cached blocks
  memory::reset_peaks();
  reset_peak_rss();
  nn::ParallelConfig parallel;
  parallel.sequence_parallel = o.sequence_parallel;
  parallel.checkpoint_blocks = o.checkpoint_blocks;
  parallel.shard_optimizer = item.shard_optimizer;
  std::mutex mu;
  launch::run_on_backend("threads", ranks, [&](const comm::CommunicatorPtr& world) {
    const int r = world->rank();
    // Domain r + 1: 0 is every other thread's (the launcher's, the executor's).
    const memory::ScopedDomain domain(r + 1);
    RankFigures mine;
    {
      auto mesh = std::make_shared<const dist::DeviceMesh>(world, dist::parse_mesh(item.spec));
      auto model = nn::make_model(cfg, parallel, mesh, /*seed=*/1);
      const std::vector<nn::Parameter*> params = model->parameters();
      for (const nn::Parameter* p : params) {
        mine.params_bytes += static_cast<std::size_t>(p->value.numel()) * dtype_size(p->value.dtype());
      }
      // The same batch on every rank: random tokens of a fixed seed.
      const std::vector<std::int64_t> tokens = random::randint({cfg.batch, cfg.seq + 1}, 7, cfg.vocab).to_int64_vector();
      std::vector<std::int64_t> in, tg;
      for (int b = 0; b < cfg.batch; ++b) {
        for (int s = 0; s < cfg.seq; ++s) {
          in.push_back(tokens[static_cast<std::size_t>(b) * (cfg.seq + 1) + s]);
          tg.push_back(tokens[static_cast<std::size_t>(b) * (cfg.seq + 1) + s + 1]);
        }
      }
      const nn::Batch batch{Tensor::from_int64(in, {cfg.batch, cfg.seq}), Tensor::from_int64(tg, {cfg.batch, cfg.seq})};
      optim::GradientSynchronizer sync(params, mesh);
      optim::AdamW optimizer(params, mesh);
      for (int step = 0; step + 1 < o.steps; ++step) train::train_step(*model, batch, *mesh, sync, optimizer);
      // The last step, measured from what it keeps across steps (parameters, AdamW's m and v):
      // train_step drops the previous gradients first too.
      mine.peak_bytes = memory::domain_stats(r + 1).peak_bytes;   // so far
      optimizer.zero_grad();
      memory::reset_peak(r + 1);
      // The step by hand (train_step's body without clipping) to see what the forward pass keeps.
      nn::Batch share = batch;   // this rank's rows: the batch is split over dp x fsdp
      std::vector<int> batch_axes;
      for (const char* name : {"dp", "fsdp"}) {
        if (mesh->has_axis(name)) batch_axes.push_back(mesh->axis_index(name));
      }
      if (!batch_axes.empty()) {
        const dist::ProcessGroup& rows = mesh->flattened_group(batch_axes);
        share = data::dp_shard(batch, rows.rank(), rows.size());
      }
      const std::size_t before = memory::domain_stats(r + 1).live_bytes;
      Tensor loss = model->loss(share, std::int64_t(cfg.batch) * cfg.seq);
      mine.saved_bytes = memory::domain_stats(r + 1).live_bytes - before;
      backward(loss);
      loss = Tensor();
      sync.finish();
      optimizer.step();
      mine.step_extra = memory::domain_stats(r + 1).peak_bytes - before;
      mine.resident_bytes = memory::domain_stats(r + 1).live_bytes;
      mine.peak_bytes = std::max(mine.peak_bytes, memory::domain_stats(r + 1).peak_bytes);
      if (r == 0) {
        std::lock_guard lock(mu);
        fig.n_params = static_cast<double>(train::count_parameters(params));
      }
    }
    world->barrier();
    std::lock_guard lock(mu);
    fig.ranks[static_cast<std::size_t>(r)] = mine;
  });
  fig.peak_rss = peak_rss_bytes();
  return fig;
}

double mib(double bytes) { return bytes / double(1 << 20); }

int run_bench_memory(const BenchMemoryOptions& o) {
  const std::vector<MeshItem> meshes = parse_mesh_list(o.mesh);
  MG_CHECK(o.steps >= 1, "bench memory: --steps must be >= 1, got {}", o.steps);
  const nn::ModelConfig cfg =
      nn::ModelConfig::gpt(o.layers, o.hidden, o.heads, o.vocab, o.seq, o.batch, parse_dtype(o.dtype));
  fmt::print("meshgrad bench memory: GPT layers {} hidden {} heads {} seq {} batch {} vocab {} {}{}{}, {} training "
             "step(s), threads backend\n", cfg.layers, cfg.hidden, cfg.heads, cfg.seq, cfg.batch, cfg.vocab, o.dtype,
             o.sequence_parallel ? ", sequence-parallel" : "", o.checkpoint_blocks ? ", checkpoint-blocks" : "", o.steps);
  fmt::print("per rank, MiB. ideal: states = N es / (tp fsdp) parameters + 3 N es / (tp fsdp) gradients and AdamW m "
             "and v (/ (tp dp) with zero = --shard-optimizer), act = activations of the rank's rows "
             "one step saves (formula in docs/BENCHMARKS.md); measured: the rank's tensor bytes (caching allocator, "
             "one accounting domain per rank thread)\n");
  fmt::print("{:<22} {:>8} {:>8} {:>8} {:>8} | {:>8} {:>8} {:>10} | {:>8} {:>9} {:>9} | {:>8}\n", "mesh", "params",
             "states", "act", "ideal", "resident", "peak", "peak/ideal", "saved", "grads+act", "step-pmv", "RSS");
  for (const MeshItem& item : meshes) {
    const TpFigures fig = measure(o, cfg, item);
    const Ideal ideal = ideal_bytes(cfg, fig.n_params, item, o.sequence_parallel, o.checkpoint_blocks);
    RankFigures worst;   // the rank with the highest peak
    for (const RankFigures& r : fig.ranks) {
      if (r.peak_bytes >= worst.peak_bytes) worst = r;
    }
    const double grads = ideal.gradients;
    fmt::print("{:<22} {:>8.2f} {:>8.2f} {:>8.2f} {:>8.2f} | {:>8.2f} {:>8.2f} {:>10.2f} | {:>8.2f} {:>9.2f} {:>9.2f} | "
               "{:>8.1f}\n", item.label(), mib(double(worst.params_bytes)), mib(ideal.states), mib(ideal.activations),
               mib(ideal.total()), mib(double(worst.resident_bytes)), mib(double(worst.peak_bytes)),
               double(worst.peak_bytes) / ideal.total(), mib(double(worst.saved_bytes)), mib(grads + ideal.activations),
               mib(double(worst.step_extra)), mib(double(fig.peak_rss)));
  }
  fmt::print("params: this rank's parameter shards (replicated LayerNorm, positions and row-parallel biases included); "
             "resident: held after the last step (parameters, gradients, m, v); peak: the most held at once over the "
             "run; saved: held after the last step's forward pass above what it started with (measured activations, "
             "next to act); grads+act: ideal gradients + activations; step-pmv: the last step's peak above what it "
             "started with (parameters, m, v), next to grads+act; figures of the rank with the highest peak; RSS proc: VmHWM of the "
             "whole process (all ranks)\n");
  return 0;
}

CommandSetup setup = [](CLI::App& app) {
  auto o = std::make_shared<BenchMemoryOptions>();
  app.add_option("--mesh", o->mesh, "meshes to measure: tensor-parallel sizes tp=N[,N...], or meshes separated by "
                 "';' or blanks, each optionally +shard-optimizer, e.g. 'dp=2;dp=2+shard-optimizer;fsdp=2;fsdp=2,tp=2'")
      ->capture_default_str();
  app.add_option("--layers", o->layers, "transformer blocks")->check(at_least(1))->capture_default_str();
  app.add_option("--hidden", o->hidden, "model width")->check(at_least(1))->capture_default_str();
  app.add_option("--heads", o->heads, "attention heads")->check(at_least(1))->capture_default_str();
  app.add_option("--seq", o->seq, "sequence length T")->check(at_least(1))->capture_default_str();
  app.add_option("--batch", o->batch, "batch B")->check(at_least(1))->capture_default_str();
  app.add_option("--vocab", o->vocab, "vocabulary size")->check(at_least(1))->capture_default_str();
  app.add_option("--steps", o->steps, "training steps (the first allocates AdamW's moments)")
      ->check(at_least(1))->capture_default_str();
  app.add_option("--dtype", o->dtype, "float32 or float64")->capture_default_str();
  app.add_flag("--sequence-parallel", o->sequence_parallel, "sequence parallelism (reduce-scatter / all-gather "
               "along the sequence between layers)");
  app.add_flag("--checkpoint-blocks", o->checkpoint_blocks, "activation checkpointing: each block's forward "
               "recomputed in backward");
  return [o] { return run_bench_memory(*o); };
};

MESHGRAD_REGISTER_COMMAND(bench_memory, {"bench", "memory",
    "peak tensor memory per rank on several meshes next to the ideal (sharded states + activations)", setup});

}  // namespace
}  // namespace meshgrad::tools::cmd_bench_memory
