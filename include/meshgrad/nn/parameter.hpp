// Parameters of tensor-parallel modules: this rank's piece (a leaf tensor), the full tensor's shape
// and name (Hugging Face GPT-2 names: "h.0.attn.c_attn.weight"), the mesh, and one placement per
// mesh axis in the one sharding vocabulary (distributed/placement.hpp; layout.hpp says where the
// piece lies). Examples on a 1-D mesh (dp, tp):
//   c_attn.weight [C, 3C]: (R, S(1)x3/head_dim)   heads of each of Q, K, V split whole
//   c_fc.weight   [C, 4C]: (R, S(1));   c_proj.weight [4C, C]: (R, S(0));   ln_1.weight: (R, R)
//   wte.weight    [V, C]:  (R, S(0))    vocabulary-parallel
// and on a 2-D mesh (dp, tp_row, tp_col): c_fc.weight (R, S(0), S(1)); wte.weight (R, S(0), S(0)),
// the vocabulary split over the whole grid.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshgrad/distributed/layout.hpp"
#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/distributed/placement.hpp"
#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::nn {

struct Parameter {
  std::string name;
  Tensor value;                   // this rank's piece: a leaf with requires_grad
  Shape full_shape;
  dist::Placements placements;    // one per mesh axis (never P)
  dist::DeviceMeshPtr mesh;
  // FSDP (nn/fsdp.hpp): while its unit runs forward, the piece gathered over the fsdp axis (the
  // tensor-parallel piece the layers compute with, recorded so that its gradient is reduce-scattered
  // back to `value`); undefined otherwise.
  Tensor gathered;

  // The tensor layers compute with: the gathered piece under FSDP, else value itself.
  const Tensor& operand() const { return gathered.defined() ? gathered : value; }

  // The mesh axes the parameter is replicated on: its gradient must be complete there before an
  // optimizer step (the synchroniser reduces it by the one rule).
  dist::AxisMask replicated_axes() const;
  bool sharded() const { return dist::sharded_axes(placements) != 0; }
  // This rank's layout of the full tensor.
  dist::PieceLayout layout() const;
  // The shape of operand(): value's, or under FSDP the piece gathered over fsdp (the layout with the
  // Sp placements read as R).
  Shape operand_shape() const;
};

// This rank's piece of a full tensor for p (a packed copy; int64 and floats alike).
Tensor take_shard(const Tensor& full, const Parameter& p);
// The full tensor from every rank's piece of `local` (p's value, gradient or optimizer state):
// an all-gather over the axes that shard p; every rank of that group must call it.
Tensor gather_full(const Tensor& local, const Parameter& p);

// Deterministic initialisation of this rank's piece: element g of the full tensor is
// mean + std * normal(seed_of(seed, name), g), so pieces equal slices of the tp=1 tensor.
Tensor init_normal_piece(const std::string& name, const Shape& full_shape, const dist::PieceLayout& layout,
                         std::uint64_t seed, double std, DType dtype);
std::uint64_t seed_of(std::uint64_t seed, const std::string& name);

}  // namespace meshgrad::nn
