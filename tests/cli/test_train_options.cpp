// `meshgrad train`'s options against the option table (train/option_table.hpp): every entry the
// command line takes is an option of the command that sets what the entry names, given on the
// command line and given in a --config file; and every option of the command is in the table. The
// command here is built as tools/cmd_train.cpp builds it (tools/train_options.hpp).
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "json_config.hpp"
#include "train_options.hpp"

namespace meshgrad::tools::test_train_options {
namespace {

struct Command {
  CLI::App app{"meshgrad"};
  CLI::App* train = nullptr;
  std::string mesh = train::train_option("mesh").surface_default;
  std::string backend = train::train_option("backend").surface_default;
  std::string config;
  train::TrainOptions options = command_line_defaults();
  Command() {
    train = app.add_subcommand("train");
    train->add_option("--config", config)->group(kJsonConfigGroup);
    add_train_options(*train, options, {{"mesh", &mesh}, {"backend", &backend}});
  }
  // The option's value after parsing: the held string, or the table's view of the options.
  nlohmann::json value(const train::TrainOption& t) const {
    if (t.name == "mesh") return mesh;
    if (t.name == "backend") return backend;
    return train::option_value(t, options);
  }
  void parse(std::vector<std::string> args) {
    args = expand_json_config(std::move(args), app);
    std::vector<std::string> reversed(args.rbegin(), args.rend() - 1);   // CLI11 takes them reversed, no argv[0]
    app.parse(reversed);
  }
};

// A value of the option other than its default, as a command line spells it ("" for a flag that
// turns on) and as JSON.
struct Sample {
  std::string text;
  nlohmann::json json;
};

Sample sample_for(const train::TrainOption& t, const nlohmann::json& initial) {
  using K = train::OptionKind;
  if (!t.choices.empty()) {
    for (const std::string& c : t.choices) {
      if (c != initial) return {c, c};
    }
  }
  switch (t.kind) {
    case K::Int:
    case K::Seed: {
      long long v = initial.get<long long>() + 1;
      if (v < t.min) v = t.min;
      return {std::to_string(v), v};
    }
    case K::Double: return {"0.625", 0.625};
    case K::Flag:
      // A flag on by default turns off (--config false); the others turn on.
      return initial == true ? Sample{"false", false} : Sample{"", true};
    case K::Text: return {"some text", "some text"};
    case K::Path: return {"some/path", "some/path"};
    case K::IntList: return {"2,3", nlohmann::json::array({2, 3})};
  }
  return {};
}

std::vector<std::string> command_line(const train::TrainOption& t, const Sample& s) {
  if (t.kind == train::OptionKind::Flag) return {"meshgrad", "train", "--" + t.name + (s.text.empty() ? "" : "=" + s.text)};
  return {"meshgrad", "train", "--" + t.name, s.text};
}

// Runs check(entry, command, its initial value, a sample of another) for every entry the command
// line takes, each on a fresh command; returns how many.
template <class Check>
int for_each_command_line_entry(Check check) {
  int checked = 0;
  for (const train::TrainOption& t : train::train_option_table()) {
    if (!t.on(train::kCommandLine)) continue;
    SCOPED_TRACE(t.name);
    Command c;
    const nlohmann::json initial = c.value(t);
    check(t, c, initial, sample_for(t, initial));
    ++checked;
  }
  return checked;
}

TEST(TrainOptions, EveryTableEntryIsAnOptionOfTheCommandLineThatSetsIt) {
  const int checked = for_each_command_line_entry([](const train::TrainOption& t, Command& c,
                                                     const nlohmann::json& initial, const Sample& s) {
    ASSERT_NO_THROW(c.parse(command_line(t, s)));
    EXPECT_NE(c.value(t), initial) << "--" << t.name << " " << s.text << " changed nothing it names";
    EXPECT_GE(c.train->count("--" + t.name), 1u);   // a list counts its values
  });
  EXPECT_GT(checked, 55);
}

TEST(TrainOptions, EveryTableEntryIsAKeyOfAConfigFile) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "meshgrad_test_train_options";
  std::filesystem::create_directories(dir);
  const std::string file = (dir / "config.json").string();
  for_each_command_line_entry([&](const train::TrainOption& t, Command& c, const nlohmann::json& initial,
                                  const Sample& s) {
    std::ofstream(file) << nlohmann::json{{t.name, s.json}}.dump();
    ASSERT_NO_THROW(c.parse({"meshgrad", "train", "--config", file}));
    EXPECT_NE(c.value(t), initial) << "--config {\"" << t.name << "\": " << s.json.dump() << "} changed nothing";
  });
  std::filesystem::remove_all(dir);
}

TEST(TrainOptions, EveryOptionOfTheCommandIsInTheTable) {
  Command c;
  std::vector<std::string> missing;
  for (const CLI::Option* opt : c.train->get_options()) {
    if (opt == c.train->get_help_ptr() || opt == c.train->get_help_all_ptr()) continue;
    const std::string name = opt->get_lnames().front();
    if (name == "config") continue;   // the file of the table's options, not one of them
    try {
      EXPECT_TRUE(train::train_option(name).on(train::kCommandLine)) << name;
    } catch (const std::exception&) {
      missing.push_back(name);
    }
  }
  EXPECT_EQ(missing, std::vector<std::string>{}) << "options of `meshgrad train` not in the table";
}

// The help shows each option's default from the TrainOptions the command starts from, not a copy.
TEST(TrainOptions, TheHelpShowsTheDefaultsTheCommandStartsFrom) {
  Command c;
  EXPECT_EQ(c.train->get_option("--steps")->get_default_str(), std::to_string(command_line_defaults().steps));
  EXPECT_EQ(c.train->get_option("--layers")->get_default_str(), std::to_string(command_line_defaults().model.layers));
  EXPECT_EQ(c.train->get_option("--mesh")->get_default_str(), train::train_option("mesh").surface_default);
  EXPECT_EQ(c.train->get_option("--dtype")->get_default_str(), "float32");
}

}  // namespace
}  // namespace meshgrad::tools::test_train_options
