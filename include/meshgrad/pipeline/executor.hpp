// Runs a step's micro-batches through this rank's pipeline stage in a schedule's order
// (schedule.hpp). Each forward receives the previous stage's activation (dist::recv, recorded),
// runs Model::forward_stage and sends the result on (dist::send) or, on the last stage, keeps the
// loss; each backward is autograd's backward from that token or loss: the graph's send and receive
// nodes move the gradients between stages, so nothing here writes a gradient transfer.
//
// The micro-batches' gradients accumulate exactly as optim::MicroBatchGradients accumulates them on
// one rank (the same object drives the gradient synchroniser and tells the model which backward is
// the last), so `--mesh pp=P --grad-accum M` gives the bits of one rank with `--grad-accum M`.
//
// A mesh without a pp axis is a pipeline of one stage: the same functions run it (the schedules'
// one-stage order is forward k, backward k, for k in order), with no transfer, so every step of
// meshgrad, pipelined or not, goes through run_step or forward_only.
#pragma once

#include <cstdint>
#include <vector>

#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/nn/model.hpp"
#include "meshgrad/optim/micro_batches.hpp"
#include "meshgrad/pipeline/schedule.hpp"

namespace meshgrad::pipeline {

// The pp group of the mesh; throws when the mesh has no pp axis.
const dist::ProcessGroup& stage_group(const dist::DeviceMesh& mesh);

// The group of the model's pipeline stages when there are several (the pp group: each stage holds
// other parameters, so what gathers every parameter collects over it), else nullptr: one stage holds
// them all. Throws when the model was built for another stage than the mesh gives this rank.
const dist::ProcessGroup* parameter_stages(const nn::Model& model, const dist::DeviceMesh& mesh);

// Forward and backward of every micro-batch on this rank's stage. micro: the step's micro-batches,
// in order (the same on every stage: the first reads inputs, the last targets). targets: the
// global batch's loss-target count. Returns the sum of the micro-batch losses in the model's order
// on the last stage and a zero of the model's dtype elsewhere (losses_over_stages shares it).
// Waits for every send before returning.
Tensor run_step(nn::Model& model, const std::vector<nn::Batch>& micro, std::int64_t targets,
                ScheduleKind schedule, optim::MicroBatchGradients& gradients, const dist::DeviceMesh& mesh);

// The forward of every micro-batch without recording a graph (evaluation): the summed loss on the
// last stage, a zero elsewhere.
Tensor forward_only(nn::Model& model, const std::vector<nn::Batch>& micro, std::int64_t targets,
                    const dist::DeviceMesh& mesh);

// The last stage's value of `stage_loss` on every stage (an all-reduce over the pp group in which
// the other stages add zeros: exact); without a pp axis, stage_loss itself (detached).
Tensor losses_over_stages(const Tensor& stage_loss, const dist::DeviceMesh& mesh);

}  // namespace meshgrad::pipeline
