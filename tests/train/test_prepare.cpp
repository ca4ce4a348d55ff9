// `meshgrad prepare` (prepare_dataset): the llm.c files hold the inputs' GPT-2 tokens split by token
// count, meta.json describes them with SHA-256 of the tokenizer files, nothing is left half-written,
// bad inputs are refused before any output; and `train --data DIR` trains on the result.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "meshgrad/comm/threads.hpp"
#include "meshgrad/text/tokenizer.hpp"
#include "meshgrad/data/dataset.hpp"
#include "meshgrad/io/sha256.hpp"
#include "meshgrad/data/prepare.hpp"
#include "meshgrad/train/trainer.hpp"
#include "text/gpt2_test_files.hpp"

namespace meshgrad::train::test_prepare {
namespace {

namespace fs = std::filesystem;
using meshgrad::testing::gpt2_files_present;
using meshgrad::testing::gpt2_merges;
using meshgrad::testing::gpt2_vocab;

fs::path fresh_dir(const std::string& name) { return meshgrad::testing::fresh_temp_dir("prepare_" + name); }
std::string slurp(const fs::path& p) { return meshgrad::testing::file_bytes(p); }

// The tokens of an llm.c file, read by hand (header checked here too).
std::vector<text::TokenId> read_llmc(const fs::path& p) {
  const std::string bytes = slurp(p);
  EXPECT_GE(bytes.size(), 1024u) << p;
  std::int32_t header[3];
  std::memcpy(header, bytes.data(), sizeof header);
  EXPECT_EQ(header[0], 20240520) << p;
  EXPECT_EQ(header[1], 1) << p;
  EXPECT_EQ(bytes.size(), 1024u + 2u * static_cast<std::size_t>(header[2])) << p;
  std::vector<text::TokenId> out(static_cast<std::size_t>(header[2]));
  for (std::size_t i = 0; i < out.size(); ++i) {
    std::uint16_t t;
    std::memcpy(&t, bytes.data() + 1024 + 2 * i, 2);
    out[i] = t;
  }
  return out;
}

TEST(Prepare, WritesTheTokensSplitByCountWithMetadata) {
  ASSERT_TRUE(gpt2_files_present());
  const fs::path d = fresh_dir("ok");
  const std::string a = slurp(fs::path(MESHGRAD_SOURCE_DIR) / "README.md");
  const std::string b = "Ünïcödé text: 日本語 👋 and numbers 12345.\n";
  { std::ofstream(d / "a.txt", std::ios::binary) << a; }
  { std::ofstream(d / "b.txt", std::ios::binary) << b; }
  data::PrepareOptions o;
  o.vocab = gpt2_vocab();
  o.merges = gpt2_merges();
  o.out_dir = (d / "out").string();
  o.val_fraction = 0.25;
  o.inputs = {(d / "a.txt").string(), (d / "b.txt").string()};
  std::int64_t last_done = -1, calls = 0;
  o.progress = [&](std::int64_t done, std::int64_t total) {
    EXPECT_GE(done, last_done);
    EXPECT_EQ(total, static_cast<std::int64_t>(a.size() + b.size()));
    last_done = done;
    ++calls;
  };
  const data::PrepareResult r = data::prepare_dataset(o);
  EXPECT_EQ(last_done, static_cast<std::int64_t>(a.size() + b.size()));
  EXPECT_GE(calls, 3);

  // Expected: <|endoftext|> before each input, then its tokens (the tokenizer is checked against the
  // reference encoder in test_text).
  text::Tokenizer tok = text::Tokenizer::from_files(gpt2_vocab(), gpt2_merges());
  std::vector<text::TokenId> all = {50256};
  tok.encode(a, all);
  const std::size_t a_tokens = all.size();
  all.push_back(50256);
  tok.encode(b, all);
  const auto n_val = static_cast<std::size_t>(std::floor(static_cast<double>(all.size()) * 0.25));
  std::vector<text::TokenId> train = read_llmc(d / "out" / "train.bin"), val = read_llmc(d / "out" / "val.bin");
  EXPECT_EQ(val.size(), n_val);
  EXPECT_EQ(r.train_tokens, static_cast<std::int64_t>(all.size() - n_val));
  EXPECT_EQ(r.val_tokens, static_cast<std::int64_t>(n_val));
  train.insert(train.end(), val.begin(), val.end());
  EXPECT_EQ(train, all) << "train.bin + val.bin are the tokens of the inputs, val the last quarter";

  const nlohmann::json meta = nlohmann::json::parse(slurp(d / "out" / "meta.json"));
  EXPECT_EQ(meta["vocab_size"], 50257);
  EXPECT_EQ(meta["eot_token"], 50256);
  EXPECT_EQ(meta["train_tokens"], r.train_tokens);
  EXPECT_EQ(meta["val_tokens"], r.val_tokens);
  ASSERT_EQ(meta["sources"].size(), 2u);
  EXPECT_EQ(meta["sources"][0]["bytes"], a.size());
  EXPECT_EQ(meta["sources"][0]["tokens"], a_tokens);
  EXPECT_EQ(meta["sources"][1]["file"], fs::absolute(d / "b.txt").string());
  EXPECT_EQ(meta["tokenizer"]["vocab"]["sha256"], io::sha256_file(gpt2_vocab()));
  EXPECT_EQ(meta["tokenizer"]["merges"]["sha256"], io::sha256_file(gpt2_merges()));
  // The directory decodes its own tokens (copies of the tokenizer files) and has no temporaries left.
  EXPECT_EQ(text::Tokenizer::from_directory((d / "out").string()).decode({all.begin() + 1, all.begin() + static_cast<std::ptrdiff_t>(a_tokens)}), a);
  for (const auto& entry : fs::directory_iterator(d / "out")) {
    EXPECT_NE(entry.path().filename().string().front(), '.') << "left behind: " << entry.path();
  }
  // The data loader takes the directory: vocabulary from meta.json, validation from val.bin.
  const data::TokenDataset data((d / "out").string(), 2, 16, 0);
  EXPECT_EQ(data.vocab(), 50257);
  EXPECT_EQ(data.size(), r.train_tokens);
  EXPECT_TRUE(data.has_validation());
  fs::remove_all(d);
}

TEST(Prepare, Sha256MatchesTheStandardTestVector) {
  const fs::path d = fresh_dir("sha");
  { std::ofstream(d / "abc") << "abc"; }
  // FIPS 180-2 appendix B.1.
  EXPECT_EQ(io::sha256_file((d / "abc").string()), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  fs::remove_all(d);
}

std::string prepare_error(data::PrepareOptions o) {
  try {
    data::prepare_dataset(o);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  ADD_FAILURE() << "prepare accepted the options";
  return "";
}

TEST(Prepare, BadInputsAreRefusedBeforeAnyOutput) {
  ASSERT_TRUE(gpt2_files_present());
  const fs::path d = fresh_dir("bad");
  { std::ofstream(d / "text.txt") << "some text\n"; }
  { std::ofstream(d / "empty.txt"); }
  data::PrepareOptions o;
  o.vocab = gpt2_vocab();
  o.merges = gpt2_merges();
  o.out_dir = (d / "out").string();
  o.inputs = {(d / "text.txt").string()};

  auto with = [&](auto change) {
    data::PrepareOptions c = o;
    change(c);
    return prepare_error(c);
  };
  std::string m = with([](data::PrepareOptions& c) { c.val_fraction = 1.0; });
  EXPECT_NE(m.find("--val-fraction must be in [0, 1), got 1"), std::string::npos) << m;
  m = with([](data::PrepareOptions& c) { c.val_fraction = -0.1; });
  EXPECT_NE(m.find("--val-fraction"), std::string::npos) << m;
  m = with([](data::PrepareOptions& c) { c.val_fraction = std::nan(""); });
  EXPECT_NE(m.find("--val-fraction"), std::string::npos) << m;
  m = with([](data::PrepareOptions& c) { c.inputs.clear(); });
  EXPECT_NE(m.find("no input files"), std::string::npos) << m;
  m = with([&](data::PrepareOptions& c) { c.inputs = {(d / "empty.txt").string()}; });
  EXPECT_NE(m.find("all empty"), std::string::npos) << m;
  m = with([&](data::PrepareOptions& c) { c.inputs.push_back((d / "missing.txt").string()); });
  EXPECT_NE(m.find("missing.txt' cannot be opened for reading"), std::string::npos) << m;
  m = with([&](data::PrepareOptions& c) { c.inputs.push_back(d.string()); });
  EXPECT_NE(m.find("is a directory"), std::string::npos) << m;
  m = with([&](data::PrepareOptions& c) { c.inputs.push_back("/dev/zero"); });
  EXPECT_NE(m.find("'/dev/zero' is a character device"), std::string::npos) << m;
  m = with([&](data::PrepareOptions& c) { c.out_dir = (d / "text.txt").string(); });
  EXPECT_NE(m.find("exists and is not a directory"), std::string::npos) << m;
  m = with([&](data::PrepareOptions& c) { c.merges = (d / "text.txt").string(); });
  EXPECT_NE(m.find("text.txt' line 1"), std::string::npos) << m;

  // A vocabulary with an id beyond uint16: every byte symbol plus one id 70000.
  nlohmann::json big = nlohmann::json::parse(slurp(gpt2_vocab()));
  big["zzzz"] = 70000;
  { std::ofstream(d / "big.json") << big.dump(); }
  m = with([&](data::PrepareOptions& c) { c.vocab = (d / "big.json").string(); });
  EXPECT_NE(m.find("has 70001 ids"), std::string::npos) << m;

  EXPECT_FALSE(fs::exists(d / "out")) << "nothing is written when the options are refused";
  fs::remove_all(d);
}

// The README prepared with the GPT-2 tokenizer into d/out (the source text is d/a.txt).
data::PrepareOptions prepare_readme(const fs::path& d, double val_fraction) {
  { std::ofstream(d / "a.txt") << slurp(fs::path(MESHGRAD_SOURCE_DIR) / "README.md"); }
  data::PrepareOptions p;
  p.vocab = gpt2_vocab();
  p.merges = gpt2_merges();
  p.out_dir = (d / "out").string();
  p.inputs = {(d / "a.txt").string()};
  p.val_fraction = val_fraction;
  data::prepare_dataset(p);
  return p;
}

TEST(Prepare, TrainRunsOnThePreparedDirectoryWithItsVocabulary) {
  ASSERT_TRUE(gpt2_files_present());
  const fs::path d = fresh_dir("train");
  const data::PrepareOptions p = prepare_readme(d, data::PrepareOptions{}.val_fraction);

  TrainOptions o;
  o.model.kind = "gpt";
  o.model.vocab = 0;   // from the data
  o.model.layers = 1;
  o.model.hidden = 16;
  o.model.heads = 2;
  o.model.seq = 16;
  o.model.batch = 2;
  o.model.dropout = 0;
  o.steps = 2;
  o.data_path = p.out_dir;
  o.progress = false;
  std::vector<double> losses;
  comm::run_ranks(2, [&](const comm::CommunicatorPtr& world) {
    auto mesh = std::make_shared<const dist::DeviceMesh>(world, std::vector<dist::MeshAxis>{{"dp", 1}, {"tp", 2}});
    const TrainResult r = train(o, mesh);
    if (world->rank() == 0) losses = r.losses;
  });
  ASSERT_EQ(losses.size(), 2u);
  // A fresh model predicts about uniformly over the 50257 ids of meta.json (not 256 bytes).
  EXPECT_NEAR(losses[0], std::log(50257.0), 0.5);

  // A data token beyond the model's vocabulary is refused before training, naming where it is.
  o.model.vocab = 256;
  std::string message;
  comm::run_ranks(1, [&](const comm::CommunicatorPtr& world) {
    auto mesh = std::make_shared<const dist::DeviceMesh>(world, std::vector<dist::MeshAxis>{{"dp", 1}, {"tp", 1}});
    try {
      train(o, mesh);
    } catch (const InvalidArgument& e) {
      message = e.what();
    }
  });
  EXPECT_NE(message.find("train.bin': token 50256 at position 0 (byte offset 1024) is not below the model's "
                         "vocabulary size 256"), std::string::npos) << message;
  fs::remove_all(d);
}

// Validation (--eval-every / --eval-steps): every eval_every steps and after the last, the mean
// global loss over the first eval_steps validation batches, in the metrics as val_loss. It does not
// depend on the mesh (up to float32 rounding) and it does not disturb training: the train losses
// are bitwise those of a run without evaluation. Data without a validation split is refused.
TEST(Prepare, ValidationLossIsEvaluatedOnTheValSplitAtAnyMesh) {
  ASSERT_TRUE(gpt2_files_present());
  const fs::path d = fresh_dir("eval");
  const data::PrepareOptions p = prepare_readme(d, 0.2);

  TrainOptions o;
  o.model.vocab = 0;
  o.model.layers = 1;
  o.model.hidden = 16;
  o.model.heads = 2;
  o.model.seq = 16;
  o.model.batch = 4;
  o.model.dropout = 0.1;   // evaluation runs without dropout and must not advance its stream
  // float64: the meshes then agree to rounding after training steps (float32 Adam updates drift
  // apart by ~1e-4 relative, depending on the text, which would make the bound data-dependent).
  o.model.dtype = DType::Float64;
  o.steps = 5;
  o.data_path = p.out_dir;
  o.progress = false;
  auto run = [&](const TrainOptions& opts, int dp, int tp, const std::string& metrics) {
    TrainResult result;
    TrainOptions with = opts;
    with.metrics_path = metrics;
    comm::run_ranks(dp * tp, [&](const comm::CommunicatorPtr& world) {
      auto mesh = std::make_shared<const dist::DeviceMesh>(world, std::vector<dist::MeshAxis>{{"dp", dp}, {"tp", tp}});
      TrainResult r = train(with, mesh);
      if (world->rank() == 0) result = r;
    });
    return result;
  };
  const TrainResult plain = run(o, 1, 1, "");
  o.eval_every = 2;
  o.eval_steps = 3;
  const std::string metrics = (d / "m.jsonl").string();
  const TrainResult one = run(o, 1, 1, metrics);
  // Across meshes without dropout: dropout masks are indexed by the global element along the
  // sequence and features but not yet along dp-sharded rows, so dp > 1 draws other masks.
  TrainOptions no_dropout = o;
  no_dropout.model.dropout = 0;
  const TrainResult single = run(no_dropout, 1, 1, "");
  const TrainResult grid = run(no_dropout, 2, 2, "");
  ASSERT_EQ(one.val_losses.size(), 3u);   // steps 2, 4 and the last (5)
  EXPECT_EQ(one.val_losses[0].first, 2);
  EXPECT_EQ(one.val_losses[2].first, 5);
  EXPECT_EQ(one.losses, plain.losses) << "evaluation changed the training run";
  ASSERT_EQ(grid.val_losses.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(std::isfinite(one.val_losses[i].second));
    EXPECT_NEAR(grid.val_losses[i].second, single.val_losses[i].second, 1e-9 * single.val_losses[i].second) << i;
  }
  // In the metrics: val_loss on the evaluation steps only.
  std::ifstream in(metrics);
  std::string line;
  int with_val = 0, lines = 0;
  ASSERT_TRUE(std::getline(in, line));
  EXPECT_EQ(nlohmann::json::parse(line).at("config").at("eval-every"), 2);   // the header
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    ++lines;
    if (j.contains("val_loss")) {
      ++with_val;
      EXPECT_TRUE(j["step"] == 2 || j["step"] == 4 || j["step"] == 5) << line;
      EXPECT_DOUBLE_EQ(j["val_loss"].get<double>(), one.val_losses[static_cast<std::size_t>(with_val - 1)].second);
    }
  }
  EXPECT_EQ(lines, 5);
  EXPECT_EQ(with_val, 3);

  // Bytes of a text file have no validation split: refused before step 1, saying what to do.
  const fs::path text = d / "a.txt";
  TrainOptions bad = o;
  bad.data_path = text.string();
  try {
    run(bad, 1, 1, "");
    ADD_FAILURE() << "--eval-every without a validation split was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("needs a validation split"), std::string::npos) << e.what();
  }
  fs::remove_all(d);
}

// A pipeline evaluates its micro-batches through the stages (pipeline::forward_only): the
// validation losses, like the training losses, are the bits of one rank with the same micro-batches.
TEST(Prepare, APipelineEvaluatesTheBitsOfOneRank) {
  ASSERT_TRUE(gpt2_files_present());
  const fs::path d = fresh_dir("eval_pp");
  const data::PrepareOptions p = prepare_readme(d, 0.2);
  TrainOptions o;
  o.model.vocab = 0;
  o.model.layers = 2;
  o.model.hidden = 16;
  o.model.heads = 2;
  o.model.seq = 16;
  o.model.batch = 4;
  o.model.dropout = 0.1;
  o.grad_accum = 2;
  o.steps = 4;
  o.eval_every = 2;
  o.eval_steps = 2;
  o.data_path = p.out_dir;
  o.progress = false;
  auto run = [&](const std::string& spec) {
    TrainResult result;
    comm::run_ranks(dist::mesh_world_size(spec), [&](const comm::CommunicatorPtr& world) {
      TrainResult r = train(o, std::make_shared<const dist::DeviceMesh>(world, dist::parse_mesh(spec)));
      if (world->rank() == 0) result = r;
    });
    return result;
  };
  const TrainResult one = run("tp=1");
  const TrainResult piped = run("pp=2");
  ASSERT_EQ(one.val_losses.size(), 2u);
  EXPECT_EQ(piped.val_losses, one.val_losses);
  EXPECT_EQ(piped.losses, one.losses);
}

}  // namespace
}  // namespace meshgrad::train::test_prepare
