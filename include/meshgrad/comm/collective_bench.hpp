// The collective benchmark behind `meshgrad bench collectives`: nccl-tests' table (size, count, type,
// time, algbw, busbw, #wrong) for any Communicator, with results verified against closed-form values
// on every run, and this machine's single-thread memcpy bandwidth to read the figures against.
//
// Conventions (nccl-tests, PERFORMANCE.md): size is the bytes of the whole buffer (all_reduce: the
// buffer; all_gather: the gathered output; reduce_scatter: the full input; all_to_all: the send
// buffer); algbw = size / time; busbw = algbw x factor, factor = 2(n-1)/n for all_reduce, (n-1)/n for
// all_gather, reduce_scatter and all_to_all, 1 for broadcast. time is the slowest rank's mean.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "meshgrad/comm/communicator.hpp"

namespace meshgrad::comm {

struct CollectiveBenchOptions {
  std::vector<std::string> ops{"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"};
  std::size_t min_bytes = 1024;
  std::size_t max_bytes = std::size_t(64) << 20;
  int step_factor = 2;  // sizes min, min x f, ... up to max
  DType dtype = DType::Float32;
  int iters = 0;   // 0 = enough for ~seconds_per_size per size (5..20000), from the warm-up's time
  int warmup = 0;  // 0 = 5, then ~warmup_seconds more (the first size runs right after the ranks started)
  double seconds_per_size = 0.05;  // the automatic iterations' target time (of each block)
  double warmup_seconds = 0.02;    // the automatic warm-up's extra time
  int repeats = 1;  // timed blocks of `iters` per size; the row's time is the fastest block's mean
  int max_iters = 20000;  // the automatic iterations' and warm-up's cap: bounds a block whose ops slowed
                          // down after the warm-up timed them (a loaded machine)
};

struct CollectiveBenchRow {
  std::string op;
  std::size_t bytes = 0, count = 0;
  DType dtype = DType::Float32;
  int iters = 0;
  double time_us = 0, algbw_gbps = 0, busbw_gbps = 0;
  std::size_t wrong = 0;  // elements that differ from the closed-form result (on any rank)
};

// "1024", "1K", "64M", "1G" (powers of 1024; case-insensitive, optional trailing "B").
std::size_t parse_byte_size(std::string_view text);
// The nccl-tests bus bandwidth factor of op on n ranks.
double busbw_factor(std::string_view op, int n);
// Every rank of comm calls this with the same options; returns the same rows on every rank.
std::vector<CollectiveBenchRow> run_collective_bench(Communicator& comm, const CollectiveBenchOptions& options);
// Single-thread memcpy bandwidth, bytes read + written per second / 1e9 (as the peer membw.c), best of 5.
double measure_memcpy_gbps(std::size_t bytes);
// The table, nccl-tests style, with the average busbw per op and the memcpy line.
std::string format_collective_table(const std::vector<CollectiveBenchRow>& rows, std::string_view backend, int ranks,
                                    double memcpy_gbps);

}  // namespace meshgrad::comm
