// Equivalence checking: the model on a mesh against the same model on one rank, built from the same
// seed, trained K optimizer steps on the same data. What `meshgrad check` prints.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "meshgrad/distributed/comm_counter.hpp"
#include "meshgrad/nn/model.hpp"

namespace meshgrad::diag {

struct EquivalenceOptions {
  nn::ModelConfig model;
  nn::ParallelConfig parallel;
  std::string mesh = "tp=2";
  std::string backend = "threads";
  int steps = 2;
  double lr = 1e-3;
  std::uint64_t seed = 1;
  // Seed of the mesh model when it must differ from the reference's (0: the same). Only for
  // showing that the checker catches a mismatch; a real check leaves it 0.
  std::uint64_t mesh_seed = 0;
  // Micro-batches per step, on the mesh and in the reference alike (a pipeline's --micro-batches).
  int micro_batches = 1;
};

struct ParameterDifference {
  std::string name;
  double grad_max_abs = 0, grad_max_rel = 0;       // of the last step's gradients
  double weight_max_abs = 0, weight_max_rel = 0;   // after the last step
  bool passed = true;
};

struct EquivalenceReport {
  std::vector<ParameterDifference> parameters;   // forward order
  std::vector<double> reference_losses, mesh_losses;   // per step
  double max_loss_difference = 0;
  // Collectives of one step on the mesh (rank 0), per phase and op: counts and bytes.
  std::map<std::string, std::map<std::string, std::pair<int, std::int64_t>>> collectives;
  double grad_tolerance = 0, weight_tolerance = 0, loss_tolerance = 0;
  std::string first_divergence;   // the first parameter (forward order) above tolerance, "" if none
  bool passed = false;
  // False in a process that did not host mesh rank 0 (under mpi: every rank but 0). Such a process
  // takes part in the mesh run but compares nothing: its report is otherwise empty and passed, and
  // rank 0's report is the verdict.
  bool compared = true;
};

// The tolerances, relative to each parameter's largest magnitude (max |a - b| / max |b|):
//  float64: gradients 1e-9 (the sharded model sums the same terms in another order: differences are
//           a few ulps of accumulations over at most thousands of terms, ~1e-13); weights 1e-9.
//  float32: 1e-4 on gradients and weights. float32's epsilon is 6e-8; reordered sums of up to ~10^4
//           terms and the softmax / layer-norm statistics lose up to ~10^2-10^3 ulps in the worst
//           element, and Adam's normalisation amplifies relative gradient noise of near-zero
//           gradient elements into their updates, so 1e-4 still catches any wrong formula (those
//           show as 1e-2 and above) without flagging rounding.
// run_on_mesh(fn) must call fn(mesh) on every rank of the mesh `options.mesh` (the CLI passes its
// backend launcher; tests pass run_ranks). The reference runs afterwards on one rank in this
// process, only in the process that hosted mesh rank 0 (which holds the mesh's results).
EquivalenceReport check_equivalence(const EquivalenceOptions& options, const dist::RunOnMesh& run_on_mesh);

}  // namespace meshgrad::diag
