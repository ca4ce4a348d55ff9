// The parallel context of a model and its summation-order policy (parallel_context.hpp).
#include "meshgrad/nn/parallel_context.hpp"

#include <algorithm>

#include "meshgrad/distributed/mappings.hpp"
#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/shard.hpp"

namespace meshgrad::nn {

using dist::Placement;

Tensor GatherBuffers::reusable(const Shape& shape, DType dtype) const {
  for (const Tensor& b : buffers_) {
    if (b.shape() == shape && b.dtype() == dtype && b.storage().use_count() == 1) return b;
  }
  return Tensor();
}

void GatherBuffers::keep(const Tensor& t) {
  for (const Tensor& b : buffers_) {
    if (b.storage() == t.storage()) return;
  }
  // One buffer per (shape, dtype) is what the layers need; a second appears only while the first
  // is held (two forwards before a backward) and then stays for reuse too.
  buffers_.push_back(t);
}

const dist::ProcessGroup& tensor_parallel_group(const dist::DeviceMesh& mesh) {
  if (mesh.has_axis("tp_row") && mesh.has_axis("tp_col")) {
    return mesh.flattened_group({mesh.axis_index("tp_row"), mesh.axis_index("tp_col")});
  }
  return mesh.group("tp");
}

namespace {
// The axes of parameter_shard_group: those that shard some parameter, else the tp axes.
std::vector<int> shard_group_axes(const dist::DeviceMesh& mesh, const std::vector<Parameter*>& params) {
  dist::AxisMask mask = 0;
  for (const Parameter* p : params) mask |= dist::sharded_axes(p->placements);
  std::vector<int> axes;
  for (int a = 0; a < mesh.ndim(); ++a) {
    const std::string& name = mesh.axes()[static_cast<std::size_t>(a)].name;
    const bool tp_axis = name == "tp" || name == "tp_row" || name == "tp_col";
    if (mask != 0 ? (mask & dist::axis_bit(a)) != 0 : tp_axis) axes.push_back(a);
  }
  return axes;
}
}  // namespace

const dist::ProcessGroup& parameter_shard_group(const dist::DeviceMesh& mesh, const std::vector<Parameter*>& params) {
  const std::vector<int> axes = shard_group_axes(mesh, params);
  if (axes.empty()) return tensor_parallel_group(mesh);
  return mesh.flattened_group(axes);
}

bool in_first_parameter_shard_group(const dist::DeviceMesh& mesh, const std::vector<Parameter*>& params) {
  const std::vector<int> axes = shard_group_axes(mesh, params);
  for (int a = 0; a < mesh.ndim(); ++a) {
    // Every pipeline stage holds parameters of its own: each stage has its first group.
    if (mesh.axes()[static_cast<std::size_t>(a)].name == "pp") continue;
    if (std::find(axes.begin(), axes.end(), a) == axes.end() && mesh.coordinate(a) != 0) return false;
  }
  return true;
}

// Indexed by the enum's value (None, Tp, Mesh).
const char* invariance_name(Invariance mode) {
  static constexpr const char* kNames[] = {"none", "tp", "mesh"};
  return kNames[static_cast<int>(mode)];
}

const char* invariance_option(Invariance mode) {
  static constexpr const char* kOptions[] = {"", "tp-invariant", "mesh-invariant"};
  return kOptions[static_cast<int>(mode)];
}

std::shared_ptr<const ParallelContext> ParallelContext::on(dist::DeviceMeshPtr mesh, const ParallelConfig& config) {
  MG_CHECK(mesh != nullptr, "model: no mesh given");
  auto ctx = std::make_shared<ParallelContext>();
  ctx->config = config;
  ctx->dp_axis = mesh->has_axis("dp") ? mesh->axis_index("dp") : -1;
  ctx->fsdp_axis = mesh->has_axis("fsdp") ? mesh->axis_index("fsdp") : -1;
  ctx->pp_axis = mesh->has_axis("pp") ? mesh->axis_index("pp") : -1;
  ctx->ep_axis = mesh->has_axis("ep") ? mesh->axis_index("ep") : -1;
  ctx->cp_axis = mesh->has_axis("cp") ? mesh->axis_index("cp") : -1;
  if (config.shard_optimizer) {
    MG_CHECK(ctx->dp_axis >= 0 && mesh->axis_size(ctx->dp_axis) > 1, "--shard-optimizer shards the optimizer state "
             "over the dp axis, and the mesh {} has no dp axis of more than one rank", mesh->str());
    MG_CHECK(ctx->fsdp_axis < 0 || mesh->axis_size(ctx->fsdp_axis) == 1, "--shard-optimizer with an fsdp axis ({}): "
             "fsdp shards the optimizer state already; use one of them", mesh->str());
    ctx->fsdp_axis = ctx->dp_axis;
  }
  if (mesh->has_axis("tp_row") || mesh->has_axis("tp_col")) {
    MG_CHECK(mesh->has_axis("tp_row") && mesh->has_axis("tp_col") && !mesh->has_axis("tp"),
             "model: a 2-D tensor-parallel mesh has axes tp_row and tp_col (and no tp), got {}", mesh->str());
    ctx->two_d = true;
    ctx->row_axis = mesh->axis_index("tp_row");
    ctx->col_axis = mesh->axis_index("tp_col");
    ctx->tp = tensor_parallel_group(*mesh);
    const bool grid = mesh->axis_size(ctx->row_axis) > 1 || mesh->axis_size(ctx->col_axis) > 1;
    MG_CHECK(!(grid && config.sequence_parallel),
             "model: sequence parallelism is not supported on a 2-D tensor-parallel mesh ({}); use tp=N", mesh->str());
    MG_CHECK(!(grid && (config.overlap || config.recompute_allgather)),
             "model: --overlap and --regather apply to the 1-D column-parallel layers, not to a 2-D mesh ({})",
             mesh->str());
  } else {
    MG_CHECK(mesh->has_axis("tp"), "model: the mesh {} has no tensor-parallel axis (tp, or tp_row and tp_col)",
             mesh->str());
    ctx->tp_axis = mesh->axis_index("tp");
    ctx->tp = mesh->group(ctx->tp_axis);
  }
  // The invariant modes fix the shapes of every product and the order of every sum over the tokens;
  // context parallelism changes both unless the sequence is cut into --mesh-invariant's fixed
  // sequence blocks (each cp rank's blocks a subtree of their tree: nn/context_parallel.hpp).
  const int cp = ctx->cp_axis >= 0 ? mesh->axis_size(ctx->cp_axis) : 1;
  MG_CHECK(!(config.tp_invariant() && !config.mesh_invariant() && cp > 1),
           "--tp-invariant with context parallelism (the mesh {} has cp = {}): --tp-invariant fixes the sums over tp "
           "only; --mesh-invariant --sequence-blocks N (a multiple of {}) fixes those over the sequence's chunks too",
           mesh->str(), cp, 2 * cp);
  if (config.mesh_invariant()) {
    const int n = config.sequence_blocks;
    MG_CHECK(n >= 1 && tree::is_power_of_two(n), "--mesh-invariant: --sequence-blocks {} must be a power of two (1, 2, "
             "4, 8, ...): the sequence blocks are added in a fixed binary tree", n);
    MG_CHECK(cp == 1 || n % (2 * cp) == 0, "--mesh-invariant on the mesh {} (cp = {}): each cp rank holds two chunks "
             "of every sequence, and they must be whole blocks of the sequence's fixed tree: give --sequence-blocks a "
             "multiple of 2 x cp = {} (got {}), the same on every mesh whose bits you compare (the bits depend on it)",
             mesh->str(), cp, 2 * cp, n, 2 * cp);
  }
  if (config.sequence_blocked()) {
    const int n = config.sequence_blocks;
    const char* what = cp > 1 ? "context parallelism under --mesh-invariant" : "--mesh-invariant --sequence-blocks";
    MG_CHECK(!ctx->two_d || (mesh->axis_size(ctx->row_axis) == 1 && mesh->axis_size(ctx->col_axis) == 1),
             "{} (--sequence-blocks {}) on the 2-D tensor-parallel mesh {}: the grid's layers do not cut their "
             "products into sequence blocks; use tp=N", what, n, mesh->str());
    MG_CHECK(cp == 1 || !(ctx->fsdp_axis >= 0 && mesh->axis_size(ctx->fsdp_axis) > 1),
             "{} (--sequence-blocks {}) with {} on the mesh {}: an fsdp unit adds its micro-batches' gradients before "
             "they are summed over cp, which the sequence blocks' tree needs first; use dp instead of fsdp, or train "
             "without cp", what, n, config.shard_optimizer ? "--shard-optimizer" : "fsdp", mesh->str());
    MG_CHECK(!(ctx->ep_axis >= 0 && mesh->axis_size(ctx->ep_axis) > 1),
             "{} (--sequence-blocks {}) with expert parallelism (the mesh {}): the experts' products do not cut "
             "their tokens into sequence blocks; train the mixture of experts without --sequence-blocks", what, n,
             mesh->str());
    const int tp_ranks = ctx->tp.size();
    MG_CHECK(!config.sequence_parallel || (n / cp) % tp_ranks == 0,
             "{}: --sequence-parallel on the mesh {} gives each of tp = {} ranks 1/{} of a cp rank's {} sequence "
             "blocks, which must be whole blocks; give --sequence-blocks a multiple of cp x tp = {}", what,
             mesh->str(), tp_ranks, tp_ranks, n / cp, cp * tp_ranks);
  }
  if (config.tp_invariant()) {
    MG_CHECK(tree::is_power_of_two(config.invariant_blocks), "--{}: --invariant-blocks {} must be a power of two (1, "
             "2, 4, 8, ...)", invariance_option(config.invariance), config.invariant_blocks);
    // OpenBLAS splits a GEMM over its threads, and the split changes the bits of edge tiles: one
    // thread per rank makes a GEMM's result a function of its shape and data only. (The banner's
    // thread policy then names the mode.)
    blas::set_threads_per_rank(1, fmt::format("--{}", invariance_option(config.invariance)));
    // oneDNN picks its kernel from the operands' row strides (a dense matrix: its brgemm kernels; a
    // block of a wider one: its jit gemm), and the two round differently once K is longer than a
    // kernel's K block: the same fixed block is a whole local matrix on one mesh and part of one on
    // another. OpenBLAS's result depends on the shape and data only, so the invariant modes' products
    // are OpenBLAS's (restored when the launch's ThreadsPerRank scope ends).
    blas::set_float32_gemm_library(blas::GemmLibrary::OpenBlas);
  }
  ctx->mesh = std::move(mesh);
  return ctx;
}

dist::Placements ParallelContext::replicated() const {
  dist::Placements out(static_cast<std::size_t>(mesh->ndim()), Placement::replicate());
  if (fsdp_axis >= 0) out[static_cast<std::size_t>(fsdp_axis)] = Placement::shard_of_piece(0);
  return out;
}

dist::Placements ParallelContext::on_tp(Placement p) const {
  dist::Placements out = replicated();
  if (two_d) {
    out[static_cast<std::size_t>(row_axis)] = p;
    out[static_cast<std::size_t>(col_axis)] = p;
  } else {
    out[static_cast<std::size_t>(tp_axis)] = p;
  }
  return out;
}

dist::Placements ParallelContext::on_grid(Placement p_row, Placement p_col) const {
  MG_CHECK(two_d, "on_grid: the mesh {} is not a 2-D tensor-parallel mesh", mesh->str());
  dist::Placements out = replicated();
  out[static_cast<std::size_t>(row_axis)] = p_row;
  out[static_cast<std::size_t>(col_axis)] = p_col;
  return out;
}

dist::Placements ParallelContext::on_experts() const {
  dist::Placements out = replicated();
  if (ep_axis >= 0) out[static_cast<std::size_t>(ep_axis)] = Placement::shard(0);
  return out;
}

dist::AxisMask ParallelContext::batch_axes() const {
  dist::AxisMask axes = 0;
  for (const int a : {dp_axis, fsdp_axis, ep_axis}) {
    if (a >= 0 && mesh->axis_size(a) > 1) axes |= dist::axis_bit(a);
  }
  return axes;
}

namespace {
// The axes of a mask, as indices in mesh order.
std::vector<int> indices_of(dist::AxisMask axes, int ndim) {
  std::vector<int> out;
  for (int a = 0; a < ndim; ++a) {
    if (axes & dist::axis_bit(a)) out.push_back(a);
  }
  return out;
}
}  // namespace

std::vector<int> ParallelContext::batch_axis_indices() const { return indices_of(batch_axes(), mesh->ndim()); }

dist::AxisMask ParallelContext::token_axes() const {
  dist::AxisMask axes = batch_axes();
  if (context_parallel()) axes |= dist::axis_bit(cp_axis);
  return axes;
}

std::vector<int> ParallelContext::token_axis_indices() const { return indices_of(token_axes(), mesh->ndim()); }

int ParallelContext::batch_replicas() const {
  int n = 1;
  for (const int a : batch_axis_indices()) n *= mesh->axis_size(a);
  return n;
}

Tensor ParallelContext::partial_over_tp(const Tensor& x) const {
  if (tp.size() == 1) return x;
  return dist::mark_partial_grad(x, tp.axes);
}

Tensor ParallelContext::loss_partial_over_dp(const Tensor& loss) const {
  return dist::mark_partial_grad(loss, token_axes());   // no axis: the loss itself
}

// ---- the summation-order policy ------------------------------------------------------------------

dist::ReduceOrder ParallelContext::reduce_order() const {
  return tp_invariant() ? dist::ReduceOrder::FixedTree : dist::ReduceOrder::RankOrder;
}

tree::SplitPlan ParallelContext::feature_plan(const std::string& what, std::int64_t full, int parts, std::int64_t unit,
                                              std::int64_t local_extent) const {
  if (!tp_invariant()) return tree::SplitPlan::whole(local_extent);
  tree::SplitPlan plan = tree::plan_split(what, full, parts, unit, config.invariant_blocks, tp_size(), tp_rank());
  MG_CHECK(plan.local_extent() == local_extent, "{}: the plan covers {} local features, the shard has {}", what,
           plan.local_extent(), local_extent);
  return plan;
}

std::vector<std::int64_t> ParallelContext::sequence_row_blocks(std::int64_t seq, std::int64_t local_tokens,
                                                               std::int64_t rows_per_token) const {
  if (!sequence_blocked()) return {local_tokens * rows_per_token};
  const std::int64_t piece_blocks = sequence_blocks() / cp_size();
  MG_CHECK(seq > 0 && seq % piece_blocks == 0 && local_tokens % (seq / piece_blocks) == 0,
           "--sequence-blocks {}: a rank's piece of {} positions (cp = {}) does not cut into {} blocks of which "
           "{} local positions are whole ones", sequence_blocks(), seq, cp_size(), piece_blocks, local_tokens);
  const std::int64_t block_tokens = seq / piece_blocks;
  return std::vector<std::int64_t>(static_cast<std::size_t>(local_tokens / block_tokens), block_tokens * rows_per_token);
}

std::vector<std::int64_t> ParallelContext::token_row_blocks(std::int64_t seq, std::int64_t local_tokens,
                                                            std::int64_t rows_per_token) const {
  if (sequence_blocked()) return sequence_row_blocks(seq, local_tokens, rows_per_token);
  if (!tp_invariant()) return {local_tokens * rows_per_token};
  const bool sp = sequence_parallel();
  const tree::SplitPlan tokens = tree::plan_split(fmt::format("the sequence (length {})", seq), seq, 1, 1,
                                                  config.invariant_blocks, sp ? tp_size() : 1, sp ? tp_rank() : 0);
  MG_CHECK(tokens.local_extent() == local_tokens, "the token blocks of a sequence of {} cover {} local tokens, the "
           "activation holds {}", seq, tokens.local_extent(), local_tokens);
  std::vector<std::int64_t> rows;
  for (const std::int64_t n : tokens.sizes()) rows.push_back(n * rows_per_token);
  return rows;
}

Tensor ParallelContext::replicated_on_sequence_shard(const Tensor& p) const {
  if (!sequence_parallel()) return p;
  if (!tp_invariant()) return partial_over_tp(p);
  // Forward identity; the gradient arrives marked partial, so the R -> R step all-reduces it (tree).
  return dist::mark_partial_grad(dist::copy_to_region(p, tp, dist::ReduceOrder::FixedTree), tp.axes);
}

Tensor ParallelContext::reduced_over_cp_per_use(const Tensor& p) const {
  if (!sequence_blocked() || !context_parallel()) return p;
  return dist::copy_to_region(p, context_group(), dist::ReduceOrder::FixedTree);
}

}  // namespace meshgrad::nn
