// The Python module `meshgrad`: the CLI's jobs as functions (train, grads, explain, sample), a
// Tensor that converts to and from numpy, and (python/training_api.cpp) the API for training code
// of one's own: operations with autograd, meshes, layers and plans, models, AdamW, checkpoints.
//
//   import meshgrad
//   steps = meshgrad.train(mesh="tp=2", steps=5)           # [{"step": 1, "loss": 5.5, ...}, ...]
//   g = meshgrad.grads(mesh="tp=2", seed=3)                # {"wte.weight": ndarray, ...}
//   rows = meshgrad.explain(model="gpt", mesh="tp=4")      # [{"layer": ..., "op": ..., ...}, ...]
//   text = meshgrad.sample(checkpoint="w.safetensors", prompt="The ", tokens=50)   # prompt + continuation
//
// Every function takes keyword arguments only, named as the CLI's options with '_' for '-'; an
// unknown keyword or a value of the wrong type is a TypeError naming it. The jobs are the library's
// (launch/jobs.hpp, diag/explain.hpp), started by the library's launch API (launch/launch.hpp) as
// the CLI starts them: the bindings are a front-end like the CLI and use only installed headers, so
// the CLI's checks apply and meshgrad's errors arrive as meshgrad.Error (RuntimeError) or
// meshgrad.InvalidArgument (also a ValueError) with the same message. The GIL is released while
// the ranks run.
#include <fmt/core.h>
#include <algorithm>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <limits>
#include <type_traits>
#include <variant>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "meshgrad/comm/mpi.hpp"
#include "meshgrad/distributed/cost_model.hpp"
#include "meshgrad/tensor/error.hpp"
#include "meshgrad/tensor/tensor.hpp"
#include "meshgrad/diag/explain.hpp"
#include "meshgrad/checkpoint/directory.hpp"
#include "meshgrad/checkpoint/manifest.hpp"
#include "meshgrad/io/file_io.hpp"
#include "meshgrad/launch/jobs.hpp"
#include "meshgrad/generate/sample.hpp"
#include "meshgrad/launch/launch.hpp"
#include "meshgrad/train/option_table.hpp"
#include "module.hpp"

namespace meshgrad::python {
namespace {

// The Python name of the type a keyword takes, for messages ("str", not std::__cxx11::basic_string).
template <class T>
const char* python_type_name() {
  if constexpr (std::is_same_v<T, bool>) return "bool";
  else if constexpr (std::is_integral_v<T>) return "int";
  else if constexpr (std::is_floating_point_v<T>) return "float";
  else if constexpr (std::is_same_v<T, std::string>) return "str";
  else if constexpr (std::is_same_v<T, std::vector<int>>) return "a list of int";
  else return "a list of str";
}

// Keyword arguments of one call: get() reads the known ones, finish() rejects the rest. Call
// finish() before doing any work, so a typo costs nothing.
class Keywords {
 public:
  Keywords(const char* function, const py::kwargs& kwargs) : function_(function), kwargs_(kwargs) {}

  template <class T>
  void get(const char* key, T& out) {
    known_.insert(key);
    if (!kwargs_.contains(key)) return;
    py::handle value = kwargs_[key];
    // bool is a subclass of int in Python, and pybind11 converts True to 1: steps=True would run one
    // step. A number keyword (or a list of them) takes no bool.
    if constexpr ((std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) || std::is_same_v<T, std::vector<int>>) {
      const char* found = py::isinstance<py::bool_>(value) ? "bool" : nullptr;
      if constexpr (std::is_same_v<T, std::vector<int>>) {
        if (py::isinstance<py::list>(value) || py::isinstance<py::tuple>(value)) {
          for (py::handle item : value) found = py::isinstance<py::bool_>(item) ? "an item is a bool" : found;
        }
      }
      if (found != nullptr) {
        throw py::type_error(fmt::format("{}(): {} must be {}, got {} ({})", function_, key, python_type_name<T>(),
                                         std::string(py::repr(value)), found));
      }
    }
    // An int too large for the option is a range error, not a type error.
    if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
      if (py::isinstance<py::int_>(value) && !py::isinstance<py::bool_>(value)) {
        const py::int_ v = py::reinterpret_borrow<py::int_>(value);
        const bool fits = py::int_(std::numeric_limits<T>::min()) <= v && v <= py::int_(std::numeric_limits<T>::max());
        if (!fits) {
          throw py::value_error(fmt::format("{}(): {} must be an int in [{}, {}], got {}", function_, key,
                                            std::numeric_limits<T>::min(), std::numeric_limits<T>::max(),
                                            std::string(py::repr(value))));
        }
      }
    }
    // A str that UTF-8 cannot hold (a lone surrogate such as '\udc80', from surrogateescape decoding)
    // is the right type with a wrong value.
    if constexpr (std::is_same_v<T, std::string>) {
      if (py::isinstance<py::str>(value)) {
        const py::object encoded = py::reinterpret_steal<py::object>(PyUnicode_AsUTF8String(value.ptr()));
        if (!encoded) {
          PyErr_Clear();
          throw py::value_error(fmt::format("{}(): {} {} cannot be encoded as UTF-8 (it holds a lone surrogate, "
                                            "e.g. from bytes decoded with errors='surrogateescape')",
                                            function_, key, std::string(py::repr(value))));
        }
      }
    }
    try {
      out = value.cast<T>();
    } catch (const py::cast_error&) {
      throw py::type_error(fmt::format("{}(): {} must be {}, got {} ({})", function_, key, python_type_name<T>(),
                                       std::string(py::repr(value)), std::string(py::str(value.get_type().attr("__name__")))));
    }
  }

  // A path that may be left out: None (or the keyword absent) means none; a str is taken as given,
  // so an empty one is refused by the job ("the path is empty"), never read as "none".
  void get_path(const char* key, std::string& out) {
    if (kwargs_.contains(key) && kwargs_[key].is_none()) {
      known_.insert(key);
      return;
    }
    get(key, out);
  }

  void finish() const {
    for (auto item : kwargs_) {
      const auto key = item.first.cast<std::string>();
      if (!known_.count(key)) {
        std::string choices;
        for (const auto& k : known_) choices += (choices.empty() ? "" : ", ") + k;
        throw py::type_error(
            fmt::format("{}() got an unexpected keyword argument '{}' (it takes: {})", function_, key, choices));
      }
    }
  }

 private:
  const char* function_;
  const py::kwargs& kwargs_;
  std::set<std::string> known_;
};

}  // namespace

// ---- tensors <-> numpy -------------------------------------------------------------------------

std::string numpy_format(DType dtype) {
  switch (dtype) {
    case DType::Float32: return py::format_descriptor<float>::format();
    case DType::Float64: return py::format_descriptor<double>::format();
    case DType::Int64: return py::format_descriptor<std::int64_t>::format();
    case DType::BFloat16:
      throw InvalidArgument("meshgrad.Tensor: numpy has no bfloat16; convert the tensor to float32 first");
  }
  throw InvalidArgument("meshgrad.Tensor: unknown dtype");
}

// The tensor's memory as a buffer: shape and byte strides of its view, no copy.
py::buffer_info tensor_buffer(const Tensor& t) {
  const auto item = static_cast<py::ssize_t>(dtype_size(t.dtype()));
  std::vector<py::ssize_t> shape(t.shape().begin(), t.shape().end());
  std::vector<py::ssize_t> strides;
  for (std::int64_t s : t.strides()) strides.push_back(static_cast<py::ssize_t>(s) * item);
  void* data = t.storage()->data() + t.offset() * item;
  return py::buffer_info(data, item, numpy_format(t.dtype()), t.dim(), shape, strides);
}

// A numpy array viewing t's memory; the array keeps the storage alive.
py::array to_numpy(const Tensor& t) {
  const py::buffer_info info = tensor_buffer(t);
  auto* keep = new Tensor(t);
  py::capsule owner(keep, [](void* p) { delete static_cast<Tensor*>(p); });
  return py::array(py::dtype(info), info.shape, info.strides, info.ptr, owner);
}

// A Tensor of the array's values. Without a copy when the layout allows: a writeable array whose
// strides are non-negative multiples of its item size (C-contiguous, or a strided view) becomes a
// tensor over the same memory, and the tensor holds a reference to the array (released with the
// GIL held, whichever thread drops the last handle). Otherwise (read-only, negative or unaligned
// strides) a C-contiguous copy. float32, float64 and int64 only; anything else is named.
template <class T>
Tensor adopt_or_copy_array(const py::array& a, DType dtype) {
  bool adoptable = a.writeable() && a.ndim() <= 8;
  Shape shape(a.shape(), a.shape() + a.ndim());
  Strides strides;
  std::int64_t span = 1;   // elements from the first to one past the last
  for (py::ssize_t d = 0; d < a.ndim() && adoptable; ++d) {
    const py::ssize_t st = a.strides(d);
    adoptable = st >= 0 && st % static_cast<py::ssize_t>(sizeof(T)) == 0;
    strides.push_back(st / static_cast<py::ssize_t>(sizeof(T)));
    if (shape[static_cast<std::size_t>(d)] > 0) span += (shape[static_cast<std::size_t>(d)] - 1) * strides.back();
  }
  if (adoptable) {
    auto* owner = new py::object(a);   // keeps the array (and its memory) alive
    auto release = [owner] {
      py::gil_scoped_acquire gil;
      delete owner;
    };
    return Tensor::from_external(const_cast<void*>(a.data()), static_cast<std::size_t>(span) * sizeof(T), dtype,
                                 std::move(shape), std::move(strides), std::move(release));
  }
  auto c = py::array_t<T, py::array::c_style>::ensure(a);
  Tensor t = Tensor::empty(shape, dtype);
  if (t.numel() > 0) std::memcpy(t.data<T>(), c.data(), static_cast<std::size_t>(t.numel()) * sizeof(T));
  return t;
}

Tensor from_numpy(const py::array& a) {
  const py::dtype dt = a.dtype();
  if (dt.is(py::dtype::of<float>())) return adopt_or_copy_array<float>(a, DType::Float32);
  if (dt.is(py::dtype::of<double>())) return adopt_or_copy_array<double>(a, DType::Float64);
  if (dt.is(py::dtype::of<std::int64_t>())) return adopt_or_copy_array<std::int64_t>(a, DType::Int64);
  throw py::type_error(fmt::format("meshgrad.Tensor: numpy dtype {} is not supported (float32, float64 or int64)",
                                   std::string(py::str(py::handle(dt)))));
}

// ---- jobs ----------------------------------------------------------------------------------------

// MPI can be initialised once per process, and a job's own session would finalise it when the job
// ends. So the first backend="mpi" call opens a session the module keeps until the interpreter
// exits, and every later call runs on the same MPI world. (A build without MPI throws here,
// naming the backend, as the CLI does.)
void keep_mpi_initialised(const std::string& backend) {
  static std::unique_ptr<comm::MpiSession> session;
  if (backend != "mpi" || session) return;
  int argc = 0;
  char** argv = nullptr;
  session = std::make_unique<comm::MpiSession>(&argc, &argv);
  py::module_::import("atexit").attr("register")(py::cpp_function([] { session.reset(); }));
}

namespace {

// The Python functions' default GPT: small enough for a few seconds of training on 2 cores.
nn::ModelConfig small_gpt() { return nn::ModelConfig::gpt(/*layers=*/1, /*hidden=*/32, /*heads=*/4, /*vocab=*/256, 16, 4); }

void model_keywords(Keywords& k, nn::ModelConfig& c) {
  k.get("layers", c.layers);
  k.get("hidden", c.hidden);
  k.get("heads", c.heads);
  k.get("seq", c.seq);
  k.get("batch", c.batch);
}

}  // namespace

// Runs job (which polls `stop` between its steps) on a worker thread while this thread, Python's
// main thread, answers signals: Python runs its signal handlers only there, and only when it holds
// the GIL, so a train() that held this thread in C++ for the whole run heard Ctrl-C only when it
// ended (reliability-2 Y6). Every 50 ms the GIL is taken and PyErr_CheckSignals() runs the handlers;
// when one raises (KeyboardInterrupt), `stop` is set, the job ends after its current step (with a
// checkpoint when it writes them) and the exception is raised here once the job has returned. An
// error of the job itself is rethrown after it.
void run_answering_signals(std::atomic<bool>& stop, const std::function<void()>& job) {
  std::mutex mu;
  std::condition_variable done_cv;
  bool done = false;
  std::exception_ptr job_error;
  std::optional<py::error_already_set> interrupt;
  {
    py::gil_scoped_release release;
    std::thread worker([&] {
      try {
        job();
      } catch (...) {
        job_error = std::current_exception();
      }
      const std::lock_guard<std::mutex> lock(mu);
      done = true;
      done_cv.notify_all();
    });
    std::unique_lock<std::mutex> lock(mu);
    while (!done_cv.wait_for(lock, std::chrono::milliseconds(50), [&] { return done; })) {
      if (interrupt) continue;   // asked once: the job is stopping at the end of its step
      lock.unlock();
      {
        py::gil_scoped_acquire acquire;
        if (PyErr_CheckSignals() != 0) {
          interrupt.emplace();   // takes the raised exception (KeyboardInterrupt) out of the interpreter
          stop = true;
        }
      }
      lock.lock();
    }
    lock.unlock();
    worker.join();
  }
  if (interrupt) throw std::move(*interrupt);
  if (job_error) std::rethrow_exception(job_error);
}

namespace {

// The options train() starts from: a small model and a few steps (seconds), no progress bar; the
// rest the library's defaults (train::TrainOptions), as the CLI's.
train::TrainOptions python_defaults() {
  train::TrainOptions o;
  o.model = small_gpt();
  o.model.vocab = 0;   // as the CLI: from the data (256 for bytes, a prepared directory's meta.json)
  o.steps = 5;
  o.progress = false;
  return o;
}

// train()'s keywords, one per entry of train::train_option_table() Python takes: read into `o` (the
// SurfaceHeld ones into held[name]). The adapters' values are applied after k.finish(), in the
// table's order, so an unknown keyword is refused before any of them runs.
void train_keywords(Keywords& k, const py::kwargs& kwargs, train::TrainOptions& o,
                    const std::map<std::string, std::string*>& held) {
  std::vector<std::function<void()>> adapters;
  for (const train::TrainOption& t : train::train_option_table()) {
    if (!t.on(train::kPython)) continue;
    const std::string key = t.python_keyword();
    if (t.is_alias()) {
      const std::string other = train::train_option(t.alias_of).python_keyword();
      MG_CHECK(!(kwargs.contains(key) && kwargs.contains(other)), "train: give {} or {}, not both (they are one "
               "setting)", key, other);
    }
    std::visit(
        [&](const auto& field) {
          using F = std::decay_t<decltype(field)>;
          if constexpr (std::is_same_v<F, train::SurfaceHeld>) {
            k.get(key.c_str(), *held.at(t.name));
          } else if constexpr (std::is_same_v<F, train::FlagAdapter> || std::is_same_v<F, train::TextAdapter>) {
            using V = std::conditional_t<std::is_same_v<F, train::FlagAdapter>, bool, std::string>;
            V value{};
            k.get(key.c_str(), value);
            if (kwargs.contains(key.c_str())) adapters.push_back([&o, set = field.set, value] { set(o, value); });
          } else if constexpr (std::is_same_v<F, train::OptionMember<std::string>>) {
            if (t.kind == train::OptionKind::Path) k.get_path(key.c_str(), field(o));
            else k.get(key.c_str(), field(o));
          } else {
            k.get(key.c_str(), field(o));
          }
        },
        t.field);
  }
  k.finish();
  for (const auto& apply : adapters) apply();
}

// A JSON value as Python writes it: 3, 0.003, True, 'float32', [3, 3].
std::string python_repr(const nlohmann::json& v) {
  if (v.is_boolean()) return v.get<bool>() ? "True" : "False";
  if (v.is_number_float()) return py::repr(py::float_(v.get<double>()));
  if (v.is_number()) return v.dump();
  if (v.is_string()) return py::repr(py::str(v.get<std::string>()));
  std::string out;
  for (const nlohmann::json& e : v) out += (out.empty() ? "" : ", ") + python_repr(e);
  return "[" + out + "]";
}

// train()'s docstring: every keyword with its default (python_defaults()) and the table's help.
std::string train_docstring() {
  const train::TrainOptions o = python_defaults();
  std::string doc =
      "train(**keywords) -> list of per-step dicts, the metrics file's step lines (step, loss, tokens_per_s, "
      "gflops, elapsed_s, lr, grad_norm, ms_per_step, mfu, and val_loss on the steps that evaluated), as `meshgrad "
      "train`. Under backend='mpi' (one rank per process, started by mpirun) the process of rank 0 gets the list, "
      "the others [].\n\nKeywords: `meshgrad train`'s options with _ for - (help as there). A path left out (None) "
      "is none; an empty str is an error.\n"
      "And on_step=None: fn(step_dict), called after every step while training runs; returning False stops the run "
      "after that step as Ctrl-C does (a checkpoint first with checkpoint_dir), and an exception stops it and is "
      "raised by train(). model= also takes a kind registered with register_family.\n";
  for (const train::TrainOption& t : train::train_option_table()) {
    if (!t.on(train::kPython)) continue;
    std::string value;
    if (std::holds_alternative<train::SurfaceHeld>(t.field)) value = python_repr(t.surface_default);
    else if (t.kind == train::OptionKind::Path && train::option_value(t, o).get<std::string>().empty()) value = "None";
    else value = python_repr(train::option_value(t, o));
    doc += fmt::format("  {}={}: {}\n", t.python_keyword(), value, t.help);
  }
  return doc;
}

// One step's figures as a dict: the metrics file's step line (train::step_metrics_json), the same
// keys as the CLI.
py::dict step_dict(const train::StepMetrics& m) {
  py::dict d;
  const nlohmann::json line = train::step_metrics_json(m);   // named: items() refers into it
  for (const auto& [key, value] : line.items()) {
    if (value.is_array()) {   // expert_load: per MoE layer, the assignments per expert
      py::list layers;
      for (const auto& layer : value) layers.append(py::cast(layer.get<std::vector<std::int64_t>>()));
      d[py::str(key)] = layers;
    } else if (value.is_number_integer()) {
      d[py::str(key)] = value.get<std::int64_t>();
    } else {
      d[py::str(key)] = value.get<double>();
    }
  }
  return d;
}

py::list train_job(const py::kwargs& given) {
  // on_step is Python's alone (a callable, not an option of the table).
  const auto kwargs = py::reinterpret_steal<py::kwargs>(PyDict_Copy(given.ptr()));
  py::object on_step = py::none();
  if (kwargs.contains("on_step")) on_step = kwargs.attr("pop")("on_step");
  if (!on_step.is_none() && !PyCallable_Check(on_step.ptr())) {
    throw py::type_error(fmt::format("train(): on_step must be a callable taking the step's dict, got {}",
                                     std::string(py::repr(on_step))));
  }
  train::TrainOptions o = python_defaults();
  std::string mesh = train::train_option("mesh").surface_default;
  std::string backend = train::train_option("backend").surface_default;
  Keywords k("train", kwargs);
  train_keywords(k, kwargs, o, {{"mesh", &mesh}, {"backend", &backend}});
  // As the CLI: the keywords given override a resumed checkpoint's configuration (by option name).
  for (const auto& item : kwargs) {
    if (item.second.is_none()) continue;   // a path left out
    std::string key = py::str(item.first);
    std::replace(key.begin(), key.end(), '_', '-');
    o.given_options.insert(key);
  }
  if (!o.resume.empty() && !kwargs.contains("mesh")) {
    mesh = checkpoint::read_manifest(checkpoint::resolve_checkpoint(o.resume)).state.value("mesh", mesh);
  }
  // As the CLI: with init_from, the sizes not given come from its config.json (0 = the file's).
  if (!o.init_from.empty()) {
    for (auto [key, field] : {std::pair{"layers", &o.model.layers}, std::pair{"hidden", &o.model.hidden},
                              std::pair{"heads", &o.model.heads}}) {
      if (!kwargs.contains(key)) *field = 0;
    }
  }

  keep_mpi_initialised(backend);
  std::vector<train::StepMetrics> steps;   // filled on rank 0's thread; read after the ranks joined
  std::atomic<bool> stop{false};
  // on_step(dict) runs on rank 0's thread while the ranks train (the GIL taken for it): False stops
  // the run after this step as Ctrl-C does (a checkpoint when it writes them); an exception stops it
  // too and is raised here once the ranks have stopped.
  std::optional<py::error_already_set> callback_error;
  o.on_step = [&](const train::StepMetrics& m) {
    steps.push_back(m);
    if (on_step.is_none()) return;
    py::gil_scoped_acquire gil;
    if (callback_error) return;
    try {
      const py::object verdict = on_step(step_dict(m));
      if (py::isinstance<py::bool_>(verdict) && !verdict.cast<bool>()) stop = true;
    } catch (py::error_already_set& e) {
      callback_error.emplace(std::move(e));
      stop = true;
    }
  };
  o.stop_requested = [&stop] { return stop.load(); };
  run_answering_signals(stop, [&] { launch::run_train_job(o, launch::mesh_runner(backend, mesh)); });
  if (callback_error) throw std::move(*callback_error);
  py::list out;
  for (const auto& m : steps) {
    py::dict d = step_dict(m);
    out.append(d);
  }
  return out;
}

// The option table as train_options() returns it (what the tests hold train() and its docstring to).
py::list train_options_list() {
  static constexpr const char* kKinds[] = {"int", "seed", "float", "flag", "text", "path", "list of int"};
  py::list out;
  for (const train::TrainOption& t : train::train_option_table()) {
    py::dict d;
    d["name"] = t.name;
    d["keyword"] = t.on(train::kPython) ? py::object(py::str(t.python_keyword())) : py::object(py::none());
    d["kind"] = kKinds[static_cast<int>(t.kind)];
    d["help"] = t.help;
    d["recorded"] = t.recorded != train::Recorded::No;
    d["alias_of"] = t.is_alias() ? py::object(py::str(t.alias_of)) : py::object(py::none());
    out.append(d);
  }
  return out;
}

py::dict grads_job(const py::kwargs& kwargs) {
  launch::GradsJob job;
  std::string mesh = "tp=2", backend = "threads";
  job.model = small_gpt();
  Keywords k("grads", kwargs);
  k.get("mesh", mesh);
  k.get("backend", backend);
  model_keywords(k, job.model);
  k.get("vocab", job.model.vocab);
  k.get("seed", job.seed);
  k.get("config", job.config);
  k.get("weights", job.weights);
  k.get("batch_file", job.batch);
  k.get("dtype", job.dtype);
  k.get("sequence_parallel", job.sequence_parallel);
  k.get("tp_invariant", job.tp_invariant);
  k.get("mesh_invariant", job.mesh_invariant);
  k.get("invariant_blocks", job.invariant_blocks);
  k.get("batch_blocks", job.batch_blocks);
  k.get("sequence_blocks", job.sequence_blocks);
  k.finish();

  keep_mpi_initialised(backend);
  launch::GradsResult r;
  {
    py::gil_scoped_release release;
    r = launch::run_grads_job(job, launch::mesh_runner(backend, mesh));
  }
  py::dict out;
  for (const auto& [name, grad] : r.gradients) out[py::str(name)] = to_numpy(grad);
  return out;
}

py::list explain_job(const py::kwargs& kwargs) {
  nn::ModelConfig c;   // nn::ModelConfig's small defaults, as `meshgrad explain`
  nn::ParallelConfig parallel;
  std::string mesh = "tp=2", link_name = "nvlink4";
  double alpha_us = -1, beta_gbs = -1;
  Keywords k("explain", kwargs);
  k.get("model", c.kind);
  model_keywords(k, c);
  k.get("ffn", c.ffn);
  k.get("vocab", c.vocab);
  k.get("mesh", mesh);
  k.get("sequence_parallel", parallel.sequence_parallel);
  k.get("overlap", parallel.overlap);
  k.get("recompute", parallel.recompute_allgather);
  k.get("checkpoint_blocks", parallel.checkpoint_blocks);
  diag::ExplainPipeline pipe;
  std::string schedule = "1f1b";
  k.get("micro_batches", pipe.micro_batches);
  k.get("pp_layers", parallel.pp_layers);
  k.get("pp_schedule", schedule);
  k.get("link", link_name);
  k.get("alpha_us", alpha_us);
  k.get("beta_gbs", beta_gbs);
  k.finish();
  // As the CLI: alpha_us and beta_gbs go together and exclude link.
  const bool custom = kwargs.contains("alpha_us") || kwargs.contains("beta_gbs");
  MG_CHECK(!custom || (kwargs.contains("alpha_us") && kwargs.contains("beta_gbs")),
           "explain: alpha_us and beta_gbs go together (a custom link needs both)");
  MG_CHECK(!custom || !kwargs.contains("link"), "explain: give either link or alpha_us and beta_gbs, not both");
  MG_CHECK(c.kind == "gpt" || c.kind == "mlp", "explain: model must be \"gpt\" or \"mlp\", got \"{}\"", c.kind);
  MG_CHECK(c.ffn >= 0, "explain: ffn must be >= 0 (0 = 4 x hidden), got {}", c.ffn);
  std::vector<diag::ExplainRow> rows;
  dist::Link link;
  {
    py::gil_scoped_release release;
    // link='measured': all-reduces timed on the mesh's rank threads and the link fitted to them (as
    // `meshgrad explain --link measured`; a 1-rank mesh is refused naming the option).
    if (!custom && link_name == "measured") {
      const std::vector<dist::MeshAxis> axes = dist::parse_mesh(mesh);
      MG_CHECK(dist::mesh_world_size(mesh) >= 2, "explain: link='measured' times all-reduces between the run's ranks, "
               "but the mesh {} has 1 rank: there is no link to measure (give a named link or alpha_us/beta_gbs)", mesh);
      link = *diag::measure_mesh_link(launch::mesh_runner("threads", mesh));
    } else {
      link = custom ? dist::custom_link(alpha_us, beta_gbs) : dist::link_preset(link_name);
    }
    pipe.schedule = pipeline::parse_schedule(schedule);
    rows = diag::explain_model(c, parallel, dist::parse_mesh(mesh), link, pipe);
  }
  py::list out;
  for (const auto& r : rows) {
    py::dict d;
    d["layer"] = r.layer;
    d["phase"] = r.phase;
    d["op"] = r.op;
    d["axis"] = r.axis;
    d["bytes"] = r.bytes;
    d["predicted_us"] = r.predicted_us;
    d["ranks"] = r.ranks;
    d["algorithm"] = r.algorithm;
    d["source"] = diag::explain_source_name(r.source);
    d["stage"] = r.stage;
    d["tensors"] = r.tensors;
    if (link.measurement) {   // the fitted link each row is costed on, as the JSON's "link"
      d["link"] = py::dict(py::arg("name") = link.name, py::arg("alpha_us") = link.alpha_us,
                           py::arg("beta_gbs") = link.beta_gbs,
                           py::arg("rms_residual") = link.measurement->rms_residual);
    }
    out.append(d);
  }
  return out;
}

py::str sample_job(const py::kwargs& kwargs) {
  generate::SampleJob job;
  std::string mesh = "tp=2", backend = "threads";
  std::optional<std::string> tokenizer;
  Keywords k("sample", kwargs);
  for (const char* required : {"checkpoint", "prompt", "tokens"}) {
    if (!kwargs.contains(required)) {
      throw py::type_error(fmt::format("sample() missing required keyword argument '{}'", required));
    }
  }
  k.get("checkpoint", job.checkpoint);
  k.get("prompt", job.prompt);
  k.get("tokens", job.tokens);
  k.get("temperature", job.sampling.temperature);
  k.get("top_k", job.sampling.top_k);
  k.get("top_p", job.sampling.top_p);
  k.get("seed", job.sampling.seed);
  k.get("tokenizer", tokenizer);
  k.get("tp_invariant", job.tp_invariant);
  k.get("invariant_blocks", job.invariant_blocks);
  k.get("mesh", mesh);
  k.get("backend", backend);
  k.finish();
  if (tokenizer) job.tokenizer = *tokenizer;

  keep_mpi_initialised(backend);
  generate::SampleResult r;
  {
    py::gil_scoped_release release;
    r = generate::run_sample_job(job, launch::mesh_runner(backend, mesh));
  }
  return py::str(r.text);   // valid UTF-8 by construction (invalid bytes became U+FFFD)
}

}  // namespace
}  // namespace meshgrad::python

PYBIND11_MODULE(meshgrad, m) {
  using namespace meshgrad;
  using namespace meshgrad::python;
  m.doc() = "meshgrad: tensor-parallel training with exact gradients (CPU, rank threads or MPI)";

  // meshgrad.Error (a RuntimeError) for every meshgrad error; meshgrad.InvalidArgument, also a
  // ValueError, for bad input. The message is meshgrad's.
  static py::exception<Error> error(m, "Error", PyExc_RuntimeError);
  static py::handle invalid = PyErr_NewException("meshgrad.InvalidArgument",
                                                 py::make_tuple(error, py::handle(PyExc_ValueError)).release().ptr(),
                                                 nullptr);
  m.attr("InvalidArgument") = invalid;
  // What is wrong with a file rather than with an argument: a failed file system call is also an
  // OSError, a corrupt or unusable checkpoint a meshgrad.CheckpointError (neither is a ValueError).
  static py::handle file_error = PyErr_NewException("meshgrad.FileError",
                                                    py::make_tuple(error, py::handle(PyExc_OSError)).release().ptr(),
                                                    nullptr);
  m.attr("FileError") = file_error;
  static py::handle checkpoint_error =
      PyErr_NewException("meshgrad.CheckpointError", py::make_tuple(error).release().ptr(), nullptr);
  m.attr("CheckpointError") = checkpoint_error;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const io::FileIoError& e) {
      PyErr_SetString(file_error.ptr(), e.what());
    } catch (const checkpoint::CheckpointError& e) {
      PyErr_SetString(checkpoint_error.ptr(), e.what());
    } catch (const InvalidArgument& e) {
      PyErr_SetString(invalid.ptr(), e.what());
    } catch (const Error& e) {
      PyErr_SetString(error.ptr(), e.what());
    }
  });

  m.attr("__version__") = MESHGRAD_VERSION;   // the CMake project's version

  auto tensor = py::class_<Tensor>(m, "Tensor", py::buffer_protocol(),
                     "A meshgrad tensor. numpy.asarray(t) / t.numpy() view its memory without a copy; "
                     "meshgrad.Tensor(array) of a writeable float32, float64 or int64 array views the array's "
                     "memory too (no copy; the tensor keeps the array alive); read-only or negatively strided "
                     "arrays are copied.")
      .def(py::init(&from_numpy), py::arg("array"))
      .def_buffer(&tensor_buffer)
      .def("numpy", &to_numpy, "A numpy array viewing this tensor's memory (no copy)")
      .def_property_readonly("shape", [](const Tensor& t) { return t.shape(); })
      .def_property_readonly("dtype", [](const Tensor& t) { return std::string(dtype_name(t.dtype())); })
      .def("__repr__", [](const Tensor& t) { return "meshgrad.Tensor(" + t.str() + ")"; });
  // pybind11 caches numpy's dtype-from-format function in a function-local static whose first
  // initialisation imports numpy (letting the GIL go): two rank threads calling numpy() first at
  // once deadlocked, one holding the GIL while it waited on the static's guard. Initialised here,
  // on import, while one thread runs.
  (void)to_numpy(Tensor::zeros({1}, DType::Float32));
  bind_training_api(m, tensor);

  static const std::string train_doc = train_docstring();
  m.def("train", &train_job, train_doc.c_str());
  m.def("train_options", &train_options_list,
        "train_options() -> list of dicts, one per option of train() and `meshgrad train` (the table both are made "
        "from): name (the command line's), keyword (train()'s, None for an option of the command line only), kind, "
        "help, recorded (kept in a checkpoint's run record), alias_of (the option it is another name of, or None)");
  m.def("grads", &grads_job,
        "grads(mesh='tp=2', layers=1, hidden=32, heads=4, seq=16, batch=4, vocab=256, seed=1, dtype='float32', "
        "sequence_parallel=False, tp_invariant=False, mesh_invariant=False, invariant_blocks=4, batch_blocks=4, sequence_blocks=1, "
        "backend='threads') or grads(mesh=..., config=..., weights=..., batch_file=...) "
        "-> {parameter name: numpy array of its full gradient}. config: a Hugging Face config.json (gpt2, llama, "
        "qwen2, mistral), weights and gradients in its Hugging Face names and layout; mesh: tp, dp, fsdp, pp, ep, cp, tp=2x2. With a seed, the weights and batch depend only on "
        "the seed, not the mesh. Under backend='mpi' the process of rank 0 gets the dict, the others {}.");
  m.def("explain", &explain_job,
        "explain(model='gpt', mesh='tp=2', layers=2, hidden=64, heads=4, seq=32, batch=4, ffn=0, vocab=256, "
        "sequence_parallel=False, overlap=False, recompute=False, checkpoint_blocks=False, micro_batches=1, "
        "pp_layers=None, pp_schedule='1f1b', link='nvlink4' | 'measured' | alpha_us=..., beta_gbs=...) -> list of row dicts "
        "(layer, phase, op, axis, bytes, predicted_us, ranks, algorithm, source, stage, tensors: the parameters a grouped "
        "collective carries), as `meshgrad explain` "
        "(mesh='pp=2,tp=2': the first rank of each stage, its sends and receives included)");
  m.def("sample", &sample_job,
        "sample(checkpoint=..., prompt=..., tokens=..., temperature=1.0, top_k=0, top_p=1.0, seed=1234, mesh='tp=2', "
        "tokenizer=None, backend='threads', tp_invariant=False, invariant_blocks=4) -> str: the prompt and its continuation, as `meshgrad sample` prints "
        "them. checkpoint: a safetensors file from train(save=...) (its own gpt2_config metadata gives the sizes; "
        "another tool's file needs a config.json beside it) or a "
        "directory with config.json + model.safetensors. temperature=0 is greedy (the same text on every mesh); "
        "the same seed gives the same text. Generation stops early when the context (n_positions) is full.");
}
