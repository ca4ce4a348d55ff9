// The jobs behind `meshgrad train` and `meshgrad grads`, as library calls: they check the options
// (the same checks whoever calls: the CLI, the Python module, a C++ program), start the ranks on
// the chosen backend (launch.hpp) and hand back rank 0's results. The CLI parses options into these
// structs and prints; the Python bindings convert them to dicts and numpy arrays.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "meshgrad/train/trainer.hpp"

namespace meshgrad::train {

// `meshgrad train`: a GPT trained on a mesh (options.model.kind must be "gpt").
struct TrainJob {
  std::string mesh = "tp=2";        // --mesh spec (launch.hpp)
  std::string backend = "threads";  // "threads" or "mpi"
  TrainOptions options;
};

// Throws InvalidArgument naming the option (as the CLI spells it) when a size is not positive,
// the dtype is int64, dropout is outside [0, 1), steps < 1 or lr <= 0.
void check_train_job(const TrainJob& job);

// Checks the job, then trains on every rank. Returns the result as rank 0 sees it (under the mpi
// backend, on every process: TrainResult::losses is the same on all ranks). options.on_step runs
// on rank 0 only.
TrainResult run_train_job(const TrainJob& job);

// `meshgrad grads`: the full gradient of every GPT-2 parameter for one batch.
// Two sources of weights and batch:
//  - files: config (Hugging Face config.json), weights (safetensors, full tensors) and batch
//    (safetensors with int64 "inputs" and "targets" [B, T]); model sizes come from the files;
//  - a seed (config, weights and batch all empty): a GPT of `model`'s sizes initialised from seed
//    (nn::make_model) and a batch of random tokens in [0, vocab) from seed
//    (nn::make_synthetic_batch). The same seed gives the same weights and batch at any mesh.
struct GradsJob {
  std::string mesh = "tp=1";
  std::string backend = "threads";
  std::string config, weights, batch;   // all three or none
  nn::ModelConfig model;                // seed mode: the sizes (kind "gpt")
  std::uint64_t seed = 1;               // seed mode
  std::string dtype;                    // compute dtype: "" = the weights' (files) / model.dtype (seed)
  bool sequence_parallel = false;
};

struct GradsResult {
  double loss = 0;                                        // global mean cross-entropy
  std::vector<std::pair<std::string, Tensor>> gradients;  // full gradients, forward order; files:
                                                          // in each parameter's dtype in the weights
  DType dtype = DType::Float32;                           // the weights' dtype (files) / compute dtype
  std::string mesh;                                       // DeviceMesh::str() of the mesh it ran on
  std::string backend;                                    // "threads" / "mpi"
  bool has_result = false;   // false on MPI processes other than rank 0 (fields are then empty)
};

// Checks the job (files readable, batch shapes, T <= n_positions ...), computes the gradients on
// the mesh and returns them on the process of rank 0.
GradsResult run_grads_job(const GradsJob& job);

}  // namespace meshgrad::train
