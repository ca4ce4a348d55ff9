// `meshgrad grads`: a gradient dump of a GPT-2 or a Llama-family model (llama, qwen2, mistral) for one
// batch, for comparison with other frameworks and across meshes (the same file whatever --mesh, up
// to rounding; bitwise with --mesh-invariant).
//   meshgrad grads --config config.json --weights w.safetensors --batch batch.safetensors
//                  --mesh dp=2,tp=2 --sequence-parallel --out grads.safetensors
// CONFIG: a Hugging Face config.json (model_type gpt2, llama, qwen2, mistral; GPT-2's keys without a
// model_type). WEIGHTS: full tensors in Hugging Face names and layout (Llama's linears [out, in]). BATCH: int64 "inputs" and "targets" [B, T]. Loss: mean cross-entropy over
// the positions whose target is not -100 (PyTorch's ignore_index), no dropout. OUT: every parameter's full gradient under its name, in the
// weights' dtype, and "loss" as a scalar.
#include <fmt/core.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "command.hpp"
#include "meshgrad/launch/launch.hpp"
#include "meshgrad/launch/jobs.hpp"
#include "meshgrad/io/output_path.hpp"
#include "meshgrad/io/safetensors.hpp"

namespace meshgrad::tools::cmd_grads {
namespace {

struct GradsArgs {
  std::string config, weights, batch, out;
  std::string mesh = "tp=1";
  std::string backend = "threads";
  std::string dtype;   // "" = the weights' dtype
  bool sequence_parallel = false;
  bool tp_invariant = false;
  bool mesh_invariant = false;
  int invariant_blocks = 4;
  int batch_blocks = 4;
  int sequence_blocks = 1;
  double capacity_factor = 0;
  bool capacity_given = false;
};

// Reading and checking the files and computing the gradients is the library's job
// (launch::run_grads_job, shared with the Python module); this writes rank 0's result.
int run(const GradsArgs& a) {
  // Before any work: --out must be writable and must not be one of the inputs.
  io::check_output_paths({{"--out", a.out}}, {{"--config", a.config}, {"--weights", a.weights}, {"--batch", a.batch}});
  launch::GradsJob job;
  job.config = a.config;
  job.weights = a.weights;
  job.batch = a.batch;
  job.dtype = a.dtype;
  job.sequence_parallel = a.sequence_parallel;
  job.tp_invariant = a.tp_invariant;
  job.invariant_blocks = a.invariant_blocks;
  job.mesh_invariant = a.mesh_invariant;
  job.batch_blocks = a.batch_blocks;
  job.sequence_blocks = a.sequence_blocks;
  job.capacity_factor = a.capacity_factor;
  MG_CHECK(!a.capacity_given || a.capacity_factor >= 0, "grads: --capacity-factor {} must be > 0 (or 0: dropless "
           "routing, the default)", a.capacity_factor);
  const launch::GradsResult r = launch::run_grads_job(job, launch::mesh_runner(a.backend, a.mesh));
  if (!r.has_result) return 0;   // an MPI process without mesh rank 0
  std::vector<std::pair<std::string, Tensor>> tensors = r.gradients;
  tensors.emplace_back("loss", Tensor::scalar(r.loss, r.dtype));
  if (r.aux_loss) tensors.emplace_back("aux_loss", Tensor::scalar(*r.aux_loss, r.dtype));
  io::write_safetensors(a.out, tensors, {{"format", "pt"}, {"producer", "meshgrad grads"}, {"mesh", a.mesh}});
  fmt::print("loss {:.10g}; wrote {} gradients and the loss ({}) to {} (mesh {}, {}{})\n", r.loss, r.gradients.size(),
             dtype_name(r.dtype), a.out, r.mesh, r.backend, a.sequence_parallel ? ", sequence-parallel" : "");
  return 0;
}

}  // namespace

MESHGRAD_REGISTER_COMMAND(
    grads, {"", "grads", "Write the full gradient of every parameter (GPT-2, Llama, Qwen2, Mistral) for one batch (safetensors)",
            [](CLI::App& app) -> std::function<int()> {
              auto a = std::make_shared<GradsArgs>();
              app.add_option("--config", a->config, "Hugging Face config.json (gpt2, llama, qwen2, mistral)")->required();
              app.add_option("--weights", a->weights, "Full parameters (safetensors, Hugging Face names and layout)")->required();
              app.add_option("--batch", a->batch, "int64 \"inputs\" and \"targets\" [B, T] (safetensors)")->required();
              app.add_option("--out", a->out, "Where to write the gradients (safetensors)")->required();
              app.add_option("--mesh", a->mesh, "Mesh axes pp, dp, fsdp, ep, cp and tp, e.g. tp=2, dp=2,tp=2, fsdp=2,tp=2, pp=2, cp=2 or tp=2x2 (2-D)")
                  ->capture_default_str();
              app.add_option("--backend", a->backend, "threads (rank threads) or mpi (under mpirun)")
                  ->check(CLI::IsMember({"threads", "mpi"}))
                  ->capture_default_str();
              app.add_option("--dtype", a->dtype, "Compute dtype (default: the weights' dtype)")
                  ->check(CLI::IsMember({"float32", "float64"}));
              app.add_flag("--sequence-parallel", a->sequence_parallel, "Sequence parallelism");
              app.add_flag("--tp-invariant", a->tp_invariant,
                           "Bitwise the same gradients at every tp that keeps the fixed reduction tree "
                           "(docs/mesh-invariance.md)");
              app.add_option("--invariant-blocks", a->invariant_blocks,
                             "With --tp-invariant: fixed blocks per split dimension (a power of two)")
                  ->capture_default_str();
              app.add_flag("--mesh-invariant", a->mesh_invariant,
                           "Bitwise the same gradients on every mesh that keeps both fixed trees (as train's; "
                           "docs/mesh-invariance.md)");
              app.add_option("--batch-blocks", a->batch_blocks,
                             "With --mesh-invariant: the batch's fixed row blocks (a power of two dividing B)")
                  ->capture_default_str();
              app.add_option("--sequence-blocks", a->sequence_blocks,
                             "With --mesh-invariant: the sequence's fixed blocks (a power of two dividing T; cp=C "
                             "needs a multiple of 2C)")
                  ->capture_default_str();
              app.add_option_function<double>(
                  "--capacity-factor",
                  [a](double f) {
                    a->capacity_factor = f;
                    a->capacity_given = true;
                  },
                  "A mixture of experts: each expert takes at most ceil(f x tokens x k / experts) of a rank's tokens "
                  "and drops the rest (0, the default: dropless)");
              return [a] { return run(*a); };
            }});

}  // namespace meshgrad::tools::cmd_grads
