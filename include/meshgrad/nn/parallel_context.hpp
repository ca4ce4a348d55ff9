// The mesh a model lives on, its tensor-parallel groups, the parallel options, and the summation-
// order policy that is the whole difference between the normal and the tp-invariant mode.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/distributed/placement.hpp"
#include "meshgrad/distributed/rule.hpp"
#include "meshgrad/nn/model.hpp"
#include "meshgrad/ops/tree_reduce.hpp"
#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::nn {

// Buffers for the sequence all-gather of the column layers in regather mode, shared by every layer
// of a model per (shape, dtype) as Megatron's global memory buffer: forward gathers into one, uses
// it and lets it go; backward gathers into it again. A buffer is handed out only while nobody else
// holds it, so a saved tensor is never overwritten.
class GatherBuffers {
 public:
  // A buffer of this shape and dtype that nobody else holds, or an undefined Tensor (the gather then
  // allocates; take() keeps the result for next time).
  Tensor reusable(const Shape& shape, DType dtype) const;
  void keep(const Tensor& t);
  std::size_t size() const { return buffers_.size(); }

 private:
  std::vector<Tensor> buffers_;
};

// The mesh a model lives on, its tensor-parallel groups and the parallel options. Built once per
// model and shared (std::shared_ptr) by its layers and by the graph nodes they record, so a node
// never points into a layer or model that moved or died.
//   1-D mesh (dp, tp):            tp = the "tp" axis group
//   2-D mesh (dp, tp_row, tp_col): tp = the whole grid (tp_row+tp_col); row / col = the axis groups
struct ParallelContext {
  dist::DeviceMeshPtr mesh;
  dist::ProcessGroup tp;
  bool two_d = false;
  int tp_axis = -1;                  // 1-D
  int row_axis = -1, col_axis = -1;  // 2-D
  int dp_axis = -1;                  // -1: no dp axis
  // The axis parameters are sharded over for data parallelism (nn/fsdp.hpp): fsdp, or dp under
  // --shard-optimizer; -1: none.
  int fsdp_axis = -1;
  int pp_axis = -1;                  // -1: no pp axis (pipeline parallelism, pipeline/executor.hpp)
  // Expert parallelism (nn/moe.hpp): the ep axis splits the batch like dp for the dense layers and
  // the experts of every MoE block among its ranks; -1: no ep axis.
  int ep_axis = -1;
  // Context parallelism (nn/context_parallel.hpp): the cp axis splits every sequence into 2 x cp
  // chunks, two per rank; attention gathers the keys and values over it; -1: no cp axis.
  int cp_axis = -1;
  ParallelConfig config;
  mutable GatherBuffers gather_buffers;   // regather mode (one model per rank: no lock)

  // Collective over the mesh (builds the grid group on a 2-D mesh). Throws naming the mesh when it
  // has neither a "tp" axis nor "tp_row" and "tp_col", and for options 2-D does not support.
  static std::shared_ptr<const ParallelContext> on(dist::DeviceMeshPtr mesh, const ParallelConfig& config);
  int tp_size() const { return tp.size(); }
  int tp_rank() const { return tp.rank(); }
  const dist::ProcessGroup& row() const { return mesh->group(row_axis); }
  const dist::ProcessGroup& col() const { return mesh->group(col_axis); }
  // The pipeline's stages: this rank's group along the pp axis (stage = rank in it); 1 without one.
  int pp_size() const { return pp_axis >= 0 ? mesh->axis_size(pp_axis) : 1; }
  int pp_rank() const { return pp_axis >= 0 ? mesh->coordinate(pp_axis) : 0; }
  bool sequence_parallel() const { return config.sequence_parallel && tp.size() > 1; }
  // The ranks the experts are split over (1 and 0 without an ep axis).
  int ep_size() const { return ep_axis >= 0 ? mesh->axis_size(ep_axis) : 1; }
  int ep_rank() const { return ep_axis >= 0 ? mesh->coordinate(ep_axis) : 0; }
  bool expert_parallel() const { return ep_size() > 1; }
  // The ep axis's group; only when expert_parallel().
  const dist::ProcessGroup& expert_group() const { return mesh->group(ep_axis); }
  // The ranks every sequence is split over (1 and 0 without a cp axis).
  int cp_size() const { return cp_axis >= 0 ? mesh->axis_size(cp_axis) : 1; }
  int cp_rank() const { return cp_axis >= 0 ? mesh->coordinate(cp_axis) : 0; }
  bool context_parallel() const { return cp_size() > 1; }
  // The cp axis's group; only when context_parallel().
  const dist::ProcessGroup& context_group() const { return mesh->group(cp_axis); }
  // --mesh-invariant with --sequence-blocks N > 1 (ParallelConfig::sequence_blocked): every product over
  // tokens runs per sequence block, every sum over tokens adds the blocks in the fixed tree, and a
  // rank's piece of the sequence is its N / cp blocks in leaf order (nn/context_parallel.hpp).
  bool sequence_blocked() const { return config.sequence_blocked(); }
  int sequence_blocks() const { return sequence_blocked() ? config.sequence_blocks : 1; }
  // Attention runs per position run of the rank's piece against the keys up to the run's end
  // (context_attention): with cp, and under the sequence blocks, where even one rank runs each block
  // alone so that its products have the shapes they have on every cp.
  bool attention_per_run() const { return context_parallel() || sequence_blocked(); }
  // The axes that split the batch (dp, fsdp and ep), as a mask of those with more than one rank.
  dist::AxisMask batch_axes() const;
  // The axes whose ranks hold different tokens of one forward's batch: the batch axes and cp (which
  // splits the sequence), as a mask, and as indices in mesh order. A loss is partial over them.
  dist::AxisMask token_axes() const;
  std::vector<int> token_axis_indices() const;
  // The same as mesh axis indices, in mesh order (the axes of their flattened group).
  std::vector<int> batch_axis_indices() const;
  // The ranks that split the batch: the product of those axes' sizes.
  int batch_replicas() const;
  // The features' fixed tree (--tp-invariant, and --mesh-invariant, which holds it).
  bool tp_invariant() const { return config.invariance != Invariance::None; }
  // Parameters are sharded over an fsdp axis of more than one rank and gathered per unit (fsdp.hpp).
  bool fsdp_active() const { return fsdp_axis >= 0 && mesh->axis_size(fsdp_axis) > 1; }
  // Whether an FSDP unit gives its gathered bytes back after its forward (see fsdp.hpp): yes unless
  // --no-reshard-after-forward, and not under block checkpointing, whose recomputation in backward
  // is followed at once by the block's backward.
  bool reshard_after_forward() const {
    return config.reshard_after_forward && !config.checkpoint_blocks && !config.shard_optimizer;
  }
  // --shard-optimizer: the units keep their gathered parameters from step to step, and gather again
  // only when a shard changed (the optimizer stepped it).
  bool keeps_gathered_parameters() const { return config.shard_optimizer; }
  // Placements of a parameter: replicated everywhere; `p` on the tp axis (1-D) or on both grid
  // axes (2-D: the dim split over the whole grid); or p_row on tp_row and p_col on tp_col (2-D).
  // With an fsdp axis every parameter is Sp(0) there (replicated() included: FSDP shards them all).
  dist::Placements replicated() const;
  dist::Placements on_tp(dist::Placement p) const;
  dist::Placements on_grid(dist::Placement p_row, dist::Placement p_col) const;
  // An MoE block's stacked expert tensor [experts, ...]: split along dim 0 over ep (each rank holds
  // its experts whole), replicated on tp, Sp(0) on fsdp as every parameter.
  dist::Placements on_experts() const;
  // Marks x's gradient partial over the tp group (a replicated tensor used on sequence-sharded data
  // whose rows are disjoint over tp, such as the position table: its sum is exact in any order).
  Tensor partial_over_tp(const Tensor& x) const;
  // Marks a loss partial over the axes that split the tokens, dp, fsdp, ep and cp (token_axes): each
  // rank's loss is its share of the global one, so every gradient arrives partial there; the FSDP
  // units reduce-scatter over fsdp and the synchroniser all-reduces over dp and cp, by the one rule.
  Tensor loss_partial_over_dp(const Tensor& loss) const;

  // ---- the summation-order policy (ParallelConfig::invariance; docs/mesh-invariance.md) ----------
  // The two modes differ in nothing but the order of the sums split over tp, and these four are
  // where that difference lives; layers ask them and run the same code in both modes.
  //
  // The order of every sum over tp: the fixed tree in tp-invariant mode, else the backends' rank
  // order. Steps of the one rule carry it (dist::StepArgs::order), and the trainer follows it for its
  // own sums (micro-batches, dp, the reported loss, the gradient norm).
  dist::ReduceOrder reduce_order() const;
  // The blocks this rank computes a split feature dimension in (`what` names it in errors; full,
  // parts and unit as tree::plan_split): the fixed blocks of the tp-invariant mode (throws
  // InvalidArgument when this tp cannot keep the tree), else its whole local shard of
  // `local_extent` features as one block.
  tree::SplitPlan feature_plan(const std::string& what, std::int64_t full, int parts, std::int64_t unit,
                               std::int64_t local_extent) const;
  // The token blocks of an activation [T_local, B, ...] of a sequence of `seq` positions, as sizes
  // of consecutive row blocks of its [T_local * B, ...] view: the fixed token blocks of this rank's
  // sequence shard (the whole sequence without SP) in tp-invariant mode, else one block.
  // Under the sequence blocks these are the sequence blocks (see sequence_row_blocks).
  std::vector<std::int64_t> token_row_blocks(std::int64_t seq, std::int64_t local_tokens,
                                             std::int64_t rows_per_token) const;
  // The sequence blocks of an activation [T_local, B, ...] holding `local_tokens` consecutive local
  // positions (the rank's whole piece, or its sequence-parallel shard) of a rank's piece of `seq`
  // positions, as sizes of consecutive row blocks of its [T_local * B, ...] view: the piece's
  // N / cp equal blocks under sequence_blocked() (in leaf order, so consecutive blocks are the
  // tree's leaves in order), else one block of every row. Throws naming the sizes when the tokens
  // are not whole blocks.
  std::vector<std::int64_t> sequence_row_blocks(std::int64_t seq, std::int64_t local_tokens,
                                                std::int64_t rows_per_token) const;
  // A replicated parameter p used on this rank's tokens only (sequence parallelism), whose gradient
  // is therefore a partial sum over tp; p itself without SP. Normal mode: the gradient is marked
  // partial and the gradient synchroniser reduces it once per step, overlapped with backward.
  // TP-invariant mode: the rule's R -> R step in the tree order reduces it in backward, so every
  // micro-batch's gradient is complete before the micro-batches are added in their tree (adding
  // partial sums across micro-batches first would be another tree).
  Tensor replicated_on_sequence_shard(const Tensor& p) const;
  // A parameter used twice in one forward (a tied token table: the embedding and the output layer),
  // under the sequence blocks on a mesh with cp > 1: each use's gradient is summed over cp in the
  // tree in its backward (the rule's R -> R step), so the two uses' complete sums are added as one
  // rank adds its two trees; summed after their addition, the cp ranks' roots would mix the two
  // trees. p itself otherwise (the gradient stays partial over cp for the micro-batch's reduction).
  Tensor reduced_over_cp_per_use(const Tensor& p) const;
};
using ParallelContextPtr = std::shared_ptr<const ParallelContext>;

// The whole tensor-parallel group of a mesh: the "tp" axis, or both axes of a 2-D grid (tp_row and
// tp_col). Collective over the mesh on first use for a grid (every rank calls it in the same order).
const dist::ProcessGroup& tensor_parallel_group(const dist::DeviceMesh& mesh);
// The group of every mesh axis that shards some parameter of `params` (tp, fsdp, and dp under
// --shard-optimizer): the group a full parameter is gathered over, which one rank of writes it. The
// tensor-parallel group when none is sharded. Collective on first use, as above.
const dist::ProcessGroup& parameter_shard_group(const dist::DeviceMesh& mesh, const std::vector<Parameter*>& params);
// Whether this rank lies in the first such group: coordinate 0 on every axis that shards no
// parameter (the replicas hold the same values: one group gathers and writes them), but any pp
// coordinate (each pipeline stage holds other parameters: one group per stage).
bool in_first_parameter_shard_group(const dist::DeviceMesh& mesh, const std::vector<Parameter*>& params);

}  // namespace meshgrad::nn
