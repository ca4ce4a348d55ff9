// A model's tensor-parallel plan: which of its linear layers are column-parallel and which
// row-parallel, by name, as torchtitan's parallelize plans (ColwiseParallel / RowwiseParallel per
// module name) and Megatron's layer specs say it. A module tree asks the plan for each of its linears
// (TensorParallelPlan::linear) by its full name and spec; the plan picks the style, and the mesh
// picks the layer that computes it:
//
//   style    1-D mesh (tp)                          2-D mesh (tp_row x tp_col)
//   Column   ColumnParallelLinear: out split, the   GridLinear, in on tp_row, out on tp_col
//            input replicated (or gathered from
//            the sequence shards under SP)
//   Row      RowParallelLinear: in split, the       GridLinear, in on tp_col, out on tp_row, the
//            output all-reduced (reduce-scattered   output all-gathered over tp_row
//            along the sequence under SP)
//
// So a module never branches on the mesh, and a new family's plan is a short table of names. The
// communication of every style is the DESIGN table's (layers.hpp lists it per layer). What a plan
// does not name is not split by it: norms and biases follow their layer, and the token embedding and
// the output layer of a language model are vocabulary-parallel in every family (decoder_lm.hpp).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "meshgrad/nn/parallel_context.hpp"
#include "meshgrad/nn/parameter.hpp"

namespace meshgrad::nn {

enum class LinearStyle { Column, Row };
const char* linear_style_name(LinearStyle style);   // "column" / "row"

// A linear layer's shape and initialisation, what a module tree knows of it. The weight is
// [in, out] (y = x W + b), initialised normal(0, init_std) from the model's seed and its name.
struct LinearSpec {
  std::int64_t in = 0;
  std::int64_t out = 0;
  bool bias = true;
  int blocks = 1;                // fused outputs split alike (GPT-2's c_attn holds q, k, v: 3)
  std::int64_t in_unit = 1;      // a split of the input features cuts whole units (a row layer after heads)
  std::int64_t out_unit = 1;     // a split of the output features cuts whole units (a head's width)
  double init_std = 0.02;
  // A column layer with fewer whole output units than tensor-parallel ranks (key/value heads at
  // tp > num_key_value_heads): true replicates the weight over tp and rank r computes unit
  // r * units / tp (Megatron's and vLLM's way; tp must be a multiple of the units); false refuses.
  bool replicate_units = false;
};

// One linear layer as a plan built it, whatever the mesh.
class ParallelLinear {
 public:
  virtual ~ParallelLinear() = default;
  // Column: x [T(_local), B, in] (sequence-sharded under SP; seq = the global T) -> [T, B, out_local],
  //         this rank's output features.
  // Row:    x [T, B, in_local] (a column layer's output) -> [T(_local), B, out]: every output
  //         feature, sequence-sharded under SP.
  virtual Tensor forward(const Tensor& x, std::int64_t seq) const = 0;
  // The feature count of forward's output on this rank (Column: its share; Row: out).
  virtual std::int64_t output_features() const = 0;
  // Its parameters in the one-rank model's order: weight, then bias (when it has one).
  virtual void collect(std::vector<Parameter*>& out) = 0;
};

struct TensorParallelRule {
  std::string pattern;   // a dotted name; "*" stands for any one component ("h.*.mlp.c_fc")
  LinearStyle style;
};

struct TensorParallelPlan {
  std::string family;                     // named in errors ("gpt2")
  std::vector<TensorParallelRule> rules;  // the first that matches a name decides

  // The style of the linear named `name`; InvalidArgument naming the family and the layer when no
  // rule matches (a module tree and its plan that disagree are a programming error said at build).
  LinearStyle style_of(const std::string& name) const;
  // The layer `name` in its style on ctx's mesh, its parameters named name + ".weight" / ".bias".
  std::unique_ptr<ParallelLinear> linear(const std::string& name, const LinearSpec& spec, const ParallelContextPtr& ctx,
                                         std::uint64_t seed, DType dtype) const;
  // One line per rule: "h.*.attn.c_attn  column" (explain, docs).
  std::vector<std::string> describe() const;
};

// Whether dotted `name` matches `pattern` component by component ("*" matches any one component).
bool plan_pattern_matches(const std::string& pattern, const std::string& name);

}  // namespace meshgrad::nn
