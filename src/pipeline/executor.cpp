// A pipeline stage's step (contracts in include/meshgrad/pipeline/executor.hpp).
#include "meshgrad/pipeline/executor.hpp"

#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/distributed/collectives.hpp"
#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/distributed/p2p.hpp"
#include "meshgrad/tensor/trace.hpp"

namespace meshgrad::pipeline {

namespace {

// The forward of micro-batch k on this stage: the activation in from the previous stage, the
// stage's layers, the activation out to the next (the token returned stands for it) or the loss.
// stages: the pp group, or nullptr on a one-stage pipeline (a mesh without pp), which sends nothing.
Tensor forward_micro(nn::Model& model, const nn::Batch& batch, int k, std::int64_t targets,
                     const dist::ProcessGroup* stages, const dist::SendQueuePtr& sends) {
  const nn::PipelineStage st = model.stage();
  const bool recording = autograd::GradMode::is_enabled();
  // The transfers (and, through the graph, their gradients') are labelled as the stage boundary.
  Tensor input;
  if (!st.is_first()) {
    const dist::CommLabelScope label(fmt::format("pp {}->{}", st.index - 1, st.index));
    input = dist::recv(model.stage_input_shape(batch), model.config().dtype, *stages, st.index - 1, dist::tags_for(k),
                       sends, recording);
  }
  const Tensor out = model.forward_stage(batch, input, targets);
  if (st.is_last()) return out;
  const dist::CommLabelScope label(fmt::format("pp {}->{}", st.index, st.index + 1));
  return dist::send(out, *stages, st.index + 1, dist::tags_for(k), sends);
}

// The pp group when the mesh has a pp axis, else nullptr: then the model must be one stage.
const dist::ProcessGroup* stages_of(const nn::Model& model, const dist::DeviceMesh& mesh) {
  const nn::PipelineStage st = model.stage();
  if (!mesh.has_axis("pp")) {
    MG_CHECK(st.count == 1, "pipeline: the model was built as stage {} of {}, and the mesh {} has no pp axis",
             st.index, st.count, mesh.str());
    return nullptr;
  }
  const dist::ProcessGroup& stages = mesh.group("pp");
  MG_CHECK(stages.size() == st.count && stages.rank() == st.index, "pipeline: the model was built as stage {} of {}, "
           "and this rank is stage {} of {} of the mesh {}", st.index, st.count, stages.rank(), stages.size(),
           mesh.str());
  return &stages;
}

}  // namespace

const dist::ProcessGroup& stage_group(const dist::DeviceMesh& mesh) {
  MG_CHECK(mesh.has_axis("pp"), "pipeline: the mesh {} has no pp axis", mesh.str());
  return mesh.group("pp");
}

const dist::ProcessGroup* parameter_stages(const nn::Model& model, const dist::DeviceMesh& mesh) {
  const dist::ProcessGroup* stages = stages_of(model, mesh);
  return stages != nullptr && stages->size() > 1 ? stages : nullptr;
}

Tensor run_step(nn::Model& model, const std::vector<nn::Batch>& micro, std::int64_t targets, ScheduleKind schedule,
                optim::MicroBatchGradients& gradients, const dist::DeviceMesh& mesh) {
  const nn::PipelineStage st = model.stage();
  const dist::ProcessGroup* stages = stages_of(model, mesh);
  const int m = static_cast<int>(micro.size());
  // One stage runs 1F1B's order (forward k, backward k): GPipe's order only holds every micro-batch's
  // activations at once there, with nothing to overlap.
  const std::vector<Action> actions = stage_actions(st.count == 1 ? ScheduleKind::OneFOneB : schedule, st.count,
                                                    st.index, m);
  auto sends = std::make_shared<dist::SendQueue>();
  optim::MicroBatchLosses losses(model.reduce_order(), model.micro_batch_sum_group());
  std::vector<Tensor> roots(micro.size());   // per micro-batch, from its forward to its backward
  // Every micro-batch draws the dropout seeds of one forward of the whole batch (as train_step).
  const std::uint64_t dropout_start = model.random_state();
  {
    const dist::CommLabelScope label("wte copy");
    model.refresh_stage_copies();
  }
  for (const Action& a : actions) {
    const auto k = static_cast<std::size_t>(a.micro);
    if (a.kind == Action::Kind::Forward) {
      trace::Span span(fmt::format("forward {}", a.micro), "pipeline_forward");
      model.set_random_state(dropout_start);
      roots[k] = forward_micro(model, micro[k], a.micro, targets, stages, sends);
      if (st.is_last()) losses.push(roots[k].detach());
    } else {
      trace::Span span(fmt::format("backward {}", a.micro), "pipeline_backward");
      gradients.before_backward(a.micro);   // arms the synchroniser and tells the model if more follow
      backward(roots[k]);
      roots[k] = Tensor();   // the micro-batch's graph and activations go
      gradients.after_backward(a.micro);
    }
  }
  sends->wait_all();
  return st.is_last() ? losses.total() : Tensor::scalar(0.0, model.config().dtype);
}

Tensor forward_only(nn::Model& model, const std::vector<nn::Batch>& micro, std::int64_t targets,
                    const dist::DeviceMesh& mesh) {
  autograd::NoGradGuard no_grad;
  const nn::PipelineStage st = model.stage();
  const dist::ProcessGroup* stages = stages_of(model, mesh);
  auto sends = std::make_shared<dist::SendQueue>();
  optim::MicroBatchLosses losses(model.reduce_order(), model.micro_batch_sum_group());
  {
    const dist::CommLabelScope label("wte copy");
    model.refresh_stage_copies();
  }
  for (std::size_t k = 0; k < micro.size(); ++k) {
    const Tensor out = forward_micro(model, micro[k], static_cast<int>(k), targets, stages, sends);
    if (st.is_last()) losses.push(out);
  }
  sends->wait_all();
  return st.is_last() ? losses.total() : Tensor::scalar(0.0, model.config().dtype);
}

Tensor losses_over_stages(const Tensor& stage_loss, const dist::DeviceMesh& mesh) {
  if (!mesh.has_axis("pp")) return stage_loss.detach();   // one stage: its loss is the step's
  dist::PhaseScope phase(dist::Phase::Optimizer);
  return dist::all_reduce(stage_loss.detach(), stage_group(mesh));
}

}  // namespace meshgrad::pipeline
