// The meshgrad CLI is a set of commands, one file each (tools/cmd_*.cpp), that register themselves
// here at static-initialisation time; main.cpp builds the CLI11 app from the registry. Adding a
// command touches no other file. Each cmd_<name>.cpp keeps its code in namespace
// meshgrad::tools::cmd_<name>: the tools compile as unity batches (CMakeLists.txt, MESHGRAD_UNITY), where
// the file-local names of two commands would otherwise meet.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>

namespace meshgrad::tools {

// A command adds its options to `app` and returns the function that runs it (exit status).
// Option storage must outlive the call: capture a std::shared_ptr to it in the returned function.
using CommandSetup = std::function<std::function<int()>(CLI::App& app)>;

struct Command {
  std::string parent;       // "" for a top-level command, e.g. "bench" for `meshgrad bench matmul`
  std::string name;         // "train", "matmul", ...
  std::string description;  // one line for --help
  CommandSetup setup;
};

// Registers a command; returns true so it can initialise a static.
bool register_command(Command command);

}  // namespace meshgrad::tools

// In a cmd_*.cpp:  MESHGRAD_REGISTER_COMMAND(bench_matmul, {"bench", "matmul", "...", setup});
#define MESHGRAD_REGISTER_COMMAND(id, ...) \
  [[maybe_unused]] static const bool meshgrad_command_##id = ::meshgrad::tools::register_command(__VA_ARGS__)
