// The option table (train/option_table.hpp) and the run record made from it (run_config.hpp): every
// recorded entry is a key of the record and comes back on resume; the model's keys are
// interop::model_config_fields'; the invariance flags record and resume as the two booleans did.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "meshgrad/interop/checkpoint_model.hpp"
#include "meshgrad/train/option_table.hpp"
#include "meshgrad/train/run_config.hpp"

namespace meshgrad::train::test_option_table {
namespace {

// A value of the option other than the one in `o`, of its kind (a choice when it has choices).
nlohmann::json other_value(const TrainOption& t, const TrainOptions& o) {
  const nlohmann::json now = option_value(t, o);
  for (const std::string& c : t.choices) {
    if (c != now) return c;
  }
  switch (t.kind) {
    case OptionKind::Int:
    case OptionKind::Seed: return std::max<long long>(now.get<long long>() + 1, std::max(1LL, t.min));
    case OptionKind::Double: return 0.625;
    case OptionKind::Flag: return !now.get<bool>();
    case OptionKind::Text: return "some text";
    case OptionKind::Path: return "/some/path/" + t.name;
    case OptionKind::IntList: return nlohmann::json::array({2, 3});
  }
  return nullptr;
}

TEST(OptionTable, NamesAreUniqueAndAliasesNameAnEntry) {
  std::set<std::string> names;
  for (const TrainOption& t : train_option_table()) {
    EXPECT_TRUE(names.insert(t.name).second) << t.name << " is declared twice";
    if (t.is_alias()) {
      EXPECT_NO_THROW(train_option(t.alias_of)) << t.name;
    }
    EXPECT_FALSE(t.help.empty()) << t.name;
    EXPECT_NE(t.surfaces, 0u) << t.name << " is taken nowhere";
  }
  EXPECT_THROW(train_option("no-such-option"), InvalidArgument);
}

TEST(OptionTable, TheModelKeysAreTheCheckpointModelFields) {
  for (const interop::ModelConfigField& m : interop::model_config_fields()) {
    SCOPED_TRACE(m.name);
    ASSERT_NO_THROW(train_option(m.name));
    EXPECT_EQ(train_option(m.name).recorded, m.fixed_by_checkpoint ? Recorded::Fixed : Recorded::Kept);
  }
  // And back: every option a checkpoint fixes (the Llama family's included) is a field sample,
  // export and check read back from it (interop::checkpoint_model_config).
  const auto& fields = interop::model_config_fields();
  for (const TrainOption& t : train_option_table()) {
    if (t.recorded != Recorded::Fixed) continue;
    EXPECT_TRUE(std::any_of(fields.begin(), fields.end(), [&](const interop::ModelConfigField& m) { return m.name == t.name; }))
        << "--" << t.name << " is fixed by a checkpoint but not in interop::model_config_fields";
  }
}

TEST(OptionTable, EveryRecordedEntryIsInTheRecordAndComesBackOnResume) {
  TrainOptions given;
  given.model.vocab = 300;
  for (const TrainOption& t : train_option_table()) {
    if (t.recorded == Recorded::Kept && !(t.name == "tp-invariant" || t.name == "mesh-invariant")) {
      set_option_value(t, given, other_value(t, given));
    }
  }
  // A resume in place (the checkpoint's folder is the recorded --checkpoint-dir, an existing one)
  // takes every value, the output files included.
  const std::filesystem::path folder = std::filesystem::temp_directory_path() / "meshgrad_test_option_table";
  std::filesystem::create_directories(folder);
  given.checkpoint_dir = folder.string();
  const nlohmann::json record = run_config_json(given, given.model.vocab);
  const std::string checkpoint = (folder / "step_00000001").string();
  const TrainOptions resumed = resume_options(TrainOptions{}, record, checkpoint);
  int recorded = 0;
  for (const TrainOption& t : train_option_table()) {
    if (t.recorded == Recorded::No) {
      EXPECT_EQ(record.count(t.name), 0u) << t.name << " is not to be recorded";
      continue;
    }
    SCOPED_TRACE(t.name);
    ++recorded;
    EXPECT_EQ(record.count(t.name), 1u);
    if (t.recorded == Recorded::Kept) {
      EXPECT_EQ(option_value(t, resumed), option_value(t, given));
    }
  }
  EXPECT_GT(recorded, 40);
  std::filesystem::remove_all(folder);
}

TEST(OptionTable, TheInvarianceFlagsRecordAndResumeAsTwoBooleans) {
  const auto record_of = [](nn::Invariance mode) {
    TrainOptions o;
    o.parallel.invariance = mode;
    const nlohmann::json r = run_config_json(o, 256);
    return std::pair{r.at("tp-invariant").get<bool>(), r.at("mesh-invariant").get<bool>()};
  };
  EXPECT_EQ(record_of(nn::Invariance::None), std::pair(false, false));
  EXPECT_EQ(record_of(nn::Invariance::Tp), std::pair(true, false));
  EXPECT_EQ(record_of(nn::Invariance::Mesh), std::pair(false, true));   // as a run given --mesh-invariant alone
  // Read back by key: both true (a run given both flags before the enum) is the mesh mode.
  for (const auto& [tp, mesh, expected] : {std::tuple{false, false, nn::Invariance::None},
                                          std::tuple{true, false, nn::Invariance::Tp},
                                          std::tuple{false, true, nn::Invariance::Mesh},
                                          std::tuple{true, true, nn::Invariance::Mesh}}) {
    TrainOptions o;
    nlohmann::json r = run_config_json(o, 256);
    r["tp-invariant"] = tp;
    r["mesh-invariant"] = mesh;
    EXPECT_EQ(resume_options(o, r, "ck/step_00000001").parallel.invariance, expected) << tp << " " << mesh;
  }
  // A caller's --tp-invariant on a mesh-invariant checkpoint: the mesh mode, which holds the tp one.
  TrainOptions caller;
  caller.parallel.invariance = nn::Invariance::Tp;
  caller.given_options = {"tp-invariant"};
  nlohmann::json r = run_config_json(TrainOptions{}, 256);
  r["mesh-invariant"] = true;
  EXPECT_EQ(resume_options(caller, r, "ck/step_00000001").parallel.invariance, nn::Invariance::Mesh);
}

TEST(OptionTable, AnAliasIsGivenAsItsOption) {
  EXPECT_EQ(option_names("grad-accum"), (std::vector<std::string>{"grad-accum", "micro-batches"}));
  EXPECT_EQ(option_names("metrics"), (std::vector<std::string>{"metrics", "no-metrics"}));
}

}  // namespace
}  // namespace meshgrad::train::test_option_table
