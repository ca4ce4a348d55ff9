// What the Python module's source files share (python/meshgrad.cpp: the module, the jobs and the
// Tensor's numpy conversions; python/training_api.cpp: the API for training code of one's own).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <functional>
#include <string>

#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::python {

namespace py = pybind11;

// A numpy array viewing t's memory; the array keeps the storage alive.
py::array to_numpy(const Tensor& t);
// A Tensor of the array's values, viewing its memory when the layout allows (else a copy).
Tensor from_numpy(const py::array& a);
// The first backend="mpi" call opens an MPI session the module keeps until the interpreter exits.
void keep_mpi_initialised(const std::string& backend);
// Runs job on a worker thread while Python's main thread answers signals (Ctrl-C sets `stop` and is
// raised once the job returned); the job's own error is rethrown after it. Call with the GIL held.
void run_answering_signals(std::atomic<bool>& stop, const std::function<void()>& job);

// meshgrad's training API (python/training_api.cpp): tensor operations and autograd on `tensor`,
// meshes, layers and plans, models and families of one's own, AdamW, data, checkpoints, launch.
void bind_training_api(py::module_& m, py::class_<Tensor>& tensor);

}  // namespace meshgrad::python
