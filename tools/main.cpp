// meshgrad: the command-line tool. Commands live in tools/cmd_*.cpp and register themselves.
#include <fmt/core.h>

#include <cstdlib>
#include <unistd.h>
#include <exception>
#include <map>
#include <memory>
#include <vector>

#include "command.hpp"
#include "json_config.hpp"
#include "meshgrad/launch/launch.hpp"
#include "meshgrad/tensor/error.hpp"
#include "version.hpp"

namespace meshgrad::tools {
namespace {
std::vector<Command>& registry() {
  static std::vector<Command> commands;
  return commands;
}
}  // namespace

bool register_command(Command command) {
  registry().push_back(std::move(command));
  return true;
}

namespace {

// A value as the ranks compare it: numbers by value ("3e-3" and "0.003" agree), the rest as text.
std::string normalized(const std::string& text) {
  if (text.empty()) return text;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  return end == text.c_str() + text.size() ? fmt::format("{:.17g}", v) : text;
}

// The parsed configuration of command `sub` (e.g. `bench collectives`), for the start-up agreement
// of MPI ranks: the command, the binary's version, every option's effective value (given, else its
// default), and the environment variables that change the communication protocol.
std::vector<launch::OptionValue> parsed_options(const CLI::App& sub, const std::string& version) {
  std::string command = sub.get_name();
  for (const CLI::App* p = sub.get_parent(); p != nullptr && p->get_parent() != nullptr; p = p->get_parent()) {
    command = p->get_name() + " " + command;
  }
  std::vector<launch::OptionValue> out{{"command", command}, {"meshgrad version", version}};
  for (const CLI::Option* opt : sub.get_options()) {
    if (opt->get_name() == "--help" || opt->get_name() == "--help-all") continue;
    std::string value;
    if (opt->count() > 0) {
      for (const std::string& r : opt->results()) value += (value.empty() ? "" : " ") + normalized(r);
    } else {
      value = normalized(opt->get_default_str());
    }
    out.push_back({opt->get_name(), value});
  }
  const char* debug = std::getenv("MESHGRAD_COMM_DEBUG");
  out.push_back({"environment variable MESHGRAD_COMM_DEBUG", debug != nullptr ? debug : ""});
  return out;
}

}  // namespace

}  // namespace meshgrad::tools

namespace {

// oneDNN runs its products on GNU OpenMP's threads, which by default spin for a while after each
// parallel region. Between a rank's products (its elementwise work, attention, the optimizer) that
// spinning takes the core the rank's own worker threads need: measured 13-16% of the tokens/s of a
// one-rank nanoGPT-sized step on 2 cores, in float32 and in bf16. libgomp reads its wait policy once,
// when it is loaded (before main), so the process sets OMP_WAIT_POLICY=passive and starts itself
// again, unless the user chose a policy (OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment).
// The banner's compute line names the policy (blas::idle_wait_policy). If the exec fails the run
// goes on with the default policy.
void start_again_with_passive_openmp_threads(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr || std::getenv("GOMP_SPINCOUNT") != nullptr) return;
  if (::setenv("OMP_WAIT_POLICY", "passive", 1) != 0) return;
  ::execv("/proc/self/exe", argv);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace meshgrad::tools;
  start_again_with_passive_openmp_threads(argv);
  meshgrad::launch::reserve_memory_for_out_of_memory_errors();
  CLI::App app{"meshgrad: tensor-parallel training with exact gradients"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show help for every command");
  const std::string version = fmt::format("meshgrad {} (git {})", program_version(), program_git_commit());
  app.set_version_flag("--version", version);

  std::map<std::string, CLI::App*> groups;  // parent name -> its CLI11 subcommand
  std::vector<std::pair<CLI::App*, std::function<int()>>> runners;
  for (auto& command : registry()) {
    CLI::App* parent = &app;
    if (!command.parent.empty()) {
      auto it = groups.find(command.parent);
      if (it == groups.end()) {
        CLI::App* group = app.add_subcommand(command.parent, command.parent + " commands");
        group->require_subcommand(1);
        it = groups.emplace(command.parent, group).first;
      }
      parent = it->second;
    }
    CLI::App* sub = parent->add_subcommand(command.name, command.description);
    runners.emplace_back(sub, command.setup(*sub));
  }

  // `--config FILE.json` is expanded into the command's own options first (json_config.hpp).
  std::vector<std::string> args(argv, argv + argc);
  try {
    args = expand_json_config(std::move(args), app);
  } catch (const std::exception& e) {
    fmt::print(stderr, "meshgrad: error: {}\n", e.what());
    return 1;
  }
  std::vector<char*> expanded;
  for (std::string& a : args) expanded.push_back(a.data());
  try {
    app.parse(static_cast<int>(expanded.size()), expanded.data());
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    for (auto& [sub, run] : runners) {
      if (!sub->parsed()) continue;
      meshgrad::launch::set_launch_options(parsed_options(*sub, version));
      return run();
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "meshgrad: error: {}\n", meshgrad::launch::error_message(e));
    return 1;
  }
  fmt::print(stderr, "meshgrad: no command given (see --help)\n");
  return 2;
}
