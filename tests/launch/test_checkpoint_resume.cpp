// Sharded checkpoints: the manifest reader refuses what is malformed, a resumed run on the same mesh
// repeats the uninterrupted run's losses bit for bit (dropout included), a checkpoint resumes on any
// other mesh (tp=1..4 with uneven tp=3, dp x tp, 2-D) with losses equal up to rounding, corruption and
// truncation are refused naming the file and the tensor, --keep prunes only after a commit, and a
// second run cannot write into the same directory.
//
// Tolerance across meshes: float64 models; the only difference between meshes is the order of the
// sums split over ranks (about 1e-16 relative per operation), carried through 3 resumed steps of
// AdamW: 1e-9 on losses of magnitude ~4 is far above that and far below any real error (a wrong shard
// or moment changes the loss in the 3rd digit).
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "meshgrad/comm/threads.hpp"
#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/checkpoint/directory.hpp"
#include "meshgrad/checkpoint/reader.hpp"
#include "meshgrad/checkpoint/saver.hpp"
#include "meshgrad/checkpoint/verify.hpp"
#include "meshgrad/interop/hf_io.hpp"
#include "meshgrad/io/safetensors.hpp"
#include "meshgrad/generate/sample.hpp"
#include "meshgrad/launch/jobs.hpp"
#include "meshgrad/optim/adamw.hpp"
#include "meshgrad/interop/checkpoint_model.hpp"
#include "meshgrad/train/run_config.hpp"
#include "meshgrad/train/trainer.hpp"

namespace meshgrad::launch::test_checkpoint_resume {
namespace {

namespace fs = std::filesystem;

struct MeshSpec {
  int dp = 1, tp = 1, rows = 0, cols = 0;
  std::string str() const {
    return rows > 0 ? fmt::format("dp={},tp={}x{}", dp, rows, cols) : fmt::format("dp={},tp={}", dp, tp);
  }
};

// Flips the bits of `mask` in the byte at `offset` of a file, as a corrupt disk or a stray write would.
void flip_byte(const fs::path& file, std::uint64_t offset, unsigned char mask) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(f) << "cannot open " << file;
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  ASSERT_TRUE(f.read(&c, 1)) << file << " has no byte at offset " << offset;
  c = static_cast<char>(c ^ static_cast<char>(mask));
  f.seekp(static_cast<std::streamoff>(offset));
  ASSERT_TRUE(f.write(&c, 1)) << "cannot write " << file;
}

dist::RunOnMesh on_threads(const MeshSpec& m) {
  return [m](const std::function<void(const dist::DeviceMeshPtr&)>& fn) {
    comm::ThreadsOptions options;
    options.timeout = std::chrono::milliseconds(60000);
    const std::vector<dist::MeshAxis> axes = m.rows > 0 ? std::vector<dist::MeshAxis>{{"dp", m.dp}, {"tp_row", m.rows}, {"tp_col", m.cols}}
                                                        : std::vector<dist::MeshAxis>{{"dp", m.dp}, {"tp", m.tp}};
    const int world = m.rows > 0 ? m.dp * m.rows * m.cols : m.dp * m.tp;
    comm::run_ranks(world, [&](const comm::CommunicatorPtr& w) { fn(std::make_shared<const dist::DeviceMesh>(w, axes)); },
                    options);
  };
}

class CheckpointStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / fmt::format("mg_ckstore_{}_{}", ::getpid(),
                                                   ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A small float64 GPT with dropout whose split is uneven at tp=3 and tp=4 (vocab 256, 6 heads).
  train::TrainOptions options(int steps) const {
    train::TrainOptions o;
    o.model.kind = "gpt";
    o.model.layers = 2;
    o.model.hidden = 24;
    o.model.heads = 6;
    o.model.seq = 8;
    o.model.batch = 4;
    o.model.dropout = 0.1;
    o.model.dtype = DType::Float64;
    o.steps = steps;
    o.warmup_steps = 2;
    o.progress = false;
    return o;
  }
  std::string path(const std::string& leaf) const { return (dir_ / leaf).string(); }

  fs::path dir_;
};

// ---- manifest --------------------------------------------------------------------------------------

std::string hex64(char c) { return std::string(64, c); }
std::string hex32(char c) { return std::string(32, c); }

nlohmann::json good_manifest() {
  return {{"format", "meshgrad-checkpoint"},
          {"version", 1},
          {"step", 3},
          {"mesh", "dp=1,tp=2"},
          {"state", nlohmann::json::object()},
          {"files", {{{"name", "rank_00000.bin"}, {"bytes", 32}, {"sha256", hex64('a')}}}},
          {"tensors",
           {{{"name", "w"},
             {"dtype", "float32"},
             {"shape", {2, 4}},
             {"pieces",
              {{{"file", 0}, {"offset", 0}, {"box", {{0, 2}, {0, 2}}}, {"xxh3", hex32('b')}},
               {{"file", 0}, {"offset", 16}, {"box", {{0, 2}, {2, 2}}}, {"xxh3", hex32('c')}}}}}}}};
}

TEST_F(CheckpointStoreTest, ManifestRoundTripsAndRefusesMalformedOnes) {
  const checkpoint::Manifest m = checkpoint::parse_manifest(good_manifest().dump(), "m.json");
  ASSERT_EQ(m.tensors.size(), 1u);
  EXPECT_EQ(m.tensors[0].pieces.size(), 2u);
  EXPECT_EQ(checkpoint::parse_manifest(checkpoint::manifest_to_json(m), "again").tensors[0].pieces[1].offset, 16u);

  const auto refused = [](const std::function<void(nlohmann::json&)>& edit, const std::string& expected) {
    nlohmann::json j = good_manifest();
    edit(j);
    try {
      checkpoint::parse_manifest(j.dump(), "bad.json");
      ADD_FAILURE() << "accepted a manifest that should fail with: " << expected;
    } catch (const checkpoint::CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("bad.json"), std::string::npos) << e.what();
    }
  };
  refused([](auto& j) { j["format"] = "other"; }, "\"format\"");
  refused([](auto& j) { j["version"] = 2; }, "version 2");
  // reliability-3 N67: the next commit (+ 1) would overflow and sort oldest.
  refused([](auto& j) { j["commit"] = std::numeric_limits<std::int64_t>::max(); }, "\"commit\" = 9223372036854775807 is out of range");
  refused([](auto& j) { j["commit"] = checkpoint::kMaxCommitNumber + 1; }, "is out of range");
  {
    nlohmann::json j = good_manifest();
    j["commit"] = checkpoint::kMaxCommitNumber;
    EXPECT_EQ(checkpoint::parse_manifest(j.dump(), "max.json").commit, checkpoint::kMaxCommitNumber);
  }
  refused([](auto& j) { j["files"][0]["name"] = "../escape"; }, "not a plain file name");
  refused([](auto& j) { j["files"][0]["sha256"] = "xyz"; }, "64 lowercase hex");
  refused([](auto& j) { j["tensors"][0]["pieces"][0]["xxh3"] = hex64('a'); }, "32 lowercase hex");
  refused([](auto& j) { j["tensors"][0]["pieces"][1]["box"] = {{0, 2}, {1, 2}}; }, "overlaps");
  refused([](auto& j) { j["tensors"][0]["pieces"][1]["box"] = {{0, 1}, {2, 2}}; }, "cover 6 of its 8 elements");
  refused([](auto& j) { j["tensors"][0]["pieces"][1]["box"] = {{0, 2}, {3, 2}}; }, "outside the tensor");
  refused([](auto& j) { j["tensors"][0]["pieces"][1]["offset"] = 24; }, "outside file");
  refused([](auto& j) { j["tensors"][0]["pieces"][1]["offset"] = 8; }, "overlap in file 'rank_00000.bin'");
  // An edited dtype doubles a piece's bytes: the message names the tensor and the dtype that sizes it
  // (reliability-2 C9: it said only "two pieces share bytes at offset 16").
  refused(
      [](auto& j) {
        j["files"][0]["bytes"] = 64;
        j["tensors"][0]["dtype"] = "float64";
      },
      "tensor w piece 0 (float64 box");
  refused([](auto& j) { j["tensors"][0]["pieces"][1]["file"] = 5; }, "file index 5");
  refused([](auto& j) { j["tensors"][0]["dtype"] = "float16"; }, "dtype");
  refused([](auto& j) { j["tensors"][0]["shape"] = {-2, 4}; }, "negative");
  refused([](auto& j) { j["tensors"].push_back(j["tensors"][0]); }, "named twice");
  // Deep nesting is refused by the bounded reader, not by a crash.
  std::string deep = "{\"format\": ";
  for (int i = 0; i < 100000; ++i) deep += "[";
  EXPECT_THROW(checkpoint::parse_manifest(deep, "deep.json"), checkpoint::CheckpointError);
}

// ---- resume ----------------------------------------------------------------------------------------

// The losses of a run of `steps` steps on mesh m that resumes from `resume` (or starts fresh).
train::TrainResult run(train::TrainOptions o, const MeshSpec& m) { return run_train_job(o, on_threads(m)); }

TEST_F(CheckpointStoreTest, ResumeOnTheSameMeshRepeatsTheLossesBitForBit) {
  const train::TrainResult full = run(options(6), {1, 2});
  train::TrainOptions first = options(6);
  first.checkpoint_dir = path("ck");
  first.save_every = 3;
  const train::TrainResult whole = run(first, {1, 2});
  ASSERT_EQ(checkpoint::list_checkpoints(path("ck")).size(), 2u);   // step 3 and the final step 6
  // As if the run had been killed after step 3's checkpoint (the process-level kill is tested by
  // tests/cli/checkpoint_cli.py).
  fs::remove_all(path("ck/step_00000006"));
  train::TrainOptions again = options(6);
  again.resume = path("ck");
  const train::TrainResult resumed = run(again, {1, 2});
  ASSERT_EQ(resumed.first_step, 3);
  ASSERT_EQ(resumed.losses.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(resumed.losses[i], full.losses[3 + i]) << "step " << 4 + i;   // bitwise: no tolerance
    EXPECT_EQ(whole.losses[3 + i], full.losses[3 + i]);
  }
  // The resumed run wrote its final checkpoint into the same directory (the configuration's).
  EXPECT_EQ(fs::path(checkpoint::list_checkpoints(path("ck")).back()).filename(), "step_00000006");
}

TEST_F(CheckpointStoreTest, ReshardsToAnyMesh) {
  const std::vector<std::pair<MeshSpec, std::vector<MeshSpec>>> cases = {
      {{1, 2}, {{1, 1}, {1, 3}, {1, 4}, {2, 2}, {2, 1}, {1, 1, 2, 2}}},
      {{1, 1, 2, 2}, {{1, 3}, {2, 1}}},
      {{2, 3}, {{1, 2}}},
  };
  for (const auto& [from, targets] : cases) {
    SCOPED_TRACE("written on " + from.str());
    const train::TrainResult full = run(options(5), from);
    train::TrainOptions o = options(5);
    o.checkpoint_dir = path("ck_" + from.str());
    o.save_every = 2;
    run(o, from);
    const std::string ck = (fs::path(o.checkpoint_dir) / "step_00000002").string();
    ASSERT_TRUE(fs::exists(fs::path(ck) / "manifest.json"));
    for (const MeshSpec& to : targets) {
      SCOPED_TRACE("resumed on " + to.str());
      train::TrainOptions r = options(5);
      r.resume = ck;
      r.checkpoint_dir = path("ck_resumed");   // its own directory: the source stays as it is
      r.given_options = {"checkpoint-dir"};
      const train::TrainResult resumed = run(r, to);
      ASSERT_EQ(resumed.losses.size(), 3u);
      for (int i = 0; i < 3; ++i) EXPECT_NEAR(resumed.losses[i], full.losses[2 + i], 1e-9) << "step " << 3 + i;
      fs::remove_all(path("ck_resumed"));
    }
  }
}

TEST_F(CheckpointStoreTest, ReadsOnlyThePiecesARankNeeds) {
  // Written at tp=4 (4 files); one tp=2 rank's pieces of a vocabulary-sharded tensor lie in 2 files.
  train::TrainOptions o = options(1);
  o.model.dropout = 0;
  o.checkpoint_dir = path("ck");
  run(o, {1, 4});
  const std::string ck = checkpoint::list_checkpoints(path("ck")).back();
  const checkpoint::Manifest m = checkpoint::read_manifest(ck);
  // Destroy the files ranks 2 and 3 wrote: rank 0 of tp=2 (vocab rows [0, 128)) must not touch them.
  for (const char* f : {"rank_00002.bin", "rank_00003.bin"}) fs::resize_file(fs::path(ck) / f, 0);
  dist::PieceLayout first_half;
  first_half.ranges = {{{0, 128}}, {{0, 24}}};
  first_half.local_shape = {128, 24};
  const checkpoint::ManifestTensor* wte = m.find("wte.weight");
  ASSERT_NE(wte, nullptr);
  bool only_low_files = true;
  for (const checkpoint::ManifestPiece& p : wte->pieces) {
    if (p.box[0].offset < 128) only_low_files = only_low_files && p.file < 2;
  }
  ASSERT_TRUE(only_low_files) << "the test assumes rows [0, 128) were written by ranks 0 and 1";
  const std::vector<Tensor> got = checkpoint::read_pieces(ck, m, {{"wte.weight", {256, 24}, first_half, DType::Float64}});
  EXPECT_EQ(got[0].shape(), (Shape{128, 24}));
  // The other half needs the destroyed files: refused, naming the file as truncated.
  dist::PieceLayout second_half = first_half;
  second_half.ranges = {{{128, 128}}, {{0, 24}}};
  try {
    checkpoint::read_pieces(ck, m, {{"wte.weight", {256, 24}, second_half, DType::Float64}});
    ADD_FAILURE() << "read a truncated file";
  } catch (const checkpoint::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }
}

TEST_F(CheckpointStoreTest, CorruptionIsRefusedNamingTheFileAndTheTensor) {
  train::TrainOptions o = options(2);
  o.checkpoint_dir = path("ck");
  run(o, {1, 2});
  const std::string ck = checkpoint::list_checkpoints(path("ck")).back();
  EXPECT_GT(checkpoint::verify_checkpoint(ck), 0u);
  const checkpoint::Manifest m = checkpoint::read_manifest(ck);
  const checkpoint::ManifestTensor* t = m.find("h.1.mlp.c_fc.weight");
  ASSERT_NE(t, nullptr);
  const checkpoint::ManifestPiece& p = t->pieces.at(0);
  const fs::path file = fs::path(ck) / m.files[p.file].name;
  flip_byte(file, p.offset + 5, 0x10);
  try {
    checkpoint::verify_checkpoint(ck);
    ADD_FAILURE() << "verified a corrupt checkpoint";
  } catch (const checkpoint::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("h.1.mlp.c_fc.weight"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(m.files[p.file].name), std::string::npos) << e.what();
  }
  train::TrainOptions r = options(4);
  r.resume = ck;
  r.given_options = {"steps"};
  try {
    run(r, {1, 2});
    ADD_FAILURE() << "resumed from a corrupt checkpoint";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("h.1.mlp.c_fc.weight"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("fails its hash"), std::string::npos) << e.what();
  }
}

// A corrupt piece that only one rank reads (rank 1's rows of the vocabulary) fails that rank's load;
// the others must not go on to training and wait for it until the communication deadline (60 s
// here): every rank stops at once with that rank's error.
TEST_F(CheckpointStoreTest, ALoadThatFailsOnOneRankEndsEveryRankAtOnce) {
  train::TrainOptions o = options(2);
  o.checkpoint_dir = path("ck");
  run(o, {1, 2});
  const std::string ck = checkpoint::list_checkpoints(path("ck")).back();
  const checkpoint::Manifest m = checkpoint::read_manifest(ck);
  const checkpoint::ManifestTensor* wte = m.find("wte.weight");
  ASSERT_NE(wte, nullptr);
  const auto second_half = std::find_if(wte->pieces.begin(), wte->pieces.end(),
                                        [&](const checkpoint::ManifestPiece& p) { return p.box[0].offset > 0; });
  ASSERT_NE(second_half, wte->pieces.end());
  flip_byte(fs::path(ck) / m.files[second_half->file].name, second_half->offset + 3, 0x40);
  train::TrainOptions r = options(4);
  r.resume = ck;
  r.given_options = {"steps"};
  std::vector<std::string> errors(2);
  const auto t0 = std::chrono::steady_clock::now();
  on_threads({1, 2})([&](const dist::DeviceMeshPtr& mesh) {
    try {
      train::train(resolve_resume(r), mesh);
    } catch (const std::exception& e) {
      errors[static_cast<std::size_t>(mesh->rank())] = e.what();
    }
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(seconds, 30.0) << "a rank waited for the failed one";
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("wte.weight"), std::string::npos) << e;
    EXPECT_NE(e.find("fails its hash"), std::string::npos) << e;
  }
}

// A FIFO put in place of a rank's file (or of the manifest) is refused at once by verify and resume;
// both blocked in open() for ever (reliability-2 C14).
TEST_F(CheckpointStoreTest, AFifoInACheckpointIsRefusedWithoutBlocking) {
  train::TrainOptions o = options(2);
  o.model.layers = 1;
  o.checkpoint_dir = path("ck");
  run(o, {1, 2});
  const std::string ck = checkpoint::list_checkpoints(path("ck")).back();
  for (const std::string leaf : {"rank_00001.bin", "manifest.json"}) {
    SCOPED_TRACE(leaf);
    const fs::path file = fs::path(ck) / leaf;
    const fs::path saved = file.string() + ".saved";
    fs::rename(file, saved);
    ASSERT_EQ(::mkfifo(file.c_str(), 0600), 0);
    const auto t0 = std::chrono::steady_clock::now();
    std::string verify_error;
    try {
      checkpoint::verify_checkpoint(ck);
    } catch (const checkpoint::CheckpointError& e) {
      verify_error = e.what();
    }
    EXPECT_NE(verify_error.find("is not a regular file"), std::string::npos) << verify_error;
    train::TrainOptions r = options(4);
    r.model.layers = 1;
    r.resume = ck;
    r.given_options = {"steps"};
    std::string resume_error;
    try {
      run(r, {1, 2});
    } catch (const std::exception& e) {
      resume_error = e.what();
    }
    EXPECT_NE(resume_error.find("is not a regular file"), std::string::npos) << resume_error;
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
    fs::remove(file);
    fs::rename(saved, file);
  }
}

// A rank's training state as bytes: every parameter and both moments (zeros when not created),
// with the optimizer's step count and the model's random stream.
std::string state_bytes(nn::Model& model, const optim::AdamW& opt) {
  std::string out = fmt::format("{}/{}/", opt.steps(), model.random_state());
  for (const checkpoint::StateTensor& t : train::training_state_tensors(model.parameters(), opt)) {
    const Tensor c = t.local.contiguous();
    out += t.name;
    out.append(static_cast<const char*>(c.raw_data()), static_cast<std::size_t>(c.numel()) * dtype_size(c.dtype()));
  }
  return out;
}

// train --resume reads the checkpoint straight into the model's parameters and the optimizer's
// moments (StateLoad::in_place); a load into a live model reads into new tensors first
// (all_or_nothing). Both give the same state bit for bit, on the checkpoint's mesh and resharded.
// A corrupt piece leaves an all-or-nothing load's model and optimizer exactly as they were; in place,
// the same error names the tensor and the file. Errors found before reading (a tensor the checkpoint
// lacks) change nothing in place either.
TEST_F(CheckpointStoreTest, InPlaceAndAllOrNothingLoadsGiveTheSameStateAndRefuseTheSameCorruption) {
  train::TrainOptions o = options(2);
  o.checkpoint_dir = path("ck");
  run(o, {1, 2});
  const std::string ck = checkpoint::list_checkpoints(path("ck")).back();
  const checkpoint::Manifest good = checkpoint::read_manifest(ck);
  const nn::ModelConfig config = interop::checkpoint_model_config(good, ck);
  const auto build = [&](const dist::DeviceMeshPtr& mesh, std::uint64_t seed) {
    auto model = nn::make_model(config, {}, mesh, seed);
    auto opt = std::make_unique<optim::AdamW>(model->parameters(), mesh);
    return std::make_pair(std::move(model), std::move(opt));
  };
  for (const MeshSpec& m : std::vector<MeshSpec>{{1, 2}, {1, 3}, {1, 1}}) {
    SCOPED_TRACE("loaded on " + m.str());
    on_threads(m)([&](const dist::DeviceMeshPtr& mesh) {
      auto [a, opt_a] = build(mesh, 5);
      auto [b, opt_b] = build(mesh, 6);
      const std::string before = state_bytes(*b, *opt_b);
      EXPECT_EQ(train::load_training_state(ck, good, *a, *opt_a, train::StateLoad::all_or_nothing), 2);
      EXPECT_EQ(train::load_training_state(ck, good, *b, *opt_b, train::StateLoad::in_place), 2);
      EXPECT_EQ(opt_b->steps(), 2);
      EXPECT_TRUE(state_bytes(*a, *opt_a) == state_bytes(*b, *opt_b)) << "in place and all-or-nothing differ on rank " << mesh->rank();
      EXPECT_FALSE(state_bytes(*b, *opt_b) == before);
    });
  }
  // A tensor the checkpoint lacks: refused before anything is read, in place too.
  checkpoint::Manifest lacking = good;
  lacking.tensors.erase(std::find_if(lacking.tensors.begin(), lacking.tensors.end(),
                                     [](const checkpoint::ManifestTensor& t) { return t.name == "optimizer.exp_avg_sq.ln_f.weight"; }));
  on_threads({1, 2})([&](const dist::DeviceMeshPtr& mesh) {
    auto [model, opt] = build(mesh, 5);
    const std::string before = state_bytes(*model, *opt);
    try {
      train::load_training_state(ck, lacking, *model, *opt, train::StateLoad::in_place);
      ADD_FAILURE() << "loaded a checkpoint without optimizer.exp_avg_sq.ln_f.weight";
    } catch (const checkpoint::CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find("optimizer.exp_avg_sq.ln_f.weight"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(state_bytes(*model, *opt) == before) << "the parameters changed although nothing was read";
  });
  // A flipped byte in the last piece of the first file.
  const checkpoint::ManifestTensor* victim = nullptr;
  const checkpoint::ManifestPiece* piece = nullptr;
  for (const checkpoint::ManifestTensor& t : good.tensors) {
    for (const checkpoint::ManifestPiece& p : t.pieces) {
      if (p.file == 0 && (piece == nullptr || p.offset > piece->offset)) {
        victim = &t;
        piece = &p;
      }
    }
  }
  ASSERT_NE(piece, nullptr);
  flip_byte(fs::path(ck) / good.files[0].name, piece->offset + piece->bytes(victim->dtype) - 1, 0x40);
  for (const train::StateLoad how : {train::StateLoad::all_or_nothing, train::StateLoad::in_place}) {
    on_threads({1, 2})([&](const dist::DeviceMeshPtr& mesh) {
      auto [model, opt] = build(mesh, 5);
      const std::string before = state_bytes(*model, *opt);
      bool refused = false;
      try {
        train::load_training_state(ck, good, *model, *opt, how);
      } catch (const checkpoint::CheckpointError& e) {
        refused = true;
        EXPECT_NE(std::string(e.what()).find("fails its hash"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find(good.files[0].name), std::string::npos) << e.what();
      }
      // File 0 holds pieces rank 0 wrote, so rank 0 holds (and reads) the corrupt one on this mesh;
      // rank 1 reads it only when it is a replicated piece. A refused all-or-nothing load changed nothing.
      if (mesh->rank() == 0) {
        EXPECT_TRUE(refused) << "rank 0 loaded a corrupt piece";
      }
      if (refused && how == train::StateLoad::all_or_nothing) {
        EXPECT_TRUE(state_bytes(*model, *opt) == before) << "a refused all-or-nothing load changed the state";
      }
    });
  }
}

TEST_F(CheckpointStoreTest, AnotherModelShapeIsRefusedNamingTheOptions) {
  train::TrainOptions o = options(2);
  o.checkpoint_dir = path("ck");
  run(o, {1, 1});
  train::TrainOptions r = options(4);
  r.resume = path("ck");
  r.model.hidden = 48;
  r.model.layers = 3;
  r.given_options = {"steps", "hidden", "layers", "lr"};
  r.lr = 1e-3;   // may change
  try {
    resolve_resume(r);
    ADD_FAILURE() << "accepted another model shape";
  } catch (const checkpoint::CheckpointError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("--hidden 48 (the checkpoint has 24)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("--layers 3 (the checkpoint has 2)"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("--lr"), std::string::npos) << msg;
  }
  // Without its own "positions", the model has one position row per --seq: --seq is its shape too
  // (reliability-2 C25: the refusal blamed an edited manifest instead of naming --seq).
  r.model.hidden = 24;
  r.model.layers = 2;
  r.model.seq = 2 * o.model.seq;
  r.given_options = {"steps", "lr", "seq"};
  try {
    resolve_resume(r);
    ADD_FAILURE() << "accepted another --seq for a model whose positions are its seq";
  } catch (const checkpoint::CheckpointError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(fmt::format("--seq {} (the checkpoint has {})", 2 * o.model.seq, o.model.seq)), std::string::npos)
        << msg;
  }
  r.model.seq = o.model.seq;
  r.given_options = {"steps", "hidden", "layers", "lr"};
  const train::TrainOptions merged = resolve_resume(r);
  EXPECT_EQ(merged.lr, 1e-3);
  EXPECT_EQ(merged.steps, 4);
  EXPECT_EQ(merged.model.dropout, 0.1);   // from the checkpoint
  EXPECT_EQ(merged.resume_dir, checkpoint::list_checkpoints(path("ck")).back());
}

// reliability-3 N1: a resume writes into the folder it resumed from unless told otherwise; the
// recorded outputs are taken only when that folder is the recorded --checkpoint-dir (any spelling).
TEST_F(CheckpointStoreTest, AResumeWritesIntoTheFolderItResumedFrom) {
  EXPECT_EQ(train::resumed_from_folder("ck/step_00000006"), "ck");
  EXPECT_EQ(train::resumed_from_folder("ck/step_00000006/"), "ck");
  EXPECT_EQ(train::resumed_from_folder("step_00000006"), ".");
  EXPECT_EQ(train::resumed_from_folder("/a/b/./ck/step_00000006"), "/a/b/ck");
  train::TrainOptions original = options(2);
  original.checkpoint_dir = path("orig");
  original.metrics_path = path("om.jsonl");
  original.save_path = path("w.safetensors");
  original.grad_accum = 2;
  fs::create_directories(path("orig"));
  fs::create_directories(path("copy"));
  fs::create_directory_symlink(path("orig"), path("link"));
  const nlohmann::json saved = train::run_config_json(original, 256);
  train::TrainOptions caller = options(4);
  caller.metrics_path = path("default.jsonl");   // the CLI's default: not the original's either
  caller.given_options = {"steps"};
  std::string left_out;
  // In place, also through a link: as recorded.
  for (const std::string folder : {"orig", "link"}) {
    const train::TrainOptions r = train::resume_options(caller, saved, path(folder) + "/step_00000002", nullptr, &left_out);
    EXPECT_EQ(r.checkpoint_dir, path("orig")) << folder;
    EXPECT_EQ(r.metrics_path, path("om.jsonl")) << folder;
    EXPECT_EQ(r.save_path, path("w.safetensors")) << folder;
    EXPECT_EQ(left_out, "") << folder;
    EXPECT_EQ(r.grad_accum, 2);
    EXPECT_EQ(r.from_checkpoint.at("grad-accum"), "2");
  }
  // From a copy: the copy, and none of the original's files.
  train::TrainOptions r = train::resume_options(caller, saved, path("copy") + "/step_00000002", nullptr, &left_out);
  EXPECT_EQ(r.checkpoint_dir, path("copy"));
  EXPECT_EQ(r.metrics_path, "");
  EXPECT_EQ(r.save_path, "");
  EXPECT_NE(left_out.find("--metrics " + path("om.jsonl")), std::string::npos) << left_out;
  EXPECT_NE(left_out.find("--save " + path("w.safetensors")), std::string::npos) << left_out;
  // Given options win; --micro-batches is --grad-accum.
  caller.given_options = {"steps", "checkpoint-dir", "metrics", "micro-batches"};
  caller.checkpoint_dir = path("out");
  caller.grad_accum = 1;
  r = train::resume_options(caller, saved, path("copy") + "/step_00000002", nullptr, &left_out);
  EXPECT_EQ(r.checkpoint_dir, path("out"));
  EXPECT_EQ(r.metrics_path, path("default.jsonl"));
  EXPECT_EQ(r.grad_accum, 1);
  EXPECT_EQ(r.from_checkpoint.count("grad-accum"), 0u);
  EXPECT_EQ(r.from_checkpoint.count("checkpoint-dir"), 0u);
}

TEST_F(CheckpointStoreTest, KeepPrunesOlderCheckpointsAndTheDirectoryIsLocked) {
  train::TrainOptions o = options(5);
  o.model.layers = 1;
  o.checkpoint_dir = path("ck");
  o.save_every = 1;
  o.keep = 2;
  run(o, {1, 2});
  const std::vector<std::string> left = checkpoint::list_checkpoints(path("ck"));
  ASSERT_EQ(left.size(), 2u);
  EXPECT_EQ(fs::path(left[0]).filename(), "step_00000004");
  EXPECT_EQ(fs::path(left[1]).filename(), "step_00000005");
  // Leftovers of a killed save are removed when the next saver opens the directory.
  fs::create_directories(path("ck/.step_00000009.tmp"));
  std::ofstream(path("ck/.step_00000009.tmp/rank_00000.bin")) << "partial";
  on_threads({1, 1})([&](const dist::DeviceMeshPtr& mesh) {
    checkpoint::CheckpointSaver saver(path("ck"), mesh, 0);
    EXPECT_FALSE(fs::exists(path("ck/.step_00000009.tmp")));
    // A second saver (another run) on the same directory is refused while the first holds it.
    try {
      checkpoint::CheckpointSaver second(path("ck"), mesh, 0);
      ADD_FAILURE() << "two savers on one directory";
    } catch (const checkpoint::CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find("in use by another run"), std::string::npos) << e.what();
    }
  });
}

// A run resumed from an older checkpoint continues a new branch: the checkpoints it commits, not the
// abandoned higher steps, are the newest (Manifest::commit), for --resume DIR and for --keep
// (reliability review 6.1.2: step_6 of the abandoned branch used to win). The same on a file system
// without rename flags (NFS answers EINVAL; MESHGRAD_IO_FAULT=no-rename-flags makes this one answer
// so), where the commit falls back to plain renames under the directory's lock: every save commits,
// also the one that replaces a step that exists (review 6.1.1: every save after the first failed).
// A newest checkpoint whose manifest cannot be read is reported, not passed over for an older one
// (reliability-2 C6, C8, C9 after commit numbers ordered checkpoints: resume and verify silently took
// step 2); naming the older checkpoint still works, and the next save numbers after the readable ones.
TEST_F(CheckpointStoreTest, ANewestCheckpointThatCannotBeReadIsReportedNotPassedOver) {
  const std::string root = path("ck_broken");
  train::TrainOptions first = options(4);
  first.model.layers = 1;
  first.checkpoint_dir = root;
  first.save_every = 2;
  run(first, {1, 2});   // step_2 (commit 1), step_4 (commit 2)
  const std::string newest = (fs::path(root) / "step_00000004").string();
  std::ofstream(fs::path(newest) / "manifest.json", std::ios::trunc) << "{\"format\": ";   // cut short
  EXPECT_EQ(checkpoint::list_checkpoints(root).back(), newest);
  try {
    (void)checkpoint::resolve_checkpoint(root);
    ADD_FAILURE() << "the unreadable newest checkpoint was passed over";
  } catch (const checkpoint::CheckpointError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("newest checkpoint under"), std::string::npos) << m;
    EXPECT_NE(m.find("step_00000004"), std::string::npos) << m;
  }
  const std::string older = (fs::path(root) / "step_00000002").string();
  EXPECT_EQ(checkpoint::resolve_checkpoint(older), older);
  EXPECT_EQ(checkpoint::commit_number(newest), std::nullopt);
  EXPECT_EQ(checkpoint::commit_number(older), std::optional<std::int64_t>(1));
  // Resuming from the named older step saves again with the next commit number after the readable ones.
  train::TrainOptions again = first;
  again.resume = older;
  again.steps = 3;
  again.save_every = 1;
  again.given_options = {"steps", "save-every"};
  run(again, {1, 2});
  EXPECT_EQ(checkpoint::read_manifest((fs::path(root) / "step_00000003").string()).commit, 2);
}

TEST_F(CheckpointStoreTest, TheCheckpointCommittedLastIsTheNewestAlsoWithoutRenameFlags) {
  for (const bool nfs : {false, true}) {
    SCOPED_TRACE(nfs ? "without rename flags (as NFS)" : "with rename flags");
    if (nfs) ::setenv("MESHGRAD_IO_FAULT", "no-rename-flags", 1);
    const std::string root = path(nfs ? "ck_nfs" : "ck");
    train::TrainOptions first = options(6);
    first.model.layers = 1;
    first.checkpoint_dir = root;
    first.save_every = 2;
    run(first, {1, 2});   // step_2, step_4, step_6
    train::TrainOptions branch = first;
    branch.steps = 5;
    branch.save_every = 1;
    branch.resume = (fs::path(root) / "step_00000002").string();
    branch.given_options = {"steps", "save-every"};
    const train::TrainResult resumed = run(branch, {1, 2});   // step_3, step_4 again, step_5
    EXPECT_EQ(resumed.first_step, 2);
    EXPECT_EQ(checkpoint::resolve_checkpoint(root), (fs::path(root) / "step_00000005").string());
    std::vector<std::string> order;
    for (const std::string& c : checkpoint::list_checkpoints(root)) order.push_back(fs::path(c).filename().string());
    EXPECT_EQ(order, (std::vector<std::string>{"step_00000002", "step_00000006", "step_00000003", "step_00000004",
                                              "step_00000005"}));
    for (const std::string& c : checkpoint::list_checkpoints(root)) EXPECT_GT(checkpoint::verify_checkpoint(c), 0u) << c;
    // Commits 1, 2, 3 were the first run's steps 2, 4, 6; the branch committed 3, 4, 5 as 4, 5, 6.
    EXPECT_EQ(checkpoint::read_manifest((fs::path(root) / "step_00000004").string()).commit, 5)
        << "the re-saved step_4 is the branch's";
    // --keep 2 keeps the two committed last: the abandoned step_6 goes with the older ones.
    train::TrainOptions more = branch;
    more.resume = root;
    more.steps = 6;
    more.keep = 2;
    more.given_options = {"steps", "save-every", "keep"};
    run(more, {1, 2});
    order.clear();
    for (const std::string& c : checkpoint::list_checkpoints(root)) order.push_back(fs::path(c).filename().string());
    EXPECT_EQ(order, (std::vector<std::string>{"step_00000005", "step_00000006"}));
    EXPECT_EQ(checkpoint::resolve_checkpoint(root), (fs::path(root) / "step_00000006").string());
    EXPECT_EQ(checkpoint::read_manifest(checkpoint::resolve_checkpoint(root)).commit, 7);
    std::vector<std::string> others;
    for (const auto& e : fs::directory_iterator(root)) {
      const std::string name = e.path().filename().string();
      if (name != ".lock" && !name.starts_with("step_")) others.push_back(name);
    }
    EXPECT_TRUE(others.empty()) << "left behind: " << others.front();
    ::unsetenv("MESHGRAD_IO_FAULT");
  }
}

// Files go through an aligned staging buffer with O_DIRECT (8 MiB per write, the tail rounded up to
// 4096 and the file cut back): the bytes must be exactly those of buffered writes, for a tensor that
// spans several staging buffers and ones whose sizes are not multiples of 4096, on a disk filesystem
// and on tmpfs (older kernels refuse O_DIRECT there: the buffered fallback), sync and async.
TEST_F(CheckpointStoreTest, DirectAndBufferedWritesGiveTheSameFiles) {
  auto read_all = [](const fs::path& f) {
    std::ifstream in(f, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  std::vector<std::string> roots{path("direct"), path("buffered")};
  const fs::path shm = fs::path("/dev/shm") / fmt::format("mg_ckstore_{}", ::getpid());
  const bool have_shm = fs::is_directory("/dev/shm");
  if (have_shm) roots.push_back(shm.string());
  for (std::size_t i = 0; i < roots.size(); ++i) {
    ::setenv("MESHGRAD_CHECKPOINT_DIRECT", i == 1 ? "0" : "1", 1);
    on_threads({1, 2})([&](const dist::DeviceMeshPtr& mesh) {
      std::vector<checkpoint::StateTensor> tensors;
      const std::vector<std::int64_t> sizes{(std::int64_t{9} << 20) / 4 + 3, 1001, 7};   // 9 MiB + 12 bytes, odd ones
      for (std::size_t t = 0; t < sizes.size(); ++t) {
        std::vector<double> v(static_cast<std::size_t>(sizes[t]));
        for (std::size_t e = 0; e < v.size(); ++e) v[e] = static_cast<double>((e * 2654435761u + t) % 1000003) * 1e-3;
        Tensor full = Tensor::from_values(v, {sizes[t]}, DType::Float32);
        tensors.push_back({fmt::format("t{}", t), {sizes[t]}, {dist::Replicate(), dist::Replicate()}, full});
      }
      checkpoint::CheckpointSaver saver(roots[i], mesh, 0);
      saver.save(1, tensors, nlohmann::json::object(), false);
      saver.save(2, tensors, nlohmann::json::object(), true);
      saver.wait();
    });
  }
  ::unsetenv("MESHGRAD_CHECKPOINT_DIRECT");
  for (const char* step : {"step_00000001", "step_00000002"}) {
    std::size_t files = 0;
    for (const auto& entry : fs::directory_iterator(fs::path(roots[1]) / step)) {
      const std::string name = entry.path().filename().string();
      const std::string want = read_all(entry.path());
      for (std::size_t i = 0; i < roots.size(); ++i) {
        if (i == 1) continue;
        EXPECT_TRUE(read_all(fs::path(roots[i]) / step / name) == want) << roots[i] << "/" << step << "/" << name;
      }
      ++files;
    }
    EXPECT_GE(files, 2u);
    for (const std::string& root : roots) EXPECT_GT(checkpoint::verify_checkpoint((fs::path(root) / step).string()), (9u << 20)) << root;
  }
  if (have_shm) fs::remove_all(shm);
}

// A rank that spreads its pieces over several files (one writing thread each: the default wherever a
// rank has several cores to itself) saves the same bytes synchronously (straight from the tensors)
// and asynchronously (through the snapshot buffer, where the pieces of all its files lie), and they
// load back exactly: on one rank, on two tp ranks (sharded pieces), and over dp (replicated pieces
// spread over their holders).
TEST_F(CheckpointStoreTest, SeveralFilesPerRankSaveTheSameBytesSyncAndAsync) {
  // t4 makes every rank's snapshot larger than parallel::kMinElements, so that the async copy is
  // split over the two threads set here (cut inside a piece and across pieces).
  const std::vector<std::int64_t> rows{7, 1000, 4099, 3, 100001};
  const int blas_threads = blas::num_threads();
  blas::set_num_threads(2);
  struct Restore {
    int n;
    ~Restore() { blas::set_num_threads(n); }
  } restore{blas_threads};
  std::vector<Tensor> originals;
  for (std::size_t t = 0; t < rows.size(); ++t) {
    std::vector<double> v(static_cast<std::size_t>(rows[t] * 6));
    for (std::size_t e = 0; e < v.size(); ++e) v[e] = static_cast<double>((e * 2654435761u + 977 * t) % 1000003) * 1e-3;
    originals.push_back(Tensor::from_values(v, {rows[t], 6}, DType::Float32));
  }
  for (const MeshSpec& mesh_spec : std::vector<MeshSpec>{{1, 1}, {1, 2}, {2, 1}}) {
    SCOPED_TRACE(mesh_spec.str());
    const std::string root = path("ck_" + mesh_spec.str());
    on_threads(mesh_spec)([&](const dist::DeviceMeshPtr& mesh) {
      std::vector<checkpoint::StateTensor> tensors;
      for (std::size_t t = 0; t < rows.size(); ++t) {
        // Even tensors sharded by rows over tp, odd ones replicated.
        const dist::Placements placements{dist::Replicate(), t % 2 == 0 ? dist::Shard(0) : dist::Replicate()};
        const dist::PieceLayout layout = dist::piece_layout({rows[t], 6}, *mesh, placements, mesh->coordinates());
        const std::int64_t lo = layout.ranges.at(0).at(0).offset, n = layout.local_shape.at(0);
        tensors.push_back({fmt::format("t{}", t), {rows[t], 6}, placements, originals[t].narrow(0, lo, n).contiguous()});
      }
      checkpoint::CheckpointSaver saver(root, mesh, 0, /*files_per_rank=*/3);
      saver.save(1, tensors, nlohmann::json::object(), /*async=*/false);
      saver.save(2, tensors, nlohmann::json::object(), /*async=*/true);
      saver.wait();
    });
    const auto read_all = [](const fs::path& f) {
      std::ifstream in(f, std::ios::binary);
      return std::string(std::istreambuf_iterator<char>(in), {});
    };
    const std::vector<std::string> cks = checkpoint::list_checkpoints(root);
    ASSERT_EQ(cks.size(), 2u);
    std::size_t files = 0;
    for (const auto& entry : fs::directory_iterator(cks[0])) {
      const std::string name = entry.path().filename().string();
      if (name == "manifest.json") continue;
      EXPECT_TRUE(read_all(entry.path()) == read_all(fs::path(cks[1]) / name)) << name << " differs between sync and async";
      ++files;
    }
    EXPECT_EQ(files, static_cast<std::size_t>(3 * mesh_spec.dp * mesh_spec.tp));
    for (const std::string& ck : cks) {
      const checkpoint::Manifest m = checkpoint::read_manifest(ck);
      std::vector<checkpoint::PieceRequest> requests;
      for (std::size_t t = 0; t < rows.size(); ++t) {
        dist::PieceLayout whole;
        whole.ranges = {{{0, rows[t]}}, {{0, 6}}};
        whole.local_shape = {rows[t], 6};
        requests.push_back({fmt::format("t{}", t), {rows[t], 6}, whole, DType::Float32});
      }
      const std::vector<Tensor> got = checkpoint::read_pieces(ck, m, requests);
      for (std::size_t t = 0; t < rows.size(); ++t) {
        EXPECT_EQ(std::memcmp(got[t].raw_data(), originals[t].raw_data(), static_cast<std::size_t>(rows[t] * 6 * 4)), 0)
            << ck << ": t" << t;
      }
    }
  }
}

// Pieces larger than the 8 MiB read buffers are read in several spans, the next one while the last
// is copied out (O_DIRECT on a filesystem that takes it, buffered otherwise): the bytes come back
// exactly, also for a piece whose end is not 4096-aligned, and a flipped byte in the third span or a
// file cut in the second are refused.
TEST_F(CheckpointStoreTest, PiecesLargerThanTheReadBuffersRoundTripAndAreChecked) {
  const std::vector<std::int64_t> sizes{1001, (std::int64_t{21} << 20) / 4 + 5};   // 21 MiB + 20 bytes
  std::vector<Tensor> originals;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    std::vector<double> v(static_cast<std::size_t>(sizes[t]));
    for (std::size_t e = 0; e < v.size(); ++e) v[e] = static_cast<double>((e * 2654435761u + t) % 1000003) * 1e-3;
    originals.push_back(Tensor::from_values(v, {sizes[t]}, DType::Float32));
  }
  on_threads({1, 1})([&](const dist::DeviceMeshPtr& mesh) {
    std::vector<checkpoint::StateTensor> tensors;
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      tensors.push_back({fmt::format("t{}", t), {sizes[t]}, {dist::Replicate(), dist::Replicate()}, originals[t]});
    }
    checkpoint::CheckpointSaver saver(path("ck"), mesh, 0);
    saver.save(1, tensors, nlohmann::json::object(), false);
    saver.wait();
  });
  const std::string ck = checkpoint::list_checkpoints(path("ck")).back();
  const checkpoint::Manifest m = checkpoint::read_manifest(ck);
  const auto request = [&] {
    dist::PieceLayout whole;
    whole.ranges = {{{0, sizes[1]}}};
    whole.local_shape = {sizes[1]};
    return std::vector<checkpoint::PieceRequest>{{"t1", {sizes[1]}, whole, DType::Float32}};
  };
  const std::vector<Tensor> got = checkpoint::read_pieces(ck, m, request());
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(std::memcmp(got[0].raw_data(), originals[1].raw_data(), static_cast<std::size_t>(sizes[1]) * 4), 0);
  const checkpoint::ManifestPiece& p = m.find("t1")->pieces.at(0);
  const fs::path file = fs::path(ck) / m.files[p.file].name;
  flip_byte(file, p.offset + (std::uint64_t{17} << 20), 0x01);   // the third 8 MiB span
  try {
    checkpoint::read_pieces(ck, m, request());
    ADD_FAILURE() << "read a corrupt piece";
  } catch (const checkpoint::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("'t1'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("fails its hash"), std::string::npos) << e.what();
  }
  fs::resize_file(file, p.offset + (std::uint64_t{10} << 20));
  try {
    checkpoint::read_pieces(ck, m, request());
    ADD_FAILURE() << "read a truncated piece";
  } catch (const checkpoint::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(m.files[p.file].name), std::string::npos) << e.what();
  }
}

TEST_F(CheckpointStoreTest, CheckpointDirectoryThatCannotBeUsedIsRefusedBeforeStepOne) {
  std::ofstream(path("file")) << "x";
  fs::create_directories(path("real"));
  fs::create_symlink(path("real"), path("link"));
  for (const auto& [dir, expected] : std::vector<std::pair<std::string, std::string>>{
           {path("file"), "not a directory"}, {path("link"), "symbolic link"}, {path("no/such/parent"), "parent"}}) {
    train::TrainOptions o = options(1);
    o.checkpoint_dir = dir;
    o.metrics_path = path("metrics.jsonl");
    try {
      run(o, {1, 1});
      ADD_FAILURE() << "accepted --checkpoint-dir " << dir;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(path("metrics.jsonl"))) << "the run started before refusing " << dir;
  }
  // --metrics naming the checkpoint directory (not there yet, or spelled another way) is refused
  // before anything is written: neither a metrics file nor a directory appears.
  for (const auto& [metrics, dir] : std::vector<std::pair<std::string, std::string>>{
           {path("ck"), path("ck")}, {path("ck"), path("ck") + "/"}, {path("sub/../ck"), path("ck")}}) {
    fs::create_directories(path("sub"));
    train::TrainOptions o = options(1);
    o.checkpoint_dir = dir;
    o.metrics_path = metrics;
    try {
      run(o, {1, 2});
      ADD_FAILURE() << "accepted --metrics " << metrics << " with --checkpoint-dir " << dir;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("is also the path of --metrics"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(path("ck"))) << "--metrics " << metrics << " / --checkpoint-dir " << dir << " left a file";
  }
}

// The saver's own check of the directory runs on rank 0; every rank throws rank 0's message (the
// threads backend reports whichever rank failed first, so a generic message on the others would
// hide the cause).
TEST_F(CheckpointStoreTest, EveryRankReportsWhyTheCheckpointDirectoryWasRefused) {
  std::ofstream(path("file")) << "x";
  on_threads({1, 3})([&](const dist::DeviceMeshPtr& mesh) {
    try {
      checkpoint::CheckpointSaver saver(path("file"), mesh, 0);
      ADD_FAILURE() << "rank " << mesh->rank() << " accepted a file as the checkpoint directory";
    } catch (const checkpoint::CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find("exists and is not a directory"), std::string::npos)
          << "rank " << mesh->rank() << ": " << e.what();
    }
  });
}

TEST_F(CheckpointStoreTest, SampleAndExportReadACheckpointLikeTheSavedFile) {
  // One run writes both a sharded checkpoint (at tp=2) and the --save file of the same weights.
  train::TrainOptions o = options(3);
  o.model.dtype = DType::Float32;
  o.checkpoint_dir = path("ck");
  o.save_path = path("w.safetensors");
  run(o, {1, 2});
  for (const MeshSpec& m : std::vector<MeshSpec>{{1, 1}, {1, 3}, {2, 2}}) {
    SCOPED_TRACE("sampled on " + m.str());
    generate::SampleJob job;
    job.prompt = "The ";
    job.tokens = 4;   // the model has 8 positions; the prompt takes 4
    job.checkpoint = path("ck");
    const generate::SampleResult from_checkpoint = generate::run_sample_job(job, on_threads(m));
    job.checkpoint = path("w.safetensors");
    const generate::SampleResult from_file = generate::run_sample_job(job, on_threads(m));
    EXPECT_EQ(from_checkpoint.new_tokens, from_file.new_tokens);
    EXPECT_EQ(from_checkpoint.new_tokens.size(), 4u);
  }
  interop::ExportOptions e;
  e.checkpoint = path("ck");
  e.out_dir = path("hf_from_ck");
  interop::export_hf(e);
  e.checkpoint = path("w.safetensors");
  e.out_dir = path("hf_from_file");
  interop::export_hf(e);
  const io::SafetensorsFile a(path("hf_from_ck/model.safetensors")), b(path("hf_from_file/model.safetensors"));
  ASSERT_EQ(a.names(), b.names());
  for (const std::string& name : a.names()) {
    const Tensor x = a.get(name), y = b.get(name);
    ASSERT_EQ(x.shape(), y.shape()) << name;
    EXPECT_EQ(x.to_vector(), y.to_vector()) << name;   // bitwise (float32 values as doubles)
  }
}

}  // namespace
}  // namespace meshgrad::launch::test_checkpoint_resume
