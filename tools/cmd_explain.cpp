// `meshgrad explain`: for each layer of a tensor-parallel model, the collectives its forward and
// backward issue (op, mesh axis, bytes) and the time an alpha-beta model predicts for them on a link.
// The counts come from running the model once (diag/explain.hpp); this file parses options and prints.
//   meshgrad explain --rules      the one communication rule (distributed/rule.hpp) as a table
//   meshgrad explain --model gpt --mesh tp=4
//   meshgrad explain --model gpt --mesh dp=2,tp=2 --sequence-parallel --link ib-ndr --format json
//   meshgrad explain --model mlp --mesh tp=2 --alpha-us 5 --beta-gbs 25
//   meshgrad explain --config meshgrad-metrics.jsonl --link ib-ndr   (a training run: its metrics or checkpoint)
//   meshgrad explain --mesh tp=2 --link measured     (alpha and beta fitted to all-reduces timed on the run's ranks)
//   mpirun -np 2 meshgrad explain --mesh tp=2 --link measured --backend mpi   (the MPI world's link; rank 0 prints)
#include <fmt/core.h>

#include <map>
#include <memory>
#include <optional>
#include <string>

#include "command.hpp"
#include "json_config.hpp"
#include "model_options.hpp"
#include "options.hpp"
#include "meshgrad/distributed/cost_model.hpp"
#include "meshgrad/launch/launch.hpp"
#include "meshgrad/distributed/rule.hpp"
#include "meshgrad/diag/explain.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad::tools::cmd_explain {
namespace {

struct ExplainArgs {
  nn::ModelConfig config;   // small defaults (nn::ModelConfig): runs in well under a second
  nn::ParallelConfig parallel;
  std::string mesh = "tp=2";
  std::string link = "nvlink4";       // a preset, or "measured"
  std::string link_fallback;           // --link-fallback: the preset of a measured link on a 1-rank mesh
  std::string backend = "threads";     // where --link measured probes
  double alpha_us = 0, beta_gbs = 0;   // used when custom_link is set
  bool custom_link = false;            // --alpha-us and --beta-gbs were given (CLI11: both or neither)
  bool rules = false;                  // print the rule table instead
  std::string format = "table";
  std::string run_config;              // --config: expanded into the options before parsing (json_config.hpp)
  diag::ExplainPipeline pipeline;
  std::string schedule = "1f1b";
  FamilyOptions family;                        // the Llama family's options and --model-config
  std::map<std::string, CLI::Option*> given;   // the model options by name, to tell which were given
};

// --link measured: the link the run's ranks have, timed and fitted (diag::measure_mesh_link) on the
// backend the run uses; a mesh of one rank has none and is refused, or costed on --link-fallback's
// preset when the user asked for one. nullopt: an MPI process without mesh rank 0 (rank 0 prints).
std::optional<dist::Link> measured_explain_link(const ExplainArgs& a, const std::vector<dist::MeshAxis>& axes) {
  int world = 1;
  for (const auto& axis : axes) world *= axis.size;
  if (world < 2) {
    if (a.link_fallback.empty()) {
      throw InvalidArgument(fmt::format(
          "explain: --link measured times all-reduces between the run's ranks, but the mesh {} has 1 rank: there is "
          "no link to measure. Give a mesh of 2 or more ranks, a named link (--link shm, nvlink4 or ib-ndr) or "
          "--alpha-us/--beta-gbs, or add --link-fallback NAME to cost on that preset when there is nothing to measure",
          dist::mesh_spec(axes)));
    }
    dist::Link link = dist::link_preset(a.link_fallback);
    link.source = fmt::format("--link-fallback {}: --link measured had nothing to measure on the 1-rank mesh {}; {}",
                              a.link_fallback, dist::mesh_spec(axes), link.source);
    return link;
  }
  return diag::measure_mesh_link(launch::mesh_runner(a.backend, a.mesh));
}

int run_explain(ExplainArgs& a) {
  // --alpha-us/--beta-gbs need each other and exclude --link (CLI11 checks that); either gives the link.
  const bool measured = !a.custom_link && a.link == "measured";
  MG_CHECK(a.link_fallback.empty() || measured, "explain: --link-fallback {} is the preset of --link measured on a "
           "1-rank mesh; without --link measured give the link itself (--link {})", a.link_fallback, a.link_fallback);
  if (!a.link_fallback.empty()) (void)dist::link_preset(a.link_fallback);   // a wrong name fails before anything runs
  dist::Link link = a.custom_link ? dist::custom_link(a.alpha_us, a.beta_gbs)
                    : measured    ? dist::Link{}
                                  : dist::link_preset(a.link);
  if (a.rules) {
    fmt::print("The one rule: the backward of every communication step, from the placement of the gradient that\n"
               "arrives (R replicated, P partial, S(d) shard; distributed/rule.hpp)\n\n{}",
               dist::format_rule_table());
    return 0;
  }
  a.config = family_model("explain", a.config, a.family, a.given);
  const std::vector<dist::MeshAxis> axes = dist::parse_mesh(a.mesh);
  if (measured) {
    std::optional<dist::Link> fitted = measured_explain_link(a, axes);
    if (!fitted) return 0;
    link = std::move(*fitted);
  }
  diag::ExplainPipeline pipe = a.pipeline;
  pipe.schedule = pipeline::parse_schedule(a.schedule);
  const std::vector<diag::ExplainRow> rows = diag::explain_model(a.config, a.parallel, axes, link, pipe);
  if (a.format == "json") {
    fmt::print("{}", diag::format_explain_json(rows, link));
  } else {
    fmt::print("{}", diag::format_explain_table(rows, {a.config, a.parallel, axes, link, pipe}));
  }
  return 0;
}

MESHGRAD_REGISTER_COMMAND(explain, {"", "explain",
    "Per layer, the collectives a tensor-parallel model's forward and backward issue and their predicted time",
    [](CLI::App& app) -> std::function<int()> {
      auto a = std::make_shared<ExplainArgs>();
      nn::ModelConfig& c = a->config;
      auto& given = a->given;
      given["model"] = app.add_option("--model", c.kind, "mlp, gpt or llama")->check(CLI::IsMember({"mlp", "gpt", "llama"}))
          ->capture_default_str();
      given["layers"] = app.add_option("--layers", c.layers, "blocks (n_layer)")->check(at_least(1))->capture_default_str();
      given["hidden"] = app.add_option("--hidden", c.hidden, "hidden size (n_embd)")->check(at_least(1))->capture_default_str();
      given["ffn"] = app.add_option("--ffn", c.ffn, "feed-forward size (0 = 4 x hidden)")->check(at_least(0))
          ->capture_default_str();
      given["heads"] = app.add_option("--heads", c.heads, "attention heads (gpt, llama)")->check(at_least(1))->capture_default_str();
      given["vocab"] = app.add_option("--vocab", c.vocab, "vocabulary size")->check(at_least(1))->capture_default_str();
      add_family_options(app, a->family);
      app.add_option("--seq", c.seq, "sequence length T")->check(at_least(1))->capture_default_str();
      app.add_option("--batch", c.batch, "global batch B (split over dp)")->check(at_least(1))
          ->capture_default_str();
      app.add_option("--mesh", a->mesh, "mesh, e.g. tp=4, dp=2,tp=2, pp=2,tp=2 or tp=2x2 (missing axes have size 1)")
          ->capture_default_str();
      app.add_flag("--sequence-parallel", a->parallel.sequence_parallel,
                   "sequence parallelism: all-gather / reduce-scatter along the sequence instead of all-reduce");
      app.add_flag("--overlap", a->parallel.overlap,
                   "column layers overlap their backward communication with compute (same collectives)");
      app.add_flag("--regather", a->parallel.recompute_allgather,
                   "with --sequence-parallel: re-gather column inputs in backward (adds backward all-gathers)");
      app.add_option("--config", a->run_config,
                     "A training run to describe: its metrics file, a checkpoint directory or a train --config JSON "
                     "file; the run's model, mesh and parallel options that explain has are taken from it (the "
                     "command line wins), the others (optimizer, data) are not explain's")
          ->group(kRunConfigGroup);
      app.add_flag("--rules", a->rules, "print the one communication rule (forward step x arriving gradient -> "
                   "backward) and exit");
      app.add_flag("--checkpoint-blocks", a->parallel.checkpoint_blocks,
                   "activation checkpointing per block (adds a recompute phase)");
      app.add_option_function<std::string>(
             "--cp-schedule", [a](const std::string& v) { a->parallel.cp_ring = v == "ring"; },
             "with cp=C: ring (keys and values passed rank to rank, the default) or all-gather (train's --cp-schedule)")
          ->check(CLI::IsMember({"ring", "all-gather"}));
      app.add_option_function<std::string>(
             "--reduce-dtype",
             [a](const std::string& v) { a->parallel.reduce_dtype = v == "bf16" ? DType::BFloat16 : DType::Float32; },
             "float32 or bf16: the gradients' element type over the data-parallel axes (train's --reduce-dtype)")
          ->check(CLI::IsMember({"float32", "bf16"}));
      app.add_option("--micro-batches", a->pipeline.micro_batches,
                     "with pp=P in --mesh: micro-batches of the pipeline step")
          ->check(at_least(1))
          ->capture_default_str();
      app.add_option("--pp-layers", a->parallel.pp_layers, "with pp=P: blocks per stage, e.g. 3,1")
          ->delimiter(',')
          ->check(each_count("3,1"));
      app.add_option("--pp-schedule", a->schedule, "with pp=P: 1f1b or gpipe")
          ->check(CLI::IsMember({"1f1b", "gpipe"}))
          ->capture_default_str();
      std::string presets;
      for (const auto& link : dist::link_presets()) presets += (presets.empty() ? "" : ", ") + link.name;
      auto* link = app.add_option("--link", a->link,
                                  "link preset: " + presets + "; or measured: alpha and beta fitted to all-reduces "
                                  "timed on the run's ranks (--backend), printed with the fit")
                       ->capture_default_str();
      app.add_option("--link-fallback", a->link_fallback,
                     "with --link measured: the preset to cost on when the mesh has 1 rank (nothing to measure; "
                     "refused without it)");
      app.add_option("--backend", a->backend,
                     "where --link measured probes: threads (rank threads in this process) or mpi (under mpirun: "
                     "the MPI world, rank 0 prints); the counting runs on rank threads either way")
          ->check(CLI::IsMember({"threads", "mpi"}))
          ->capture_default_str();
      auto* alpha = app.add_option("--alpha-us", a->alpha_us, "custom link: latency per step, microseconds");
      auto* beta = app.add_option("--beta-gbs", a->beta_gbs, "custom link: bandwidth per rank, GB/s");
      alpha->needs(beta)->excludes(link);
      beta->needs(alpha)->excludes(link);
      app.add_option("--format", a->format, "table or json")->check(CLI::IsMember({"table", "json"}))
          ->capture_default_str();
      return [a, alpha] {
        a->custom_link = alpha->count() > 0;
        return run_explain(*a);
      };
    }});

}  // namespace
}  // namespace meshgrad::tools::cmd_explain
