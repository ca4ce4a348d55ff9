// meshgrad: the command-line tool. Commands live in tools/cmd_*.cpp and register themselves.
#include <fmt/core.h>

#include <exception>
#include <map>
#include <memory>
#include <vector>

#include "command.hpp"
#include "meshgrad/tensor/error.hpp"

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

}  // namespace meshgrad::tools

int main(int argc, char** argv) {
  using namespace meshgrad::tools;
  CLI::App app{"meshgrad: tensor-parallel training with exact gradients"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show help for every command");

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

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    for (auto& [sub, run] : runners) {
      if (sub->parsed()) return run();
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "meshgrad: error: {}\n", e.what());
    return 1;
  }
  fmt::print(stderr, "meshgrad: no command given (see --help)\n");
  return 2;
}
