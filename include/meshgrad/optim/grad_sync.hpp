// Gradient synchronisation for a dp x tp mesh, started from gradient hooks during backward.
//
// After loss.backward() each rank holds, per parameter piece, its local gradient, marked partial
// (distributed/placement.hpp) on the mesh axes where it is a partial sum:
//   - "dp": every replica saw different rows (the models mark their loss partial over dp);
//   - a tp axis, for replicated parameters used on sharded data (LayerNorm weights under sequence
//     parallelism see only this rank's slice of the sequence).
// The synchroniser asks the one rule (distributed/rule.hpp) for every axis where the parameter is
// replicated: the parameter entered the computation as R -> R, so a gradient arriving P is
// all-reduced there and an unmarked one is left alone. The dp and cp axes (every rank of them saw
// other tokens: other rows, or other positions of the same rows under context parallelism) share
// buckets: gradients are packed into them (bucket_bytes each, in the order gradients become ready)
// and each is all-reduced in place over the flattened dp x cp group as soon as every member is in;
// other axes (tp under SP, ep) are reduced one parameter at a time:
//
//   backward:  ... grad(p3) ready -[tp all-reduce if partial]-> copy into bucket 0 ─┐
//                  grad(p2) ready -> copy into bucket 0 (full) ─────────────────────┴ dp all-reduce(bucket 0), async
//                  grad(p1) ready -> bucket 1 ...                                     overlaps the rest of backward
//   finish():  wait every reduction (each with the communicator's deadline); param.grad = its slot
//
// Parameters sharded over a data-parallel axis (FSDP's fsdp axis, or dp under --shard-optimizer;
// nn/fsdp.hpp) arrive already reduce-scattered there by the rule's backward of their gather: the
// synchroniser reduces only the axes a parameter is replicated on, so it all-reduces them over dp
// (HSDP) or not at all.
//
// Why a SUM over dp and not an average: Model::loss divides by the *global* token count, so each
// rank's loss is already its share of the global mean and the global gradient is the plain sum of
// the per-rank gradients. Averaging would divide by dp a second time.
//
// Collective order: hooks fire in the autograd engine's deterministic order, which is the same on
// every rank of a group (same graph), and every collective here is issued from a hook or from
// finish() in a fixed order, so all ranks of each dp / tp group issue the same sequence.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/distributed/placement.hpp"
#include "meshgrad/distributed/rule.hpp"
#include "meshgrad/nn/parameter.hpp"

namespace meshgrad::optim {

struct GradSyncOptions {
  // Bytes of gradient per dp all-reduce (PyTorch DDP's bucket_cap_mb is 25 MiB). A parameter larger
  // than a bucket gets a bucket of its own.
  std::int64_t bucket_bytes = std::int64_t{25} << 20;
  // The order of every sum the synchroniser runs (the model's, nn::Model::reduce_order): with
  // FixedTree (TP-invariant mode, docs/mesh-invariance.md, "dp") the buckets are summed over dp, and
  // partial gradients over their tp axes, in the fixed binary tree ((r0 + r1) + (r2 + r3)) instead
  // of the backend's rank order. dp must then be a power of two.
  dist::ReduceOrder order = dist::ReduceOrder::RankOrder;
  // The dp buckets' element type on the wire (nn::ParallelConfig::reduce_dtype): BFloat16 sends a
  // bf16 copy of each float32 bucket and widens the reduced sum back into it.
  DType reduce_dtype = DType::Float32;
};

class GradientSynchronizer {
 public:
  // Registers hooks on every parameter's value. Construct it after the parameters' tensors are final
  // (after loading weights): hooks belong to the tensor objects. params must outlive the
  // synchroniser's use; the mesh needs a "dp" axis or none (then dp size is 1). Destroying the
  // synchroniser disarms its hooks (they hold only a weak reference).
  GradientSynchronizer(std::vector<nn::Parameter*> params, dist::DeviceMeshPtr mesh, GradSyncOptions options = {});
  ~GradientSynchronizer();
  GradientSynchronizer(const GradientSynchronizer&) = delete;
  GradientSynchronizer& operator=(const GradientSynchronizer&) = delete;

  // After backward: waits for every reduction launched during backward (each wait bounded by the
  // communicator's deadline) and sets param->value.grad() to the complete gradient (no partial
  // mark; with dp > 1 a view into its bucket). Throws InvalidArgument naming every parameter whose
  // gradient never became ready (after waiting for the others, so no reduction is left in flight).
  // Re-arms for the next step.
  void finish();

  // Gradient accumulation: while on, backward passes only accumulate into .grad (no reduction is
  // launched, nothing counts as ready); the backward after turning it off reduces the sum once.
  // Every rank must switch at the same micro-batch.
  void set_accumulating(bool on);

  // For a caller that accumulates gradients itself (MicroBatchGradients in the tree order adds the
  // micro-batches in the fixed tree): after backward passes with accumulating on, it sets every
  // param->value.grad() to the total and calls this, which turns accumulating off and reduces each
  // gradient as if its hook fired now (in reverse parameter order, the order backward makes them).
  // finish() then completes the step; a parameter without a gradient is reported there.
  void reduce_gradients();

  // Reductions launched since the last finish() (tp and dp), for tests and reports.
  int launched() const;
  // The dp buckets: how many, and which parameters each holds (names, in slot order).
  std::vector<std::vector<std::string>> buckets() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace meshgrad::optim
