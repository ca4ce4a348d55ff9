// The sparse mixture-of-experts block and expert parallelism (contracts in include/meshgrad/nn/moe.hpp).
#include "meshgrad/nn/moe.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <numeric>

#include "meshgrad/autograd/function.hpp"
#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/mappings.hpp"
#include "meshgrad/nn/layers.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/ops/tree_reduce.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/trace.hpp"

namespace meshgrad::nn {

namespace {

using autograd::Function;

// ---- row gathers: the token permutations, exact in both directions ------------------------------

// Adds (or copies) row `from` of src into row `to` of dst; both contiguous [rows, width].
template <class T>
void add_row(T* dst, std::int64_t to, const T* src, std::int64_t from, std::int64_t width) {
  T* d = dst + to * width;
  const T* s = src + from * width;
  for (std::int64_t i = 0; i < width; ++i) d[i] += s[i];
}

// out[i] = x[index[i]] (x [n, width] contiguous).
Tensor gather_rows_raw(const Tensor& x, const std::vector<std::int64_t>& index) {
  const Tensor src = x.contiguous();
  const std::int64_t width = src.numel() / std::max<std::int64_t>(src.size(0), 1);
  Shape shape = src.shape();
  shape[0] = static_cast<std::int64_t>(index.size());
  Tensor out = Tensor::empty(shape, src.dtype());
  const std::size_t row_bytes = static_cast<std::size_t>(width) * dtype_size(src.dtype());
  const auto* s = static_cast<const char*>(src.raw_data());
  auto* d = static_cast<char*>(out.raw_data());
  for (std::size_t i = 0; i < index.size(); ++i) {
    std::memcpy(d + i * row_bytes, s + static_cast<std::size_t>(index[i]) * row_bytes, row_bytes);
  }
  return out;
}

// out = zeros [n, width]; out[index[i]] += x[i] for i = 0, 1, ... in order (so a row hit twice adds
// its terms in the order of i).
Tensor scatter_add_rows_raw(const Tensor& x, const std::vector<std::int64_t>& index, std::int64_t n) {
  const Tensor src = x.contiguous();
  Shape shape = src.shape();
  shape[0] = n;
  Tensor out = Tensor::zeros(shape, src.dtype());
  const std::int64_t width = n > 0 ? out.numel() / n : 0;
  if (src.dtype() == DType::Float64) {
    for (std::size_t i = 0; i < index.size(); ++i) {
      add_row(out.data<double>(), index[i], src.data<double>(), static_cast<std::int64_t>(i), width);
    }
  } else {
    MG_CHECK(src.dtype() == DType::Float32, "moe: token rows must be float32 or float64, got {}", src.dtype());
    for (std::size_t i = 0; i < index.size(); ++i) {
      add_row(out.data<float>(), index[i], src.data<float>(), static_cast<std::int64_t>(i), width);
    }
  }
  return out;
}

// y = x[index] (rows): backward adds each gradient row back into its source row, in order.
class GatherRowsFn final : public Function {
 public:
  explicit GatherRowsFn(std::vector<std::int64_t> index) : index_(std::move(index)) {}
  std::string_view name() const override { return "gather_rows"; }
  TensorList forward(const TensorList& x) override {
    rows_ = x[0].size(0);
    return {gather_rows_raw(x[0], index_)};
  }
  TensorList backward(const TensorList& g) override { return {scatter_add_rows_raw(g[0], index_, rows_)}; }

 private:
  std::vector<std::int64_t> index_;
  std::int64_t rows_ = 0;
};

// y = zeros [n, ...], y[index[i]] += x[i] in order: backward reads each row's gradient back.
class ScatterAddRowsFn final : public Function {
 public:
  ScatterAddRowsFn(std::vector<std::int64_t> index, std::int64_t n) : index_(std::move(index)), n_(n) {}
  std::string_view name() const override { return "scatter_add_rows"; }
  TensorList forward(const TensorList& x) override { return {scatter_add_rows_raw(x[0], index_, n_)}; }
  TensorList backward(const TensorList& g) override { return {gather_rows_raw(g[0], index_)}; }

 private:
  std::vector<std::int64_t> index_;
  std::int64_t n_;
};

Tensor gather_rows(const Tensor& x, std::vector<std::int64_t> index) {
  return autograd::apply<GatherRowsFn>({x}, std::move(index))[0];
}
Tensor scatter_add_rows(const Tensor& x, std::vector<std::int64_t> index, std::int64_t n) {
  return autograd::apply<ScatterAddRowsFn>({x}, std::move(index), n)[0];
}

// ---- the grouped product: one GEMM per expert (per source block under --mesh-invariant) --------
//
// x [R, in]: rows of local expert 0, then 1, ... ; each expert's rows cut into `parts[e]` row counts
// (one part, or one per source rank). W [E_local, in, out]. y[rows of e] = x[rows of e] W[e], one
// product per nonempty part. Backward: dx per part = dy W[e]^T; dW[e] = the parts' x^T dy added in
// the fixed tree (tree::sum; an empty part is a zero leaf, so the tree's shape depends on the
// part count only).
//
// Placements: dx keeps the arriving gradient's marks; dW is complete over `complete` (the ep axis: the
// owner multiplied every source's rows), so a gradient partial over the batch axes stays partial over
// dp and fsdp only. (Left partial over ep, fsdp's reduce-scatter would add other ranks' experts.)
class GroupedProductFn final : public Function {
 public:
  GroupedProductFn(std::vector<std::vector<std::int64_t>> parts, dist::AxisMask complete)
      : parts_(std::move(parts)), complete_(complete) {}
  std::string_view name() const override { return "grouped_product"; }
  bool decides_gradient_placement() const override { return true; }
  TensorList forward(const TensorList& in) override {
    const Tensor& x = in[0];
    const Tensor& w = in[1];
    MG_CHECK(x.dim() == 2 && w.dim() == 3 && x.size(1) == w.size(1) &&
                 static_cast<std::int64_t>(parts_.size()) == w.size(0),
             "grouped_product: x {} and W {} ([experts, in, out]) with {} experts' parts", shape_str(x.shape()),
             shape_str(w.shape()), parts_.size());
    const Tensor rows = kernels::product_operand(x.contiguous());
    const Tensor weights = w.contiguous();
    save_for_backward({needs_input_grad(1) ? rows : Tensor(), needs_input_grad(0) ? weights : Tensor()});
    Tensor y = Tensor::empty({x.size(0), w.size(2)}, x.dtype());
    std::int64_t off = 0;
    for (std::size_t e = 0; e < parts_.size(); ++e) {
      const Tensor we = kernels::product_operand(expert(weights, e));
      for (const std::int64_t n : parts_[e]) {
        if (n > 0) {
          Tensor dst = y.narrow(0, off, n);
          kernels::matmul_into(dst, rows.narrow(0, off, n), we, /*accumulate=*/false);
        }
        off += n;
      }
    }
    MG_CHECK(off == x.size(0), "grouped_product: the parts cover {} rows, x has {}", off, x.size(0));
    return {y};
  }
  TensorList backward(const TensorList& g) override {
    const TensorList& s = saved();
    const Tensor dy = kernels::product_operand(g[0].contiguous());
    Tensor gx, gw;
    if (needs_input_grad(0)) gx = Tensor::empty({dy.size(0), s[1].size(1)}, g[0].dtype());
    std::vector<Tensor> per_expert;
    std::int64_t off = 0;
    for (std::size_t e = 0; e < parts_.size(); ++e) {
      std::vector<Tensor> leaves;
      for (const std::int64_t n : parts_[e]) {
        const Tensor dy_part = dy.narrow(0, off, n);
        if (needs_input_grad(0) && n > 0) {
          Tensor dst = gx.narrow(0, off, n);
          kernels::matmul_into(dst, dy_part, kernels::product_operand(expert(s[1], e)).transpose(0, 1), false);
        }
        if (needs_input_grad(1)) {
          const std::int64_t in = s[0].size(1), out = dy.size(1);
          leaves.push_back(n > 0 ? kernels::matmul(s[0].narrow(0, off, n).transpose(0, 1), dy_part)
                                 : Tensor::zeros({in, out}, g[0].dtype()));
        }
        off += n;
      }
      if (needs_input_grad(1)) per_expert.push_back(leaves.size() == 1 ? leaves[0] : tree::sum(leaves));
    }
    if (needs_input_grad(1)) {
      const std::int64_t in = s[0].size(1), out = dy.size(1);
      gw = Tensor::empty({static_cast<std::int64_t>(per_expert.size()), in, out}, g[0].dtype());
      for (std::size_t e = 0; e < per_expert.size(); ++e) expert(gw, e).copy_from(per_expert[e]);
    }
    const dist::AxisMask arriving = dist::partial_axes(g[0]);
    if (gx.defined()) dist::set_partial_axes(gx, arriving);
    if (gw.defined()) dist::set_partial_axes(gw, arriving & ~complete_);
    return {gx, gw};
  }

 private:
  static Tensor expert(const Tensor& w, std::size_t e) {
    return w.narrow(0, static_cast<std::int64_t>(e), 1).view({w.size(1), w.size(2)});
  }
  std::vector<std::vector<std::int64_t>> parts_;
  dist::AxisMask complete_;
};

Tensor grouped_product(const Tensor& x, const Tensor& w, std::vector<std::vector<std::int64_t>> parts,
                       dist::AxisMask complete) {
  return autograd::apply<GroupedProductFn>({x, w}, std::move(parts), complete)[0];
}

// ---- routing -------------------------------------------------------------------------------------

// The k experts of one token by probability, largest first (ties: the lower index first).
void top_k(const double* probs, int experts, int k, std::vector<int>& out) {
  out.resize(static_cast<std::size_t>(experts));
  std::iota(out.begin(), out.end(), 0);
  std::partial_sort(out.begin(), out.begin() + k, out.end(),
                    [&](int a, int b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); });
  out.resize(static_cast<std::size_t>(k));
}

}  // namespace

// ---- checks ----------------------------------------------------------------------------------------

void check_moe(const ModelConfig& cfg, const ParallelContext& ctx) { check_moe(cfg, ctx.ep_size(), ctx.mesh->str()); }

void check_moe(const ModelConfig& cfg, int ep, const std::string& mesh) {
  if (!cfg.moe()) {
    MG_CHECK(ep == 1, "--mesh {}: ep = {} splits a mixture of experts' experts, and the {} model has none (--experts "
             "0): use dp for data parallelism", mesh, ep, cfg.kind);
    return;
  }
  MG_CHECK(cfg.experts >= 1, "moe: num_local_experts is {}; a mixture of experts needs at least one", cfg.experts);
  MG_CHECK(cfg.experts_per_token >= 1 && cfg.experts_per_token <= cfg.experts, "moe: num_experts_per_tok {} must be "
           "between 1 and num_local_experts {}", cfg.experts_per_token, cfg.experts);
  MG_CHECK(std::isfinite(cfg.capacity_factor) && cfg.capacity_factor >= 0, "moe: --capacity-factor {} must be > 0 (or 0: "
           "dropless, every token reaches its experts)", cfg.capacity_factor);
  MG_CHECK(std::isfinite(cfg.router_aux_loss_coef) && cfg.router_aux_loss_coef >= 0, "moe: router_aux_loss_coef {} "
           "must be >= 0", cfg.router_aux_loss_coef);
  MG_CHECK(ep <= cfg.experts, "--mesh {}: ep = {} ranks split the experts, and the model has {} (num_local_experts); "
           "use ep <= {}", mesh, ep, cfg.experts, cfg.experts);
  MG_CHECK(cfg.experts % ep == 0, "--mesh {}: ep = {} does not divide the {} experts (num_local_experts): every ep rank "
           "holds the same number of whole experts; use an ep that divides {}", mesh, ep, cfg.experts, cfg.experts);
}

// ---- the router log --------------------------------------------------------------------------------

namespace {

// The axes whose ranks hold other tokens of one forward: the batch axes and cp
// (ParallelContext::token_axes), and tp under SP (each tp rank routes its sequence shard), in mesh order.
std::vector<int> routed_token_axes(const ParallelContext& ctx) {
  std::vector<int> axes = ctx.token_axis_indices();
  if (ctx.sequence_parallel()) axes.push_back(ctx.tp_axis);
  std::sort(axes.begin(), axes.end());
  return axes;
}

// Each element of `local` summed over the ranks of the axes (exact: int64), every rank the same.
std::vector<std::int64_t> sum_counts(const std::vector<std::int64_t>& local, const ParallelContext& ctx,
                                     const std::vector<int>& axes) {
  if (axes.empty()) return local;
  const std::vector<std::int64_t> all = dist::all_gather_counts(local, ctx.mesh->flattened_group(axes));
  std::vector<std::int64_t> total(local.size(), 0);
  for (std::size_t i = 0; i < all.size(); ++i) total[i % local.size()] += all[i];
  return total;
}

}  // namespace

RouterLog::RouterLog(const ModelConfig& cfg, ParallelContextPtr ctx) : cfg_(cfg), ctx_(std::move(ctx)) {}

bool RouterLog::counting() const {
  return (training_ || autograd::GradMode::is_enabled()) && dist::current_phase() != dist::Phase::Recompute;
}

void RouterLog::record(const std::string& layer, const Tensor& prob_sum, std::vector<std::int64_t> selected,
                       std::int64_t tokens, std::int64_t dropped) {
  // Recomputation (activation checkpointing) and evaluation route again: only the first, training
  // forward counts toward the load.
  if (counting()) {
    auto it = std::find(load_.layers.begin(), load_.layers.end(), layer);
    if (it == load_.layers.end()) {
      load_.layers.push_back(layer);
      load_.tokens.emplace_back(selected.size(), 0);
      it = load_.layers.end() - 1;
    }
    std::vector<std::int64_t>& total = load_.tokens[static_cast<std::size_t>(it - load_.layers.begin())];
    for (std::size_t e = 0; e < selected.size(); ++e) total[e] += selected[e];
    load_.dropped += dropped;
  }
  if (dist::current_phase() == dist::Phase::Recompute) return;
  forward_.push_back({layer, prob_sum, std::move(selected), tokens});
}

Tensor RouterLog::auxiliary_loss(int forwards) {
  if (!cfg_.output_router_logits || forward_.empty()) return Tensor();
  const ParallelContext& ctx = *ctx_;
  const auto experts = static_cast<std::size_t>(cfg_.experts);
  // Hugging Face concatenates every layer's router logits: the counts and the probabilities are
  // summed over layers and tokens alike, and the token count is layers x tokens.
  std::vector<std::int64_t> counts(experts + 1, 0);   // [E] selections, then the token count
  Tensor prob_sum;
  for (const Entry& e : forward_) {
    for (std::size_t x = 0; x < experts; ++x) counts[x] += e.selected[x];
    counts[experts] += e.tokens;
    prob_sum = prob_sum.defined() ? add(prob_sum, e.prob_sum) : e.prob_sum;
  }
  // The normal mode averages over the tokens every rank of this round holds (the ranks that split
  // the batch, and tp's sequence shards); --mesh-invariant over this row block alone, which is
  // what one forward on one rank holds there.
  if (!ctx.config.mesh_invariant()) {
    dist::CommLabelScope label("router-aux-counts");
    counts = sum_counts(counts, ctx, routed_token_axes(ctx));
  }
  const double tokens = static_cast<double>(counts[experts]);
  MG_CHECK(tokens > 0, "moe: the load-balancing loss over no tokens");
  // aux = E / tokens^2 * sum_e count_e * prob_sum_e (prob_sum this rank's, so summed over the ranks
  // that split the tokens it is the whole forward's), averaged over the step's forwards.
  const double factor = static_cast<double>(cfg_.experts) / (tokens * tokens) / forwards;
  std::vector<double> weights(experts);
  for (std::size_t x = 0; x < experts; ++x) weights[x] = static_cast<double>(counts[x]) * factor;
  Tensor aux = sum(mul(prob_sum, Tensor::from_values(weights, {static_cast<std::int64_t>(experts)},
                                                     prob_sum.dtype())));
  // Under SP each tp rank summed its sequence shard's probabilities: the loss is replicated over tp,
  // so the shares are added there (P -> R: the gradient arrives replicated and passes through).
  if (ctx.sequence_parallel()) {
    dist::CommLabelScope label("router-aux");
    aux = dist::reduce_from_region(aux, ctx.tp, ctx.reduce_order());
  }
  if (counting()) load_.aux_loss += aux.detach().item();
  forward_.clear();
  return scale(aux, cfg_.router_aux_loss_coef);
}

ExpertLoad RouterLog::take_load() {
  ExpertLoad out = std::move(load_);
  load_ = {};
  const ParallelContext& ctx = *ctx_;
  // Every rank's routing summed: the counts over the ranks that hold other tokens (the batch axes,
  // and tp's sequence shards under SP), the aux shares over the batch axes (under SP each share is
  // already the tp group's, auxiliary_loss reduced it).
  dist::CommLabelScope label("expert-load");
  dist::PhaseScope phase(dist::Phase::Optimizer);
  std::vector<std::int64_t> local{out.dropped};
  for (const auto& layer : out.tokens) local.insert(local.end(), layer.begin(), layer.end());
  const std::vector<std::int64_t> total = sum_counts(local, ctx, routed_token_axes(ctx));
  out.dropped = total[0];
  std::size_t at = 1;
  for (auto& layer : out.tokens) {
    for (auto& v : layer) v = total[at++];
  }
  const std::vector<int> loss_axes = ctx.token_axis_indices();
  if (!loss_axes.empty()) {
    out.aux_loss = dist::sum_scalar_over(Tensor::scalar(out.aux_loss, DType::Float64),
                                         ctx.mesh->flattened_group(loss_axes), ctx.reduce_order());
  }
  return out;
}

// ---- the block -------------------------------------------------------------------------------------

SparseMoe::SparseMoe(const std::string& name, const ModelConfig& cfg, const ParallelContextPtr& ctx,
                     std::uint64_t seed, std::shared_ptr<RouterLog> log)
    : name_(name), cfg_(cfg), ctx_(ctx), log_(std::move(log)) {
  check_moe(cfg, *ctx);
  MG_CHECK(!ctx->sequence_blocked(), "--mesh-invariant --sequence-blocks {} with a mixture of experts ({}): the "
           "experts' products and the router's counts do not cut their tokens into sequence blocks yet, so cp and the "
           "sequence blocks are for dense models; train it with --sequence-blocks 1 (and without cp)",
           ctx->sequence_blocks(), name);
  const std::int64_t c = cfg.hidden, f = cfg.expert_ffn_size(), e = cfg.experts;
  // Mixtral's names w1 (gated by silu), w3, w2; Qwen2-MoE's gate_proj, up_proj, down_proj.
  qwen_names_ = cfg.model_type == "qwen2_moe";
  const auto expert = [&](const char* mixtral, const char* qwen) {
    return fmt::format("{}.experts.{}.weight", name, qwen_names_ ? qwen : mixtral);
  };
  gate = make_parameter(name + ".gate.weight", {c, e}, ctx->replicated(), *ctx, seed, 0.02, 0.0, cfg.dtype);
  w1 = make_parameter(expert("w1", "gate_proj"), {e, c, f}, ctx->on_experts(), *ctx, seed, 0.02, 0.0, cfg.dtype);
  w2 = make_parameter(expert("w2", "down_proj"), {e, f, c}, ctx->on_experts(), *ctx, seed, 0.02, 0.0, cfg.dtype);
  w3 = make_parameter(expert("w3", "up_proj"), {e, c, f}, ctx->on_experts(), *ctx, seed, 0.02, 0.0, cfg.dtype);
}

void SparseMoe::collect(std::vector<Parameter*>& out) {
  out.push_back(&gate);
  // Hugging Face's order within an expert: w1, w2, w3 (Mixtral); gate_proj, up_proj, down_proj (Qwen2-MoE).
  const std::array<Parameter*, 3> order =
      qwen_names_ ? std::array<Parameter*, 3>{&w1, &w3, &w2} : std::array<Parameter*, 3>{&w1, &w2, &w3};
  out.insert(out.end(), order.begin(), order.end());
}

namespace {

// One forward's routing on this rank: which rows go where, and the plan of the exchange.
struct Routing {
  std::vector<std::int64_t> token_of;    // per kept assignment, in expert order: its token's row
  std::vector<std::int64_t> weight_of;   // ... and its weight's index in the [n * k] weights
  std::vector<std::int64_t> picks;       // per token and slot: row * E + expert (the chosen probability)
  std::vector<std::int64_t> selected;    // per expert: assignments before the capacity drop
  std::vector<std::int64_t> kept;        // per expert: assignments kept
  std::int64_t dropped = 0;
};

// The k largest probabilities of each of the n tokens ([n, E] row-major, row t * B + b) and the
// assignments by expert, each expert's in token order (batch row, position, then the slot), at most
// `capacity` per expert.
Routing route_tokens(const std::vector<double>& p, std::int64_t t_local, std::int64_t b, int experts, int k,
                     std::int64_t capacity) {
  const std::int64_t n = t_local * b;
  Routing r;
  r.picks.resize(static_cast<std::size_t>(n * k));
  std::vector<int> top;
  for (std::int64_t row = 0; row < n; ++row) {
    top_k(p.data() + row * experts, experts, k, top);
    for (int j = 0; j < k; ++j) r.picks[static_cast<std::size_t>(row * k + j)] = row * experts + top[static_cast<std::size_t>(j)];
  }
  std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> by_expert(static_cast<std::size_t>(experts));
  for (std::int64_t bi = 0; bi < b; ++bi) {
    for (std::int64_t t = 0; t < t_local; ++t) {
      const std::int64_t row = t * b + bi;
      for (int j = 0; j < k; ++j) {
        const std::int64_t e = r.picks[static_cast<std::size_t>(row * k + j)] % experts;
        by_expert[static_cast<std::size_t>(e)].emplace_back(row, row * k + j);
      }
    }
  }
  for (const auto& list : by_expert) {
    const auto size = static_cast<std::int64_t>(list.size());
    const std::int64_t keep = std::min(capacity, size);
    r.selected.push_back(size);
    r.kept.push_back(keep);
    r.dropped += size - keep;
    for (std::int64_t i = 0; i < keep; ++i) {
      r.token_of.push_back(list[static_cast<std::size_t>(i)].first);
      r.weight_of.push_back(list[static_cast<std::size_t>(i)].second);
    }
  }
  return r;
}

// The exchange of one forward over ep: rows per rank each way, and on the owner the expert-major
// order of what it received with each expert's rows cut into parts (one, or one per source block).
struct Exchange {
  std::vector<std::int64_t> send_rows, recv_rows;
  std::vector<std::int64_t> expert_major;            // the received row each expert-major row is
  std::vector<std::vector<std::int64_t>> parts;      // per local expert
};

// counts: every rank's kept assignments per expert, [source][expert]; this rank is `me` of `ep`.
Exchange plan_exchange(const std::vector<std::int64_t>& counts, int experts, int ep, int me, bool per_source) {
  const int local = experts / ep;
  const auto count = [&](int source, int e) {
    return counts[static_cast<std::size_t>(source) * static_cast<std::size_t>(experts) + static_cast<std::size_t>(e)];
  };
  Exchange x;
  x.send_rows.assign(static_cast<std::size_t>(ep), 0);
  x.recv_rows.assign(static_cast<std::size_t>(ep), 0);
  for (int d = 0; d < ep; ++d) {
    for (int e = d * local; e < (d + 1) * local; ++e) x.send_rows[static_cast<std::size_t>(d)] += count(me, e);
  }
  for (int s = 0; s < ep; ++s) {
    for (int e = me * local; e < (me + 1) * local; ++e) x.recv_rows[static_cast<std::size_t>(s)] += count(s, e);
  }
  // Received: [source][local expert][token]; wanted: [local expert][source][token].
  std::vector<std::int64_t> source_offset(static_cast<std::size_t>(ep), 0);
  for (int s = 1; s < ep; ++s) {
    source_offset[static_cast<std::size_t>(s)] =
        source_offset[static_cast<std::size_t>(s - 1)] + x.recv_rows[static_cast<std::size_t>(s - 1)];
  }
  x.parts.resize(static_cast<std::size_t>(local));
  for (int l = 0; l < local; ++l) {
    const int e = me * local + l;
    std::int64_t whole = 0;
    for (int s = 0; s < ep; ++s) {
      std::int64_t start = source_offset[static_cast<std::size_t>(s)];
      for (int before = me * local; before < e; ++before) start += count(s, before);
      const std::int64_t rows = count(s, e);
      for (std::int64_t i = 0; i < rows; ++i) x.expert_major.push_back(start + i);
      if (per_source) x.parts[static_cast<std::size_t>(l)].push_back(rows);
      whole += rows;
    }
    if (!per_source) x.parts[static_cast<std::size_t>(l)] = {whole};
  }
  return x;
}

// The inverse of a permutation.
std::vector<std::int64_t> inverse(const std::vector<std::int64_t>& order) {
  std::vector<std::int64_t> where(order.size());
  for (std::size_t i = 0; i < order.size(); ++i) where[static_cast<std::size_t>(order[i])] = static_cast<std::int64_t>(i);
  return where;
}

}  // namespace

// Trace scopes: router, permute (the row gathers and the final scatter), dispatch and combine (the
// two all-to-alls), experts (the grouped products); the backward runs under the same names.
Tensor SparseMoe::forward(const Tensor& x, std::int64_t /*seq*/) const {
  trace::Scope scope(name_);
  const ParallelContext& ctx = *ctx_;
  MG_CHECK(x.dim() == 3 && x.size(2) == cfg_.hidden, "{}: input {} must be [T, B, {}]", name_, shape_str(x.shape()),
           cfg_.hidden);
  const std::int64_t t_local = x.size(0), b = x.size(1), c = x.size(2), n = t_local * b;
  const int experts = cfg_.experts, k = cfg_.experts_per_token, ep = ctx.ep_size();
  const Tensor rows = reshape(x, {n, c});   // row t * B + b

  // The router: probabilities over every expert, the k largest renormalised (the model's dtype;
  // under SP the replicated weights see this rank's tokens only).
  Routing routing;
  Tensor weights, probs;   // weights [n * k, 1]: each token's k renormalised weights, in its top-k order
  {
    trace::Scope router("router");
    probs = softmax(matmul(rows, ctx.replicated_on_sequence_shard(gate.operand())));   // [n, E]
    const std::int64_t capacity =
        cfg_.capacity_factor > 0
            ? static_cast<std::int64_t>(std::ceil(cfg_.capacity_factor * static_cast<double>(n * k) / experts))
            : n * k;
    routing = route_tokens(probs.detach().to_vector(), t_local, b, experts, k, capacity);
    // The k chosen probabilities, renormalised unless norm_topk_prob is off (Qwen2-MoE's default):
    // the router's gradient comes through them.
    const Tensor chosen = reshape(gather_rows(reshape(probs, {n * experts, 1}), routing.picks), {n, k});
    weights = reshape(cfg_.norm_topk_prob ? div(chosen, sum(chosen, {1}, /*keepdim=*/true)) : chosen, {n * k, 1});
  }
  log_->record(name_, cfg_.output_router_logits ? sum(probs, {0}) : Tensor(), routing.selected, n, routing.dropped);

  // Dispatch: the kept assignments' rows, grouped by expert (so by owning rank), to the owners.
  Tensor received;
  {
    trace::Scope permute("permute");
    received = gather_rows(rows, routing.token_of);   // [M, C]
  }
  Exchange exchange;
  if (ep == 1) {
    for (const std::int64_t kept : routing.kept) exchange.parts.push_back({kept});
  } else {
    dist::CommLabelScope label(name_);
    exchange = plan_exchange(dist::all_gather_counts(routing.kept, ctx.expert_group()), experts, ep, ctx.ep_rank(),
                             /*per_source=*/ctx.config.mesh_invariant());
    {
      trace::Scope a2a("dispatch");
      received = dist::all_to_all_rows(received, ctx.expert_group(), exchange.send_rows, exchange.recv_rows);
    }
    trace::Scope permute("permute");
    received = gather_rows(received, exchange.expert_major);
  }

  // The experts: w2(silu(w1 x) * w3 x), one product per expert and weight.
  Tensor expert_out;
  {
    trace::Scope experts_scope("experts");
    const dist::AxisMask owners = ep > 1 ? ctx.expert_group().axes : 0;
    const auto product = [&](const Tensor& in, const Parameter& w) {
      return grouped_product(in, ctx.replicated_on_sequence_shard(w.operand()), exchange.parts, owners);
    };
    expert_out = product(mul(silu(product(received, w1)), product(received, w3)), w2);
  }

  // Combine: back to the sources, weighted, added into the tokens in expert order.
  if (ep > 1) {
    dist::CommLabelScope label(name_);
    {
      trace::Scope permute("permute");
      expert_out = gather_rows(expert_out, inverse(exchange.expert_major));
    }
    trace::Scope a2a("combine");
    expert_out = dist::all_to_all_rows(expert_out, ctx.expert_group(), exchange.recv_rows, exchange.send_rows);
  }
  trace::Scope permute("permute");
  const Tensor w = gather_rows(weights, routing.weight_of);   // [M, 1]
  return reshape(scatter_add_rows(mul(expert_out, w), routing.token_of, n), {t_local, b, c});
}

}  // namespace meshgrad::nn
