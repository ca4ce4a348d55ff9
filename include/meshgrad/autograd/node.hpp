// Graph nodes. A Node is the backward of one recorded op: it takes the gradients of the op's
// outputs and returns the gradients of its inputs, which flow along next_edges to the nodes that
// made those inputs (or to the AccumulateGrad node of a leaf).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "meshgrad/tensor/tensor.hpp"
#include "meshgrad/tensor/trace.hpp"

namespace meshgrad::autograd {

class Node;

// Where the gradient of one input goes: input_nr-th gradient slot of node. node == nullptr: the
// input needs no gradient.
struct Edge {
  std::shared_ptr<Node> node;
  std::uint32_t input_nr = 0;
  bool valid() const { return node != nullptr; }
};

// What an input or output looked like, to check and zero-fill gradients without keeping the data.
struct TensorMeta {
  Shape shape;
  DType dtype = DType::Float32;
};

class Node : public std::enable_shared_from_this<Node> {
 public:
  virtual ~Node() = default;

  // The op's name, as error messages and graph dumps show it ("matmul", "all_reduce[tp]", ...).
  virtual std::string_view name() const = 0;
  // grads: one per output of the op (undefined = zero, only when some other output has one).
  // Returns one gradient per input (next_edges.size()), undefined where an input gets none.
  virtual TensorList apply(TensorList&& grads) = 0;
  // Drops what forward saved (called after backward unless the graph is retained).
  virtual void release_saved() {}
  // Whether this node sets the annotation of the gradients it returns itself (communication nodes:
  // an all-reduce makes a partial gradient complete). Otherwise the engine gives returned gradients
  // without an annotation the annotation of the gradients the node received (annotation.hpp).
  virtual bool decides_gradient_placement() const { return false; }

  std::vector<Edge> next_edges;        // one per input of the op
  std::vector<TensorMeta> input_meta;  // one per input: gradients returned must match
  std::vector<TensorMeta> output_meta; // one per output: missing output gradients are zero-filled
  std::uint64_t sequence_nr = 0;       // creation order; backward runs later-created nodes first
  // Hooks on the gradient of output k (tensor.register_hook on a non-leaf tensor).
  std::vector<std::pair<std::uint32_t, GradHook>> pre_hooks;
  // The trace scope (layer) the op was recorded in, while a trace records; the engine draws the
  // node's backward inside spans of the same names (tensor/trace.hpp). nullptr: none.
  const trace::ScopeNode* trace_scope = nullptr;
};

// Next creation number (per thread; only the order within one graph matters).
std::uint64_t next_sequence_nr();

// The edge a gradient for `t` must flow along: its grad_fn, or its leaf accumulator when it
// requires grad, or none.
Edge gradient_edge(const Tensor& t);

// Makes `output` (a fresh handle) the output_nr-th output of node.
void set_history(Tensor& output, const std::shared_ptr<Node>& node, std::uint32_t output_nr);

// Runs hook on the gradient of t when backward computes it (a leaf: before accumulation; a
// non-leaf: when its grad_fn receives it). The hook may return a replacement gradient.
void register_hook(const Tensor& t, GradHook hook);

// The node that accumulates into a leaf's .grad; one per leaf (held weakly by the leaf).
std::shared_ptr<Node> grad_accumulator(const Tensor& leaf);

}  // namespace meshgrad::autograd
