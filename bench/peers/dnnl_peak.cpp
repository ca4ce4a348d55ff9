// Physical-limit probe: oneDNN matmul GFLOP/s, best of REPS, for a square n x n by n x n product in
// float32 or bf16 (bf16 inputs, float32 accumulation and output: what a bf16 training step's
// products do), row-major, weights in plain layout. The primitive is created once, as a training
// step's would be. Usage: dnnl_peak N [REPS [f32|bf16]] (default 5 repeats after one untimed call;
// OMP_NUM_THREADS sets the threads), or dnnl_peak M REPS TYPE N K for an M x K by K x N product.
// Prints "dnnl <dtype> MxNxK threads=T: G GFLOP/s (impl)".
#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <omp.h>

int main(int argc, char** argv) {
  const long m = argc > 1 ? std::atol(argv[1]) : 1024;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 5;
  const std::string type = argc > 3 ? argv[3] : "f32";
  const long n = argc > 5 ? std::atol(argv[4]) : m, k = argc > 5 ? std::atol(argv[5]) : m;
  if (m <= 0 || n <= 0 || k <= 0 || reps <= 0 || (type != "f32" && type != "bf16")) {
    std::fprintf(stderr, "usage: dnnl_peak N [REPS [f32|bf16]] | dnnl_peak M REPS TYPE N K\n");
    return 2;
  }
  using dt = dnnl::memory::data_type;
  using tag = dnnl::memory::format_tag;
  const dt in = type == "bf16" ? dt::bf16 : dt::f32;
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream s(eng);
  const dnnl::memory::desc a_md({m, k}, in, tag::ab), b_md({k, n}, in, tag::ab), c_md({m, n}, dt::f32, tag::ab);
  dnnl::matmul::primitive_desc pd;
  try {
    pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, c_md), eng);
  } catch (const dnnl::error& e) {
    std::printf("dnnl %s %ldx%ldx%ld: not available on this CPU (%s)\n", type.c_str(), m, n, k, e.what());
    return 0;
  }
  dnnl::matmul mm(pd);
  dnnl::memory a(a_md, eng), b(b_md, eng), c(c_md, eng);
  // Values of a few bits: exact in bf16, so the inputs are the same numbers in both types.
  const std::size_t elem = type == "bf16" ? 2 : 4;
  const long count = std::max(m * k, k * n);
  std::vector<unsigned char> bytes(static_cast<std::size_t>(count) * elem);
  for (long i = 0; i < count; ++i) {
    const float v = static_cast<float>(i % 7) * 0.125f;
    unsigned int bits;
    std::memcpy(&bits, &v, 4);
    if (elem == 2) {
      const unsigned short h = static_cast<unsigned short>(bits >> 16);
      std::memcpy(bytes.data() + i * 2, &h, 2);
    } else {
      std::memcpy(bytes.data() + i * 4, &v, 4);
    }
  }
  std::memcpy(a.get_data_handle(), bytes.data(), static_cast<std::size_t>(m * k) * elem);
  std::memcpy(b.get_data_handle(), bytes.data(), static_cast<std::size_t>(k * n) * elem);
  auto run = [&] {
    mm.execute(s, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
    s.wait();
  };
  run();
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (t < best) best = t;
  }
  std::printf("dnnl %s %ldx%ldx%ld threads=%d: %.1f GFLOP/s (%s)\n", type.c_str(), m, n, k, omp_get_max_threads(),
              2.0 * m * n * k / best / 1e9, pd.impl_info_str());
  return 0;
}
