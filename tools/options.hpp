// Range checks for integer options, with messages that say what is wrong: CLI11's PositiveNumber
// says "Value 0 not in range 0.000000 to 1.8e308" and lets a negative seed wrap into an unsigned one.
//   app.add_option("--steps", steps, "...")->check(at_least(1));   // "--steps: must be >= 1, got 0"
#pragma once

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include <charconv>
#include <climits>
#include <cstdint>
#include <string>

#include "meshgrad/nn/model.hpp"
#include "meshgrad/train/option_table.hpp"

namespace meshgrad::tools {

// Accepts an integer in [min, max] written in decimal digits (no sign: negative values are refused
// before CLI11 converts them, so "-1" never wraps into an unsigned option). max is the option's
// type's largest value: INT_MAX for int options (the default), UINT64_MAX for seeds.
inline CLI::Validator at_least(unsigned long long min, unsigned long long max = INT_MAX) {
  return CLI::Validator(
      [min, max](std::string& text) -> std::string {
        unsigned long long value = 0;
        const char* last = text.data() + text.size();
        const auto [end, ec] = std::from_chars(text.data(), last, value);
        if (text.empty() || text[0] == '-' || text[0] == '+' || end != last || ec == std::errc::invalid_argument) {
          return fmt::format("must be an integer >= {}, got '{}'", min, text);
        }
        if (ec == std::errc() && value < min) return fmt::format("must be >= {}, got {}", min, text);
        if (ec == std::errc::result_out_of_range || value > max) return fmt::format("must be <= {}, got {}", max, text);
        return "";
      },
      fmt::format("INT>={}", min));
}

// at_least(min) (an int option), or exactly -1: the option's "left out" value, whose `meaning` the
// message gives ("--decay-steps: must be -1 (the rest of the run) or an integer in [1, 2147483647]").
inline CLI::Validator at_least_or_minus_one(unsigned long long min, const char* meaning) {
  const CLI::Validator range = at_least(min);
  return CLI::Validator(
      [range, min, meaning](std::string& text) -> std::string {
        if (text == "-1" || range(text).empty()) return "";
        return fmt::format("must be -1 ({}) or an integer in [{}, {}], got '{}'", meaning, min, INT_MAX, text);
      },
      fmt::format("-1|INT>={}", min));
}

// Each item of a comma-separated list of counts (--pp-layers, bench pipeline's --stages and --micro):
// at_least(min, max), and an empty list (`--pp-layers ''`) named as empty, where CLI11 would read it
// as 0.
inline CLI::Validator each_count(const char* example, unsigned long long min = 1, unsigned long long max = INT_MAX) {
  const CLI::Validator each = at_least(min, max);
  return CLI::Validator(
      [each, example, min](std::string& text) -> std::string {
        if (text.empty()) return fmt::format("an empty count in the list: give integers >= {}, e.g. {}", min, example);
        return each(text);
      },
      fmt::format("INT>={},...", min));
}

// --tp-invariant: asks for nn::Invariance::Tp (a --mesh-invariant given too wins: it holds Tp's
// tree). `--tp-invariant=false` asks for nothing.
inline CLI::Option* add_tp_invariant_flag(CLI::App& app, nn::ParallelConfig& parallel, const std::string& help) {
  return app.add_flag_callback("--tp-invariant", [&parallel] { parallel.require(nn::Invariance::Tp); }, help);
}

// --mesh-invariant, --batch-blocks and --sequence-blocks for `meshgrad check` (train's come from the option table,
// train_options.hpp), with the table's help: the mode's contract is nn::ParallelConfig::invariance's
// (docs/mesh-invariance.md).
inline void add_mesh_invariant_options(CLI::App& app, nn::ParallelConfig& parallel) {
  app.add_flag_callback("--mesh-invariant", [&parallel] { parallel.require(nn::Invariance::Mesh); },
                        train::train_option("mesh-invariant").help);
  app.add_option("--batch-blocks", parallel.batch_blocks, train::train_option("batch-blocks").help)
      ->check(at_least(1))
      ->capture_default_str();
  app.add_option("--sequence-blocks", parallel.sequence_blocks, train::train_option("sequence-blocks").help)
      ->check(at_least(1))
      ->capture_default_str();
}

}  // namespace meshgrad::tools
