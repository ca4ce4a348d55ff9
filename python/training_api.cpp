// meshgrad's Python API for training code of one's own, on the C++ library (nothing is computed in
// Python): tensor operations with autograd, meshes and the ranks that run a function, layers split
// by a tensor-parallel plan, models (built-in kinds and families whose blocks are written in
// Python), AdamW with the gradient synchroniser, the learning-rate schedules, data and checkpoints.
//
//   def rank_main(mesh):                                  # runs on every rank (a thread, or an MPI process)
//       model = meshgrad.Model(mesh, kind="gpt", layers=2, hidden=64, heads=4, seq=32, batch=8)
//       opt = meshgrad.AdamW(model, lr=1e-3)
//       data = meshgrad.Data(batch=8, seq=32)
//       for step in range(100):
//           inputs, targets = data.batch(step)
//           loss = model.loss(inputs, targets)           # this rank's share of the global mean
//           loss.backward()
//           opt.step(); opt.zero_grad()
//   meshgrad.launch(rank_main, mesh="fsdp=2")
//
// Threads and the GIL: under backend "threads" every rank is a thread of this process running the
// Python function with the GIL, and every operation below releases the GIL while it computes or
// communicates, so one rank's collective never waits on a rank that cannot get the GIL. Python code
// called from C++ (a block's forward, on_step) takes the GIL for its call.
#include <fmt/core.h>
#include <fmt/ranges.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/checkpoint/directory.hpp"
#include "meshgrad/checkpoint/manifest.hpp"
#include "meshgrad/checkpoint/saver.hpp"
#include "meshgrad/data/dataset.hpp"
#include "meshgrad/distributed/mappings.hpp"
#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/distributed/placement.hpp"
#include "meshgrad/launch/launch.hpp"
#include "meshgrad/nn/context_parallel.hpp"
#include "meshgrad/nn/decoder_lm.hpp"
#include "meshgrad/nn/layers.hpp"
#include "meshgrad/nn/model.hpp"
#include "meshgrad/nn/parallel_context.hpp"
#include "meshgrad/nn/tp_plan.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/optim/adamw.hpp"
#include "meshgrad/optim/grad_norm.hpp"
#include "meshgrad/optim/grad_sync.hpp"
#include "meshgrad/tensor/error.hpp"
#include "meshgrad/train/options.hpp"
#include "meshgrad/train/state.hpp"
#include "meshgrad/train/step.hpp"
#include "meshgrad/train/trainer.hpp"
#include "module.hpp"

namespace meshgrad::python {
namespace {

// The GIL released around a bound function's C++ call (its arguments are converted before and its
// result after, with the GIL). Never on a py::init: there the guard also covers pybind11's placing of
// the new object into its Python instance, which registers it in pybind11's process-wide instance
// map, and two rank threads doing that at once without the GIL corrupt the map ("Tried to deallocate
// unregistered instance", or a double free). A constructor releases the GIL inside its factory, as
// Model's does; python/tests/test_training_api.py checks both.
using Release = py::call_guard<py::gil_scoped_release>;

DType dtype_of(const std::string& name) {
  if (name == "float32") return DType::Float32;
  if (name == "float64") return DType::Float64;
  if (name == "int64") return DType::Int64;
  throw InvalidArgument(fmt::format("dtype '{}' is not one of float32, float64, int64", name));
}

// A tensor argument: a meshgrad.Tensor, or anything numpy.asarray takes (viewed when it can be).
Tensor as_tensor(const py::handle& value) {
  if (py::isinstance<Tensor>(value)) return value.cast<Tensor>();
  return from_numpy(py::module_::import("numpy").attr("asarray")(value).cast<py::array>());
}

// ---- meshes and contexts ---------------------------------------------------------------------------

// This rank's view of a mesh (DeviceMeshPtr holds a const mesh, which pybind11 holders do not).
struct MeshRef {
  dist::DeviceMeshPtr ptr;
  const dist::DeviceMesh& operator*() const { return *ptr; }
};

// How a model's layers are split on a mesh: the mesh and the parallel options (nn::ParallelContext).
struct Context {
  nn::ParallelContextPtr ctx;
};

nn::ParallelConfig parallel_config(bool sequence_parallel, bool overlap, bool checkpoint_blocks,
                                   bool reshard_after_forward) {
  nn::ParallelConfig p;
  p.sequence_parallel = sequence_parallel;
  p.overlap = overlap;
  p.checkpoint_blocks = checkpoint_blocks;
  p.reshard_after_forward = reshard_after_forward;
  return p;
}

const dist::ProcessGroup& axis_group(const dist::DeviceMesh& mesh, const std::string& axis) {
  MG_CHECK(mesh.has_axis(axis), "the mesh {} has no axis '{}'", mesh.str(), axis);
  return mesh.group(mesh.axis_index(axis));
}

// ---- a block written in Python inside a decoder family ---------------------------------------------

// A Python object (deleted with the GIL held, from whichever thread lets it go).
using PyRef = std::shared_ptr<py::object>;
PyRef keep(py::object o) {
  return PyRef(new py::object(std::move(o)), [](py::object* p) {
    py::gil_scoped_acquire gil;
    delete p;
  });
}

// DecoderBlock over a Python object with forward(x, seq, dropout) -> Tensor and parameters() ->
// list of meshgrad.Parameter (owned by the object's layers). The object lives as long as the block.
class PythonBlock final : public nn::DecoderBlock {
 public:
  PythonBlock(PyRef object, std::string name) : object_(std::move(object)), name_(std::move(name)) {}
  const std::string& name() const override { return name_; }
  Tensor forward(const Tensor& x, std::int64_t seq, const nn::Dropout& dropout) const override {
    py::gil_scoped_acquire gil;
    const py::cpp_function drop([&dropout](const Tensor& t) { return dropout(t); }, Release());
    const py::object out = object_->attr("forward")(x, seq, drop);
    MG_CHECK(py::isinstance<Tensor>(out), "block '{}': forward returned {}, not a meshgrad.Tensor", name_,
             std::string(py::repr(out.get_type())));
    return out.cast<Tensor>();
  }
  Tensor forward_cached(const Tensor&, const Tensor&, const Tensor&, std::int64_t, std::int64_t&) const override {
    throw no_decoding();
  }
  Shape cache_shape(std::int64_t, std::int64_t) const override { throw no_decoding(); }
  void collect(std::vector<nn::Parameter*>& out) override {
    py::gil_scoped_acquire gil;
    for (const py::handle p : object_->attr("parameters")()) {
      MG_CHECK(py::isinstance<nn::Parameter>(p), "block '{}': parameters() holds {}, not a meshgrad.Parameter", name_,
               std::string(py::repr(p)));
      out.push_back(p.cast<nn::Parameter*>());
    }
  }

 private:
  InvalidArgument no_decoding() const {
    return InvalidArgument(fmt::format("block '{}' is written in Python and has no cached decoding: sample and generate "
                                       "need a family whose blocks implement forward_cached (C++)", name_));
  }
  PyRef object_;
  std::string name_;
};

// The model configuration as the block factory sees it.
py::dict config_dict(const nn::ModelConfig& c) {
  py::dict d;
  d["kind"] = c.kind;
  d["layers"] = c.layers;
  d["hidden"] = c.hidden;
  d["ffn"] = c.ffn_size();
  d["heads"] = c.heads;
  d["vocab"] = c.vocab;
  d["seq"] = c.seq;
  d["batch"] = c.batch;
  d["positions"] = c.n_positions();
  d["layer_norm_epsilon"] = c.layer_norm_epsilon;
  d["dropout"] = c.dropout;
  d["dtype"] = std::string(dtype_name(c.dtype));
  return d;
}

// Kinds registered from Python: unregistered when the interpreter exits (their factories hold
// Python objects, which must go before Python does).
std::set<std::string>& python_kinds() {
  static std::set<std::string> kinds;
  return kinds;
}

void register_family(const std::string& kind, py::object block, int dropout_draws) {
  MG_CHECK(PyCallable_Check(block.ptr()), "register_family: block must be callable as block(name, layer, config, "
           "context, seed), got {}", std::string(py::repr(block)));
  PyRef factory = keep(std::move(block));
  nn::register_decoder_family(
      kind, nn::gpt2_family_with_blocks(
                [factory](const std::string& name, int layer, const nn::ModelConfig& config,
                          const nn::ParallelContextPtr& ctx, std::uint64_t seed) -> std::shared_ptr<nn::DecoderBlock> {
                  py::gil_scoped_acquire gil;
                  py::object made = (*factory)(name, layer, config_dict(config), Context{ctx}, seed);
                  MG_CHECK(py::hasattr(made, "forward") && py::hasattr(made, "parameters"),
                           "the block factory made {} for '{}': a block has forward(x, seq, dropout) and parameters()",
                           std::string(py::repr(made)), name);
                  return std::make_shared<PythonBlock>(keep(std::move(made)), name);
                },
                dropout_draws),
      "gpt", /*decodes=*/false);
  python_kinds().insert(kind);
}

// ---- models ----------------------------------------------------------------------------------------

nn::ModelConfig model_config(const std::string& kind, const py::kwargs& kwargs) {
  nn::ModelConfig c = nn::ModelConfig::gpt(2, 64, 4, 256, 32, 4);
  c.kind = kind;
  std::set<std::string> known;
  auto get_int = [&](const char* key, int& out) {
    known.insert(key);
    if (kwargs.contains(key)) out = kwargs[key].cast<int>();
  };
  auto get_double = [&](const char* key, double& out) {
    known.insert(key);
    if (kwargs.contains(key)) out = kwargs[key].cast<double>();
  };
  get_int("layers", c.layers);
  get_int("hidden", c.hidden);
  get_int("ffn", c.ffn);
  get_int("heads", c.heads);
  get_int("vocab", c.vocab);
  get_int("seq", c.seq);
  get_int("batch", c.batch);
  get_int("positions", c.positions);
  get_int("kv_heads", c.kv_heads);
  get_double("dropout", c.dropout);
  get_double("layer_norm_epsilon", c.layer_norm_epsilon);
  known.insert("dtype");
  if (kwargs.contains("dtype")) c.dtype = dtype_of(kwargs["dtype"].cast<std::string>());
  for (const auto& item : kwargs) {
    const auto key = item.first.cast<std::string>();
    if (!known.count(key)) {
      throw py::type_error(fmt::format("Model() got an unexpected keyword argument '{}' (it takes: mesh, kind, seed, "
                                       "sequence_parallel, overlap, checkpoint_blocks, reshard_after_forward, {})",
                                       key, fmt::join(known, ", ")));
    }
  }
  return c;
}

// A model on this rank (nn::make_model), with the mesh it was built on.
struct PyModel {
  std::unique_ptr<nn::Model> model;
  dist::DeviceMeshPtr mesh;
  nn::Model& get() const {
    MG_CHECK(model != nullptr, "the model was closed");
    return *model;
  }
};

nn::Batch global_batch(const py::handle& inputs, const py::handle& targets) {
  nn::Batch b;
  b.inputs = as_tensor(inputs);
  b.targets = as_tensor(targets);
  return b;
}

// ---- optimizer -------------------------------------------------------------------------------------

// AdamW with the gradient synchroniser of the model's mesh: step() completes every gradient (tp,
// dp, fsdp reductions launched during backward), then updates this rank's pieces.
struct PyAdamW {
  std::vector<nn::Parameter*> params;
  dist::DeviceMeshPtr mesh;
  std::unique_ptr<optim::GradientSynchronizer> sync;
  std::unique_ptr<optim::AdamW> adamw;
  bool finished = false;   // the synchroniser finished this step's gradients
  void finish() {
    if (!finished) sync->finish();
    finished = true;
  }
};

std::unique_ptr<PyAdamW> make_adamw(std::vector<nn::Parameter*> params, const dist::DeviceMeshPtr& mesh,
                                    dist::ReduceOrder order, const optim::AdamWOptions& options) {
  auto o = std::make_unique<PyAdamW>();
  o->params = std::move(params);
  o->mesh = mesh;
  py::gil_scoped_release release;
  o->sync = std::make_unique<optim::GradientSynchronizer>(o->params, mesh, optim::GradSyncOptions{.order = order});
  o->adamw = std::make_unique<optim::AdamW>(o->params, mesh, options);
  return o;
}

// ---- checkpoints -----------------------------------------------------------------------------------

struct PyCheckpointer {
  std::unique_ptr<checkpoint::CheckpointSaver> saver;
  dist::DeviceMeshPtr mesh;
};

void bind_tensors(py::module_& m, py::class_<Tensor>& tensor) {
  // ---- tensors and autograd --------------------------------------------------------------------------
  tensor
      .def_property(
          "requires_grad", [](const Tensor& t) { return t.requires_grad(); },
          [](Tensor& t, bool on) { t.set_requires_grad(on); }, "Whether operations on it record the graph (leaves)")
      .def_property_readonly(
          "grad", [](const Tensor& t) -> std::optional<Tensor> {
            const Tensor g = t.grad();
            return g.defined() ? std::optional<Tensor>(g) : std::nullopt;
          },
          "The gradient backward accumulated into this leaf, or None")
      .def("backward", [](const Tensor& t) { meshgrad::backward(t); }, Release(),
           "Backpropagates from this one-element tensor (its gradient 1) into every leaf that requires grad")
      .def("detach", &Tensor::detach, "The same values, outside the graph")
      .def("item", &Tensor::item, "The value of a one-element tensor")
      .def("to", [](const Tensor& t, const std::string& d) { return t.to(dtype_of(d)); }, py::arg("dtype"), Release())
      .def("contiguous", [](const Tensor& t) { return contiguous(t); }, Release())
      .def("reshape", [](const Tensor& t, const Shape& s) { return reshape(t, s); }, Release())
      .def("transpose", [](const Tensor& t, std::int64_t a, std::int64_t b) { return transpose(t, a, b); }, Release())
      .def("permute", [](const Tensor& t, const std::vector<std::int64_t>& d) { return permute(t, d); }, Release())
      .def("sum", [](const Tensor& t, const std::vector<std::int64_t>& dims, bool keep) { return sum(t, dims, keep); },
           py::arg("dims") = std::vector<std::int64_t>{}, py::arg("keepdim") = false, Release())
      .def("mean", [](const Tensor& t, const std::vector<std::int64_t>& dims, bool keep) { return mean(t, dims, keep); },
           py::arg("dims") = std::vector<std::int64_t>{}, py::arg("keepdim") = false, Release())
      .def("size", [](const Tensor& t, std::int64_t d) { return t.size(d); })
      .def("__add__", [](const Tensor& a, const Tensor& b) { return add(a, b); }, Release())
      .def("__add__", [](const Tensor& a, double s) { return add_scalar(a, s); }, Release())
      .def("__radd__", [](const Tensor& a, double s) { return add_scalar(a, s); }, Release())
      .def("__sub__", [](const Tensor& a, const Tensor& b) { return sub(a, b); }, Release())
      .def("__sub__", [](const Tensor& a, double s) { return add_scalar(a, -s); }, Release())
      .def("__mul__", [](const Tensor& a, const Tensor& b) { return mul(a, b); }, Release())
      .def("__mul__", [](const Tensor& a, double s) { return scale(a, s); }, Release())
      .def("__rmul__", [](const Tensor& a, double s) { return scale(a, s); }, Release())
      .def("__truediv__", [](const Tensor& a, const Tensor& b) { return div(a, b); }, Release())
      .def("__truediv__", [](const Tensor& a, double s) { return scale(a, 1.0 / s); }, Release())
      .def("__neg__", [](const Tensor& a) { return neg(a); }, Release())
      .def("__matmul__", [](const Tensor& a, const Tensor& b) { return matmul(a, b); }, Release());

  m.def("tensor", [](const py::handle& value, bool requires_grad) {
        Tensor t = as_tensor(value);
        if (requires_grad) t.set_requires_grad(true);
        return t;
      }, py::arg("value"), py::arg("requires_grad") = false,
      "A Tensor of an array (viewing its memory when the layout allows, as Tensor(array)); requires_grad makes it a "
      "leaf whose gradient backward accumulates");
  m.def("zeros", [](const Shape& s, const std::string& d) { return Tensor::zeros(s, dtype_of(d)); }, py::arg("shape"),
        py::arg("dtype") = "float32");
  // Element-wise and structural operations, each with its derived backward (ops/ops.hpp).
  m.def("add", [](const Tensor& a, const Tensor& b) { return add(a, b); }, Release());
  m.def("mul", [](const Tensor& a, const Tensor& b) { return mul(a, b); }, Release());
  m.def("matmul", [](const Tensor& a, const Tensor& b) { return matmul(a, b); }, Release(),
        "a @ b; batched over leading dimensions");
  m.def("relu", [](const Tensor& a) { return relu(a); }, Release());
  m.def("gelu", [](const Tensor& a) { return gelu(a); }, Release(), "GELU, tanh approximation (GPT-2's)");
  m.def("silu", [](const Tensor& a) { return silu(a); }, Release());
  m.def("tanh", [](const Tensor& a) { return meshgrad::tanh(a); }, Release());
  m.def("exp", [](const Tensor& a) { return meshgrad::exp(a); }, Release());
  m.def("log", [](const Tensor& a) { return meshgrad::log(a); }, Release());
  m.def("softmax", [](const Tensor& a) { return softmax(a); }, Release(), "over the last dimension");
  m.def("log_softmax", [](const Tensor& a) { return log_softmax(a); }, Release(), "over the last dimension");
  m.def("cat", [](const std::vector<Tensor>& parts, std::int64_t dim) { return cat(parts, dim); }, py::arg("tensors"),
        py::arg("dim"), Release());
  m.def("split", [](const Tensor& t, std::int64_t dim, const std::vector<std::int64_t>& sizes) {
        return split(t, dim, sizes);
      }, py::arg("tensor"), py::arg("dim"), py::arg("sizes"), Release());
  m.def("narrow", [](const Tensor& t, std::int64_t dim, std::int64_t start, std::int64_t length) {
        return narrow(t, dim, start, length);
      }, Release());
  m.def("cross_entropy", [](const Tensor& logits, const Tensor& targets) { return cross_entropy(logits, targets); },
        py::arg("logits"), py::arg("targets"), Release(),
        "Mean cross-entropy of logits [N, V] against int64 targets [N] (targets -100 ignored)");
  m.def("causal_attention", [](const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t window) {
        return causal_attention(q, k, v, window);
      }, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("window") = 0, Release(),
      "softmax(q k^T / sqrt(D), causal) v for q, k, v [B, H, T, D]; window > 0: a sliding window");
  m.def("backward", [](const Tensor& root, const std::optional<Tensor>& grad) {
        meshgrad::backward(root, grad ? *grad : Tensor());
      }, py::arg("root"), py::arg("grad") = std::nullopt, Release(),
      "Backpropagates root (its gradient `grad`, or 1 for one element) into the leaves");

  // meshgrad.no_grad(): a context manager under which operations record nothing (this rank's thread).
  struct NoGrad {
    std::optional<autograd::NoGradGuard> guard;
  };
  py::class_<NoGrad>(m, "no_grad", "with meshgrad.no_grad(): operations record no graph (on this thread)")
      .def(py::init<>())
      .def("__enter__", [](NoGrad& g) { g.guard.emplace(); })
      .def("__exit__", [](NoGrad& g, const py::args&) { g.guard.reset(); });
}

void bind_ranks(py::module_& m) {
  // ---- meshes, ranks and placements ---------------------------------------------------------------------
  py::class_<MeshRef>(m, "Mesh", "This rank's view of the device mesh (given to launch's function)")
      .def_property_readonly("rank", [](const MeshRef& m) { return m.ptr->rank(); })
      .def_property_readonly("size", [](const MeshRef& m) { return m.ptr->size(); })
      .def("axis_size", [](const MeshRef& m, const std::string& axis) {
        return m.ptr->has_axis(axis) ? m.ptr->axis_size(axis) : 1;
      }, py::arg("axis"), "The ranks on `axis` (1 when the mesh has no such axis)")
      .def("coordinate", [](const MeshRef& m, const std::string& axis) {
        return m.ptr->has_axis(axis) ? m.ptr->coordinate(axis) : 0;
      }, py::arg("axis"), "This rank's coordinate on `axis` (0 when the mesh has no such axis)")
      .def("__str__", [](const MeshRef& m) { return m.ptr->str(); })
      .def("__repr__", [](const MeshRef& m) {
        return fmt::format("meshgrad.Mesh('{}', rank {})", m.ptr->str(), m.ptr->rank());
      });

  m.def("launch", [](py::function fn, const std::string& mesh, const std::string& backend) {
        keep_mpi_initialised(backend);
        std::mutex mu;
        std::map<int, PyRef> results;            // by rank
        std::optional<py::error_already_set> first_error;   // the first rank's Python exception
        std::string first_error_rank;
        std::atomic<bool> stop{false};
        const PyRef function = keep(std::move(fn));
        try {
          run_answering_signals(stop, [&] {
            launch::mesh_runner(backend, mesh)([&](const dist::DeviceMeshPtr& rank_mesh) {
              py::gil_scoped_acquire gil;
              try {
                PyRef out = keep((*function)(MeshRef{rank_mesh}));
                const std::lock_guard<std::mutex> lock(mu);
                results[rank_mesh->rank()] = std::move(out);
              } catch (py::error_already_set& e) {
                // Kept to be raised as itself; meshgrad's error makes the launcher stop the other ranks.
                const std::string message = fmt::format("rank {} of {}: {}", rank_mesh->rank(), rank_mesh->str(), e.what());
                const std::lock_guard<std::mutex> lock(mu);
                if (!first_error) {
                  first_error.emplace(std::move(e));
                  first_error_rank = fmt::format("on rank {} of {}", rank_mesh->rank(), rank_mesh->str());
                }
                throw Error(message);
              }
            });
          });
        } catch (const Error&) {
          if (!first_error) throw;
          // The rank's own exception (its type and traceback), with a note naming the rank.
          if (py::hasattr(first_error->value(), "add_note")) first_error->value().attr("add_note")(first_error_rank);
          throw std::move(*first_error);
        }
        py::list out;
        for (const auto& [rank, value] : results) out.append(*value);
        return out;
      }, py::arg("fn"), py::arg("mesh") = "tp=2", py::arg("backend") = "threads",
      "launch(fn, mesh='tp=2', backend='threads') -> [fn's result on each rank of this process]: runs fn(mesh) on every "
      "rank of the mesh, as rank threads of this process (threads) or as this process's rank under mpirun (mpi). An "
      "exception on one rank stops every rank and is raised here as itself, with a note naming the rank.");

  m.def("all_reduce", [](const Tensor& x, const MeshRef& mesh, const std::string& axis) {
        return dist::reduce_from_region(x, axis_group(*mesh, axis));
      }, py::arg("x"), py::arg("mesh"), py::arg("axis"), Release(),
      "The sum of x over `axis` (P -> R); its backward passes the gradient through (R -> R)");
  m.def("all_gather", [](const Tensor& x, const MeshRef& mesh, const std::string& axis, std::int64_t dim) {
        return dist::gather_from_region(x, axis_group(*mesh, axis), dim);
      }, py::arg("x"), py::arg("mesh"), py::arg("axis"), py::arg("dim") = -1, Release(),
      "The pieces of x on `axis` concatenated along dim (S(dim) -> R); its backward keeps this rank's piece");
  m.def("redistribute", [](const Tensor& x, const MeshRef& mesh, const std::string& axis,
                           const std::string& from, const std::string& to) {
        return dist::change_placement(x, axis_group(*mesh, axis), dist::parse_placement(from), dist::parse_placement(to));
      }, py::arg("x"), py::arg("mesh"), py::arg("axis"), py::arg("from_placement"), py::arg("to_placement"), Release(),
      "x from one placement to another on `axis` ('R', 'P', 'S(d)'), by the one rule: the collective it takes, and "
      "its backward the dual's");
}

void bind_layers(py::module_& m) {
  // ---- contexts, parameters, layers and plans -------------------------------------------------------------
  py::class_<Context>(m, "Context", "A mesh and how layers split on it (sequence parallelism, overlap, ...)")
      .def(py::init([](const MeshRef& mesh, bool sp, bool overlap, bool checkpoint_blocks, bool reshard) {
             return Context{nn::ParallelContext::on(mesh.ptr, parallel_config(sp, overlap, checkpoint_blocks, reshard))};
           }), py::arg("mesh"), py::arg("sequence_parallel") = false, py::arg("overlap") = false,
           py::arg("checkpoint_blocks") = false, py::arg("reshard_after_forward") = true)
      .def_property_readonly("mesh", [](const Context& c) { return MeshRef{c.ctx->mesh}; })
      .def_property_readonly("tp_size", [](const Context& c) { return c.ctx->tp_size(); })
      .def_property_readonly("sequence_parallel", [](const Context& c) { return c.ctx->sequence_parallel(); })
      .def("parameter", [](const Context& c, const std::string& name, const Shape& shape, double std, double constant,
                           std::uint64_t seed, const std::string& dtype) {
             return nn::make_parameter(name, shape, c.ctx->replicated(), *c.ctx, seed, std, constant, dtype_of(dtype));
           }, py::arg("name"), py::arg("shape"), py::arg("std") = 0.02, py::arg("constant") = 0.0, py::arg("seed") = 0,
           py::arg("dtype") = "float32", Release(),
           "A parameter replicated over the tensor-parallel ranks (sharded by fsdp when its block is a unit): "
           "normal(0, std) from the seed and its name (std > 0), else the constant")
      .def("replicated_on_sequence_shard", [](const Context& c, const Tensor& p) {
             return c.ctx->replicated_on_sequence_shard(p);
           }, Release(), "A replicated parameter used on this rank's sequence shard under SP (its gradient reduced over tp)")
      .def("attention", [](const Context& c, const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t window) {
             return nn::attention(q, k, v, window, c.ctx);
           }, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("window") = 0, Release(),
           "Causal attention of this rank's queries whatever the mesh (context parallelism included)");

  py::class_<nn::Parameter>(m, "Parameter", "A parameter: this rank's piece of a full tensor, and where it lives")
      .def_readonly("name", &nn::Parameter::name)
      .def_property_readonly("value", [](const nn::Parameter& p) { return p.value; }, "This rank's piece (a leaf)")
      .def_property_readonly("operand", [](const nn::Parameter& p) { return p.operand(); },
                             "What layers compute with: the piece gathered over fsdp inside its unit, else value")
      .def_property_readonly("grad", [](const nn::Parameter& p) -> std::optional<Tensor> {
        const Tensor g = p.value.grad();
        return g.defined() ? std::optional<Tensor>(g) : std::nullopt;
      })
      .def_property_readonly("full_shape", [](const nn::Parameter& p) { return p.full_shape; })
      .def_property_readonly("placements", [](const nn::Parameter& p) {
        std::vector<std::string> out;
        for (const dist::Placement& pl : p.placements) out.push_back(pl.str());
        return out;
      }, "One placement per mesh axis ('R', 'S(d)', 'Sp(d)')")
      .def("gather", [](const nn::Parameter& p, const Tensor& piece) { return nn::gather_full(piece, p); },
           py::arg("piece"), Release(),
           "The full tensor of a piece laid out as this parameter (its value, or its grad): collective over the mesh "
           "axes that shard it")
      .def("__repr__", [](const nn::Parameter& p) {
        return fmt::format("meshgrad.Parameter('{}', full {}, piece {})", p.name, shape_str(p.full_shape),
                           shape_str(p.value.shape()));
      });

  // A linear layer in the style its plan gives it (ColumnParallelLinear, RowParallelLinear or a 2-D grid's).
  py::class_<nn::ParallelLinear, std::shared_ptr<nn::ParallelLinear>>(m, "Linear")
      .def("__call__", [](const nn::ParallelLinear& l, const Tensor& x, std::int64_t seq) { return l.forward(x, seq); },
           py::arg("x"), py::arg("seq"), Release(),
           "column: x [T(_local), B, in] -> [T, B, out_local]; row: [T, B, in_local] -> [T(_local), B, out]")
      .def_property_readonly("output_features", &nn::ParallelLinear::output_features)
      .def("parameters", [](nn::ParallelLinear& l) {
        std::vector<nn::Parameter*> out;
        l.collect(out);
        return out;
      }, py::return_value_policy::reference_internal);

  py::class_<nn::TensorParallelPlan>(m, "Plan",
                                     "A tensor-parallel plan: (pattern, 'column' | 'row') rules over dotted names, "
                                     "'*' any one component; the first rule that matches a linear's name decides")
      .def(py::init([](const std::string& family, const std::vector<std::pair<std::string, std::string>>& rules) {
             nn::TensorParallelPlan plan{family, {}};
             for (const auto& [pattern, style] : rules) {
               MG_CHECK(style == "column" || style == "row", "Plan '{}': rule '{}' has style '{}' (column or row)", family,
                        pattern, style);
               plan.rules.push_back({pattern, style == "column" ? nn::LinearStyle::Column : nn::LinearStyle::Row});
             }
             return plan;
           }), py::arg("family"), py::arg("rules"))
      .def("style_of", [](const nn::TensorParallelPlan& p, const std::string& name) {
        return std::string(nn::linear_style_name(p.style_of(name)));
      })
      .def("linear", [](const nn::TensorParallelPlan& plan, const Context& c, const std::string& name, std::int64_t in,
                        std::int64_t out, bool bias, std::uint64_t seed, double init_std, int blocks, std::int64_t in_unit,
                        std::int64_t out_unit, const std::string& dtype) {
             const nn::LinearSpec spec{.in = in, .out = out, .bias = bias, .blocks = blocks, .in_unit = in_unit,
                                       .out_unit = out_unit, .init_std = init_std};
             return std::shared_ptr<nn::ParallelLinear>(plan.linear(name, spec, c.ctx, seed, dtype_of(dtype)));
           }, py::arg("context"), py::arg("name"), py::arg("in_features"), py::arg("out_features"), py::arg("bias") = true,
           py::arg("seed") = 0, py::arg("init_std") = 0.02, py::arg("blocks") = 1, py::arg("in_unit") = 1,
           py::arg("out_unit") = 1, py::arg("dtype") = "float32", Release(),
           "The linear `name` ([in, out] weight, y = x W + b) in the plan's style on the context's mesh; its "
           "parameters are `name`.weight / .bias, initialised normal(0, init_std) from the seed and the name (the "
           "same values on every mesh). out_unit / in_unit: a split cuts whole units (a head's width); blocks: "
           "fused outputs split alike (q, k, v: 3)")
      .def("describe", &nn::TensorParallelPlan::describe);

  py::class_<nn::LayerNorm, std::shared_ptr<nn::LayerNorm>>(m, "LayerNorm")
      .def(py::init([](const Context& c, const std::string& name, std::int64_t features, double eps, const std::string& d) {
             return std::make_shared<nn::LayerNorm>(name, features, eps, c.ctx, dtype_of(d));
           }), py::arg("context"), py::arg("name"), py::arg("features"), py::arg("eps") = 1e-5,
           py::arg("dtype") = "float32")
      .def("__call__", [](const nn::LayerNorm& l, const Tensor& x, std::int64_t seq) { return l.forward(x, seq); },
           py::arg("x"), py::arg("seq") = -1, Release(), "x [T(_local), B, C]; seq: the whole sequence's length")
      .def("parameters", [](nn::LayerNorm& l) { return std::vector<nn::Parameter*>{&l.weight, &l.bias}; },
           py::return_value_policy::reference_internal);
  py::class_<nn::RmsNorm, std::shared_ptr<nn::RmsNorm>>(m, "RMSNorm")
      .def(py::init([](const Context& c, const std::string& name, std::int64_t features, double eps, const std::string& d) {
             return std::make_shared<nn::RmsNorm>(name, features, eps, c.ctx, dtype_of(d));
           }), py::arg("context"), py::arg("name"), py::arg("features"), py::arg("eps") = 1e-6,
           py::arg("dtype") = "float32")
      .def("__call__", [](const nn::RmsNorm& l, const Tensor& x, std::int64_t seq) { return l.forward(x, seq); },
           py::arg("x"), py::arg("seq") = -1, Release())
      .def("parameters", [](nn::RmsNorm& l) { return std::vector<nn::Parameter*>{&l.weight}; },
           py::return_value_policy::reference_internal);
}

void bind_models(py::module_& m) {
  // ---- model families and models ---------------------------------------------------------------------------
  m.def("register_family", &register_family, py::arg("kind"), py::arg("block"), py::arg("dropout_draws") = 2,
        "register_family(kind, block, dropout_draws=2): a decoder language model of GPT-2's embedding, final norm and "
        "tied output layer around blocks of yours. block(name, layer, config, context, seed) builds block `layer` "
        "(name 'h.3', config a dict of the model's sizes) and returns an object with forward(x, seq, dropout) -> "
        "Tensor (x [T(_local), B, C]; call dropout(t) dropout_draws times) and parameters() -> [Parameter]. "
        "Model(kind=...) and train(model=...) then build it on any mesh: tp by the plan your linears come from, and "
        "dp, fsdp (a unit per block), pp, activation checkpointing and checkpoints from the runner");
  m.def("unregister_family", [](const std::string& kind) {
        python_kinds().erase(kind);
        return nn::unregister_model(kind);
      }, py::arg("kind"));
  m.def("model_kinds", &nn::model_kinds, "Every kind Model() and train(model=...) build");
  py::module_::import("atexit").attr("register")(py::cpp_function([] {
    for (const std::string& kind : python_kinds()) nn::unregister_model(kind);
    python_kinds().clear();
  }));

  py::class_<PyModel>(m, "Model", "A model on this rank of a mesh (call it inside launch's function on every rank)")
      .def(py::init([](const MeshRef& mesh, const std::string& kind, std::uint64_t seed, bool sp,
                       bool overlap, bool checkpoint_blocks, bool reshard, const py::kwargs& kwargs) {
             const nn::ModelConfig config = model_config(kind, kwargs);
             const nn::ParallelConfig parallel = parallel_config(sp, overlap, checkpoint_blocks, reshard);
             py::gil_scoped_release release;
             PyModel out{nn::make_model(config, parallel, mesh.ptr, seed), mesh.ptr};
             out.model->set_training(true);
             return out;
           }), py::arg("mesh"), py::arg("kind") = "gpt", py::arg("seed") = 1, py::arg("sequence_parallel") = false,
           py::arg("overlap") = false, py::arg("checkpoint_blocks") = false, py::arg("reshard_after_forward") = true,
           "Model(mesh, kind='gpt', seed=1, sequence_parallel=False, ..., layers=2, hidden=64, heads=4, vocab=256, "
           "seq=32, batch=4, ffn=0, positions=0, kv_heads=0, dropout=0.0, dtype='float32'): the same seed gives the same "
           "parameters on every mesh")
      .def("loss", [](PyModel& pm, const py::handle& inputs, const py::handle& targets) {
             nn::Batch batch = global_batch(inputs, targets);
             py::gil_scoped_release release;
             const std::int64_t tokens = train::count_loss_targets(batch.targets);
             const nn::Batch share = train::rank_micro_batches(pm.get(), batch, *pm.mesh, 1).front();
             return pm.get().loss(share, tokens);
           }, py::arg("inputs"), py::arg("targets"),
           "loss(inputs, targets): the global batch's int64 [B, T] tokens (the same on every rank); returns this rank's "
           "share of the mean cross-entropy (its dp x fsdp rows' losses over every target), replicated over tp, recording "
           "the graph: backward() it, then the optimizer's step completes the gradients over the mesh")
      .def("train_step", [](PyModel& pm, const py::handle& inputs, const py::handle& targets, PyAdamW& opt,
                            double grad_clip, int grad_accum) {
             nn::Batch batch = global_batch(inputs, targets);
             py::gil_scoped_release release;
             const train::StepOutcome out =
                 train::train_step(pm.get(), batch, *pm.mesh, *opt.sync, *opt.adamw, grad_clip, grad_accum);
             opt.finished = false;
             return std::make_pair(train::global_loss(out.loss, *pm.mesh, pm.get()), out.grad_norm);
           }, py::arg("inputs"), py::arg("targets"), py::arg("optimizer"), py::arg("grad_clip") = 0.0,
           py::arg("grad_accum") = 1,
           "One whole step as train() takes it: zero_grad, forward and backward of grad_accum micro-batches (through "
           "the stages' schedule on a pipeline), the gradients completed, clipped (grad_clip > 0) and stepped. Returns "
           "(the step's global loss, the gradient norm before clipping)")
      .def("global_loss", [](PyModel& pm, const Tensor& local) { return train::global_loss(local, *pm.mesh, pm.get()); },
           Release(), "The step's loss: the ranks' shares summed over dp (collective over the mesh)")
      .def("parameters", [](PyModel& pm) { return pm.get().parameters(); }, py::return_value_policy::reference_internal)
      .def("train", [](PyModel& pm, bool on) { pm.get().set_training(on); }, py::arg("mode") = true, "dropout on/off")
      .def("eval", [](PyModel& pm) { pm.get().set_training(false); })
      .def_property_readonly("config", [](PyModel& pm) { return config_dict(pm.get().config()); })
      .def_property_readonly("mesh", [](PyModel& pm) { return MeshRef{pm.mesh}; });
}

void bind_optimizer(py::module_& m) {
  // ---- optimizer and schedules ----------------------------------------------------------------------------
  py::class_<PyAdamW>(m, "AdamW", "AdamW on this rank's pieces, with the synchroniser that completes the gradients")
      .def(py::init([](PyModel& pm, double lr, std::pair<double, double> betas, double eps, double weight_decay) {
             return make_adamw(pm.get().parameters(), pm.mesh, pm.get().reduce_order(),
                               optim::AdamWOptions{lr, betas.first, betas.second, eps, weight_decay});
           }), py::arg("model"), py::arg("lr") = 1e-3, py::arg("betas") = std::pair<double, double>{0.9, 0.95},
           py::arg("eps") = 1e-8, py::arg("weight_decay") = 0.1, py::keep_alive<1, 2>(),
           "Build it before the first backward (the synchroniser's hooks launch reductions during backward)")
      .def(py::init([](const std::vector<nn::Parameter*>& params, const MeshRef& mesh, double lr,
                       std::pair<double, double> betas, double eps, double weight_decay) {
             MG_CHECK(!params.empty(), "AdamW: no parameters given");
             for (const nn::Parameter* p : params) {
               MG_CHECK(p->mesh == mesh.ptr, "AdamW: parameter '{}' was made on another mesh than {}", p->name,
                        mesh.ptr->str());
             }
             return make_adamw(params, mesh.ptr, dist::ReduceOrder::RankOrder,
                               optim::AdamWOptions{lr, betas.first, betas.second, eps, weight_decay});
           }), py::arg("parameters"), py::arg("mesh"), py::arg("lr") = 1e-3,
           py::arg("betas") = std::pair<double, double>{0.9, 0.95}, py::arg("eps") = 1e-8, py::arg("weight_decay") = 0.1,
           py::keep_alive<1, 2>(),
           "AdamW(parameters, mesh, ...): the parameters of layers of one's own (a model built from Plan.linear, "
           "LayerNorm, Context.parameter and a loss of one's own), each made on `mesh`")
      .def("clip_grad_norm", [](PyAdamW& o, double max_norm) {
             o.finish();
             return optim::clip_grad_norm(o.params, *o.mesh, max_norm);
           }, py::arg("max_norm"), Release(),
           "Completes this step's gradients, scales them to max_norm when their global norm is larger, returns the norm")
      .def("step", [](PyAdamW& o) {
             o.finish();
             o.adamw->step();
           }, Release(), "Completes the gradients (tp, dp, fsdp) and updates every parameter's piece")
      .def("zero_grad", [](PyAdamW& o) {
             o.adamw->zero_grad();
             o.finished = false;
           }, Release())
      .def_property("lr", [](const PyAdamW& o) { return o.adamw->lr(); }, [](PyAdamW& o, double lr) { o.adamw->set_lr(lr); })
      .def_property_readonly("steps", [](const PyAdamW& o) { return o.adamw->steps(); });

  m.def("learning_rate", [](int step, int steps, double lr, int warmup_steps, const std::string& schedule,
                            double min_lr, int decay_steps, double decay_fraction) {
        train::TrainOptions o;
        o.steps = steps;
        o.lr = lr;
        o.warmup_steps = warmup_steps;
        o.lr_schedule = schedule;
        o.min_lr = min_lr;
        o.decay_steps = decay_steps;
        o.decay_fraction = decay_fraction;
        train::check_optimizer_options(o);
        return train::learning_rate(o, step);
      }, py::arg("step"), py::arg("steps"), py::arg("lr") = 3e-3, py::arg("warmup_steps") = 10,
      py::arg("schedule") = "cosine", py::arg("min_lr") = -1.0, py::arg("decay_steps") = -1,
      py::arg("decay_fraction") = 0.2,
      "The learning rate of 0-based step `step` of `steps`, as train()'s schedule (cosine, linear, constant, wsd)");
}

void bind_data_and_checkpoints(py::module_& m) {
  // ---- data ------------------------------------------------------------------------------------------------
  py::class_<data::TokenDataset>(m, "Data", "Token windows of a file, a prepared directory, or the built-in corpus")
      .def(py::init([](const std::string& path, int batch, int seq, std::uint64_t seed, const std::string& val) {
             py::gil_scoped_release release;   // reading the tokens; not around the registration (see Release)
             return std::make_unique<data::TokenDataset>(path, batch, seq, seed, val);
           }), py::arg("path") = "", py::arg("batch") = 4, py::arg("seq") = 32, py::arg("seed") = 1234,
           py::arg("val_path") = "")
      .def("batch", [](const data::TokenDataset& d, std::int64_t step) {
             const nn::Batch b = d.next_batch(step);
             return std::make_pair(b.inputs, b.targets);
           }, py::arg("step"), Release(), "(inputs, targets) int64 [B, T] of step `step`: the same on every rank")
      .def_property_readonly("vocab", [](const data::TokenDataset& d) { return d.vocab(); });

  // ---- checkpoints -----------------------------------------------------------------------------------------
  py::class_<PyCheckpointer>(m, "Checkpointer",
                             "Saves training states into a directory (step_NNNNNNNN, committed atomically): each rank "
                             "writes its own pieces; load_checkpoint reads them on any mesh")
      .def(py::init([](const std::string& dir, const MeshRef& mesh, int keep) {
             py::gil_scoped_release release;
             return PyCheckpointer{std::make_unique<checkpoint::CheckpointSaver>(dir, mesh.ptr, keep), mesh.ptr};
           }), py::arg("directory"), py::arg("mesh"), py::arg("keep") = 0)
      .def("save", [](PyCheckpointer& c, int step, PyModel& pm, PyAdamW& opt) {
             py::gil_scoped_release release;
             nlohmann::json state{{"step", step}, {"optimizer_steps", opt.adamw->steps()},
                                  {"random_state", pm.get().random_state()}, {"mesh", c.mesh->str()},
                                  {"producer", "meshgrad Python API"}};
             c.saver->save(step, train::training_state_tensors(pm.get().parameters(), *opt.adamw), state, false);
             c.saver->wait();
             return c.saver->last_committed();
           }, py::arg("step"), py::arg("model"), py::arg("optimizer"),
           "Collective: the model's parameters and AdamW's state after `step` steps; returns the committed directory");
  m.def("load_checkpoint", [](const std::string& dir, PyModel& pm, PyAdamW& opt) {
        py::gil_scoped_release release;
        const std::string resolved = checkpoint::resolve_checkpoint(dir);
        const checkpoint::Manifest manifest = checkpoint::read_manifest(resolved);
        return train::load_training_state(resolved, manifest, pm.get(), *opt.adamw);
      }, py::arg("directory"), py::arg("model"), py::arg("optimizer"),
      "Loads a checkpoint (a step_ directory, or the newest in a checkpoint directory) into this rank's pieces, "
      "whatever mesh wrote it; returns its step. Not collective; every piece is checked against its hash");
}

}  // namespace

void bind_training_api(py::module_& m, py::class_<Tensor>& tensor) {
  bind_tensors(m, tensor);
  bind_ranks(m);
  bind_layers(m);
  bind_models(m);
  bind_optimizer(m);
  bind_data_and_checkpoints(m);
}

}  // namespace meshgrad::python
