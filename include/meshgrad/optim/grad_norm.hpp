// The global gradient norm of a model split over a mesh, and clipping by it.
//
// The full model's gradient is the concatenation of every parameter's complete gradient, each
// counted once: a sharded parameter's pieces are summed over the axes that shard it (each piece
// once), a replicated parameter's gradient (the same on every coordinate after synchronisation)
// counted once, never once per replica. So the norm equals the single-rank model's at any mesh, up
// to the order of float64 additions.
#pragma once

#include <vector>

#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/nn/parameter.hpp"

namespace meshgrad::optim {

// The L2 norm of the full gradient. Gradients must be complete (after
// GradientSynchronizer::finish()); a parameter without a gradient counts zero. Collective: one
// float64 all-reduce per distinct set of sharding axes among the parameters, over that set's group;
// every rank of the mesh calls it with the same parameters.
// exact (TP-invariant mode): the sum of squares is accumulated exactly (integer bins per binary
// exponent, added without rounding, all-reduced as exact integer counts); the bins are then added
// into one double from the smallest up. That last sum can round more than once (it is not always the
// correctly rounded value), but it is a function of the exact integer sum only, so the norm is the
// same bits whatever the mesh and whatever order the pieces are added in. One float64 all-reduce of
// ~2100 bin counts per set of sharding axes instead of one float64.
double global_grad_norm(const std::vector<nn::Parameter*>& params, const dist::DeviceMesh& mesh, bool exact = false);

// PyTorch's clip_grad_norm_: when the norm exceeds max_norm, every gradient is scaled in place by
// max_norm / (norm + 1e-6). Returns the norm before clipping. max_norm must be > 0.
double clip_grad_norm(const std::vector<nn::Parameter*>& params, const dist::DeviceMesh& mesh, double max_norm,
                      bool exact = false);

}  // namespace meshgrad::optim
