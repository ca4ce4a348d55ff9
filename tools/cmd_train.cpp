// `meshgrad train`: the main job. Trains a GPT on prepared GPT-2 BPE tokens, an llm.c token file or
// the bytes of a text file (or the built-in corpus) on a dp x tp mesh with AdamW, showing progress
// on stderr and writing metrics as JSON lines.
//   meshgrad train                                   tp=2 rank threads, about a minute on 2 cores
//   meshgrad train --mesh dp=2,tp=2 --steps 100 --data book.txt --metrics run.jsonl
//   mpirun -np 2 meshgrad train --backend mpi --mesh tp=2
// The job lives in the library (launch/jobs.hpp, train/trainer.hpp); this file parses options.
#include <fmt/core.h>

#include <memory>
#include <string>

#include "command.hpp"
#include "json_config.hpp"
#include "meshgrad/checkpoint/directory.hpp"
#include "meshgrad/launch/jobs.hpp"
#include "meshgrad/launch/launch.hpp"
#include "options.hpp"
#include "train_options.hpp"
#include "version.hpp"

namespace meshgrad::tools::cmd_train {
namespace {

struct TrainArgs {
  // The options the run's TrainOptions does not hold (train/option_table.hpp: SurfaceHeld).
  std::string mesh = train::train_option("mesh").surface_default;
  std::string backend = train::train_option("backend").surface_default;
  std::string config;   // --config: expanded by main before parsing; never set here
  train::TrainOptions options = command_line_defaults();
};

// The checks and the loop are the library's (launch::run_train_job), shared with the Python module.
int run(TrainArgs& a, const CLI::App& app) {
  a.options.provenance = {{"meshgrad_version", program_version()}, {"git_commit", program_git_commit()},
                          {"backend", a.backend}};
  // Options the user gave (on the command line or in --config): on --resume they override the
  // checkpoint's configuration, the others come from it.
  for (const CLI::Option* opt : app.get_options()) {
    if (opt->count() > 0) {
      for (const std::string& name : opt->get_lnames()) a.options.given_options.insert(name);
    }
  }
  a.options.handle_signals = true;   // SIGTERM / Ctrl-C: checkpoint and exit 0 (with --checkpoint-dir)
  std::string mesh = a.mesh;
  if (!a.options.resume.empty() && a.options.given_options.count("mesh") == 0) {
    // The checkpoint's mesh, unless another one is asked for (any mesh loads it).
    const checkpoint::Manifest manifest = checkpoint::read_manifest(checkpoint::resolve_checkpoint(a.options.resume));
    mesh = manifest.state.value("mesh", a.mesh);
  }
  launch::run_train_job(a.options, launch::mesh_runner(a.backend, mesh));
  return 0;
}

}  // namespace

MESHGRAD_REGISTER_COMMAND(
    train, {"", "train", "Train a GPT (GPT-2 BPE tokens from `meshgrad prepare`, or bytes) on a dp x tp mesh (AdamW, progress bar, JSON-lines metrics)",
            [](CLI::App& app) -> std::function<int()> {
              auto a = std::make_shared<TrainArgs>();
              auto& o = a->options;
              // Expanded before parsing (json_config.hpp); declared here for --help and the check. Not in
              // the option table: it is the command line's file of the table's options, not one of them.
              app.add_option("--config", a->config, "JSON file of options, e.g. {\"steps\": 100, \"mesh\": "
                             "\"tp=2\", \"sequence-parallel\": true}; the command line overrides it")
                  ->group(kJsonConfigGroup);
              add_train_options(app, o, {{"mesh", &a->mesh}, {"backend", &a->backend}});
              // An unset $DATA must not silently train on the built-in corpus.
              app.get_option("--data")->check(CLI::Validator(
                  [](const std::string& v) {
                    return v.empty() ? std::string("the path is empty (omit --data for the built-in corpus)")
                                     : std::string();
                  },
                  "PATH"));
              return [a, sub = &app] {
                // --init-from: sizes not on the command line come from its config.json (0 = the file's).
                if (!a->options.init_from.empty()) {
                  for (auto [option, field] : {std::pair{"--layers", &a->options.model.layers},
                                               std::pair{"--hidden", &a->options.model.hidden},
                                               std::pair{"--heads", &a->options.model.heads}}) {
                    if (sub->count(option) == 0) *field = 0;
                  }
                }
                return run(*a, *sub);
              };
            }});

}  // namespace meshgrad::tools::cmd_train
