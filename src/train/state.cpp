// The training state a checkpoint holds (contracts in include/meshgrad/train/state.hpp).
#include "meshgrad/train/state.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <nlohmann/json.hpp>

#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/checkpoint/reader.hpp"

namespace meshgrad::train {

// The training state a checkpoint holds as tensors: every parameter's piece and its AdamW moments
// (zeros before the first update: the same as AdamW's lazily created ones), by name.
std::vector<checkpoint::StateTensor> training_state_tensors(const std::vector<nn::Parameter*>& params, const optim::AdamW& opt) {
  std::vector<checkpoint::StateTensor> out;
  for (const nn::Parameter* p : params) out.push_back({p->name, p->full_shape, p->placements, p->value});
  for (const char* kind : {"exp_avg", "exp_avg_sq"}) {
    for (std::size_t i = 0; i < params.size(); ++i) {
      const nn::Parameter& p = *params[i];
      Tensor m = std::string(kind) == "exp_avg" ? opt.exp_avg(i) : opt.exp_avg_sq(i);
      if (!m.defined()) m = Tensor::zeros(p.value.shape(), p.value.dtype());
      out.push_back({fmt::format("optimizer.{}.{}", kind, p.name), p.full_shape, p.placements, m});
    }
  }
  return out;
}

int load_training_state(const std::string& dir, const checkpoint::Manifest& manifest, nn::Model& model, optim::AdamW& opt, StateLoad how) {
  const std::vector<nn::Parameter*> params = model.parameters();
  std::vector<checkpoint::PieceRequest> requests;
  for (const nn::Parameter* p : params) requests.push_back({p->name, p->full_shape, p->layout(), p->value.dtype()});
  for (const char* kind : {"exp_avg", "exp_avg_sq"}) {
    for (const nn::Parameter* p : params)
      requests.push_back({fmt::format("optimizer.{}.{}", kind, p->name), p->full_shape, p->layout(), p->value.dtype()});
  }
  // The scalars first: a checkpoint without them is refused before any tensor is read.
  const nlohmann::json& state = manifest.state;
  std::int64_t optimizer_steps = 0, step = 0;
  std::uint64_t random_state = 0;
  try {
    optimizer_steps = state.at("optimizer_steps").get<std::int64_t>();
    step = state.at("step").get<std::int64_t>();
    random_state = state.at("random_state").get<std::uint64_t>();
  } catch (const std::exception& e) {
    throw checkpoint::CheckpointError(fmt::format("checkpoint '{}': its state lacks the optimizer step, the step or the random state: {}", dir, e.what()));
  }
  MG_CHECK(step == manifest.step && step >= 0 && step <= INT32_MAX, "checkpoint '{}': state step {} differs from the manifest's {}",
           dir, step, manifest.step);
  MG_CHECK(optimizer_steps >= 0, "checkpoint '{}': optimizer step count {} is negative", dir, optimizer_steps);
  const std::size_t n = params.size();
  autograd::NoGradGuard no_grad;
  if (how == StateLoad::in_place) {
    std::vector<Tensor> targets;
    targets.reserve(3 * n);
    for (const nn::Parameter* p : params) {
      MG_CHECK(p->value.is_contiguous(), "load_training_state: parameter '{}' is not contiguous", p->name);
      targets.push_back(p->value.detach());
    }
    for (Tensor& moment : opt.materialize_moments()) targets.push_back(std::move(moment));
    checkpoint::read_pieces_into(dir, manifest, requests, targets);
    opt.set_steps(optimizer_steps);
  } else {
    const std::vector<Tensor> loaded = checkpoint::read_pieces(dir, manifest, requests);
    std::vector<Tensor> m(loaded.begin() + static_cast<std::ptrdiff_t>(n), loaded.begin() + static_cast<std::ptrdiff_t>(2 * n));
    std::vector<Tensor> v(loaded.begin() + static_cast<std::ptrdiff_t>(2 * n), loaded.end());
    opt.load_state(optimizer_steps, m, v);   // checks before it changes anything
    for (std::size_t i = 0; i < n; ++i) params[i]->value.detach().copy_from(loaded[i]);
  }
  model.set_random_state(random_state);
  return static_cast<int>(step);
}

}  // namespace meshgrad::train
