// The loops and flushes under every file meshgrad writes or reads (io/file_io.hpp): every byte
// moved across their chunks, and errors that name the operation, the path and the offset.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "io/scratch_directory.hpp"
#include "meshgrad/io/file_io.hpp"

namespace meshgrad::io::test_file_io {
namespace {

namespace fs = std::filesystem;

class FileIoTest : public ScratchDirectoryTest {};

TEST_F(FileIoTest, WriteAllAndReadExactMoveEveryByteAcrossTheirChunks) {
  std::vector<std::byte> data((9u << 20) + 123);   // more than one 8 MiB chunk
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::byte>((i * 131) >> 7);
  const std::string p = path("data.bin");
  {
    const UniqueFd fd(::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    ASSERT_GE(fd.get(), 0);
    write_all(fd.get(), data.data(), data.size(), p);
    fsync_file(fd.get(), p);
  }
  EXPECT_EQ(fs::file_size(p), data.size());
  const UniqueFd fd(::open(p.c_str(), O_RDONLY | O_CLOEXEC));
  std::vector<std::byte> back(data.size() - 1000);
  read_exact(fd.get(), back.data(), back.size(), 1000, p);
  EXPECT_TRUE(std::equal(back.begin(), back.end(), data.begin() + 1000));
}

TEST_F(FileIoTest, ReadingPastTheEndNamesTheFileAndTheOffset) {
  write_bytes(path("short.bin"), std::string(100, 'x'));
  const UniqueFd fd(::open(path("short.bin").c_str(), O_RDONLY | O_CLOEXEC));
  char buf[64];
  try {
    read_exact(fd.get(), buf, sizeof buf, 90, path("short.bin"));
    ADD_FAILURE() << "read past the end of the file";
  } catch (const FileIoError& e) {
    EXPECT_EQ(e.op(), FileIoError::Op::read);
    EXPECT_EQ(std::string(e.what()), fmt::format("'{}' ends before offset 100 (truncated)", path("short.bin")));
  }
}

TEST_F(FileIoTest, AWriteErrorNamesTheFileAndWhy) {
  write_bytes(path("ro.bin"), "x");
  const UniqueFd fd(::open(path("ro.bin").c_str(), O_RDONLY | O_CLOEXEC));   // not open for writing: EBADF
  try {
    write_all(fd.get(), "abc", 3, path("ro.bin"));
    ADD_FAILURE() << "wrote through a read-only descriptor";
  } catch (const FileIoError& e) {
    EXPECT_EQ(e.op(), FileIoError::Op::write);
    EXPECT_EQ(e.reason(), errno_text(EBADF));
    EXPECT_EQ(std::string(e.what()), fmt::format("writing '{}' failed: {}", path("ro.bin"), errno_text(EBADF)));
  }
}

TEST_F(FileIoTest, FlushingADirectoryThatCannotBeOpenedIsAnErrorOnlyWhenRequired) {
  const std::string missing = path("missing");
  try {
    fsync_directory(missing);
    ADD_FAILURE() << "flushed a directory that does not exist";
  } catch (const FileIoError& e) {
    EXPECT_EQ(e.op(), FileIoError::Op::open);
    EXPECT_NE(std::string(e.what()).find(fmt::format("cannot open '{}' to flush it", missing)), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(fsync_directory_if_possible(missing));
  EXPECT_NO_THROW(fsync_directory(dir_.string()));
}

// A FIFO with no writer made open() block for ever (reliability-2 C14: checkpoint verify and resume
// hung on one put in a rank file's place); it, a directory and a device are refused at once.
TEST_F(FileIoTest, OpeningARegularFileRefusesAFifoWithoutBlocking) {
  const std::string fifo = path("rank_00001.bin");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    open_regular_file(fifo, nullptr);
    ADD_FAILURE() << "opened a FIFO";
  } catch (const FileIoError& e) {
    EXPECT_EQ(e.op(), FileIoError::Op::open);
    EXPECT_NE(std::string(e.what()).find("is not a regular file (a FIFO)"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  fs::create_directories(path("adir"));
  try {
    open_regular_file(path("adir"), nullptr);
    ADD_FAILURE() << "opened a directory";
  } catch (const FileIoError& e) {
    EXPECT_NE(std::string(e.what()).find("(a directory)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(open_regular_file("/dev/null", nullptr), FileIoError);
  write_bytes(path("plain.bin"), "12345");
  std::uint64_t size = 0;
  const UniqueFd fd = open_regular_file(path("plain.bin"), &size);
  EXPECT_EQ(size, 5u);
  char buf[5];
  read_exact(fd.get(), buf, 5, 0, path("plain.bin"));   // blocking reads again
  EXPECT_EQ(std::string(buf, 5), "12345");
}

TEST_F(FileIoTest, AUniqueFdClosesItsDescriptorOnceAndHandsItOver) {
  const int raw = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  ASSERT_GE(raw, 0);
  {
    UniqueFd a(raw);
    UniqueFd b(std::move(a));
    EXPECT_EQ(a.get(), -1);
    EXPECT_EQ(b.get(), raw);
    EXPECT_GE(::fcntl(raw, F_GETFD), 0);   // still open while owned
  }
  EXPECT_EQ(::fcntl(raw, F_GETFD), -1);   // closed by the owner's destruction
  EXPECT_EQ(errno, EBADF);
}

}  // namespace
}  // namespace meshgrad::io::test_file_io
