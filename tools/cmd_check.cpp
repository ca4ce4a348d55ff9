// meshgrad check: the model on a mesh against the same model on one rank (same seed or the same
// training checkpoint, same data, K AdamW steps); per parameter the errors of the initial weights,
// the gradients and the weights' updates, the loss difference, the collectives of one step per
// phase, and the first parameter that diverges. Exit status 1 above tolerance (diag/equivalence.hpp
// states and justifies the tolerances).
#include <fmt/core.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <memory>

#include "command.hpp"
#include "model_options.hpp"
#include "options.hpp"
#include "meshgrad/launch/launch.hpp"
#include "meshgrad/diag/equivalence.hpp"

namespace meshgrad::tools::cmd_check {
namespace {

struct CheckArgs {
  diag::EquivalenceOptions options;
  std::string dtype = "float64";
  bool recompute = false;
  std::string checkpoint;   // as given (a checkpoint directory or a --checkpoint-dir root)
  std::string fault;        // --inject-fault
  // The model options by their saved-configuration names, to tell which the user set (a checkpoint
  // refuses differing sizes).
  std::map<std::string, CLI::Option*> model_options;
  FamilyOptions family;   // the Llama family's options and --model-config
};

// The model from --checkpoint: its saved sizes, refusing given ones that differ.
void use_checkpoint(CheckArgs& a) {
  MG_CHECK(a.family.model_config.empty(), "check: --checkpoint and --model-config both give the model: give one");
  std::vector<std::string> given;
  for (const auto& options : {&a.model_options, &a.family.options}) {
    for (const auto& [name, option] : *options) {
      if (option->count() > 0) given.push_back(name);
    }
  }
  const diag::CheckpointModel c = diag::checkpoint_check_config(a.checkpoint, a.options.model, given);
  a.options.model = c.model;
  a.options.checkpoint = c.dir;
  a.dtype = std::string(dtype_name(c.model.dtype));
}

void print_parameters(const diag::EquivalenceReport& report) {
  const diag::Tolerances& t = report.tolerance;
  fmt::print("tolerances (diag/equivalence.hpp): initial weights {:.0e}, gradients {:.0e} (relative to max |w0|, max "
             "|g| per parameter); weight updates {:.0e} of lr x steps, {:.1f} for floor elements (|g| <= {:.0e} x max "
             "|g|); losses {:.0e}\n\n",
             t.init, t.grad, t.update, t.floor_update, t.floor, t.loss);
  fmt::print("{:<28} {:>10} {:>10} {:>10} {:>10} {:>10} {:>13}  {}\n", "parameter", "init rel", "grad abs", "grad rel",
             "update", "floor upd", "floor elems", "");
  for (const auto& p : report.parameters) {
    fmt::print("{:<28} {:>10.2e} {:>10.2e} {:>10.2e} {:>10.2e} {:>10.2e} {:>6}/{:<6}  {}\n", p.name, p.init_max_rel,
               p.grad_max_abs, p.grad_max_rel, p.update_max_rel, p.floor_update_max_rel, p.floor_elements, p.elements,
               p.passed ? "ok" : "DIVERGES");
  }
}

int run_check(CheckArgs& a) {
  diag::EquivalenceOptions& o = a.options;
  o.model.dtype = parse_dtype(a.dtype);
  if (!a.checkpoint.empty()) {
    // The Llama options given are compared with the checkpoint's like the sizes.
    for (const interop::ModelConfigField& field : interop::model_config_fields()) {
      if (is_family_field(field)) field.set(o.model, field.get(a.family.bound.model));
    }
    use_checkpoint(a);
  } else {
    o.model = family_model("check", o.model, a.family, a.model_options);
  }
  o.parallel.recompute_allgather = a.recompute;
  MG_CHECK(!a.recompute || o.parallel.sequence_parallel,
           "check: --regather re-gathers the sequence-parallel input in backward; it needs --sequence-parallel");
  const diag::CommFault fault = diag::parse_comm_fault(a.fault);
  diag::check_fault_axis(fault, o.mesh);
  diag::FaultCount fired{0};
  const diag::EquivalenceReport report = diag::check_equivalence(o, [&](const auto& fn) {
    launch::run_on_backend(o.backend, o.backend == "mpi" ? 0 : dist::mesh_world_size(o.mesh), [&](const comm::CommunicatorPtr& world) {
      fn(launch::make_mesh(diag::with_comm_fault(world, fault, &fired), o.mesh));
    });
  });
  if (!report.compared) return 0;   // an mpi rank other than 0: rank 0 prints the verdict and sets the exit status
  fmt::print("meshgrad check: {} ({} layers, hidden {}, heads {}{}, vocab {}, seq {}, batch {}) {} on mesh {}{}{}{}, "
             "{} steps of {} micro-batches, {}\n",
             o.model.kind, o.model.layers, o.model.hidden, o.model.heads,
             o.model.kind == "llama" ? fmt::format(", kv heads {}, head dim {}", o.model.kv_head_count(), o.model.head_size())
                                     : std::string(),
             o.model.vocab, o.model.seq, o.model.batch,
             o.precision == "bf16" ? a.dtype + " with bf16 products" : a.dtype, dist::mesh_spec(dist::parse_mesh(o.mesh)), o.parallel.sequence_parallel ? ", sequence-parallel" : "",
             o.parallel.overlap ? ", overlap" : "", a.recompute ? ", regather" : "", o.steps, o.micro_batches, o.backend);
  if (!o.checkpoint.empty()) fmt::print("both models start from checkpoint {}\n", o.checkpoint);
  if (o.mesh_seed != 0) fmt::print("injected: the mesh model starts from seed {}\n", o.mesh_seed);
  if (!a.fault.empty()) fmt::print("injected fault: {} (changed {} reductions on this process's ranks)\n", a.fault, fired.load());
  if (o.parallel.mesh_invariant()) {
    fmt::print("mesh-invariant mode: {} row blocks of the batch, {} blocks per split dimension\n",
               o.parallel.batch_blocks, o.parallel.invariant_blocks);
  } else if (o.parallel.tp_invariant()) {
    fmt::print("tp-invariant mode, {} blocks per split dimension\n", o.parallel.invariant_blocks);
  }
  print_parameters(report);
  fmt::print("\nloss per step (reference / mesh):");
  for (std::size_t i = 0; i < report.reference_losses.size(); ++i) {
    fmt::print(" {:.10f}/{:.10f}", report.reference_losses[i], report.mesh_losses[i]);
  }
  fmt::print("\nmax relative loss difference: {:.3e} (tolerance {:.0e})\n", report.max_loss_difference,
             report.tolerance.loss);
  fmt::print("\ncollectives of one step on rank 0:\n");
  for (const auto& [phase, ops] : report.collectives) {
    for (const auto& [op, cell] : ops) fmt::print("  {:<10} {:<22} {:>4} calls {:>12} bytes\n", phase, op, cell.first, cell.second);
  }
  if (report.collectives.empty()) fmt::print("  none (a single rank)\n");
  if (!report.first_divergence.empty()) fmt::print("\nfirst parameter that diverges: {}\n", report.first_divergence);
  if (!report.non_finite.empty()) {
    // The reference's first, then the mesh's; losses before parameters (forward order).
    const std::size_t shown = std::min<std::size_t>(report.non_finite.size(), 6);
    fmt::print("\nFAIL: not finite (NaN or infinite): {}{}\n",
               fmt::join(report.non_finite.begin(), report.non_finite.begin() + static_cast<std::ptrdiff_t>(shown), "; "),
               shown < report.non_finite.size() ? fmt::format("; and {} more", report.non_finite.size() - shown) : "");
    return 1;
  }
  if (!a.fault.empty() && fired.load() == 0) {
    // The fault changed nothing, so a pass would say nothing about the checker.
    fmt::print("\nFAIL: the injected fault {} never fired: no backward reduction ran on axis '{}'\n", a.fault, fault.axis);
    return 1;
  }
  if (o.parallel.tp_invariant()) {
    const char* mode = nn::invariance_option(o.parallel.invariance);
    // Both sides run the tree: anything but zero difference is a failure, however small.
    bool bitwise = report.max_loss_difference == 0;
    for (const auto& p : report.parameters) {
      bitwise = bitwise && p.init_max_rel == 0 && p.grad_max_abs == 0 && p.update_max_rel == 0 &&
                p.floor_update_max_rel == 0;
    }
    fmt::print("\n{}: {}: {}\n", bitwise ? "PASS" : "FAIL", mode,
               bitwise ? "losses, gradients and weights are bitwise those of the single rank"
                       : "the mesh model differs from the single rank in some bit");
    return bitwise ? 0 : 1;
  }
  fmt::print("\nlargest error / tolerance: {:.3g}\n", report.margin);
  fmt::print("\n{}\n", report.passed ? "PASS: the mesh model matches the single-rank model"
                                     : "FAIL: the mesh model differs from the single-rank model");
  return report.passed ? 0 : 1;
}

CommandSetup setup = [](CLI::App& app) {
  auto a = std::make_shared<CheckArgs>();
  auto& o = a->options;
  o.model.kind = "gpt";
  o.model.layers = 2;
  o.model.hidden = 32;
  o.model.heads = 4;
  o.model.vocab = 97;
  o.model.seq = 16;
  o.model.batch = 4;
  auto& given = a->model_options;
  given["model"] = app.add_option("--model", o.model.kind, "gpt, llama or mlp")->check(CLI::IsMember({"gpt", "llama", "mlp"}))->capture_default_str();
  app.add_option("--mesh", o.mesh, "mesh axes pp, dp, fsdp, ep, cp and tp, e.g. tp=2, dp=2,tp=2, pp=2,tp=2, cp=2,tp=2 or tp=2x2 (2-D)")->capture_default_str();
  app.add_option("--backend", o.backend, "threads or mpi")->check(CLI::IsMember({"threads", "mpi"}))->capture_default_str();
  given["layers"] = app.add_option("--layers", o.model.layers, "blocks / MLP layers")->check(at_least(1))->capture_default_str();
  given["hidden"] = app.add_option("--hidden", o.model.hidden, "width")->check(at_least(1))->capture_default_str();
  given["ffn"] = app.add_option("--ffn", o.model.ffn, "feed-forward width (0 = 4 x hidden)")->check(at_least(0))->capture_default_str();
  given["heads"] = app.add_option("--heads", o.model.heads, "attention heads")->check(at_least(1))->capture_default_str();
  given["vocab"] = app.add_option("--vocab", o.model.vocab, "vocabulary size")->check(at_least(1))->capture_default_str();
  given["seq"] = app.add_option("--seq", o.model.seq, "sequence length")->check(at_least(1))->capture_default_str();
  given["batch"] = app.add_option("--batch", o.model.batch, "global batch rows")->check(at_least(1))->capture_default_str();
  add_family_options(app, a->family);
  app.add_option("--steps", o.steps, "optimizer steps")->check(at_least(1))->capture_default_str();
  app.add_option("--lr", o.lr, "AdamW learning rate")->capture_default_str();
  app.add_option("--seed", o.seed, "initialisation and data seed")->check(at_least(0, UINT64_MAX))->capture_default_str();
  app.add_flag("--sequence-parallel", o.parallel.sequence_parallel, "sequence-parallel (reduce-scatter) mode");
  app.add_flag("--overlap", o.parallel.overlap, "overlap backward communication with compute");
  app.add_flag("--regather", a->recompute, "keep only the input shard and re-gather it in backward (with SP)");
  app.add_flag("--checkpoint-blocks", o.parallel.checkpoint_blocks, "activation checkpointing per block");
  app.add_option("--micro-batches", o.micro_batches,
                 "micro-batches per step on the mesh and in the single-rank reference (a pipeline's, with pp=P)")
      ->check(at_least(1))
      ->capture_default_str();
  app.add_option("--pp-layers", o.parallel.pp_layers, "with pp=P: blocks per stage, e.g. 1,1")
      ->delimiter(',')
      ->check(each_count("1,1"));
  add_tp_invariant_flag(app, o.parallel,
               "TP-invariant mode on both sides: the mesh must match the single rank bit for bit (docs/mesh-invariance.md)");
  app.add_option("--invariant-blocks", o.parallel.invariant_blocks, "with --tp-invariant: fixed blocks per split "
                 "dimension (a power of two)")->capture_default_str();
  add_mesh_invariant_options(app, o.parallel);
  given["dtype"] = app.add_option("--dtype", a->dtype, "float32 or float64")->check(CLI::IsMember({"float32", "float64"}))->capture_default_str();
  app.add_option("--precision", o.precision, "float32, or bf16 (train's --precision: bf16 inputs to the products, "
                 "float32 accumulation) on both sides, held to the bf16 tolerances (diag/equivalence.hpp)")
      ->check(CLI::IsMember({"float32", "bf16"}))
      ->capture_default_str();
  app.add_option("--checkpoint", a->checkpoint,
                 "a training checkpoint (DIR/step_XXXXXXXX, or DIR from `train --checkpoint-dir DIR` for its newest): "
                 "check that model, from its parameters and with its sizes");
  app.add_option("--mesh-seed", o.mesh_seed, "for testing the checker: the mesh model starts from this seed instead "
                 "(0 = the reference's start); the check must fail")->check(at_least(0, UINT64_MAX));
  app.add_option("--inject-fault", a->fault, "for testing the checker: drop:AXIS, double:AXIS or scale:AXIS:FACTOR "
                 "changes every backward reduction on the mesh axis; the check must fail");
  return [a, sub = &app] {
    // As train's notes (docs/training.md): a mode's setting given without its mode changes nothing.
    if (sub->count("--batch-blocks") > 0 && !a->options.parallel.mesh_invariant()) {
      fmt::print(stderr, "meshgrad check: note: --batch-blocks {} changes nothing without --mesh-invariant\n",
                 a->options.parallel.batch_blocks);
    }
    if (sub->count("--invariant-blocks") > 0 && !a->options.parallel.tp_invariant()) {
      fmt::print(stderr, "meshgrad check: note: --invariant-blocks {} changes nothing without --tp-invariant or "
                 "--mesh-invariant\n", a->options.parallel.invariant_blocks);
    }
    return run_check(*a);
  };
};

MESHGRAD_REGISTER_COMMAND(check, {"", "check", "compare the model on a mesh with the same model on one rank", setup});

}  // namespace
}  // namespace meshgrad::tools::cmd_check
