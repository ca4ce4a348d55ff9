// Tensor-parallel layers. Activations are [T, B, C] (sequence first, as Megatron), so sequence
// parallelism shards dim 0. A linear weight is [in, out] and y = x W + b.
//
// Where communication happens (the DESIGN table; the tests count it):
//   column-parallel, all-reduce mode   forward: none                 backward: all-reduce of dX
//   row-parallel, all-reduce mode      forward: all-reduce of Y      backward: none
//   column-parallel, sequence-parallel forward: all-gather X (seq)   backward: reduce-scatter of dX (seq)
//   row-parallel, sequence-parallel    forward: reduce-scatter Y     backward: all-gather of dY (seq)
// Weight gradients stay local. Replicated parameters used on sequence-sharded data (LayerNorm,
// the row-parallel bias, position embeddings under SP) get gradients marked partial over tp; the
// trainer's GradientSynchronizer sums them over tp.
#pragma once

#include <cstdint>
#include <string>

#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/nn/model.hpp"
#include "meshgrad/nn/parameter.hpp"
#include "meshgrad/tensor/random.hpp"

namespace meshgrad::nn {

// The mesh a model lives on, its tp group and the parallel options.
struct ParallelContext {
  dist::DeviceMeshPtr mesh;
  dist::ProcessGroup tp;
  int tp_axis = 0;
  ParallelConfig config;

  static ParallelContext on(dist::DeviceMeshPtr mesh, const ParallelConfig& config);
  int tp_size() const { return tp.size(); }
  int tp_rank() const { return tp.rank(); }
  bool sequence_parallel() const { return config.sequence_parallel && tp.size() > 1; }
  // Marks x's gradient partial over tp (replicated tensor used on sequence-sharded data).
  Tensor partial_over_tp(const Tensor& x) const;
};

// A parameter of a layer, created from its full shape with deterministic init.
Parameter make_parameter(const std::string& name, const Shape& full_shape, const ShardSpec& spec,
                         const ParallelContext& ctx, std::uint64_t seed, double std, double constant, DType dtype);

class ColumnParallelLinear {
 public:
  struct Options {
    bool bias = true;
    bool gather_output = false;   // all-gather the output features (forward) / keep own slice (backward)
    int blocks = 1;               // fused outputs split per block (QKV: 3)
    std::int64_t unit = 1;        // split in whole units (a head's width)
    double init_std = 0.02;
    bool owns_weight = true;      // false: the caller passes the weight to forward_with (tied LM head)
  };
  ColumnParallelLinear(const std::string& name, std::int64_t in, std::int64_t out, const Options& options,
                       const ParallelContext& ctx, std::uint64_t seed, DType dtype);
  // x: [T, B, in] (replicated) or, under sequence parallelism, [T_local, B, in] with seq_len = T.
  // Returns [T, B, out_local] ([T, B, out] with gather_output).
  Tensor forward(const Tensor& x, std::int64_t seq_len) const;
  // The same with an explicit weight [in, out_local] (the tied LM head passes wte^T).
  Tensor forward_with(const Tensor& x, std::int64_t seq_len, const Tensor& weight, const Tensor& bias) const;

  Parameter weight, bias;
  // The buffer the sequence all-gather writes into; reused while nobody else holds it (tests).
  const Tensor& gather_buffer() const { return gather_buffer_; }

 private:
  std::string name_;
  Options options_;
  std::int64_t out_;
  const ParallelContext* ctx_;
  mutable Tensor gather_buffer_;   // reused across steps for the sequence all-gather
};

class RowParallelLinear {
 public:
  struct Options {
    bool bias = true;
    bool input_is_parallel = true;   // else scatter the input features first
    std::int64_t unit = 1;
    double init_std = 0.02;
  };
  RowParallelLinear(const std::string& name, std::int64_t in, std::int64_t out, const Options& options,
                    const ParallelContext& ctx, std::uint64_t seed, DType dtype);
  // x: [T, B, in_local] -> [T, B, out] (all-reduce mode) or [T_local, B, out] (sequence parallel).
  Tensor forward(const Tensor& x) const;

  Parameter weight, bias;

 private:
  std::string name_;
  Options options_;
  const ParallelContext* ctx_;
};

class LayerNorm {
 public:
  LayerNorm(const std::string& name, std::int64_t features, double eps, const ParallelContext& ctx, DType dtype);
  Tensor forward(const Tensor& x) const;
  Parameter weight, bias;

 private:
  double eps_;
  const ParallelContext* ctx_;
};

// Embedding whose table [V, C] is split over tp by vocabulary rows. forward returns this rank's
// partial sum (rows it does not hold contribute zero); the caller reduces it over tp.
class VocabParallelEmbedding {
 public:
  VocabParallelEmbedding(const std::string& name, std::int64_t vocab, std::int64_t features,
                         const ParallelContext& ctx, std::uint64_t seed, DType dtype);
  // ids: int64 [...] -> [..., C], partial over tp.
  Tensor forward_partial(const Tensor& ids) const;
  std::int64_t vocab_offset() const { return offset_; }
  std::int64_t vocab() const { return vocab_; }
  Parameter weight;

 private:
  std::int64_t vocab_, offset_;
  const ParallelContext* ctx_;
};

// Cross-entropy over logits split by vocabulary ([N, V_local], never gathered): the sum over the
// N positions of -log softmax(logits)[target], divided by `divisor`; positions whose target is
// ignore_index count zero. Three small all-reduces over tp in forward (row max, sum of exps,
// target logit), none in backward. Works for a vocabulary not divisible by the ranks.
Tensor vocab_parallel_cross_entropy(const Tensor& logits_local, const Tensor& targets, std::int64_t vocab_offset,
                                    std::int64_t vocab, const dist::ProcessGroup& tp, double divisor,
                                    std::int64_t ignore_index = -100);

// Dropout whose mask element for global index g of a tensor of `global_shape` is
// uniform(seed, g) < p, so a sharded activation gets exactly its slice of the unsharded mask and a
// replicated one the same mask on every rank. offsets: this piece's offsets in the global tensor.
Tensor dropout_global(const Tensor& x, double p, std::uint64_t seed, const Shape& global_shape,
                      const std::vector<std::int64_t>& offsets);

}  // namespace meshgrad::nn
