// The training state a checkpoint holds: the model's parameters, AdamW's moments and step count,
// the model's random stream; saved as the pieces each rank holds and loaded on any mesh.
#pragma once

#include <string>
#include <vector>

#include "meshgrad/checkpoint/manifest.hpp"
#include "meshgrad/checkpoint/state_tensor.hpp"
#include "meshgrad/nn/model.hpp"
#include "meshgrad/optim/adamw.hpp"

namespace meshgrad::train {

// The training state a checkpoint holds as tensors: every parameter's piece, then its AdamW moments
// ("optimizer.exp_avg.NAME", "optimizer.exp_avg_sq.NAME"; zeros before the first update, which is
// what AdamW's lazily created moments start from).
std::vector<checkpoint::StateTensor> training_state_tensors(const std::vector<nn::Parameter*>& params, const optim::AdamW& optimizer);
// How load_training_state treats the state it replaces.
enum class StateLoad {
  // Read into new tensors and checked, then copied in: on any error the model and the optimizer are
  // unchanged. Costs a second copy of the state in memory while loading.
  all_or_nothing,
  // Read straight into the parameters' memory and the optimizer's moments (created first, as zeros):
  // no second copy, and no memory the process has not touched already. Errors found from the
  // manifest and the files' sizes still change nothing; a hash mismatch found while reading leaves
  // the values partly overwritten. For a model and optimizer built for the resume, which the caller
  // drops when it throws (train --resume).
  in_place,
};
// Loads parameters, AdamW state and the model's random stream from checkpoint dir (written on any
// mesh: each rank reads the pieces of its own layout), every piece checked against its hash. Returns
// the number of steps the checkpoint was taken after. Not collective. Throws CheckpointError naming
// the file and the tensor.
int load_training_state(const std::string& dir, const checkpoint::Manifest& manifest, nn::Model& model, optim::AdamW& optimizer,
                        StateLoad how = StateLoad::all_or_nothing);

}  // namespace meshgrad::train
