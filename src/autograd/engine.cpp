// The backward engine. One GraphTask per call (no global state), so rank threads run their own
// backward passes concurrently and a checkpoint's nested backward can run inside a node.
#include "meshgrad/autograd/engine.hpp"

#include <algorithm>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "accumulate_grad.hpp"
#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/autograd/node.hpp"
#include "meshgrad/tensor/kernels.hpp"

namespace meshgrad::autograd {

namespace {

struct ReadyOrder {
  // Later-created nodes first: backward visits ops in reverse order of the forward, which is also
  // the order in which gradients become ready for overlap.
  bool operator()(const std::shared_ptr<Node>& a, const std::shared_ptr<Node>& b) const {
    return a->sequence_nr < b->sequence_nr;
  }
};

struct GraphTask {
  std::unordered_map<Node*, int> dependencies;     // pending incoming gradients per node
  std::unordered_map<Node*, TensorList> buffers;   // gradients of each node's outputs, summed
  std::priority_queue<std::shared_ptr<Node>, std::vector<std::shared_ptr<Node>>, ReadyOrder> ready;
  // grad(): where to capture gradients instead of accumulating into leaves.
  std::unordered_map<Node*, std::vector<std::pair<std::uint32_t, std::size_t>>> captures;
  TensorList captured;
  bool accumulate_into_leaves = true;
  bool retain_graph = false;
};

// Adds g into slot of node's buffer (out of place: the incoming tensor may be shared).
void add_to_buffer(GraphTask& task, Node* node, std::uint32_t slot, Tensor g) {
  TensorList& buffer = task.buffers[node];
  if (buffer.size() < node->output_meta.size()) buffer.resize(node->output_meta.size());
  MG_CHECK(slot < buffer.size(), "autograd: gradient slot {} out of range for node {} with {} outputs", slot,
           node->name(), buffer.size());
  Tensor& existing = buffer[slot];
  if (!existing.defined()) {
    existing = std::move(g);
  } else {
    AnnotationPtr annotation = combine_annotations(existing.annotation(), g.annotation());
    existing = kernels::binary(kernels::Binary::Add, existing, g);
    existing.set_annotation(std::move(annotation));
  }
}

// The annotation shared by a node's incoming gradients (null when none has one). Gradients of one
// node's outputs with different annotations are combined as if summed.
AnnotationPtr common_annotation(const TensorList& grads) {
  AnnotationPtr result;
  bool seen = false;
  for (const Tensor& g : grads) {
    if (!g.defined()) continue;
    result = seen ? combine_annotations(result, g.annotation()) : g.annotation();
    seen = true;
  }
  return result;
}

void count_dependencies(GraphTask& task, const std::vector<std::shared_ptr<Node>>& roots) {
  std::vector<Node*> stack;
  std::unordered_set<Node*> seen;
  for (const auto& r : roots) {
    if (seen.insert(r.get()).second) stack.push_back(r.get());
  }
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    for (const Edge& e : node->next_edges) {
      if (!e.valid()) continue;
      ++task.dependencies[e.node.get()];
      if (seen.insert(e.node.get()).second) stack.push_back(e.node.get());
    }
  }
}

void check_gradients(const Node& node, const TensorList& grads) {
  MG_CHECK(grads.size() == node.next_edges.size(),
           "autograd: backward of {} returned {} gradients for {} inputs (one per input, or an undefined "
           "Tensor for none)", node.name(), grads.size(), node.next_edges.size());
  for (std::size_t i = 0; i < grads.size(); ++i) {
    const Tensor& g = grads[i];
    if (!g.defined() || !node.next_edges[i].valid()) continue;
    const TensorMeta& expected = node.input_meta[i];
    MG_CHECK(g.shape() == expected.shape && g.dtype() == expected.dtype,
             "autograd: backward of {} returned a gradient {} for input {}, which is {}{}", node.name(), g.str(), i,
             dtype_name(expected.dtype), shape_str(expected.shape));
  }
}

// While a trace records: the "backward" span of one pass on this thread's lane and, inside it, one
// span per scope (layer) the nodes were recorded in (Node::trace_scope), nested like the forward's
// scopes: moving to a node of another scope closes the spans that are not its ancestors and opens
// the missing ones. A node recorded outside any scope (a leaf's AccumulateGrad) runs inside
// whatever is open.
class BackwardSpans {
 public:
  BackwardSpans() : pass_("backward", "backward") {
    if (pass_.active()) lane_ = trace::this_thread_lane();
  }
  ~BackwardSpans() {
    if (lane_ != 0) close_to(0, trace::Clock::now());
  }
  BackwardSpans(const BackwardSpans&) = delete;
  BackwardSpans& operator=(const BackwardSpans&) = delete;

  void enter(const trace::ScopeNode* scope) {
    if (lane_ == 0 || scope == nullptr || (!open_.empty() && open_.back().scope == scope)) return;
    path_.clear();
    for (const trace::ScopeNode* s = scope; s != nullptr; s = s->parent) path_.push_back(s);
    std::reverse(path_.begin(), path_.end());
    std::size_t common = 0;
    while (common < open_.size() && common < path_.size() && open_[common].scope == path_[common]) ++common;
    const trace::Clock::time_point now = trace::Clock::now();
    close_to(common, now);
    for (std::size_t i = common; i < path_.size(); ++i) open_.push_back({path_[i], now});
  }

 private:
  struct Open {
    const trace::ScopeNode* scope;
    trace::Clock::time_point begin;
  };
  void close_to(std::size_t depth, trace::Clock::time_point now) {
    for (; open_.size() > depth; open_.pop_back()) {
      trace::complete(lane_, open_.back().scope->name, "backward", open_.back().begin, now);
    }
  }
  trace::Span pass_;   // ends after the layer spans (members are destroyed after the body)
  int lane_ = 0;       // 0: not recording
  std::vector<Open> open_;
  std::vector<const trace::ScopeNode*> path_;
};

void run(GraphTask& task, const TensorList& roots, const TensorList& root_grads_in) {
  MG_CHECK(root_grads_in.empty() || root_grads_in.size() == roots.size(),
           "backward: {} root gradients given for {} roots", root_grads_in.size(), roots.size());
  std::vector<std::shared_ptr<Node>> root_nodes;
  std::vector<std::pair<Edge, Tensor>> root_inputs;
  for (std::size_t i = 0; i < roots.size(); ++i) {
    const Tensor& root = roots[i];
    MG_CHECK(root.defined(), "backward: root {} is undefined", i);
    MG_CHECK(root.requires_grad(), "backward: root {} ({}) does not require grad: nothing recorded a graph for it",
             i, root.str());
    Tensor g = i < root_grads_in.size() ? root_grads_in[i] : Tensor();
    if (!g.defined()) {
      MG_CHECK(root.numel() == 1, "backward: a gradient can be implied only for a one-element root; root {} is {}",
               i, root.str());
      g = Tensor::ones(root.shape(), root.dtype());
    }
    MG_CHECK(g.shape() == root.shape() && g.dtype() == root.dtype(),
             "backward: gradient {} does not match root {} ({})", g.str(), i, root.str());
    Edge e = gradient_edge(root);
    root_nodes.push_back(e.node);
    root_inputs.emplace_back(e, g);
  }
  count_dependencies(task, root_nodes);
  for (auto& [edge, g] : root_inputs) add_to_buffer(task, edge.node.get(), edge.input_nr, std::move(g));
  std::unordered_set<Node*> queued;
  for (const auto& node : root_nodes) {
    if (task.dependencies[node.get()] == 0 && queued.insert(node.get()).second) task.ready.push(node);
  }

  NoGradGuard no_grad;  // backward formulas are not recorded
  BackwardPassGuard in_backward;
  BackwardSpans spans;
  while (!task.ready.empty()) {
    std::shared_ptr<Node> node = task.ready.top();
    task.ready.pop();
    TensorList grads = std::move(task.buffers[node.get()]);
    task.buffers.erase(node.get());
    grads.resize(node->output_meta.size());

    bool any = false;
    for (const Tensor& g : grads) any = any || g.defined();
    // Annotation of what arrived (before zero-filling: zeros are compatible with anything). A node
    // that decides its gradients' placement may receive differently placed ones on its outputs (an
    // FSDP unit's gathered parameters: some partial over tp, some not); its zero-filled ones carry none.
    const AnnotationPtr incoming = any && !node->decides_gradient_placement() ? common_annotation(grads) : nullptr;
    if (any) {
      for (std::size_t k = 0; k < grads.size(); ++k) {
        if (!grads[k].defined()) {
          grads[k] = Tensor::zeros(node->output_meta[k].shape, node->output_meta[k].dtype);
          grads[k].set_annotation(incoming);
        }
      }
      for (auto& [slot, hook] : node->pre_hooks) {
        Tensor replaced = hook(grads[slot]);
        if (replaced.defined()) grads[slot] = std::move(replaced);
      }
      if (auto it = task.captures.find(node.get()); it != task.captures.end()) {
        for (auto [slot, index] : it->second) task.captured[index] = grads[slot];
      }
    }
    const bool is_leaf_sink = dynamic_cast<AccumulateGrad*>(node.get()) != nullptr;
    TensorList input_grads;
    if (any && (task.accumulate_into_leaves || !is_leaf_sink)) {
      spans.enter(node->trace_scope);
      input_grads = node->apply(std::move(grads));
      check_gradients(*node, input_grads);
      if (incoming && !node->decides_gradient_placement()) {
        for (Tensor& g : input_grads) {
          if (g.defined() && !g.annotation()) g.set_annotation(incoming);
        }
      }
    }
    if (!task.retain_graph) node->release_saved();

    for (std::size_t i = 0; i < node->next_edges.size(); ++i) {
      const Edge& e = node->next_edges[i];
      if (!e.valid()) continue;
      if (i < input_grads.size() && input_grads[i].defined()) {
        add_to_buffer(task, e.node.get(), e.input_nr, std::move(input_grads[i]));
      }
      if (--task.dependencies[e.node.get()] == 0) task.ready.push(e.node);
    }
  }
}

}  // namespace

void backward(const TensorList& roots, const TensorList& root_grads, const BackwardOptions& options) {
  GraphTask task;
  task.retain_graph = options.retain_graph;
  run(task, roots, root_grads);
}

TensorList grad(const TensorList& roots, const TensorList& inputs, const TensorList& root_grads,
                const BackwardOptions& options) {
  GraphTask task;
  task.retain_graph = options.retain_graph;
  task.accumulate_into_leaves = false;
  task.captured.resize(inputs.size());
  std::vector<std::shared_ptr<Node>> keep_alive;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& t = inputs[i];
    MG_CHECK(t.defined() && t.requires_grad(), "grad: input {} ({}) does not require grad", i, t.str());
    Edge e = gradient_edge(t);
    keep_alive.push_back(e.node);
    task.captures[e.node.get()].emplace_back(e.input_nr, i);
  }
  run(task, roots, root_grads);
  return std::move(task.captured);
}

}  // namespace meshgrad::autograd
