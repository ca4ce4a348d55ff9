// Placements: how a tensor lives on one mesh axis.
//   Shard(d)   each coordinate holds its slice along dim d (shard rule)   prints S(d)
//   Replicate  every coordinate holds the whole tensor                     prints R
//   Partial    the tensor is the sum over coordinates of what each holds  prints P
// A DTensor has one placement per mesh axis.
//
// Gradients carry their own placement information: a PartialGradient annotation says on which
// mesh axes the local gradient is only a partial sum of the true one (e.g. a replicated tensor
// used by a loss that differs per rank, or a replicated parameter used on sharded data). Where a
// tensor is sharded its local gradient is always complete (no other rank's loss can depend on
// this rank's shard), so the flag only matters where the tensor is replicated.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/tensor/annotation.hpp"
#include "meshgrad/tensor/shard.hpp"
#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::dist {

struct Placement {
  enum class Kind : std::uint8_t { Shard, Replicate, Partial };
  Kind kind = Kind::Replicate;
  int dim = 0;              // Shard only
  // Shard only: the dim is made of `blocks` equal blocks (a fused QKV weight: 3) and each block is
  // split by the shard rule in whole units of `unit` elements (a head's width, so heads are never
  // split); this coordinate's piece is its part of every block, concatenated. 1, 1: a plain shard.
  int blocks = 1;
  std::int64_t unit = 1;
  // Shard only: the axis splits dim `dim` of the piece the other axes leave (by the shard rule, over
  // its local extent), not the full dim: FSDP's placement on the fsdp axis, applied after tensor
  // parallelism, so that gathering it over fsdp gives back exactly the tensor-parallel piece the
  // layers compute with (PyTorch DTensor calls this a strided shard). Prints Sp(d).
  bool of_piece = false;

  static Placement shard(int d, int blocks = 1, std::int64_t unit = 1) { return {Kind::Shard, d, blocks, unit}; }
  static Placement shard_of_piece(int d) { return {Kind::Shard, d, 1, 1, true}; }
  static Placement replicate() { return {Kind::Replicate, 0}; }
  static Placement partial() { return {Kind::Partial, 0}; }
  bool is_shard() const { return kind == Kind::Shard; }
  bool is_shard(int d) const { return kind == Kind::Shard && dim == d; }
  bool is_replicate() const { return kind == Kind::Replicate; }
  bool is_partial() const { return kind == Kind::Partial; }
  bool is_plain_shard() const { return is_shard() && blocks == 1 && unit == 1 && !of_piece; }
  bool operator==(const Placement& o) const {
    return kind == o.kind &&
           (kind != Kind::Shard || (dim == o.dim && blocks == o.blocks && unit == o.unit && of_piece == o.of_piece));
  }
  std::string str() const;   // "S(0)", "S(1)x3/64" (3 blocks in units of 64), "Sp(0)", "R", "P"
  // The ranges of a dim of extent `full` that part `index` of `parts` holds, one per block, in
  // order. Throws when the extent is not `blocks` blocks of whole units.
  std::vector<ShardRange> ranges(std::int64_t full, int parts, int index) const;
};
using Placements = std::vector<Placement>;

inline Placement Shard(int d) { return Placement::shard(d); }
inline Placement Replicate() { return Placement::replicate(); }
inline Placement Partial() { return Placement::partial(); }

std::string placements_str(const Placements& p);   // "[S(0), R]"
// Parses "S(0)", "Sp(0)", "R", "P"; throws naming the text.
Placement parse_placement(const std::string& text);

// The annotation on a gradient tensor. Summing gradients with different masks is refused: the
// result would be neither a complete gradient nor a partial one.
class PartialGradient final : public Annotation {
 public:
  explicit PartialGradient(AxisMask axes) : axes_(axes) {}
  AxisMask axes() const { return axes_; }
  std::string str() const override;
  AnnotationPtr combine(const AnnotationPtr& other) const override;

 private:
  AxisMask axes_;
};

// The partial axes of a gradient (0 when unannotated: complete, the only encoding of complete).
AxisMask partial_axes(const Tensor& grad);
// Sets the gradient's annotation to exactly `axes` (0 removes it: complete).
void set_partial_axes(const Tensor& grad, AxisMask axes);

// Identity in forward; in backward, marks the gradient partial over `axes` (added to whatever it
// already was). Used where a replicated tensor meets sharded or partial data.
Tensor mark_partial_grad(const Tensor& x, AxisMask axes);

}  // namespace meshgrad::dist
