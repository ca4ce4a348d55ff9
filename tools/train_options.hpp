// `meshgrad train`'s command-line options, generated from train::train_option_table(): one CLI11
// option per entry the command line takes, with the entry's help, group and checks, and the
// default shown from the TrainOptions it binds (command_line_defaults()). --config files name the
// same options (json_config.hpp reads a file by the command's options), so they follow.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <variant>

#include "meshgrad/tensor/error.hpp"
#include "meshgrad/train/option_table.hpp"
#include "options.hpp"

namespace meshgrad::tools {

// The options `meshgrad train` starts from: a model and a run sized to finish in about a minute on
// a 2-core machine with the loss clearly falling, and a metrics file; everything else the library's
// defaults (train::TrainOptions).
inline train::TrainOptions command_line_defaults() {
  train::TrainOptions o;
  o.model.kind = "gpt";
  o.model.vocab = 0;   // from the data: 256 for bytes, meta.json or the token range for tokens
  o.model.layers = 4;
  o.model.hidden = 128;
  o.model.heads = 4;
  o.model.seq = 64;
  o.model.batch = 16;
  o.steps = 1000;
  o.lr = 3e-3;
  o.metrics_path = "meshgrad-metrics.jsonl";
  return o;
}

// The entry's checks on the command line (option_table.hpp: min, max, minus_one, choices).
inline void add_train_option_checks(CLI::Option* opt, const train::TrainOption& t) {
  if (!t.choices.empty()) opt->check(CLI::IsMember(t.choices));
  if (t.min == train::TrainOption::kNoMinimum) return;
  const auto min = static_cast<unsigned long long>(t.min);
  if (t.kind == train::OptionKind::IntList) {
    opt->delimiter(',')->check(each_count(t.example.c_str(), min));
  } else if (!t.minus_one.empty()) {
    opt->check(at_least_or_minus_one(min, t.minus_one.c_str()));
  } else {
    opt->check(at_least(min, t.max != 0 ? t.max : t.kind == train::OptionKind::Seed ? UINT64_MAX : INT_MAX));
  }
}

// The default the help shows: the bound value, a text with control characters as JSON ("\n").
inline void show_train_option_default(CLI::Option* opt, const std::string& value) {
  const bool plain = std::none_of(value.begin(), value.end(), [](char c) { return static_cast<unsigned char>(c) < 0x20; });
  opt->default_str(plain ? value : nlohmann::json(value).dump());
}

// One entry as a CLI11 option bound into `o` (SurfaceHeld entries into held[name]).
inline CLI::Option* add_train_option(CLI::App& app, const train::TrainOption& t, train::TrainOptions& o,
                                     const std::map<std::string, std::string*>& held) {
  const std::string flag = "--" + t.name;
  CLI::Option* opt = std::visit(
      [&](const auto& field) -> CLI::Option* {
        using F = std::decay_t<decltype(field)>;
        if constexpr (std::is_same_v<F, train::SurfaceHeld>) {
          const auto it = held.find(t.name);
          MG_CHECK(it != held.end(), "meshgrad train: {} is declared in the option table but the command binds it to "
                   "nothing", flag);
          return app.add_option(flag, *it->second, t.help)->capture_default_str();
        } else if constexpr (std::is_same_v<F, train::FlagAdapter>) {
          return app.add_flag_callback(flag, [&o, set = field.set] { set(o, true); }, t.help);
        } else if constexpr (std::is_same_v<F, train::TextAdapter>) {
          CLI::Option* added = app.add_option_function<std::string>(
              flag, [&o, set = field.set](const std::string& v) { set(o, v); }, t.help);
          return added->default_str(field.get(o));
        } else if constexpr (std::is_same_v<F, train::OptionMember<bool>>) {
          bool& value = field(o);
          // A flag on by default is turned off as --no-NAME; its declared default lets a --config false
          // turn it off (json_config.hpp).
          if (value) return app.add_flag(flag + ",!--no-" + t.name, value, t.help)->default_str("true");
          return app.add_flag(flag, value, t.help);
        } else {
          return app.add_option(flag, field(o), t.help);
        }
      },
      t.field);
  add_train_option_checks(opt, t);
  const bool shows_default = t.kind != train::OptionKind::Flag && t.kind != train::OptionKind::IntList && !t.is_alias();
  if (shows_default && !std::holds_alternative<train::SurfaceHeld>(t.field)) {
    const nlohmann::json value = train::option_value(t, o);
    show_train_option_default(opt, value.is_string() ? value.get<std::string>() : value.dump());
  }
  if (t.is_alias()) opt->excludes(app.get_option("--" + t.alias_of));
  if (!t.group.empty()) opt->group(t.group);
  return opt;
}

// Every entry of the table the command line takes, in the table's order.
inline void add_train_options(CLI::App& app, train::TrainOptions& o, const std::map<std::string, std::string*>& held) {
  for (const train::TrainOption& t : train::train_option_table()) {
    if (t.on(train::kCommandLine)) add_train_option(app, t, o, held);
  }
}

}  // namespace meshgrad::tools
