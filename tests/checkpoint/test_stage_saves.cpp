// Checkpoints of ranks that hold different tensors (pipeline stages, each with its own blocks): one
// save writes the union, each tensor's boxes by ranks that hold it, and reads back whole; a tensor
// that two ranks describe differently is refused naming both.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <chrono>
#include <mutex>

#include "io/scratch_directory.hpp"
#include "meshgrad/checkpoint/directory.hpp"
#include "meshgrad/checkpoint/reader.hpp"
#include "meshgrad/checkpoint/saver.hpp"
#include "meshgrad/comm/threads.hpp"
#include "meshgrad/distributed/layout.hpp"
#include "meshgrad/tensor/random.hpp"

namespace meshgrad::checkpoint::test_stage_saves {
namespace {

using dist::Placement;

class StageSaves : public io::ScratchDirectoryTest {
 protected:
  // Runs fn on the 4 ranks of pp=2,tp=2 (axes pp, dp, tp).
  void on_stages(const std::function<void(const dist::DeviceMeshPtr&)>& fn) {
    comm::ThreadsOptions options;
    options.timeout = std::chrono::milliseconds(20000);
    comm::run_ranks(4, [&](const comm::CommunicatorPtr& world) {
      fn(std::make_shared<const dist::DeviceMesh>(world, dist::parse_mesh("pp=2,tp=2")));
    }, options);
  }
};

// The full tensors of the test: every rank can make them (seeded).
Tensor full_of(const std::string& name, const Shape& shape) {
  return random::randn(shape, std::hash<std::string>{}(name) % 1000, DType::Float32);
}

StateTensor piece_of(const std::string& name, const Shape& shape, const dist::Placements& placements,
                     const dist::DeviceMesh& mesh) {
  const dist::PieceLayout layout = dist::piece_layout(shape, mesh, placements, mesh.coordinates());
  return {name, shape, placements, dist::take_piece(full_of(name, shape), layout)};
}

TEST_F(StageSaves, EachStageWritesItsOwnTensorsIntoOneCheckpointThatReadsBackWhole) {
  const dist::Placements rows_on_tp{Placement::replicate(), Placement::replicate(), Placement::shard(0)};
  const dist::Placements replicated(3, Placement::replicate());
  on_stages([&](const dist::DeviceMeshPtr& mesh) {
    const int stage = mesh->coordinate("pp");
    std::vector<StateTensor> mine{piece_of(fmt::format("stage{}.w", stage), {6, 4}, rows_on_tp, *mesh),
                                  piece_of("shared", {3}, replicated, *mesh)};
    CheckpointSaver saver(path("ck"), mesh, 0, /*files_per_rank=*/1);
    saver.save(1, mine, {{"step", 1}}, /*async=*/false);
  });
  const std::string dir = path("ck/step_00000001");
  const Manifest m = read_manifest(dir);
  ASSERT_EQ(m.tensors.size(), 3u);
  // Stage 1's tensor lies in the files of stage 1's ranks (2 and 3), stage 0's in ranks 0 and 1's.
  for (const auto& [name, ranks] : {std::pair<std::string, std::vector<std::string>>{"stage0.w", {"rank_00000.bin",
                                                                                                  "rank_00001.bin"}},
                                    {"stage1.w", {"rank_00002.bin", "rank_00003.bin"}}}) {
    const ManifestTensor* t = m.find(name);
    ASSERT_NE(t, nullptr) << name;
    ASSERT_EQ(t->pieces.size(), 2u) << name;
    for (const ManifestPiece& p : t->pieces) {
      EXPECT_NE(std::find(ranks.begin(), ranks.end(), m.files[p.file].name), ranks.end())
          << name << " written into " << m.files[p.file].name;
    }
  }
  EXPECT_EQ(m.find("shared")->pieces.size(), 1u) << "a tensor every rank holds is written once";
  // Whole (the layout of a tensor held whole: one range per dim).
  for (const auto& [name, shape] : {std::pair<std::string, Shape>{"stage0.w", {6, 4}}, {"stage1.w", {6, 4}},
                                    {"shared", {3}}}) {
    dist::PieceLayout whole;
    for (const std::int64_t d : shape) whole.ranges.push_back({ShardRange{0, d}});
    whole.local_shape = shape;
    const PieceRequest r{name, shape, whole, DType::Float32};
    EXPECT_TRUE(bitwise_equal(read_pieces(dir, m, {r})[0], full_of(name, shape))) << name;
  }
}

TEST_F(StageSaves, ATensorTwoRanksDescribeDifferentlyIsRefusedNamingBoth) {
  const dist::Placements replicated(3, Placement::replicate());
  std::mutex mu;
  std::vector<std::string> errors;
  on_stages([&](const dist::DeviceMeshPtr& mesh) {
    const Shape shape = mesh->coordinate("pp") == 0 ? Shape{3} : Shape{4};
    CheckpointSaver saver(path("ck"), mesh, 0, 1);
    try {
      saver.save(1, {piece_of("shared", shape, replicated, *mesh)}, {{"step", 1}}, false);
    } catch (const CheckpointError& e) {
      const std::lock_guard<std::mutex> lock(mu);
      errors.push_back(e.what());
    }
  });
  ASSERT_EQ(errors.size(), 4u) << "every rank refuses";
  EXPECT_NE(errors[0].find("ranks describe state tensor 'shared' differently: float32 [3]"), std::string::npos)
      << errors[0];
  EXPECT_NE(errors[0].find("float32 [4]"), std::string::npos) << errors[0];
  EXPECT_TRUE(list_checkpoints(path("ck")).empty()) << "nothing committed";
}

// A failed save says why on every rank (reliability-3 N81): the error of the rank that failed is
// passed to the others, whichever rank's error the launcher prints.
TEST_F(StageSaves, ACommitThatFailsOnRankZeroGivesItsCauseOnEveryRank) {
  const dist::Placements replicated(3, Placement::replicate());
  std::mutex mu;
  std::vector<std::string> errors;
  on_stages([&](const dist::DeviceMeshPtr& mesh) {
    CheckpointSaver saver(path("ck"), mesh, 0, 1);
    try {
      // The manifest is UTF-8 JSON: a state string that is not cannot be written (rank 0's commit).
      saver.save(1, {piece_of("shared", {3}, replicated, *mesh)}, {{"data", "d\xFF.txt"}}, false);
    } catch (const CheckpointError& e) {
      const std::lock_guard<std::mutex> lock(mu);
      errors.push_back(e.what());
    }
  });
  ASSERT_EQ(errors.size(), 4u) << "every rank fails";
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("checkpoint of step 1 was not committed"), std::string::npos) << e;
    EXPECT_NE(e.find("not valid UTF-8"), std::string::npos) << e;
  }
  EXPECT_TRUE(list_checkpoints(path("ck")).empty()) << "nothing committed";
}

TEST_F(StageSaves, AWriteThatFailsOnOneRankGivesItsCauseOnEveryRank) {
  const dist::Placements replicated(3, Placement::replicate());
  std::mutex mu;
  std::vector<std::string> errors;
  on_stages([&](const dist::DeviceMeshPtr& mesh) {
    CheckpointSaver saver(path("ck"), mesh, 0, 1);
    if (mesh->rank() == 2) {
      // Rank 2's file cannot be created: a directory holds its name.
      ::mkdir(path("ck/.step_00000001.tmp").c_str(), 0755);
      ::mkdir(path("ck/.step_00000001.tmp/rank_00002.bin").c_str(), 0755);
    }
    try {
      saver.save(1, {piece_of("w", {8}, dist::Placements{Placement::shard(0), Placement::replicate(),
                                                           Placement::shard(0)}, *mesh)},
                 {{"step", 1}}, false);
    } catch (const CheckpointError& e) {
      const std::lock_guard<std::mutex> lock(mu);
      errors.push_back(e.what());
    }
  });
  ASSERT_EQ(errors.size(), 4u) << "every rank fails";
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("checkpoint of step 1 was not committed"), std::string::npos) << e;
    EXPECT_NE(e.find("rank_00002.bin"), std::string::npos) << "the cause, on every rank: " << e;
  }
  EXPECT_TRUE(list_checkpoints(path("ck")).empty()) << "nothing committed";
}

}  // namespace
}  // namespace meshgrad::checkpoint::test_stage_saves
