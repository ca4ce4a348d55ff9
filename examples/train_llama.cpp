// A small Llama-family model (grouped-query attention, RoPE, RMSNorm, SwiGLU, an untied head) read
// from a Hugging Face config.json and trained on meshgrad's built-in corpus on a tp=2 mesh with
// sequence parallelism, through the library's train job. A new model family is a module tree plus
// a tensor-parallel plan (docs/DESIGN.md); the job, the mesh and the trainer are GPT-2's.
// Exit status 0 when every step's loss was finite and the loss fell.
#include <fmt/core.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "meshgrad/interop/hf_config.hpp"
#include "meshgrad/launch/jobs.hpp"
#include "meshgrad/launch/launch.hpp"

using namespace meshgrad;

// What a Llama checkpoint's config.json says, at a size that trains in seconds.
const char* kConfig = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
  "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
  "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64, "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0, "rope_scaling": null, "tie_word_embeddings": false})";

int main() {
  try {
    const std::filesystem::path path = std::filesystem::temp_directory_path() / "meshgrad_example_llama_config.json";
    std::ofstream(path) << kConfig;
    train::TrainOptions options;
    options.model = interop::read_hf_config(path.string());
    std::filesystem::remove(path);
    options.model.seq = 16;
    options.model.batch = 8;
    options.parallel.sequence_parallel = true;
    options.steps = 40;
    options.progress = false;
    bool finite = true;
    options.on_step = [&finite](const train::StepMetrics& m) {
      finite = finite && std::isfinite(m.loss);
      if (m.step % 10 == 0 || m.step == 1) fmt::print("step {:3d}  loss {:.4f}\n", m.step, m.loss);
    };
    const train::TrainResult result = launch::run_train_job(options, launch::mesh_runner("threads", "tp=2"));
    const bool fell = result.end_loss() < result.start_loss() - 0.1;
    fmt::print("{} ({} layers, {} heads over {} key/value heads): loss {:.4f} -> {:.4f}\n", options.model.kind,
               options.model.layers, options.model.heads, options.model.kv_head_count(), result.start_loss(),
               result.end_loss());
    fmt::print("{}\n", finite && fell ? "PASS" : "FAIL");
    return finite && fell ? 0 : 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "train_llama: error: {}\n", e.what());
    return 1;
  }
}
