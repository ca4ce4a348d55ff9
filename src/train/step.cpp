// One optimizer step, the global loss and evaluation (contracts in include/meshgrad/train/step.hpp).
#include "meshgrad/train/step.hpp"

#include <fmt/ranges.h>

#include <algorithm>
#include <string>

#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/checkpoint/parameter_file.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/rule.hpp"
#include "meshgrad/nn/layers.hpp"
#include "meshgrad/ops/tree_reduce.hpp"
#include "meshgrad/optim/grad_norm.hpp"
#include "meshgrad/optim/micro_batches.hpp"
#include "meshgrad/pipeline/executor.hpp"
#include "meshgrad/tensor/trace.hpp"

namespace meshgrad::train {

namespace {

// This rank's place among the ranks that split the batch: the dp, fsdp and ep axes together,
// row-major (dp outermost), so that dp=M,fsdp=F holds the rows dp=M*F would, rank for rank (ep splits
// the batch like dp for the dense layers). A mesh without any is one replica.
struct DpPlace {
  int rank = 0;
  int size = 1;
  const dist::ProcessGroup* group = nullptr;
};
// with_cp: the cp axis too, which holds other positions of the same rows (the ranks a loss is summed
// over, not the ones the rows are dealt to).
DpPlace dp_place(const dist::DeviceMesh& mesh, bool with_ep = true, bool with_cp = false) {
  std::vector<int> axes;
  for (const char* name : {"dp", "fsdp", "ep", "cp"}) {
    if (!with_ep && std::string_view(name) == "ep") continue;
    if (!with_cp && std::string_view(name) == "cp") continue;
    if (mesh.has_axis(name)) axes.push_back(mesh.axis_index(name));
  }
  if (axes.empty()) return {};
  const dist::ProcessGroup& group = mesh.flattened_group(axes);
  return {group.rank(), group.size(), &group};
}

// The ranks a step's reported loss is summed over: every batch axis and cp, but those of the
// model's micro-batch group (ep, or cp's sequence blocks, under --mesh-invariant) summed each
// micro-batch's loss already (MicroBatchLosses).
DpPlace loss_place(const dist::DeviceMesh& mesh, const nn::Model& model) {
  const dist::ProcessGroup* summed = model.micro_batch_sum_group();
  const auto summed_already = [&](const char* axis) {
    return summed != nullptr && mesh.has_axis(axis) && (summed->axes & dist::axis_bit(mesh.axis_index(axis))) != 0;
  };
  return dp_place(mesh, !summed_already("ep"), !summed_already("cp"));
}

// The sum over dp of this rank's share (replicated over tp), outside the model's communication.
double sum_over_dp(const Tensor& local, const DpPlace& dp, dist::ReduceOrder order) {
  dist::PhaseScope phase(dist::Phase::Optimizer);
  if (dp.size == 1) return local.detach().item();
  return dist::sum_scalar_over(local, *dp.group, order);
}

}  // namespace

// The contract is in step.hpp; for a sibling-block group (ep under --mesh-invariant), micro-batch
// m of ep rank e in dp x fsdp replica r is block (r * count + m) * P + e of the count x replicas x
// P blocks (docs/mesh-invariance.md, "ep").
std::vector<nn::Batch> rank_micro_batches(const nn::Model& model, const nn::Batch& global_batch,
                                          const dist::DeviceMesh& mesh, int count) {
  const dist::ProcessGroup* siblings = model.sibling_block_group();
  if (siblings == nullptr) {
    const DpPlace dp = dp_place(mesh);
    const nn::Batch share = data::dp_shard(global_batch, dp.rank, dp.size);
    MG_CHECK(count >= 1 && count <= share.inputs.size(0), "train: --grad-accum {} needs at least that many rows per dp "
             "replica, and this replica has {} (--batch {} over dp={})", count, share.inputs.size(0),
             global_batch.inputs.size(0), dp.size);
    std::vector<nn::Batch> micro;
    for (int k = 0; k < count; ++k) micro.push_back(count == 1 ? share : data::dp_shard(share, k, count));
    return micro;
  }
  const DpPlace replica = dp_place(mesh, /*with_ep=*/false);
  const int p = siblings->size(), e = siblings->rank();
  const int blocks = count * replica.size * p;
  std::vector<nn::Batch> micro;
  for (int m = 0; m < count; ++m) micro.push_back(data::dp_shard(global_batch, (replica.rank * count + m) * p + e, blocks));
  return micro;
}


std::int64_t count_loss_targets(const Tensor& targets) {
  MG_CHECK(targets.defined() && targets.dtype() == DType::Int64, "count_loss_targets: targets must be int64");
  MG_CHECK(targets.numel() > 0, "the batch holds no targets (shape {}): it needs at least one row of one position",
           shape_str(targets.shape()));
  const Tensor packed = targets.contiguous();
  const std::int64_t* t = packed.data<std::int64_t>();
  std::int64_t n = 0;
  for (std::int64_t i = 0; i < packed.numel(); ++i) n += t[i] != kIgnoreIndex ? 1 : 0;
  MG_CHECK(n > 0, "every one of the {} targets is {} (the ignore index): the mean loss over no tokens is undefined",
           packed.numel(), kIgnoreIndex);
  return n;
}

void check_invariant_batch_split(std::int64_t rows, int dp_size, int grad_accum, const std::string& mesh) {
  const std::int64_t blocks = std::int64_t{dp_size} * grad_accum;
  MG_CHECK(tree::is_power_of_two(dp_size) && tree::is_power_of_two(grad_accum),
           "--tp-invariant: the data-parallel ranks (dp x fsdp = {} on {}) and --grad-accum {} must be powers of two "
           "(the micro-batches and the replicas are added in a fixed binary tree)", dp_size, mesh, grad_accum);
  MG_CHECK(rows % blocks == 0,
           "--tp-invariant: the global batch of {} rows must divide into dp x fsdp x grad-accum = {} x {} = {} "
           "micro-batches of equal rows ({}), so that every mesh with the same dp x fsdp x grad-accum sums the same "
           "micro-batches; use a --batch that is a multiple of {}", rows, dp_size, grad_accum, blocks, mesh, blocks);
}

void check_mesh_invariant_split(std::int64_t rows, int dp_size, int grad_accum, int batch_blocks) {
  MG_CHECK(batch_blocks >= 1 && tree::is_power_of_two(batch_blocks), "--mesh-invariant: --batch-blocks {} must be a "
           "power of two (1, 2, 4, 8, ...): the row blocks are added in a fixed binary tree", batch_blocks);
  MG_CHECK(rows % batch_blocks == 0, "--mesh-invariant: the global batch of {} rows must cut into --batch-blocks {} "
           "row blocks of equal rows; use a --batch that is a multiple of {}, or fewer blocks", rows, batch_blocks,
           batch_blocks);
  std::vector<std::string> fitting;
  for (int d = 1; d <= batch_blocks; d *= 2) fitting.push_back(std::to_string(d));
  MG_CHECK(tree::is_power_of_two(dp_size) && batch_blocks % dp_size == 0,
           "--mesh-invariant: dp x fsdp x ep = {} ranks cannot each hold a whole subtree of the --batch-blocks {} row "
           "blocks; meshes whose dp x fsdp x ep is {} keep the tree (or give --batch-blocks a power of two that is a "
           "multiple of {} and divides --batch {})", dp_size, batch_blocks, fmt::join(fitting, ", "), dp_size, rows);
  const int per_replica = batch_blocks / dp_size;
  MG_CHECK(grad_accum >= 1 && per_replica % grad_accum == 0,
           "--mesh-invariant: --grad-accum {} must divide the {} row blocks each of the dp x fsdp x ep = {} replicas runs "
           "(--batch-blocks {} / {}); every block is its own micro-batch whatever --grad-accum says", grad_accum,
           per_replica, dp_size, batch_blocks, dp_size);
}

int batch_split_size(const dist::DeviceMesh& mesh) { return dp_place(mesh).size; }

int micro_batches_per_replica(const nn::ParallelConfig& parallel, const dist::DeviceMesh& mesh, int grad_accum) {
  if (!parallel.mesh_invariant()) return grad_accum;
  const int replicas = batch_split_size(mesh);
  MG_CHECK(replicas >= 1 && parallel.batch_blocks % replicas == 0, "--mesh-invariant: --batch-blocks {} over dp x "
           "fsdp x ep = {} replicas", parallel.batch_blocks, replicas);
  return parallel.batch_blocks / replicas;
}

Tensor forward_backward(nn::Model& model, const nn::Batch& global_batch, const dist::DeviceMesh& mesh,
                        optim::GradientSynchronizer& sync, int micro_batches, pipeline::ScheduleKind schedule) {
  const DpPlace dp = dp_place(mesh);
  const std::vector<nn::Batch> micro = rank_micro_batches(model, global_batch, mesh, micro_batches);
  const dist::ReduceOrder order = model.reduce_order();
  if (order == dist::ReduceOrder::FixedTree) {
    check_invariant_batch_split(global_batch.inputs.size(0), dp.size, micro_batches, mesh.str());
  }
  // The mean over the non-ignored targets of the whole global batch (byte tokens never are).
  const std::int64_t targets = count_loss_targets(global_batch.targets);
  optim::MicroBatchGradients gradients(model, sync, micro_batches);
  const Tensor stage_loss = pipeline::run_step(model, micro, targets, schedule, gradients, mesh);
  gradients.finish();
  sync.finish();
  return stage_loss;
}

StepOutcome train_step(nn::Model& model, const nn::Batch& global_batch, const dist::DeviceMesh& mesh,
                       optim::GradientSynchronizer& sync, optim::AdamW& optimizer, double grad_clip, int grad_accum,
                       pipeline::ScheduleKind schedule) {
  optimizer.zero_grad();
  StepOutcome out;
  out.loss = pipeline::losses_over_stages(forward_backward(model, global_batch, mesh, sync, grad_accum, schedule),
                                          mesh);
  // The exact norm in the tree order, and wherever the batch is split (dp, fsdp): its bits must not
  // depend on how the gradient is split, so that fsdp=N clips exactly as dp=N does.
  const bool exact = model.reduce_order() == dist::ReduceOrder::FixedTree || dp_place(mesh).size > 1;
  const std::vector<nn::Parameter*> params = model.parameters();
  out.grad_norm = grad_clip > 0 ? optim::clip_grad_norm(params, mesh, grad_clip, exact)
                                : optim::global_grad_norm(params, mesh, exact);
  optimizer.step();
  return out;
}

double global_loss(const Tensor& local_loss, const dist::DeviceMesh& mesh, const nn::Model& model) {
  return sum_over_dp(local_loss, loss_place(mesh, model), model.reduce_order());
}

double evaluate(nn::Model& model, const data::TokenDataset& dataset, int batches, const dist::DeviceMesh& mesh,
                int micro_batches) {
  trace::Span span("evaluate", "evaluate");
  autograd::NoGradGuard no_grad;
  model.set_training(false);
  const DpPlace dp = loss_place(mesh, model);
  const std::int64_t n = std::min<std::int64_t>(batches, dataset.validation_batches());
  double total = 0;
  for (std::int64_t b = 0; b < n; ++b) {
    const nn::Batch global_batch = dataset.validation_batch(b);
    const std::int64_t targets = count_loss_targets(global_batch.targets);
    const int rows = static_cast<int>(global_batch.inputs.size(0) / dp_place(mesh).size);
    const int pieces = model.sibling_block_group() != nullptr ? micro_batches : std::min(micro_batches, std::max(rows, 1));
    const Tensor stage_loss = pipeline::forward_only(model, rank_micro_batches(model, global_batch, mesh, pieces),
                                                     targets, mesh);
    total += sum_over_dp(pipeline::losses_over_stages(stage_loss, mesh), dp, model.reduce_order());
  }
  model.set_training(true);
  return total / static_cast<double>(n);
}

GradientDump compute_gradients(nn::Model& model, const nn::Batch& global_batch, const dist::DeviceMeshPtr& mesh,
                               int micro_batches) {
  MG_CHECK(mesh != nullptr, "compute_gradients: no mesh");
  MG_CHECK(global_batch.inputs.defined() && global_batch.inputs.dim() == 2,
           "compute_gradients: inputs must be int64 [B, T]");
  const DpPlace dp = loss_place(*mesh, model);
  const std::vector<nn::Parameter*> params = model.parameters();
  for (const nn::Parameter* p : params) {
    MG_CHECK(!p->value.grad().defined(), "compute_gradients: parameter '{}' already has a gradient", p->name);
  }
  optim::GradientSynchronizer sync(params, mesh, {.order = model.reduce_order()});
  GradientDump dump;
  const Tensor stage_loss = forward_backward(model, global_batch, *mesh, sync, micro_batches,
                                           pipeline::ScheduleKind::OneFOneB);
  dump.loss = sum_over_dp(pipeline::losses_over_stages(stage_loss, *mesh), dp, model.reduce_order());
  const nn::ExpertLoad load = model.take_expert_load();
  if (model.config().moe() && model.config().output_router_logits) dump.aux_loss = load.aux_loss;
  const dist::ProcessGroup& shard_group = nn::parameter_shard_group(*mesh, params);
  dump.gradients = checkpoint::gather_gradients(params, shard_group);
  // A pipeline's stages hold their own blocks: every stage's gradients end on stage 0.
  if (mesh->has_axis("pp") && shard_group.rank() == 0) {
    dump.gradients = checkpoint::collect_on_first_stage(std::move(dump.gradients), mesh->group("pp"));
  }
  return dump;
}

}  // namespace meshgrad::train
