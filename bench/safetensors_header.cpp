// Time to open a safetensors file whose header lists N zero-size tensors (header parse, duplicate
// check, layout validation; no tensor data): linear in N. The goal is 100,000 tensors in under
// 1 s (issue 10; the old parser callback was quadratic: 40,000 took 20 s).
//
//   build/bench/bench_safetensors_header
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "meshgrad/io/safetensors.hpp"

namespace {

std::string write_file(int n) {
  std::string header = "{";
  for (int i = 0; i < n; ++i)
    header += fmt::format(R"({}"h.{}.weight":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}})", i ? "," : "", i);
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');
  const std::string path =
      (std::filesystem::temp_directory_path() / fmt::format("meshgrad_bench_st_{}_{}.safetensors", ::getpid(), n)).string();
  std::ofstream out(path, std::ios::binary);
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((header.size() >> (8 * i)) & 0xff));
  out << header;
  return path;
}

void BM_OpenHeader(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  const std::string path = write_file(n);
  for (auto _ : state) {
    const meshgrad::io::SafetensorsFile file(path);
    benchmark::DoNotOptimize(file.names().size());
  }
  std::remove(path.c_str());
  state.counters["tensors/s"] = benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_OpenHeader)->Arg(10'000)->Arg(40'000)->Arg(100'000)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
