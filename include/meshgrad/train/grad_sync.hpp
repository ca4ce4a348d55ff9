// Gradient synchronisation for a dp x tp mesh, started from gradient hooks during backward.
//
// After loss.backward() each rank holds, per parameter shard, its local gradient:
//   - partial over "dp": every dp replica saw different rows of the batch;
//   - partial over "tp" for some replicated parameters (LayerNorm weights under sequence
//     parallelism see only this rank's slice of the sequence); such gradients carry a
//     PartialGradient annotation with the tp bit (dist::partial_axes).
// The synchroniser turns them into the complete gradient of the global loss:
//
//   backward:  ... grad(p3) ready ─┬─ [tp all-reduce if partial over tp] ─┬─ dp all-reduce (async) ...
//                  grad(p2) ready ─┘   (waited at the next hook)          └─ overlaps the rest of backward
//   finish():  wait every dp all-reduce (each with the communicator's deadline), write param.grad
//
// Why a SUM over dp and not an average: Model::loss divides by the *global* token count, so each
// rank's loss is already its share of the global mean and the global gradient is the plain sum of
// the per-rank gradients. Averaging would divide by dp a second time.
//
// Collective order: hooks fire in the autograd engine's deterministic order, which is the same on
// every rank of a group (same graph), and every collective here is issued from a hook or from
// finish() in a fixed order, so all ranks of each dp / tp group issue the same sequence.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/distributed/placement.hpp"
#include "meshgrad/nn/parameter.hpp"

namespace meshgrad::train {

class GradientSynchronizer {
 public:
  // Registers a post-accumulate hook on every parameter's value. Construct it after the parameters'
  // tensors are final (after loading weights): hooks belong to the tensor objects. params must
  // outlive the synchroniser's use; the mesh needs a "dp" axis or none (then dp size is 1).
  // Destroying the synchroniser disarms its hooks (they hold only a weak reference).
  GradientSynchronizer(std::vector<nn::Parameter*> params, dist::DeviceMeshPtr mesh);
  ~GradientSynchronizer();
  GradientSynchronizer(const GradientSynchronizer&) = delete;
  GradientSynchronizer& operator=(const GradientSynchronizer&) = delete;

  // After backward: waits for every reduction launched during backward (each wait bounded by the
  // communicator's deadline) and sets param->value.grad() to the complete gradient, annotated as
  // complete (dist::set_partial_axes(grad, 0)). Throws InvalidArgument naming every parameter whose
  // gradient never became ready (after waiting for the others, so no reduction is left in flight).
  // Re-arms for the next step.
  void finish();

  // Reductions launched since the last finish() (tp and dp), for tests and reports.
  int launched() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace meshgrad::train
