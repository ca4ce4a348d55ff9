// `meshgrad checkpoint list|info|verify`: what a checkpoint directory holds, and whether every byte
// of it is what its manifest says (checkpoint/store.hpp).
//   meshgrad checkpoint list ck                 the committed checkpoints under a --checkpoint-dir
//   meshgrad checkpoint info ck/step_00000100   step, mesh, configuration, tensors and files
//   meshgrad checkpoint verify ck               every file and piece against its SHA-256 (the newest)
#include <fmt/core.h>

#include <chrono>
#include <memory>
#include <string>

#include "command.hpp"
#include "meshgrad/checkpoint/directory.hpp"
#include "meshgrad/checkpoint/verify.hpp"

namespace meshgrad::tools::cmd_checkpoint {
namespace {

struct CheckpointArgs {
  std::string action;
  std::string path;
};

int run_checkpoint(const CheckpointArgs& a) {
  if (a.action == "list") {
    const std::vector<std::string> all = checkpoint::list_checkpoints(a.path);
    if (all.empty()) throw checkpoint::CheckpointError(fmt::format("'{}' holds no committed checkpoint", a.path));
    for (const std::string& dir : all) {
      const checkpoint::Manifest m = checkpoint::read_manifest(dir);
      std::uint64_t bytes = 0;
      for (const auto& f : m.files) bytes += f.bytes;
      // In the order they were committed: the last is what --resume DIR takes.
      fmt::print("{}  step {}  commit {}  mesh {}  {:.1f} MB in {} files{}\n", dir, m.step, m.commit, m.mesh,
                 static_cast<double>(bytes) / 1e6, m.files.size(), dir == all.back() ? "  (newest: --resume takes it)" : "");
    }
    return 0;
  }
  const std::string dir = checkpoint::resolve_checkpoint(a.path);
  if (a.action == "verify") {
    const auto t0 = std::chrono::steady_clock::now();
    const std::uint64_t bytes = checkpoint::verify_checkpoint(dir);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    fmt::print("{}: OK, {} bytes match their SHA-256 ({:.0f} MB/s)\n", dir, bytes, static_cast<double>(bytes) / 1e6 / std::max(s, 1e-9));
    return 0;
  }
  const checkpoint::Manifest m = checkpoint::read_manifest(dir);
  fmt::print("checkpoint {}\nstep {} written on {}, commit {} of its directory\n", dir, m.step, m.mesh, m.commit);
  if (m.state.contains("config")) fmt::print("configuration: {}\n", m.state["config"].dump());
  for (const auto& f : m.files) fmt::print("file {}  {} bytes  sha256 {}\n", f.name, f.bytes, f.sha256);
  for (const auto& t : m.tensors) fmt::print("tensor {}  {} {}  {} pieces\n", t.name, dtype_name(t.dtype), shape_str(t.shape), t.pieces.size());
  return 0;
}

}  // namespace

MESHGRAD_REGISTER_COMMAND(checkpoint, {"", "checkpoint", "List, describe or verify sharded training checkpoints",
    [](CLI::App& app) -> std::function<int()> {
      auto a = std::make_shared<CheckpointArgs>();
      app.add_option("ACTION", a->action, "list, info or verify")->required()->check(CLI::IsMember({"list", "info", "verify"}));
      app.add_option("PATH", a->path, "a checkpoint directory step_XXXXXXXX, or a --checkpoint-dir (its newest)")->required();
      return [a] { return run_checkpoint(*a); };
    }});

}  // namespace meshgrad::tools::cmd_checkpoint
