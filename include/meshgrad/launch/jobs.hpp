// The jobs behind `meshgrad train` and `meshgrad grads`, as library calls: they check the options
// (the same checks whoever calls: the CLI, the Python module, a C++ program), run on every rank of
// a mesh through run_on_mesh (the front-ends pass their --backend / --mesh launcher, tests pass
// rank threads; see dist::RunOnMesh in distributed/mesh.hpp) and hand back rank 0's results. The CLI parses
// options into these structs and prints; the Python bindings convert them to dicts and numpy arrays.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "meshgrad/diag/equivalence.hpp"
#include "meshgrad/train/trainer.hpp"

namespace meshgrad::launch {

// `meshgrad train`: a GPT (options.model.kind "gpt") trained on a mesh.
// check_train_options throws InvalidArgument naming the option (as the CLI spells it) when a size
// is not positive, the dtype is int64, dropout is outside [0, 1), steps < 1 or lr <= 0.
void check_train_options(const train::TrainOptions& options);

// options with options.resume (a checkpoint directory, or a --checkpoint-dir whose newest checkpoint is
// taken) turned into resume_dir and the saved configuration (resume_options, train/run_config.hpp:
// also where the run writes); options itself when it does not resume. Prints the options that
// differ from the checkpoint's and the recorded outputs a resume from another folder leaves out.
// Refuses, naming --checkpoint-dir, a folder resumed from that the run cannot write its checkpoints
// into when --checkpoint-dir is not given.
train::TrainOptions resolve_resume(const train::TrainOptions& options);

// Resolves a resume, checks the options, then trains on every rank. An error (InvalidArgument) that
// names options a resumed run took from its checkpoint (TrainOptions::from_checkpoint) says so and
// how to override them: the user may never have given them. Returns the result as mesh rank 0 sees it; when
// run_on_mesh runs one rank per process (mpi), each process gets its own rank's (the losses are
// the same on every rank). options.on_step runs on rank 0 only.
train::TrainResult run_train_job(const train::TrainOptions& options, const dist::RunOnMesh& run_on_mesh);

// `meshgrad grads`: the full gradient of every parameter of a GPT-2 or a Llama-family model for one
// batch, on any mesh train takes (tp, SP, 2-D tp, dp, fsdp, pp), in the names and layout of the
// model's Hugging Face files (interop/model_tensors.hpp: Llama's linear weights [out, in]).
// Two sources of weights and batch:
//  - files: config (Hugging Face config.json of any model_type meshgrad builds; GPT-2's keys without
//    one), weights (safetensors, full tensors in Hugging Face names and layout) and batch
//    (safetensors with int64 "inputs" and "targets" [B, T]); model sizes come from the files;
//  - a seed (config, weights and batch all empty): a GPT of `model`'s sizes initialised from seed
//    (nn::make_model) and a batch of random tokens in [0, vocab) from seed
//    (make_synthetic_batch, explain.hpp). The same seed gives the same weights and batch at any mesh.
struct GradsJob {
  std::string config, weights, batch;   // all three or none
  nn::ModelConfig model;                // seed mode: the sizes (kind "gpt")
  std::uint64_t seed = 1;               // seed mode
  std::string dtype;                    // compute dtype: "" = the weights' (files) / model.dtype (seed)
  bool sequence_parallel = false;
  bool tp_invariant = false;            // nn::Invariance::Tp
  bool mesh_invariant = false;          // nn::Invariance::Mesh: the same bits on every mesh (as train's)
  int invariant_blocks = 4;
  int batch_blocks = 4;                 // with mesh_invariant: the batch's fixed row blocks
  int sequence_blocks = 1;              // with mesh_invariant: the sequence's fixed blocks (cp)
  double capacity_factor = 0;           // a mixture of experts' capacity (nn::ModelConfig); 0: dropless
};

struct GradsResult {
  double loss = 0;                                        // global mean cross-entropy (+ a MoE's aux term)
  std::optional<double> aux_loss;                         // a MoE's load-balancing loss (output_router_logits)
  std::vector<std::pair<std::string, Tensor>> gradients;  // full gradients, forward order; files:
                                                          // in each parameter's dtype in the weights
  DType dtype = DType::Float32;                           // the weights' dtype (files) / compute dtype
  std::string mesh;                                       // DeviceMesh::str() of the mesh it ran on
  std::string backend;                                    // its communicator's: "threads" / "mpi"
  bool has_result = false;   // false in processes without mesh rank 0 (mpi; fields are then empty)
};

// Checks the job (files readable, batch shapes, T <= n_positions ...), computes the gradients on
// the mesh and returns them in the process of mesh rank 0.
GradsResult run_grads_job(const GradsJob& job, const dist::RunOnMesh& run_on_mesh);

}  // namespace meshgrad::launch
