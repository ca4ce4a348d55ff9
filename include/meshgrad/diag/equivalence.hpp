// Equivalence checking: the model on a mesh against the same model on one rank, built from the same
// seed (or loaded from the same training checkpoint), trained K AdamW steps on the same data. What
// `meshgrad check` prints.
//
// The criterion. Both models start from the same weights w_0 and see the same batches, so a correct
// mesh model differs from the reference only by rounding: sums added in another order (reduced over
// ranks, split matmuls). What each comparison measures, and its tolerance:
//
//  initial weights   max |w0_mesh - w0_ref| / max |w0_ref| per parameter <= init tolerance (float32
//                    1e-6, float64 1e-12): both are built from one seed or read from one checkpoint
//                    and sliced, so they agree bit for bit; a mesh that starts elsewhere fails here.
//  gradients         of step 1, max |g_mesh - g_ref| / max |g_ref| per parameter <= grad tolerance
//                    (float32 1e-5, float64 1e-9). At step 1 both models hold the same weights, so
//                    the difference is the computation's alone: each element is a sum of up to ~10^4
//                    products whose reordering changes it by some ulps of the largest partial sums:
//                    measured ~5e-7 (float32, the CLI's model) to 1.2e-6 (hidden 256, vocab 2000),
//                    ~1e-15 in float64. This is the tight test of the communication: a dropped,
//                    duplicated or rescaled reduction changes whole gradients by O(1) relative (a
//                    1.001 scale: 1e-3, 100x the tolerance). Later steps' gradients are not held to
//                    it: they are taken at weights Adam already moved apart (below), and measured
//                    2e-4 apart at hidden 256; the update test covers those steps.
//  weights           by the update u = w_K - w_0 of each element, relative to the furthest AdamW can
//                    move one in K steps, lr x K: max |u_mesh - u_ref| / (lr K) <= update tolerance
//                    (float32 1e-2, float64 1e-6) over the *settled* elements, and <= 2.5 over the
//                    *floor* elements (Adam's 2 lr per step either way, with room for m/sqrt(v)
//                    a little above 1 when a gradient shrinks between steps).
//                    Why not max |w_mesh - w_ref| / max |w_ref|, as the gradients: Adam's step is
//                    lr * m / (sqrt(v) + eps) ~ lr * sign(g) for |g| >> eps = 1e-8, whatever |g|. An
//                    element whose reference gradient is within the gradient tolerance of zero
//                    (|g| <= floor = 100 x grad tolerance x max |g| of its parameter, at some step: a
//                    *floor* element) has a sign that rounding may flip, so a correct mesh may move it
//                    by up to 2 lr per step the other way. In float32 that rounding (1e-7 x max |g|)
//                    is above Adam's eps, and such elements exist in every GPT (e.g. attention
//                    weights at initialisation, rows of tokens the batch barely touches). The old
//                    1e-4-of-max-|w| test failed correct models on them: a bias starts at zero, so
//                    its max |w| after K steps is ~lr K and 1e-4 of that is below those moves.
//                    For a *settled* element (|g| > floor at every step) the update's sensitivity
//                    d(g / (|g| + eps)) = eps dg / (|g| + eps)^2 <= dg / (4 |g|) is at most
//                    grad tolerance / (4 x 100 x grad tolerance) = 1/400 of lr per step: the update
//                    tolerance 1e-2 of lr K sits above that with room (measured: <= 1.5e-3 at
//                    hidden 256, ~1e-5 on the CLI's model; floor elements <= 6e-2), and a model that
//                    moves a settled element the other way (a sign or init error: 2 lr K, 200x the tolerance)
//                    or further than Adam can fails. In float64 rounding (1e-16 x max |g|) is eight
//                    orders below Adam's eps: no element is at the floor in practice, the floor test
//                    is kept for the formula's sake, and 1e-6 of lr K stays strict.
//                    The weight test cannot see a gradient's scale (Adam divides it out): the gradient
//                    test does.
//  losses            max over steps of |l_mesh - l_ref| / |l_ref| <= loss tolerance (float32 1e-5,
//                    float64 1e-12): the mean of ~10^2 token losses, a few ulps each, plus the first-order
//                    effect of the floor elements' moves, whose gradients are by definition ~0.
//  finiteness       every loss, gradient and weight of both runs finite: a NaN passes every "error <=
//                    tolerance" test by comparing false, so NaN and infinity fail on their own, named.
// bf16 products (--precision bf16: init 1e-6, gradients 1e-2, floor 1e-1, updates 1e-1, floor
// updates 2.5, losses 1e-4). The mesh and the reference round the same operands to bf16, but an
// operand that a reordered float32 sum moved by an ulp can round to the neighbouring bf16 value,
// 2^-8 = 3.9e-3 relative away, and each such flip travels on through the layers. Measured (GPT,
// hidden 64, seq 32, 3 steps): gradients 8.3e-4 of max |g| at tp=2 and fsdp=2 x tp=2, 5.5e-7 at
// dp=2 (no split product), 0 at pp=2; settled updates 2.4e-2 of lr K with the float32 floor; losses
// 6e-6. The gradient tolerance 1e-2 is 2.5 flips of one dominant product and 12x the measured; the
// floor 1e-1 is 10x it, so a settled element's update moves at most 1e-2 / (4 x 1e-1) = 2.5e-2 of lr
// per step by the sign argument above, under the update tolerance 1e-1. What this still catches: a
// dropped, doubled or rescaled-by-2% reduction (O(1) or 2e-2 relative in whole gradients); a subtler
// error (a 1.001 scale) needs the float32 or float64 check of the same code path.
// The tp-invariant mode (the CLI's --tp-invariant) demands bitwise equality instead of all of these
// (and finiteness).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "meshgrad/comm/communicator.hpp"
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
  std::uint64_t seed = 1;   // of the initial weights (unless `checkpoint`) and of the batches
  // Seed of the mesh model when it must differ from the reference's (0: the same). Only for
  // showing that the checker catches a mismatch; a real check leaves it 0. With `checkpoint`, a
  // nonzero mesh_seed makes the mesh model start from that seed instead of the checkpoint.
  std::uint64_t mesh_seed = 0;
  // Micro-batches per step, on the mesh and in the reference alike (a pipeline's --micro-batches).
  int micro_batches = 1;
  // "float32" or "bf16" (train's --precision), on the mesh and in the reference alike; bf16 needs a
  // float32 model and is held to tolerances_for(Float32, "bf16").
  std::string precision = "float32";
  // A committed checkpoint directory (checkpoint::resolve_checkpoint's result), or "": both models
  // start from its parameters; `model` must be its configuration (checkpoint_check_config).
  std::string checkpoint;
};

// The criterion's numbers (the header comment says why each is what it is).
struct Tolerances {
  double init = 0;       // initial weights, relative to max |w0| per parameter
  double grad = 0;       // gradients of each step, relative to max |g| per parameter
  double floor = 0;      // |g| <= floor x max |g| (at some step): a floor element
  double update = 0;     // settled elements' |u_mesh - u_ref| / (lr K)
  double floor_update = 0;   // floor elements' |u_mesh - u_ref| / (lr K)
  double loss = 0;       // relative, per step
};
Tolerances tolerances_for(DType dtype, const std::string& precision = "float32");

struct ParameterDifference {
  std::string name;
  double init_max_rel = 0;                         // initial weights
  double grad_max_abs = 0, grad_max_rel = 0;       // the worst step's gradients
  double update_max_rel = 0;                       // settled elements: |u_mesh - u_ref| / (lr K)
  double floor_update_max_rel = 0;                 // floor elements: the same
  std::int64_t floor_elements = 0, elements = 0;   // how many are floor elements, of how many
  bool passed = true;
};

struct EquivalenceReport {
  std::vector<ParameterDifference> parameters;   // forward order
  std::vector<double> reference_losses, mesh_losses;   // per step
  double max_loss_difference = 0;
  // Collectives of one step on the mesh (rank 0), per phase and op: counts and bytes.
  std::map<std::string, std::map<std::string, std::pair<int, std::int64_t>>> collectives;
  Tolerances tolerance;
  // The largest error / tolerance over every comparison (< 1 passes): how close a pass came.
  double margin = 0;
  std::string first_divergence;   // the first parameter (forward order) above tolerance, "" if none
  // What is NaN or infinite, on either side: "mesh loss of step 2 (nan)", "reference gradient of
  // NAME at step 1", "mesh initial NAME", "mesh final NAME". Any fails the check (also the bitwise
  // one): a NaN compares false with every tolerance and would otherwise count as no error.
  std::vector<std::string> non_finite;
  bool passed = false;
  // False in a process that did not host mesh rank 0 (under mpi: every rank but 0). Such a process
  // takes part in the mesh run but compares nothing: its report is otherwise empty and passed, and
  // rank 0's report is the verdict.
  bool compared = true;
};

// run_on_mesh(fn) must call fn(mesh) on every rank of the mesh `options.mesh` (the CLI passes its
// backend launcher; tests pass run_ranks). The reference runs afterwards on one rank in this
// process, only in the process that hosted mesh rank 0 (which holds the mesh's results).
EquivalenceReport check_equivalence(const EquivalenceOptions& options, const dist::RunOnMesh& run_on_mesh);

// ---- a training checkpoint as the model to check ------------------------------------------------

// The configuration of the checkpoint at `path` (a checkpoint directory, or a --checkpoint-dir root
// meaning its newest), for EquivalenceOptions::model, and the resolved directory. `given` names the
// options the user set ("model" or model_config_fields' names: "layers", "dtype", ...), whose values
// are in `requested`: one that differs from the checkpoint's is refused, naming it, except seq and
// batch, which a check may choose (seq up to the checkpoint's positions). Throws naming path when it
// is missing or not a checkpoint.
struct CheckpointModel {
  std::string dir;
  nn::ModelConfig model;
};
CheckpointModel checkpoint_check_config(const std::string& path, const nn::ModelConfig& requested,
                                        const std::vector<std::string>& given);

// ---- injected faults: showing that the check catches a wrong mesh model ---------------------------

// A fault in the mesh's communication: every reduction (all-reduce, reduce-scatter) that runs in the
// backward phase on the communicator of mesh axis `axis` is changed:
//   Drop    not run: each rank keeps its own term (an all-reduce the rule forgot)
//   Double  the sum times the group size (the reduction applied twice to its own result)
//   Scale   the sum times `scale` (a wrong factor, e.g. 1.001)
struct CommFault {
  enum class Kind : std::uint8_t { None, Drop, Double, Scale } kind = Kind::None;
  std::string axis = "tp";
  double scale = 1.0;
};
// "drop:AXIS", "double:AXIS", "scale:AXIS:FACTOR" (e.g. "scale:tp:1.001"); "" is no fault. Throws
// InvalidArgument naming spec otherwise.
CommFault parse_comm_fault(const std::string& spec);
// Throws InvalidArgument, naming the axis and the mesh's axes, unless `fault` (Kind::None passes) is on
// an axis of the mesh `mesh` (a --mesh spec) with more than one rank: on any other axis no reduction
// runs, the fault would change nothing, and the check would pass while saying a fault was injected.
void check_fault_axis(const CommFault& fault, const std::string& mesh);
// How many reductions a fault changed, counted by every rank of this process (atomic: rank threads).
using FaultCount = std::atomic<std::int64_t>;
// `world` with `fault` applied to it and to every communicator split from it (the mesh's axes).
// Returns world itself for Kind::None. With `fired`, each changed reduction adds one to it (on every
// rank that ran it): a run whose fault never fired proves nothing about the checker, and the caller
// must not report it as a pass. *fired must outlive the communicators.
comm::CommunicatorPtr with_comm_fault(comm::CommunicatorPtr world, const CommFault& fault, FaultCount* fired = nullptr);

}  // namespace meshgrad::diag
