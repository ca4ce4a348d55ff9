// `--config FILE.json` for a command that declares the option: a JSON object whose keys are the
// command's long option names ("steps", "eval-every", "sequence-parallel"; a leading "--" is allowed)
// and whose values are what the option takes: a number or a string, true for a flag (false leaves
// it off), an array for an option with several values. Options on the command line override the
// file. Keys that are not options of the command, and values of other types, are refused naming the
// key and the file. The file is read with the bounded JSON reader (io/json_input.hpp).
//
// Expansion happens before parsing: the file's options are inserted after the command name, for
// every key the command line does not give itself, so CLI11 checks them like typed options.
#pragma once

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "meshgrad/tensor/error.hpp"
#include "meshgrad/io/file_io.hpp"
#include "meshgrad/io/json_input.hpp"

namespace meshgrad::tools {

// The option group a command puts its --config in to take a JSON file of its options.
inline constexpr const char* kJsonConfigGroup = "Configuration file";
// The option group of a --config that describes a training run (`meshgrad explain --config`): the
// recorded configuration of a run, read from a train --config file, a metrics file (its header line:
// "config" and "mesh") or a checkpoint directory (its manifest.json: "state"."config" and "mesh").
// The run's options that the command has are inserted as above (the command line still wins); the
// others (the optimizer's, the data's: what a training run has and the command does not) are left
// out, as are unset (null or empty) values.
inline constexpr const char* kRunConfigGroup = "Run configuration";

// The options object of a run configuration at `path` (see kRunConfigGroup), with the run's "mesh"
// added when the record has one and the options do not.
inline nlohmann::json read_run_configuration(const std::string& path) {
  const bool directory = std::filesystem::is_directory(path);
  const std::string file = directory ? path + "/manifest.json" : path;
  const std::string text = io::read_small_file(file, std::uint64_t{1} << 22, "--config");
  nlohmann::json j;
  try {
    j = io::parse_untrusted_json(text, /*max_depth=*/8);
  } catch (const std::exception&) {
    // A metrics file: JSON lines, the first of them the header.
    const std::string first = text.substr(0, text.find('\n'));
    try {
      j = io::parse_untrusted_json(first, /*max_depth=*/8);
    } catch (const std::exception& e) {
      throw InvalidArgument(fmt::format("--config '{}': neither a JSON object of options, a metrics file nor a "
                                        "checkpoint directory: {}", path, e.what()));
    }
  }
  MG_CHECK(j.is_object(), "--config '{}': the file must hold a JSON object", file);
  std::string mesh = j.contains("mesh") && j["mesh"].is_string() ? j["mesh"].get<std::string>() : "";
  if (j.contains("state") && j["state"].is_object() && j["state"].contains("config")) j = j["state"];   // a manifest
  if (j.contains("config") && j["config"].is_object()) j = j["config"];                                // a record
  MG_CHECK(j.is_object(), "--config '{}': the run's configuration is not a JSON object", file);
  if (!mesh.empty() && !j.contains("mesh")) j["mesh"] = mesh;
  return j;
}

inline std::vector<std::string> expand_json_config(std::vector<std::string> args, const CLI::App& app) {
  // Only a command whose --config is in the group kJsonConfigGroup takes a file of options (grads'
  // --config, say, is a model's config.json).
  if (args.size() < 2) return args;
  const auto found = app.get_subcommands([&](const CLI::App* c) { return c->get_name() == args[1]; });
  const CLI::App* command = found.empty() ? nullptr : found.front();
  const CLI::Option* config = command != nullptr ? command->get_option_no_throw("--config") : nullptr;
  if (config == nullptr) return args;
  const bool run_record = config->get_group() == kRunConfigGroup;
  if (config->get_group() != kJsonConfigGroup && !run_record) return args;
  std::size_t at = 0;
  std::string path;
  for (std::size_t i = 2; i < args.size(); ++i) {
    if (args[i] == "--config" && i + 1 < args.size()) {
      at = i;
      path = args[i + 1];
      args.erase(args.begin() + static_cast<std::ptrdiff_t>(i), args.begin() + static_cast<std::ptrdiff_t>(i) + 2);
      break;
    }
    if (args[i].rfind("--config=", 0) == 0) {
      at = i;
      path = args[i].substr(9);
      args.erase(args.begin() + static_cast<std::ptrdiff_t>(i));
      break;
    }
  }
  if (at == 0) return args;
  MG_CHECK(!path.empty(), "--config: the path is empty");
  nlohmann::json j;
  if (run_record) {
    j = read_run_configuration(path);
  } else {
    // A regular file of at most 1 MiB (a directory, a FIFO or /dev/zero is refused at once).
    const std::string text = io::read_small_file(path, std::uint64_t{1} << 20, "--config");
    try {
      j = io::parse_untrusted_json(text, /*max_depth=*/2);
    } catch (const std::exception& e) {
      throw InvalidArgument(fmt::format("--config '{}': not a JSON object of options: {}", path, e.what()));
    }
    MG_CHECK(j.is_object(), "--config '{}': the file must hold a JSON object {{\"option\": value, ...}}", path);
  }
  auto given = [&](const std::string& flag) {
    for (std::size_t i = 2; i < args.size(); ++i) {
      if (args[i] == flag || args[i].rfind(flag + "=", 0) == 0) return true;
    }
    return false;
  };
  auto scalar = [&](const std::string& key, const nlohmann::json& v) -> std::string {
    if (v.is_string()) return v.get<std::string>();
    if (v.is_number()) return v.dump();
    throw InvalidArgument(fmt::format("--config '{}': the value of {} must be a number, a string, true/false or an "
                                      "array of them, got {}", path, io::json_quote(key), io::json_excerpt(v)));
  };
  std::vector<std::string> inserted;
  for (const auto& [key, value] : j.items()) {
    const std::string flag = key.rfind("--", 0) == 0 ? key : "--" + key;
    const CLI::Option* option = command->get_option_no_throw(flag);
    if (run_record) {
      // The run's options the command does not have, unset values, and values that are the command's
      // default (a run records every option: a family's options at their defaults are not asked for)
      // are not the command's to take.
      if (option == nullptr || flag == "--config" || value.is_null() ||
          (value.is_string() && value.get<std::string>().empty()) || value.is_object()) {
        continue;
      }
      const std::string def = option->get_default_str();
      const bool on_by_default = def == "true" || def == "1";
      if (value.is_boolean() && value.get<bool>() == on_by_default) continue;   // a flag at its default
      if (!def.empty() && value.is_string() && value.get<std::string>() == def) continue;
      if (!def.empty() && value.is_number()) {
        char* end = nullptr;
        const double d = std::strtod(def.c_str(), &end);
        if (end != def.c_str() && *end == '\0' && d == value.get<double>()) continue;
      }
    }
    MG_CHECK(option != nullptr && flag != "--config", "--config '{}': {} is not an option of `meshgrad {}`", path,
             io::json_quote(key), args[1]);
    // --help in a file of options would print the help and run nothing, whatever else the file says.
    MG_CHECK(option != command->get_help_ptr() && option != command->get_help_all_ptr(),
             "--config '{}': {} is not an option a configuration file can give (it prints the help instead of "
             "running: use `meshgrad {} --help`)", path, io::json_quote(key), args[1]);
    if (given(flag)) continue;   // the command line wins
    const bool is_flag = option->get_expected_min() == 0 && option->get_expected_max() == 0;
    if (value.is_boolean()) {
      MG_CHECK(is_flag, "--config '{}': {} takes a value, not true/false", path, io::json_quote(key));
      // false leaves a flag out, except one whose default is true (--reshard-after-forward, which
      // declares its default): that one must turn off.
      if (value.get<bool>()) {
        inserted.push_back(flag);
      } else if (option->get_default_str() == "true" || option->get_default_str() == "1") {
        inserted.push_back(flag + "=false");
      }
      continue;
    }
    if (value.is_array() && value.empty()) continue;   // an empty list (--pp-layers []) is the option not given
    MG_CHECK(!is_flag, "--config '{}': {} is a flag: its value must be true or false, got {}", path,
             io::json_quote(key), io::json_excerpt(value));
    inserted.push_back(flag);
    if (value.is_array()) {
      for (const auto& v : value) inserted.push_back(scalar(key, v));
    } else {
      inserted.push_back(scalar(key, value));
    }
  }
  args.insert(args.begin() + 2, inserted.begin(), inserted.end());
  return args;
}

}  // namespace meshgrad::tools
