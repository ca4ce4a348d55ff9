// Output paths: the checks made before a run starts, atomic writes that clean up after themselves
// (and after dead processes), and the trainer refusing bad outputs before its first step.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits.h>
#include <stdexcept>
#include <string>
#include <vector>

#include "io/scratch_directory.hpp"
#include "meshgrad/comm/threads.hpp"
#include "meshgrad/checkpoint/directory.hpp"
#include "meshgrad/checkpoint/parameter_file.hpp"
#include "meshgrad/checkpoint/saver.hpp"
#include "meshgrad/io/output_path.hpp"
#include "meshgrad/io/safetensors.hpp"
#include "meshgrad/train/trainer.hpp"

namespace meshgrad::train {
namespace {

namespace fs = std::filesystem;

class OutputPathTest : public io::ScratchDirectoryTest {
 protected:
  std::string make_file(const std::string& leaf, const std::string& text = "data") const {
    std::ofstream(dir_ / leaf) << text;
    return path(leaf);
  }
  // Expects check_output_paths to throw InvalidArgument whose message holds every needle.
  static void expect_refused(const std::vector<io::NamedPath>& outputs, const std::vector<io::NamedPath>& inputs,
                             const std::vector<std::string>& needles) {
    try {
      io::check_output_paths(outputs, inputs);
      ADD_FAILURE() << "accepted " << (outputs.empty() ? "" : outputs.back().path);
    } catch (const InvalidArgument& e) {
      for (const auto& n : needles)
        EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << "no \"" << n << "\" in " << e.what();
    }
  }
};

TEST_F(OutputPathTest, AbsentAndRegularTargetsInWritableDirectoriesPass) {
  EXPECT_NO_THROW(io::check_output_paths({{"--save", path("new.safetensors")}, {"--metrics", make_file("old.jsonl")}},
                                     {{"--data", make_file("data.txt")}, {"--data", path("missing.txt")}}));
  EXPECT_NO_THROW(io::check_output_paths({}, {}));
  // An output directory that is not there yet, with or without a trailing separator; a file inside it.
  EXPECT_NO_THROW(io::check_output_directory({"--checkpoint-dir", path("ck")}, {}, {{"--save", path("ck/w.safetensors")}}));
  EXPECT_NO_THROW(io::check_output_directory({"--checkpoint-dir", path("ck") + "/"}, {}));
}

TEST_F(OutputPathTest, AnOutputFileAtTheOutputDirectorysPathIsRefused) {
  for (const std::string& dir : {path("ck"), path("ck") + "/", path("x/../ck")}) {
    try {
      io::check_output_directory({"--checkpoint-dir", dir}, {}, {{"--metrics", path("ck")}});
      ADD_FAILURE() << "accepted --metrics at --checkpoint-dir " << dir;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("is also the path of --metrics"), std::string::npos) << e.what();
    }
  }
}

TEST_F(OutputPathTest, UnusablePathsAreRefusedNamingTheOption) {
  expect_refused({{"--save", ""}}, {}, {"--save: the path is empty"});
  expect_refused({{"--save", path("sub") + "/"}}, {}, {"--save", "names a directory, not a file"});
  expect_refused({{"--save", path("no/such/dir/w.safetensors")}}, {}, {"--save", "its directory", "No such file"});
  make_file("plain");
  expect_refused({{"--out", path("plain/w.safetensors")}}, {}, {"--out", "plain' is not a directory"});
  fs::create_directories(dir_ / "adir");
  expect_refused({{"--metrics", path("adir")}}, {}, {"--metrics", "is a directory"});
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0600), 0);
  expect_refused({{"--metrics", path("fifo")}}, {}, {"--metrics", "is a FIFO"});
  expect_refused({{"--save", "/dev/null"}}, {}, {"--save '/dev/null'", "is a character device"});
  fs::create_symlink(make_file("target.bin"), dir_ / "link");
  expect_refused({{"--save", path("link")}}, {}, {"--save", "is a symbolic link", "give the path of its target"});
}

// An output that is an input is refused whatever the spelling: compared by device and inode.
TEST_F(OutputPathTest, AnOutputThatIsAnInputIsRefusedNamingBoth) {
  const std::string data = make_file("corpus.txt");
  expect_refused({{"--metrics", data}}, {{"--data", data}}, {"--metrics '", "same file as --data '"});
  const std::string other_spelling = (dir_ / "." / ".." / dir_.filename() / "corpus.txt").string();
  expect_refused({{"--save", other_spelling}}, {{"--data", data}}, {"--save", "--data"});
  ASSERT_EQ(::link(data.c_str(), path("hardlink.txt").c_str()), 0);
  expect_refused({{"--out", path("hardlink.txt")}}, {{"--weights", data}}, {"--out", "--weights"});
  fs::create_symlink(data, dir_ / "input_link");   // the input given through a link
  expect_refused({{"--out", data}}, {{"--batch", path("input_link")}}, {"--out", "--batch"});
  EXPECT_EQ(io::read_bytes(data), "data");
}

TEST_F(OutputPathTest, TwoOutputsNamingOneFileAreRefused) {
  expect_refused({{"--save", path("x")}, {"--metrics", path("x")}}, {}, {"--save", "--metrics", "name the same file"});
  expect_refused({{"--save", path("x")}, {"--metrics", (dir_ / "." / "x").string()}}, {}, {"name the same file"});
}

TEST_F(OutputPathTest, AnExceptionMidWriteLeavesTheOldFileAndNoTemporary) {
  const std::string p = make_file("out.bin", "old");
  try {
    io::AtomicFileWriter w(p);
    w.write("new", 3, "the first part");
    EXPECT_TRUE(fs::exists(w.temp_path()));
    EXPECT_TRUE(fs::path(w.temp_path()).filename().string().starts_with(".out.bin.tmp-"));
    throw std::runtime_error("interrupted");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(io::read_bytes(p), "old");
  EXPECT_EQ(listing(), std::vector<std::string>{"out.bin"});

  {
    io::AtomicFileWriter w(p);
    w.write("new", 3, "all");
    w.commit();
  }
  EXPECT_EQ(io::read_bytes(p), "new");
  EXPECT_EQ(listing(), std::vector<std::string>{"out.bin"});
}

// The target is checked again at commit: a directory made there meanwhile is not replaced.
TEST_F(OutputPathTest, ATargetThatBecameADirectoryIsNotReplacedAtCommit) {
  const std::string p = path("out.bin");
  {
    io::AtomicFileWriter w(p);
    w.write("x", 1, "x");
    fs::create_directories(p);
    try {
      w.commit();
      ADD_FAILURE() << "commit replaced a directory";
    } catch (const io::OutputFileError& e) {
      EXPECT_NE(std::string(e.what()).find("is a directory"), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(fs::is_directory(p));
  EXPECT_EQ(listing(), std::vector<std::string>{"out.bin"});
}

pid_t dead_pid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  int status = 0;
  ::waitpid(child, &status, 0);
  return child;
}

TEST_F(OutputPathTest, StaleTemporariesOfDeadProcessesAreRemovedAtTheNextWrite) {
  char host[HOST_NAME_MAX + 1] = {};
  ASSERT_EQ(::gethostname(host, sizeof host - 1), 0);
  const pid_t dead = dead_pid();
  const pid_t alive = ::getppid();
  const std::string dead_here = fmt::format(".w.bin.tmp-{}-0000abcd-0@{}", dead, host);
  const std::string dead_legacy = fmt::format(".w.bin.tmp-{}-0000abcd-3", dead);   // older name, no host
  const std::string alive_here = fmt::format(".w.bin.tmp-{}-0000abcd-0@{}", alive, host);
  const std::string elsewhere = fmt::format(".w.bin.tmp-{}-0000abcd-0@another-host-{}", dead, host);
  const std::string other_target = fmt::format(".v.bin.tmp-{}-0000abcd-0@{}", dead, host);
  for (const auto& leaf : {dead_here, dead_legacy, alive_here, elsewhere, other_target}) make_file(leaf);
  {
    io::AtomicFileWriter w(path("w.bin"));
    w.write("ok", 2, "ok");
    w.commit();
  }
  std::vector<std::string> expected{alive_here, elsewhere, other_target, "w.bin"};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(listing(), expected);
  EXPECT_EQ(io::remove_stale_temporaries(path("w.bin")), 0);
}

// ---- the trainer --------------------------------------------------------------------------------

TrainOptions tiny_run(int steps) {
  TrainOptions o;
  o.model.kind = "gpt";
  o.model.layers = 1;
  o.model.hidden = 16;
  o.model.heads = 4;
  o.model.seq = 8;
  o.model.batch = 2;
  o.steps = steps;
  o.progress = false;
  return o;
}

void train_on_two_ranks(const TrainOptions& o) {
  comm::ThreadsOptions options;
  options.timeout = std::chrono::milliseconds(60000);
  comm::run_ranks(
      2,
      [&](const comm::CommunicatorPtr& world) {
        train(o, std::make_shared<const dist::DeviceMesh>(world, std::vector<dist::MeshAxis>{{"dp", 1}, {"tp", 2}}));
      },
      options);
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// --save into a missing directory used to fail only after every step had run.
TEST_F(OutputPathTest, TrainRefusesAnUnwritableSaveBeforeTheFirstStep) {
  TrainOptions o = tiny_run(1'000'000);   // would take hours if it started
  o.save_path = path("no/such/dir/w.safetensors");
  o.metrics_path = path("metrics.jsonl");
  const std::string message = error_of([&] { train_on_two_ranks(o); });
  EXPECT_NE(message.find("--save"), std::string::npos) << message;
  EXPECT_NE(message.find("no/such/dir"), std::string::npos) << message;
  EXPECT_FALSE(fs::exists(o.metrics_path)) << "the run got as far as opening its metrics";
}

// --metrics equal to --data used to truncate the corpus under rank 1's feet.
TEST_F(OutputPathTest, TrainRefusesToOverwriteItsData) {
  const std::string corpus(4096, 'a');
  TrainOptions o = tiny_run(2);
  o.data_path = make_file("corpus.txt", corpus);
  o.metrics_path = o.data_path;
  std::string message = error_of([&] { train_on_two_ranks(o); });
  EXPECT_NE(message.find("--metrics"), std::string::npos) << message;
  EXPECT_NE(message.find("same file as --data"), std::string::npos) << message;
  o.metrics_path = "";
  o.save_path = o.data_path;
  message = error_of([&] { train_on_two_ranks(o); });
  EXPECT_NE(message.find("--save"), std::string::npos) << message;
  EXPECT_EQ(io::read_bytes(o.data_path), corpus);
}

// The full Hugging Face-named file is still written, and loads back.
TEST_F(OutputPathTest, TrainSaveStillWritesTheFullNamedFile) {
  TrainOptions o = tiny_run(2);
  o.save_path = path("w.safetensors");
  train_on_two_ranks(o);
  const io::SafetensorsFile file(o.save_path);
  EXPECT_TRUE(file.contains("wte.weight"));
  EXPECT_EQ(file.entry("wte.weight").shape, (Shape{256, 16}));
  EXPECT_EQ(file.entry("h.0.mlp.c_fc.weight").shape, (Shape{16, 64}));
  EXPECT_EQ(file.metadata().at("format"), "pt");
  EXPECT_EQ(listing(), std::vector<std::string>{"w.safetensors"});
  // What `grads --weights` does with it: every parameter of the same model loads.
  comm::run_ranks(1, [&](const comm::CommunicatorPtr& world) {
    const auto mesh = std::make_shared<const dist::DeviceMesh>(world, std::vector<dist::MeshAxis>{{"dp", 1}, {"tp", 1}});
    nn::ModelConfig config = o.model;
    auto model = nn::make_model(config, {}, mesh, 99);
    checkpoint::load_parameters(o.save_path, model->parameters(), mesh->group("tp"));
    for (nn::Parameter* p : model->parameters())
      EXPECT_EQ(p->value.to_vector(), file.get(p->name).to_vector()) << p->name;
  });
}

// A run refused because another run holds its checkpoint directory must not touch the metrics file,
// which may be that other run's (reliability-2 C16: 1,316 lines became 2).
TEST_F(OutputPathTest, ARunRefusedForTheCheckpointLockLeavesTheMetricsFileAlone) {
  const std::string history = "{\"type\":\"header\"}\n{\"step\":1}\n{\"step\":2}\n";
  TrainOptions o = tiny_run(3);
  o.metrics_path = make_file("live.jsonl", history);
  o.checkpoint_dir = path("ck");
  std::string message;
  comm::run_ranks(2, [&](const comm::CommunicatorPtr& world) {
    const auto mesh = std::make_shared<const dist::DeviceMesh>(world, std::vector<dist::MeshAxis>{{"dp", 1}, {"tp", 2}});
    // The live run: it holds the directory's lock.
    const checkpoint::CheckpointSaver live(o.checkpoint_dir, mesh, 0);
    const std::string e = error_of([&] { train(o, mesh); });
    if (mesh->rank() == 0) message = e;
  });
  EXPECT_NE(message.find(".lock"), std::string::npos) << message;
  EXPECT_EQ(io::read_bytes(o.metrics_path), history);
}

// A resumed run refused for another model shape must not have appended its header to the metrics
// (reliability-2 C25).
TEST_F(OutputPathTest, ARefusedResumeWritesNoMetrics) {
  TrainOptions o = tiny_run(2);
  o.checkpoint_dir = path("ck");
  o.metrics_path = path("first.jsonl");
  train_on_two_ranks(o);
  const std::string first = io::read_bytes(o.metrics_path);
  TrainOptions again = tiny_run(4);
  again.model.positions = 16;   // wpe of another shape: refused when the state loads
  again.resume_dir = checkpoint::resolve_checkpoint(o.checkpoint_dir);
  again.metrics_path = o.metrics_path;
  const std::string message = error_of([&] { train_on_two_ranks(again); });
  EXPECT_NE(message.find("wpe.weight"), std::string::npos) << message;
  EXPECT_EQ(io::read_bytes(o.metrics_path), first);
}

}  // namespace
}  // namespace meshgrad::train
