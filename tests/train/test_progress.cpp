// The progress display and MFU's peak (train/progress.hpp): the ETA from recent step times, lines
// that fit the terminal, and the peak cached per machine (issue 42's friction list).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "train/progress.hpp"

namespace meshgrad::train::test_progress {
namespace {

TEST(Progress, TheEtaIsTheMedianOfTheRecentStepsTimesTheStepsLeft) {
  EXPECT_LT(eta_seconds({}, 10), 0) << "nothing measured: unknown";
  EXPECT_DOUBLE_EQ(eta_seconds({200}, 10), 2.0);
  // A slow step among the recent ones moves the median, not the mean: 100 ms, not 280.
  EXPECT_DOUBLE_EQ(eta_seconds({100, 100, 1000, 100, 100}, 50), 5.0);
  EXPECT_DOUBLE_EQ(eta_seconds({100, 300}, 10), 2.0);
  EXPECT_DOUBLE_EQ(eta_seconds({100}, 0), 0.0);
  EXPECT_EQ(format_duration(-1), "--");
  EXPECT_EQ(format_duration(42.4), "42s");
  EXPECT_EQ(format_duration(725), "12m05s");
  EXPECT_EQ(format_duration(3 * 3600 + 7 * 60 + 20), "3h07m");
}

// The run's first step (start-up) stops counting once a later one is known: a display fed a first
// step of 4000 ms and then steps of 100 ms estimates from 100 ms.
TEST(Progress, TheFirstStepLeavesTheEstimateOnceASecondIsKnown) {
  Progress progress(10, 0);
  StepMetrics m;
  m.step = 1;
  m.ms_per_step = 4000;
  ::testing::internal::CaptureStderr();
  progress.update(m, 1, 4000, -1);
  m.step = 2;
  m.ms_per_step = 100;
  progress.update(m, 1, 100, -1);
  const std::string out = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(out.find("eta 36s"), std::string::npos) << out;   // 9 steps left at 4000 ms
  EXPECT_NE(out.find("eta 1s"), std::string::npos) << out;    // 8 steps left at 100 ms
}

TEST(Progress, LinesFitTheWidthDroppingTheLeastImportantFieldsFirst) {
  const std::vector<ProgressField> fields{{"step 3/10", 0}, {"loss 2.5000", 0}, {"100.0 ms/step", 3},
                                          {"MFU 20.0%", 2},  {"lr 3.00e-04", 5},   {"eta 1s", 1}};
  const std::string full = "step 3/10 | loss 2.5000 | 100.0 ms/step | MFU 20.0% | lr 3.00e-04 | eta 1s";
  EXPECT_EQ(fit_to_width(fields, 0), full);
  EXPECT_EQ(fit_to_width(fields, 200), full);
  EXPECT_EQ(fit_to_width(fields, 60), "step 3/10 | loss 2.5000 | 100.0 ms/step | MFU 20.0% | eta 1s");
  EXPECT_EQ(fit_to_width(fields, 45), "step 3/10 | loss 2.5000 | MFU 20.0% | eta 1s");
  EXPECT_EQ(fit_to_width(fields, 33), "step 3/10 | loss 2.5000 | eta 1s");
  EXPECT_EQ(fit_to_width(fields, 10), "step 3/10 ") << "the essentials alone are cut at the width";
  for (const int width : {20, 33, 45, 60, 80}) EXPECT_LE(static_cast<int>(fit_to_width(fields, width).size()), width);
}

// The peak is measured once per machine and key, then read from the cache; an unreadable cache is
// measured again and rewritten; MESHGRAD_CACHE_DIR=off keeps no cache.
TEST(Progress, ThePeakIsCachedPerMachine) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("meshgrad_peak_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  ::setenv("MESHGRAD_CACHE_DIR", dir.c_str(), 1);
  const std::string path = peak_cache_path();
  EXPECT_EQ(path, (dir / "peak-gflops.json").string());
  const PeakGflops first = measure_peak_gflops(DType::Float64, "float32", 2);
  EXPECT_EQ(first.source, "measured");
  EXPECT_GT(first.gflops, 0);
  ASSERT_TRUE(std::filesystem::exists(path));
  // Write a figure of our own under the same key: the next run divides by it.
  nlohmann::json cache = nlohmann::json::parse(std::ifstream(path));
  ASSERT_EQ(cache.size(), 1u);
  const std::string key = cache.begin().key();
  cache[key] = 1234.5;
  std::ofstream(path) << cache.dump();
  const PeakGflops cached = measure_peak_gflops(DType::Float64, "float32", 2);
  EXPECT_EQ(cached.gflops, 2 * 1234.5);
  EXPECT_EQ(cached.source, "cached in " + path);
  // Another precision is another key: measured, and added beside the first.
  EXPECT_EQ(measure_peak_gflops(DType::Float32, "bf16", 1).source, "measured");
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(path)).size(), 2u);
  // An unreadable cache: measured again, and the file is valid JSON afterwards.
  std::ofstream(path) << "{not json";
  EXPECT_EQ(measure_peak_gflops(DType::Float64, "float32", 1).source, "measured");
  EXPECT_NO_THROW(nlohmann::json::parse(std::ifstream(path)));
  ::setenv("MESHGRAD_CACHE_DIR", "off", 1);
  EXPECT_EQ(peak_cache_path(), "");
  EXPECT_EQ(measure_peak_gflops(DType::Float64, "float32", 1).source, "measured");
  ::unsetenv("MESHGRAD_CACHE_DIR");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace meshgrad::train::test_progress
