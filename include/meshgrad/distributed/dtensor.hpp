// DTensor: a tensor distributed over a DeviceMesh: this rank's local piece + the mesh + one
// placement per mesh axis + the global shape. Every operation here is differentiable (the local
// tensor carries the autograd history), and the backward of a redistribution is derived from the
// placement of the gradient that actually arrives, by the one rule (rule.hpp; `meshgrad explain
// --rules` prints it).
//
// So a loss computed identically on every rank (from_local(loss, {R})) and a loss that differs per
// rank and is summed over ranks (from_local(loss, {P})) both give the single-process gradient,
// with no scaling by the world size.
//
// Limits: two mesh axes may not shard the same tensor dim (nested sharding) in a DTensor: refused
// with an error (parameters may: layout.hpp).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/distributed/placement.hpp"
#include "meshgrad/distributed/rule.hpp"
#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::dist {

class DTensor {
 public:
  DTensor() = default;
  // Wraps a local piece as is (no autograd node, no communication). Checks that the local shape is
  // the one the placements give for this rank.
  DTensor(Tensor local, DeviceMeshPtr mesh, Placements placements, Shape global_shape);

  const Tensor& local() const { return local_; }
  const DeviceMeshPtr& mesh() const { return mesh_; }
  const Placements& placements() const { return placements_; }
  const Shape& shape() const { return global_shape_; }
  int dim() const { return static_cast<int>(global_shape_.size()); }
  DType dtype() const { return local_.dtype(); }
  bool requires_grad() const { return local_.requires_grad(); }
  // "DTensor(float32[8, 4] local [4, 4] on mesh(tp=2) [S(0)])"
  std::string str() const;

 private:
  Tensor local_;
  DeviceMeshPtr mesh_;
  Placements placements_;
  Shape global_shape_;
};

// The local shape and the offsets into the global tensor of `rank`'s piece.
Shape local_shape_of(const Shape& global_shape, const DeviceMesh& mesh, const Placements& placements,
                     const std::vector<int>& coords);
std::vector<std::int64_t> local_offsets_of(const Shape& global_shape, const DeviceMesh& mesh,
                                           const Placements& placements, const std::vector<int>& coords);

// Wraps this rank's piece. For Partial axes the backward marks the gradient partial there: the
// true value is the sum over those axes. global_shape empty = learn sharded extents from the ranks
// (a small exchange per sharded axis).
DTensor from_local(const Tensor& local, DeviceMeshPtr mesh, Placements placements, Shape global_shape = {});

// Changes placements, axis by axis: each step is mappings.hpp's change_placement on that axis,
// whose backward the one rule (rule.hpp) derives from the gradient that arrives. To distribute a
// tensor that is the same on every rank, wrap it as Replicate everywhere and redistribute.
DTensor redistribute(const DTensor& x, const Placements& target);

// The whole tensor on every rank (redistribute to Replicate everywhere, then the local tensor).
Tensor full_tensor(const DTensor& x);

// ---- ops that propagate placements (refusing what would silently be wrong) ----------------------
// Elementwise with broadcasting: S(d)+S(d) -> S(d); S(d) with R -> S(d) (the R side is sliced
// locally, or its gradient is partial where it broadcasts); P+P, P-P -> P; P*R, P/R, R*P -> P.
// Refused: P+R, P-R, P*P, R/P, P with S, S on different dims.
DTensor add(const DTensor& a, const DTensor& b);
DTensor sub(const DTensor& a, const DTensor& b);
DTensor mul(const DTensor& a, const DTensor& b);
DTensor div(const DTensor& a, const DTensor& b);
// a [..., m, k] @ b [k, n] or [..., k, n]: S(m)·R -> S(m), R·S(n) -> S(n), S(k)·S(k) -> P,
// S(batch)·R -> S(batch), P·R, R·P -> P, R·R -> R. Anything else is refused naming both placements.
DTensor matmul(const DTensor& a, const DTensor& b);
// Sum over dims: a sharded dim that is summed becomes P.
DTensor sum(const DTensor& x, const std::vector<std::int64_t>& dims = {}, bool keepdim = false);

// ---- gradients of distributed parameters -------------------------------------------------------
// A Replicate parameter whose gradient is partial on an axis (it was used on sharded data) must be
// summed over that axis before an optimizer step. reduce_partial_grads does it by the one rule: the
// parameter entered the computation as R -> R on each axis where it is replicated, so a gradient
// arriving P there is reduced as the rule's backward says (an all-reduce, in `order`), and marked
// complete; check_grads_complete refuses (naming the parameter and axis) if any is still partial.
// (nn models use optim::GradientSynchronizer, which asks the same rule, overlapped with backward.)
void reduce_partial_grads(const std::vector<DTensor>& params, ReduceOrder order = ReduceOrder::RankOrder);
void check_grads_complete(const std::vector<DTensor>& params, const std::vector<std::string>& names = {});

}  // namespace meshgrad::dist
