// `meshgrad grads`: a gradient dump of a GPT-2 for one batch, for comparison with other frameworks
// and across meshes (the same file whatever --mesh, up to rounding).
//   meshgrad grads --config config.json --weights w.safetensors --batch batch.safetensors
//                  --mesh dp=2,tp=2 --sequence-parallel --out grads.safetensors
// CONFIG: Hugging Face GPT-2 keys (n_layer, n_head, n_embd, vocab_size, n_positions,
// layer_norm_epsilon). BATCH: int64 "inputs" and "targets" [B, T]. Loss: mean cross-entropy over
// the positions whose target is not -100 (PyTorch's ignore_index), no dropout. OUT: every parameter's full gradient under its name, in the
// weights' dtype, and "loss" as a scalar.
#include <fmt/core.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "command.hpp"
#include "launch.hpp"
#include "meshgrad/nn/layers.hpp"
#include "meshgrad/train/checkpoint.hpp"
#include "meshgrad/train/output_path.hpp"
#include "meshgrad/train/safetensors.hpp"
#include "meshgrad/train/trainer.hpp"

namespace meshgrad::tools {
namespace {

struct GradsArgs {
  std::string config, weights, batch, out;
  std::string mesh = "tp=1";
  std::string backend = "threads";
  std::string dtype;   // "" = the weights' dtype
  bool sequence_parallel = false;
};

// The batch file's int64 [B, T] tensor `name`.
Tensor read_batch_tensor(const train::SafetensorsFile& file, const std::string& name) {
  MG_CHECK(file.contains(name), "batch '{}': no tensor \"{}\" (expected int64 \"inputs\" and \"targets\" [B, T])",
           file.path(), name);
  Tensor t = file.get(name);
  MG_CHECK(t.dtype() == DType::Int64 && t.dim() == 2, "batch '{}': \"{}\" must be int64 [B, T], got {}", file.path(),
           name, t.str());
  return t;
}

int run(const GradsArgs& a) {
  // Before any work: --out must be writable and must not be one of the inputs.
  train::check_output_paths({{"--out", a.out}}, {{"--config", a.config}, {"--weights", a.weights}, {"--batch", a.batch}});
  nn::ModelConfig config = train::read_gpt2_config(a.config);
  const train::SafetensorsFile batch_file(a.batch);
  nn::Batch batch{read_batch_tensor(batch_file, "inputs"), read_batch_tensor(batch_file, "targets")};
  MG_CHECK(batch.inputs.shape() == batch.targets.shape(), "batch '{}': inputs {} and targets {} differ in shape",
           a.batch, batch.inputs.str(), batch.targets.str());
  config.batch = static_cast<int>(batch.inputs.size(0));
  config.seq = static_cast<int>(batch.inputs.size(1));
  MG_CHECK(config.seq <= config.n_positions(), "batch '{}': T = {} exceeds n_positions = {} of config '{}'", a.batch,
           config.seq, config.n_positions(), a.config);

  // Output dtype per parameter: the weights file's; the model computes in --dtype (default: wte's).
  const train::SafetensorsFile weights_file(a.weights);
  const DType weights_dtype = weights_file.entry("wte.weight").dtype;
  MG_CHECK(weights_dtype != DType::Int64, "weights '{}': wte.weight is int64, expected float32 or float64", a.weights);
  // Before any model of the config's size is allocated: a wrong n_positions or n_layer fails here.
  train::check_gpt2_config_against_weights(config, a.config, weights_file);
  config.dtype = a.dtype.empty() ? weights_dtype : parse_dtype(a.dtype);
  nn::ParallelConfig parallel;
  parallel.sequence_parallel = a.sequence_parallel;

  return run_on_backend(a.backend, mesh_world_size(a.mesh), [&](const comm::CommunicatorPtr& world) {
    const auto mesh = make_mesh(world, a.mesh);
    auto model = nn::make_model(config, parallel, mesh, 0);
    model->set_training(false);
    train::load_parameters(a.weights, model->parameters(), nn::tensor_parallel_group(*mesh));
    train::GradientDump dump = train::compute_gradients(*model, batch, mesh);
    if (mesh->rank() != 0) return;
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (auto& [name, grad] : dump.gradients) {
      const DType out = weights_file.contains(name) ? weights_file.entry(name).dtype : weights_dtype;
      tensors.emplace_back(name, grad.to(out));
    }
    tensors.emplace_back("loss", Tensor::scalar(dump.loss, weights_dtype));
    train::write_safetensors(a.out, tensors, {{"format", "pt"}, {"producer", "meshgrad grads"}, {"mesh", a.mesh}});
    fmt::print("loss {:.10g}; wrote {} gradients and the loss ({}) to {} (mesh {}, {}{})\n", dump.loss,
               dump.gradients.size(), dtype_name(weights_dtype), a.out, mesh->str(), world->backend(),
               a.sequence_parallel ? ", sequence-parallel" : "");
  });
}

}  // namespace

MESHGRAD_REGISTER_COMMAND(
    grads, {"", "grads", "Write the full gradient of every GPT-2 parameter for one batch (safetensors)",
            [](CLI::App& app) -> std::function<int()> {
              auto a = std::make_shared<GradsArgs>();
              app.add_option("--config", a->config, "Hugging Face GPT-2 config.json")->required();
              app.add_option("--weights", a->weights, "Full parameters (safetensors, GPT-2 names)")->required();
              app.add_option("--batch", a->batch, "int64 \"inputs\" and \"targets\" [B, T] (safetensors)")->required();
              app.add_option("--out", a->out, "Where to write the gradients (safetensors)")->required();
              app.add_option("--mesh", a->mesh, "Mesh axes dp and tp, e.g. tp=2, dp=2,tp=2 or tp=2x2 (2-D)")
                  ->capture_default_str();
              app.add_option("--backend", a->backend, "threads (rank threads) or mpi (under mpirun)")
                  ->check(CLI::IsMember({"threads", "mpi"}))
                  ->capture_default_str();
              app.add_option("--dtype", a->dtype, "Compute dtype (default: the weights' dtype)")
                  ->check(CLI::IsMember({"float32", "float64"}));
              app.add_flag("--sequence-parallel", a->sequence_parallel, "Sequence parallelism");
              return [a] { return run(*a); };
            }});

}  // namespace meshgrad::tools
