// One optimizer step, the loop body every training loop shares (train, the equivalence checker),
// and what a step's loss is: the mean over the targets that are not ignored, summed over the dp
// replicas in the model's order.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "meshgrad/data/dataset.hpp"
#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/nn/model.hpp"
#include "meshgrad/optim/adamw.hpp"
#include "meshgrad/optim/grad_sync.hpp"
#include "meshgrad/pipeline/schedule.hpp"

namespace meshgrad::train {

// Targets equal to kIgnoreIndex add no loss (PyTorch's and Hugging Face's ignore_index; the default
// of nn::vocab_parallel_cross_entropy), and the mean is over the others: the loss divisor is
// count_loss_targets(global targets), not B * T.
inline constexpr std::int64_t kIgnoreIndex = -100;

// The number of targets (int64, any shape) that are not kIgnoreIndex: the divisor of the mean
// cross-entropy of a global batch. Throws InvalidArgument when it is 0 (every target ignored: the
// mean over no tokens is undefined; PyTorch returns NaN).
std::int64_t count_loss_targets(const Tensor& targets);


// One optimizer step, the loop body every training loop shares (train, the equivalence checker):
// zero the gradients, this rank's loss on its dp share of global_batch (divided by the global count
// of non-ignored targets), backward, gradient synchronisation, the global gradient norm (clipped to
// grad_clip when > 0, grad_norm.hpp), AdamW step. loss: this rank's share of the global loss (sum
// it over dp); grad_norm: the norm before clipping, the same on every rank.
struct StepOutcome {
  Tensor loss;
  double grad_norm = 0;
};
// grad_accum K > 1: this rank's rows are split into K micro-batches (shard rule) whose losses (each
// over the global target count) are backpropagated one after the other, gradients accumulating, and
// reduced once after the last: the same loss and gradients as K = 1 up to rounding, dropout masks
// included (every micro-batch draws the seeds of one forward of the whole batch, and masks are by
// global row), with one dp reduction per step and the activations of one micro-batch at a time.
// On a pipeline (a mesh with pp > 1; the model is this rank's stage), the K micro-batches run
// through the stages in `schedule`'s order (pipeline/executor.hpp) with the same accumulation, so
// the step is bitwise one rank's with the same K; the loss is the last stage's, on every stage.
// The forward and backward of one step, without the optimizer: the one step executor that train_step,
// compute_gradients and `meshgrad explain` share. This rank's dp x fsdp share of global_batch is cut
// into micro_batches (the shard rule) and run through the model's stages in schedule's order
// (pipeline::run_step; a mesh without pp is one stage, in 1F1B's order), gradients accumulated by
// one optim::MicroBatchGradients in the model's order and synchronised (sync.finish() has run).
// Returns the stage loss (pipeline::losses_over_stages makes it the step's on every stage); the
// model's parameters must hold no gradient of another step.
Tensor forward_backward(nn::Model& model, const nn::Batch& global_batch, const dist::DeviceMesh& mesh,
                        optim::GradientSynchronizer& sync, int micro_batches,
                        pipeline::ScheduleKind schedule = pipeline::ScheduleKind::OneFOneB);
StepOutcome train_step(nn::Model& model, const nn::Batch& global_batch, const dist::DeviceMesh& mesh,
                       optim::GradientSynchronizer& sync, optim::AdamW& optimizer, double grad_clip = 0, int grad_accum = 1,
                       pipeline::ScheduleKind schedule = pipeline::ScheduleKind::OneFOneB);
// The K micro-batches are added in the model's order (optim/micro_batches.hpp): in TP-invariant mode
// their gradients and losses in the fixed binary tree, and the synchroniser must be built with the
// same order (GradSyncOptions::order), so the step is bitwise the same on every mesh with the same
// dp x K (docs/mesh-invariance.md, "dp").
// check_invariant_batch_split throws InvalidArgument unless dp (dp_size: dp x fsdp) and K are powers
// of two and the global batch of `rows` splits into dp x K micro-batches of equal rows; the message
// names `mesh` (the mesh's spec, as the user wrote it: "fsdp=3", not a dp the mesh does not have).
void check_invariant_batch_split(std::int64_t rows, int dp_size, int grad_accum, const std::string& mesh);

// Mesh-invariant mode (nn::Invariance::Mesh, docs/mesh-invariance.md): the global batch
// of `rows` is cut into batch_blocks row blocks, and each of the dp_size = dp x fsdp replicas runs
// its batch_blocks / dp_size blocks as that many micro-batches (one block each), whatever
// --grad-accum says: the tree over the blocks is then the same on every mesh. Throws InvalidArgument
// naming the numbers unless batch_blocks is a power of two dividing rows, dp_size divides it (the
// message lists the dp x fsdp that do) and grad_accum divides the blocks per replica.
void check_mesh_invariant_split(std::int64_t rows, int dp_size, int grad_accum, int batch_blocks);
// The ranks that split the batch (dp x fsdp; 1 without either axis).
int batch_split_size(const dist::DeviceMesh& mesh);
// This rank's micro-batches of global_batch, as every step of the trainer takes them: its share of
// the rows over dp x fsdp x ep (dp outermost) cut into `count` (the model's sibling-block group,
// when it has one, deals out row blocks instead). InvalidArgument naming the numbers when a share
// has fewer rows than count. What a training loop of one's own gives Model::loss.
std::vector<nn::Batch> rank_micro_batches(const nn::Model& model, const nn::Batch& global_batch,
                                          const dist::DeviceMesh& mesh, int count);
// The micro-batches one replica runs per step: grad_accum, or in the mesh-invariant mode
// batch_blocks / batch_split_size(mesh).
int micro_batches_per_replica(const nn::ParallelConfig& parallel, const dist::DeviceMesh& mesh, int grad_accum);

struct GradientDump {
  double loss = 0;                                      // global mean cross-entropy (+ a MoE's aux term)
  std::optional<double> aux_loss;                       // a MoE's load-balancing loss (output_router_logits)
  std::vector<std::pair<std::string, Tensor>> gradients; // full gradient of every parameter, by name
};

// loss + backward + gradient synchronisation of model on the global batch (inputs/targets int64
// [B, T], split over dp by the shard rule; loss = mean over the positions whose target is not
// kIgnoreIndex), then every
// parameter's full gradient gathered over tp (collective: every rank calls it; every rank gets the
// full result). On a pipeline (pp > 1) the step is one micro-batch through the stages and the first
// rank of stage 0's parameter group gets every stage's gradients (the others their stage's); the
// loss is on every rank. The model's parameters must not have gradients yet. micro_batches: this
// replica's rows run as that many micro-batches (micro_batches_per_replica: the mesh-invariant mode's
// row blocks), as train_step's grad_accum.
GradientDump compute_gradients(nn::Model& model, const nn::Batch& global_batch, const dist::DeviceMeshPtr& mesh,
                               int micro_batches = 1);

// The global loss: the sum over the dp replicas of each rank's share (replicated over tp), in the
// model's order (the tree in TP-invariant mode, so the reported loss has the same bits at every
// dp x tp with the same dp x grad-accum). Collective over the mesh's dp group; counted as
// Phase::Optimizer, outside the model's communication.
double global_loss(const Tensor& local_loss, const dist::DeviceMesh& mesh, const nn::Model& model);

// The mean global loss over the first `batches` validation batches of dataset: no dropout, nothing
// recorded, the same batches at every evaluation and on every rank. Each replica's rows are split
// into micro_batches pieces as train_step splits them, their losses added in the model's order,
// then summed over dp (the same bits for every dp x tp with the same dp x micro_batches in the
// TP-invariant mode). Collective over the mesh.
double evaluate(nn::Model& model, const data::TokenDataset& dataset, int batches, const dist::DeviceMesh& mesh,
                int micro_batches);

}  // namespace meshgrad::train
