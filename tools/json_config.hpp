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

#include <cstdint>
#include <string>
#include <vector>

#include "meshgrad/tensor/error.hpp"
#include "meshgrad/io/file_io.hpp"
#include "meshgrad/io/json_input.hpp"

namespace meshgrad::tools {

// The option group a command puts its --config in to take a JSON file of its options.
inline constexpr const char* kJsonConfigGroup = "Configuration file";

inline std::vector<std::string> expand_json_config(std::vector<std::string> args, const CLI::App& app) {
  // Only a command whose --config is in the group kJsonConfigGroup takes a file of options (grads'
  // --config, say, is a model's config.json).
  if (args.size() < 2) return args;
  const auto found = app.get_subcommands([&](const CLI::App* c) { return c->get_name() == args[1]; });
  const CLI::App* command = found.empty() ? nullptr : found.front();
  const CLI::Option* config = command != nullptr ? command->get_option_no_throw("--config") : nullptr;
  if (config == nullptr || config->get_group() != kJsonConfigGroup) return args;
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
  // A regular file of at most 1 MiB (a directory, a FIFO or /dev/zero is refused at once).
  const std::string text = io::read_small_file(path, std::uint64_t{1} << 20, "--config");
  nlohmann::json j;
  try {
    j = io::parse_untrusted_json(text, /*max_depth=*/2);
  } catch (const std::exception& e) {
    throw InvalidArgument(fmt::format("--config '{}': not a JSON object of options: {}", path, e.what()));
  }
  MG_CHECK(j.is_object(), "--config '{}': the file must hold a JSON object {{\"option\": value, ...}}", path);
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
