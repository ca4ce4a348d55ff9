// The commit every atomic write of meshgrad goes through (io/atomic_commit.hpp): a staged directory
// appears at its target whole or not at all, never replaces what the caller did not ask it to, and
// leaves nothing behind when it is abandoned; temporaries are named beside their target.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "io/scratch_directory.hpp"
#include "meshgrad/io/atomic_commit.hpp"
#include "meshgrad/io/file_io.hpp"

namespace meshgrad::io::test_atomic_commit {
namespace {

namespace fs = std::filesystem;

class AtomicCommitTest : public ScratchDirectoryTest {
 protected:
  // A directory `leaf` holding one file `name` with `text`.
  std::string make_directory(const std::string& leaf, const std::string& name, const std::string& text) const {
    fs::create_directories(dir_ / leaf);
    write_bytes((dir_ / leaf / name).string(), text);
    return path(leaf);
  }
};

TEST_F(AtomicCommitTest, AStageIsAHiddenTemporaryBesideItsTargetUntilItCommits) {
  const std::string target = path("export");
  {
    StagedDirectory stage = StagedDirectory::create_beside(target);
    EXPECT_EQ(fs::path(stage.path()).parent_path(), fs::path(target).parent_path());
    EXPECT_TRUE(fs::path(stage.path()).filename().string().starts_with(".export.tmp-")) << stage.path();
    EXPECT_TRUE(fs::is_directory(stage.path()));
    write_bytes((fs::path(stage.path()) / "a.txt").string(), "new");
    EXPECT_FALSE(fs::exists(target));   // nothing at the target before the commit
    stage.commit(ExistingTarget::kReplaceFileOrEmptyDirectory, ParentFlush::kRequired);
    EXPECT_FALSE(fs::exists(stage.path()));
  }
  EXPECT_EQ(read_bytes(path("export/a.txt")), "new");
  EXPECT_EQ(listing(), std::vector<std::string>{"export"});   // the committed stage is not removed
}

TEST_F(AtomicCommitTest, AStageDestroyedWithoutACommitLeavesNothing) {
  const std::string target = path("export");
  std::string stage_path;
  {
    StagedDirectory stage = StagedDirectory::create_beside(target);
    stage_path = stage.path();
    fs::create_directories(fs::path(stage_path) / "sub");
    write_bytes((fs::path(stage_path) / "sub" / "b.bin").string(), "half-written");
  }
  EXPECT_FALSE(fs::exists(stage_path));
  EXPECT_FALSE(fs::exists(target));
  EXPECT_TRUE(listing().empty());
}

TEST_F(AtomicCommitTest, ReplacingOnlyAnEmptyDirectoryRefusesANonEmptyTargetAndChangesNothing) {
  const std::string target = make_directory("export", "old.txt", "old");
  std::string stage_path;
  {
    StagedDirectory stage = StagedDirectory::create_beside(target);
    stage_path = stage.path();
    write_bytes((fs::path(stage_path) / "new.txt").string(), "new");
    try {
      stage.commit(ExistingTarget::kReplaceFileOrEmptyDirectory, ParentFlush::kRequired);
      ADD_FAILURE() << "a non-empty target was replaced";
    } catch (const FileIoError& e) {
      EXPECT_EQ(e.op(), FileIoError::Op::rename);
      EXPECT_NE(std::string(e.what()).find(fmt::format("cannot rename '{}' to '{}'", stage_path, target)), std::string::npos)
          << e.what();
      EXPECT_FALSE(e.reason().empty());
    }
    EXPECT_EQ(read_bytes((fs::path(stage_path) / "new.txt").string()), "new");   // the stage is intact until destroyed
  }
  EXPECT_EQ(read_bytes(path("export/old.txt")), "old");
  EXPECT_FALSE(fs::exists(path("export/new.txt")));
  EXPECT_EQ(listing(), std::vector<std::string>{"export"});   // the failed stage is gone
}

TEST_F(AtomicCommitTest, ReplacingOnlyAnEmptyDirectoryTakesTheEmptyOnesPlace) {
  fs::create_directories(dir_ / "export");
  StagedDirectory stage = StagedDirectory::create_beside(path("export"));
  write_bytes((fs::path(stage.path()) / "a.txt").string(), "new");
  stage.commit(ExistingTarget::kReplaceFileOrEmptyDirectory, ParentFlush::kIfPossible);
  EXPECT_EQ(read_bytes(path("export/a.txt")), "new");
  EXPECT_EQ(listing(), std::vector<std::string>{"export"});
}

// The exchange with rename flags (local file systems), and without them as on NFS, where renameat2
// answers EINVAL (MESHGRAD_IO_FAULT=no-rename-flags): the same outcomes either way.
class ExchangeTest : public AtomicCommitTest, public ::testing::WithParamInterface<bool> {
 protected:
  void SetUp() override {
    AtomicCommitTest::SetUp();
    if (GetParam()) ::setenv("MESHGRAD_IO_FAULT", "no-rename-flags", 1);
  }
  void TearDown() override {
    ::unsetenv("MESHGRAD_IO_FAULT");
    AtomicCommitTest::TearDown();
  }
};
INSTANTIATE_TEST_SUITE_P(RenameFlags, ExchangeTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) { return info.param ? "WithoutFlagsAsOnNfs" : "WithFlags"; });

TEST_P(ExchangeTest, AnExchangeReplacesAFullTargetAndRemovesTheOldOne) {
  const std::string target = make_directory("step_00000001", "old.bin", "old");
  const std::string stage_path = make_directory(".step_00000001.tmp", "new.bin", "new");
  StagedDirectory stage = StagedDirectory::adopt(stage_path, target);
  stage.commit(ExistingTarget::kExchangeAndRemoveOld, ParentFlush::kRequired);
  EXPECT_EQ(read_bytes(path("step_00000001/new.bin")), "new");
  EXPECT_FALSE(fs::exists(path("step_00000001/old.bin")));
  EXPECT_EQ(listing(), std::vector<std::string>{"step_00000001"});   // the old one, exchanged to the stage's path, removed
}

TEST_P(ExchangeTest, AnExchangeOntoNothingIsAPlainRename) {
  const std::string stage_path = make_directory(".step_00000002.tmp", "new.bin", "new");
  StagedDirectory stage = StagedDirectory::adopt(stage_path, path("step_00000002"));
  stage.commit(ExistingTarget::kExchangeAndRemoveOld, ParentFlush::kRequired);
  EXPECT_EQ(read_bytes(path("step_00000002/new.bin")), "new");
  EXPECT_EQ(listing(), std::vector<std::string>{"step_00000002"});
}

TEST_P(ExchangeTest, AFailedRenameNamesBothPathsAndLeavesTheStage) {
  const std::string stage_path = make_directory(".x.tmp", "a.bin", "a");
  const std::string target = path("missing-parent/x");
  try {
    rename_into_place(stage_path, target, ExistingTarget::kExchangeAndRemoveOld);
    ADD_FAILURE() << "renamed into a directory that does not exist";
  } catch (const FileIoError& e) {
    EXPECT_EQ(e.op(), FileIoError::Op::rename);
    EXPECT_EQ(e.path(), target);
    EXPECT_NE(std::string(e.what()).find(fmt::format("cannot rename '{}' to '{}': ", stage_path, target)), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(read_bytes(path(".x.tmp/a.bin")), "a");
}

TEST_F(AtomicCommitTest, AFileReplacesAFile) {
  write_bytes(path("out.bin"), "old");
  const std::string temp = unique_temporary_path(path("out.bin"));
  write_bytes(temp, "new");
  rename_into_place(temp, path("out.bin"), ExistingTarget::kReplaceFileOrEmptyDirectory);
  EXPECT_EQ(read_bytes(path("out.bin")), "new");
  EXPECT_EQ(listing(), std::vector<std::string>{"out.bin"});
}

TEST_F(AtomicCommitTest, TemporaryNamesAreUniqueBesideTheTargetAndSayWhoMadeThem) {
  const std::string a = unique_temporary_path(path("w.bin")), b = unique_temporary_path(path("w.bin"));
  EXPECT_NE(a, b);
  EXPECT_EQ(fs::path(a).parent_path(), dir_);
  const std::string leaf = fs::path(a).filename().string();
  EXPECT_TRUE(leaf.starts_with(fmt::format(".w.bin.tmp-{}-", ::getpid()))) << leaf;
  EXPECT_NE(leaf.find('@'), std::string::npos) << leaf;
  EXPECT_EQ(directory_of("w.bin"), ".");
  EXPECT_EQ(fs::path(unique_temporary_path("w.bin")).parent_path(), fs::path("."));
}

TEST_F(AtomicCommitTest, TheParentsFlushIsAnErrorOnlyWhenRequired) {
  EXPECT_NO_THROW(flush_directory_of(path("missing/x"), ParentFlush::kIfPossible));
  EXPECT_THROW(flush_directory_of(path("missing/x"), ParentFlush::kRequired), FileIoError);
  EXPECT_NO_THROW(flush_directory_of(path("x"), ParentFlush::kRequired));
}

}  // namespace
}  // namespace meshgrad::io::test_atomic_commit
