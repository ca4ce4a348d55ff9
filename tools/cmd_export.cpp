// `meshgrad export`: a checkpoint as a Hugging Face directory, GPT-2 or the Llama family (interop/hf_io.hpp).
//   meshgrad export --checkpoint w.safetensors --out gpt2-mine [--dtype bfloat16] [--tokenizer DIR]
// writes gpt2-mine/config.json, model.safetensors and, when the run's data was BPE, the tokenizer
// files; transformers loads it with AutoModelForCausalLM.from_pretrained("gpt2-mine").
#include <fmt/core.h>

#include <memory>
#include <string>

#include "command.hpp"
#include "meshgrad/interop/hf_io.hpp"

namespace meshgrad::tools::cmd_export {
namespace {

int run_export(const interop::ExportOptions& o) {
  const interop::ExportResult r = interop::export_hf(o);
  std::string files;
  for (const auto& f : r.files) files += (files.empty() ? "" : ", ") + f;
  fmt::print("wrote {} ({} parameters, {}): {}\n", o.out_dir, r.parameters, o.dtype, files);
  if (!r.tokenizer.empty()) fmt::print("tokenizer from {}\n", r.tokenizer);
  if (!r.note.empty()) fmt::print(stderr, "meshgrad export: no tokenizer files written: {}\n", r.note);
  return 0;
}

}  // namespace

MESHGRAD_REGISTER_COMMAND(
    export, {"", "export", "Write a checkpoint as a Hugging Face directory (config.json, model.safetensors, tokenizer)",
             [](CLI::App& app) -> std::function<int()> {
               auto o = std::make_shared<interop::ExportOptions>();
               app.add_option("--checkpoint", o->checkpoint, "Parameters written by `meshgrad train --save`, a --checkpoint-dir checkpoint or a Hugging Face directory")->required();
               app.add_option("--out", o->out_dir, "The directory to write (must not exist, or be empty)")->required();
               app.add_option("--dtype", o->dtype, "Storage dtype of the weights")
                   ->check(CLI::IsMember({"float32", "float16", "bfloat16"}))
                   ->capture_default_str();
               app.add_option("--tokenizer", o->tokenizer, "Directory with vocab.json + merges.txt (default: the "
                              "prepared data the checkpoint was trained on)");
               app.add_option("--config", o->config, "The model's config.json, for a checkpoint without gpt2_config / "
                              "hf_config metadata (default: the checkpoint's)");
               return [o] { return run_export(*o); };
             }});

}  // namespace meshgrad::tools::cmd_export
