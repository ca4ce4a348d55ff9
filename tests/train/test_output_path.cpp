// Output paths: the checks made before a run starts, atomic writes that clean up after themselves
// (and after dead processes), and the trainer refusing bad outputs before its first step.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
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
#include "meshgrad/train/run_config.hpp"
#include "meshgrad/train/trainer.hpp"

namespace meshgrad::train::test_output_path {
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

// ---- reliability-3 (issue 37): outputs refused up front -------------------------------------------

// N80, N81: text a run records (checkpoint manifests and --save's metadata are strict UTF-8 JSON) that
// is not UTF-8 used to fail the run at its first save, after the training.
TEST_F(OutputPathTest, TrainRefusesRecordedTextThatIsNotUtf8BeforeTheFirstStep) {
  TrainOptions base = tiny_run(1'000'000);   // would take hours if it started
  base.metrics_path = path("metrics.jsonl");
  base.save_path = path("w.safetensors");
  const std::string data = make_file("d\xFF.txt", std::string(4096, 'a'));
  TrainOptions o = base;
  o.data_path = data;
  std::string message = error_of([&] { train_on_two_ranks(o); });
  EXPECT_NE(message.find("--data '" + path("d\\xFF.txt") + "' is not valid UTF-8"), std::string::npos) << message;
  EXPECT_NE(message.find(fmt::format("byte 0xFF at offset {}", data.size() - 5)), std::string::npos) << message;
  o = base;
  o.checkpoint_dir = path("ck\xFE");
  message = error_of([&] { train_on_two_ranks(o); });
  EXPECT_NE(message.find("--checkpoint-dir"), std::string::npos) << message;
  EXPECT_FALSE(fs::exists(o.checkpoint_dir)) << "refused before the saver made the directory";
  o = base;
  o.sample_prompt = "\xFF\xFE";
  o.sample_every = 2;
  o.sampler = [](const nn::ModelConfig&, const std::vector<std::pair<std::string, Tensor>>&, int) { return std::string(); };
  message = error_of([&] { train_on_two_ranks(o); });
  EXPECT_NE(message.find("--sample-prompt '\\xFF\\xFE' is not valid UTF-8 (byte 0xFF at offset 0)"), std::string::npos)
      << message;
  EXPECT_FALSE(fs::exists(base.metrics_path)) << "the run got as far as opening its metrics";
}

// The backstop for the rest of a record: the place in it, the text escaped, the offset.
TEST(RecordText, AStringThatIsNotUtf8IsNamedByItsPlace) {
  const nlohmann::json ok{{"data", {{"source", "caf\xC3\xA9.txt"}}}};
  EXPECT_NO_THROW(check_record_text(ok, "a checkpoint"));
  const nlohmann::json bad{{"data", {{"identity", {{"files", {"a.bin", "b\xFF.bin"}}}}}}};
  const std::string message = error_of([&] { check_record_text(bad, "a checkpoint"); });
  EXPECT_NE(message.find("a checkpoint would record 'b\\xFF.bin' at /data/identity/files/1"), std::string::npos) << message;
  EXPECT_NE(message.find("byte 0xFF at offset 1"), std::string::npos) << message;
  const nlohmann::json bad_key{{"k\xFE", 1}};
  EXPECT_NE(error_of([&] { check_record_text(bad_key, "x"); }).find("at /k\\xFE"), std::string::npos);
}

// N84, N85: an output file under a name the checkpoints use was destroyed by a save (--metrics
// ck/step_00000002) or failed after the training (--save ck/step_00000004).
TEST_F(OutputPathTest, AnOutputUnderACheckpointNameIsRefusedNamingBothOptions) {
  fs::create_directories(dir_ / "ck");
  const io::NamedPath root{"--checkpoint-dir", path("ck")};
  for (const std::string leaf : {"ck/step_00000002", "ck/.lock", "ck/.step_00000004.tmp", "ck/step_00000002/m.jsonl",
                                 "ck/../ck/step_00000006"}) {
    const std::string message =
        error_of([&] { checkpoint::check_outputs_outside_checkpoint_names(root, {{"--metrics", path(leaf)}}); });
    EXPECT_NE(message.find("--metrics '" + path(leaf) + "' lies in --checkpoint-dir"), std::string::npos) << message;
  }
  // Other names in the directory, and the directory's neighbours, are the user's.
  for (const std::string leaf : {"ck/metrics.jsonl", "ck/step_2", "ck/w.safetensors", "step_00000002", "ck2/.lock"}) {
    EXPECT_NO_THROW(checkpoint::check_outputs_outside_checkpoint_names(root, {{"--save", path(leaf)}})) << leaf;
  }
}

// C19: outputs that cannot fit are refused with the bytes needed and free; two on one file system
// add up.
TEST_F(OutputPathTest, OutputsThatCannotFitAreRefusedNamingTheSpace) {
  struct statvfs vfs {};
  ASSERT_EQ(::statvfs(dir_.c_str(), &vfs), 0);
  const std::uint64_t free = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  const std::uint64_t half = free / 2 + (std::uint64_t{1} << 30);   // a GiB of slack for others' writes
  EXPECT_NO_THROW(io::check_free_space({{{"--save", path("w.safetensors")}, 1 << 20}}));
  std::string message = error_of([&] { io::check_free_space({{{"--save", path("w.safetensors")}, free * 4}}); });
  EXPECT_NE(message.find("not enough free space for --save '" + path("w.safetensors") + "'"), std::string::npos) << message;
  EXPECT_NE(message.find(fmt::format("at least {} bytes", free * 4)), std::string::npos) << message;
  // Both on the file system of dir_ (the checkpoint directory not made yet: its parent's).
  message = error_of([&] {
    io::check_free_space({{{"--save", path("w.safetensors")}, half}, {{"--checkpoint-dir", path("ck")}, half}});
  });
  if (half <= free) {
    EXPECT_NE(message.find("--save '" + path("w.safetensors") + "'"), std::string::npos) << message;
    EXPECT_NE(message.find("and --checkpoint-dir '" + path("ck") + "'"), std::string::npos) << message;
  }
}

// C17: one writer per metrics file; the second is refused naming who holds it.
TEST_F(OutputPathTest, ASecondWriterOfALockedOutputIsRefusedNamingTheHolder) {
  const std::string file = make_file("m.jsonl");
  const io::UniqueFd first(::open(file.c_str(), O_WRONLY | O_CLOEXEC));
  const io::UniqueFd second(::open(file.c_str(), O_WRONLY | O_CLOEXEC));
  io::lock_output(first.get(), {"--metrics", file});
  const std::string message = error_of([&] { io::lock_output(second.get(), {"--metrics", file}); });
  EXPECT_NE(message.find("--metrics '" + file + "' is in use by another run (this process holds its lock)"),
            std::string::npos) << message;
}

// C17 through train: a second run on a live run's metrics file is refused and leaves it alone.
TEST_F(OutputPathTest, TrainRefusesAMetricsFileAnotherRunWrites) {
  const std::string history = "{\"type\":\"header\"}\n{\"step\":1}\n";
  const std::string file = make_file("live.jsonl", history);
  const io::UniqueFd live(::open(file.c_str(), O_WRONLY | O_CLOEXEC));
  io::lock_output(live.get(), {"--metrics", file});
  TrainOptions o = tiny_run(2);
  o.metrics_path = file;
  const std::string message = error_of([&] { train_on_two_ranks(o); });
  EXPECT_NE(message.find("is in use by another run"), std::string::npos) << message;
  EXPECT_EQ(io::read_bytes(file), history);
}

// N9, N10: options that make the run's figures meaningless are refused naming them.
TEST(TrainOptionChecks, WeightDecayThatFlipsTheWeightsAndAnImpossiblePeakAreRefused) {
  TrainOptions o = tiny_run(2);
  o.weight_decay = 1e308;
  std::string message = error_of([&] { train_on_two_ranks(o); });
  EXPECT_NE(message.find("--lr 0.003 times --weight-decay 1e+308"), std::string::npos) << message;
  o = tiny_run(2);
  o.lr = 0.5;
  o.weight_decay = 2;
  EXPECT_NE(error_of([&] { check_optimizer_options(o); }).find("--weight-decay 2 is 1"), std::string::npos);
  for (const double peak : {-5.0, 1e-300, std::nan(""), HUGE_VAL, 1e300}) {
    o = tiny_run(2);
    o.peak_gflops = peak;
    message = error_of([&] { train_on_two_ranks(o); });
    EXPECT_NE(message.find("--peak-gflops must be 0 (measured at start) or the mesh's peak GFLOP/s"), std::string::npos)
        << peak << ": " << message;
  }
}

}  // namespace
}  // namespace meshgrad::train::test_output_path
