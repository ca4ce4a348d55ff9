// `meshgrad sample`: text from a trained GPT, streamed to stdout as it is generated, on any mesh.
//   meshgrad sample --checkpoint w.safetensors --prompt "The " --tokens 100
//   meshgrad sample --checkpoint gpt2/ --prompt "Hello" --tokens 40 --temperature 0 --mesh tp=2
//   mpirun -np 2 meshgrad sample --backend mpi --mesh tp=2 --checkpoint w.safetensors --prompt "The " --tokens 50
// The job lives in the library (generate/sample.hpp); this file parses options and prints.
#include <fmt/core.h>

#include <cstdio>
#include <memory>
#include <string>

#include "command.hpp"
#include "meshgrad/generate/sample.hpp"
#include "meshgrad/launch/launch.hpp"
#include "options.hpp"

namespace meshgrad::tools::cmd_sample {
namespace {

struct SampleArgs {
  std::string mesh = "tp=2";
  std::string backend = "threads";
  generate::SampleJob job;
};

int run(SampleArgs& a) {
  a.job.on_text = [](std::string_view text) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);   // streaming: each token as it is produced
  };
  const generate::SampleResult r = generate::run_sample_job(a.job, launch::mesh_runner(a.backend, a.mesh));
  if (!r.leader) return 0;   // another process (mpi) printed
  if (!r.text.empty() && r.text.back() != '\n') std::fputc('\n', stdout);
  std::fflush(stdout);
  if (!r.ignored_config.empty()) {
    fmt::print(stderr, "meshgrad sample: the model's sizes came from the {}; the config.json beside the file ('{}') "
               "was not read (a file's own description wins)\n", r.config_source, r.ignored_config);
  }
  if (r.context_full) {
    fmt::print(stderr,
               "meshgrad sample: stopped after {} of {} tokens: the context is full (n_positions = {}; the prompt is {} "
               "tokens). meshgrad does not slide the window.\n",
               r.new_tokens.size(), a.job.tokens, r.n_positions, r.prompt_tokens.size());
  }
  return 0;
}

}  // namespace

MESHGRAD_REGISTER_COMMAND(
    sample, {"", "sample", "Generate text from a trained GPT-2 or Llama-family model (streamed; greedy or temperature / top-k / top-p sampling)",
             [](CLI::App& app) -> std::function<int()> {
               auto a = std::make_shared<SampleArgs>();
               auto& j = a->job;
               app.add_option("--checkpoint", j.checkpoint,
                              "A safetensors file (from `meshgrad train --save`, whose metadata gives the sizes; another tool's "
                              "file with a config.json beside it), a Hugging Face directory (GPT-2, llama, qwen2, "
                              "mistral; config.json + model.safetensors or its shards) or a training checkpoint")
                   ->required();
               app.add_option("--prompt", j.prompt, "The text to continue (printed first)")->required();
               app.add_option("--tokens", j.tokens, "New tokens to generate (fewer when the context fills up)")
                   ->check(at_least(1))
                   ->required();
               app.add_option("--temperature", j.sampling.temperature,
                              "Softmax temperature; 0 = greedy (argmax, the same text on every mesh)")
                   ->capture_default_str();
               app.add_option("--top-k", j.sampling.top_k, "Draw only from the K most likely tokens (0 = all)")
                   ->check(at_least(0))
                   ->capture_default_str();
               app.add_option("--top-p", j.sampling.top_p,
                              "Nucleus sampling: draw only from the most likely tokens whose probabilities "
                              "reach P, as Hugging Face's top_p (1 = off)")
                   ->check(CLI::Range(0.0, 1.0))
                   ->capture_default_str();
               app.add_option("--seed", j.sampling.seed, "Seed of the draws: the same seed gives the same text")
                   ->check(at_least(0, UINT64_MAX))
                   ->capture_default_str();
               app.add_option("--tokenizer", j.tokenizer,
                              "Directory with vocab.json + merges.txt (or encoder.json + vocab.bpe), or a `meshgrad "
                              "prepare` output; default: bytes for a 256-token model, or the checkpoint directory's");
               app.add_flag("--tp-invariant", j.tp_invariant,
                            "Bitwise the same logits, and so the same text for a seed, at every tensor-parallel degree "
                            "that keeps the fixed reduction tree (docs/mesh-invariance.md)");
               app.add_option("--invariant-blocks", j.invariant_blocks,
                              "With --tp-invariant: fixed blocks per split dimension (a power of two; tp must divide it)")
                   ->check(at_least(1))
                   ->capture_default_str();
               app.add_option("--mesh", a->mesh, "Mesh axes dp, fsdp, cp and tp, e.g. tp=2, dp=2,tp=2, fsdp=2,tp=2 or tp=2x2 (2-D); cp ranks each decode the whole sequence")
                   ->capture_default_str();
               app.add_option("--backend", a->backend, "threads (rank threads) or mpi (under mpirun)")
                   ->check(CLI::IsMember({"threads", "mpi"}))
                   ->capture_default_str();
               return [a] { return run(*a); };
             }});

}  // namespace meshgrad::tools::cmd_sample
