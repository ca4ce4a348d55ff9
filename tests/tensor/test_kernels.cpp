// Kernels: broadcasting arithmetic, reductions, matmul layouts, cat; random generation.
#include <gtest/gtest.h>

#include <cblas.h>

#include <cmath>
#include <cstdlib>

#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/parallel.hpp"
#include "meshgrad/tensor/random.hpp"

namespace test_kernels {

using namespace meshgrad;
using kernels::Binary;

namespace {
Tensor iota(const Shape& shape, DType dtype = DType::Float64, double start = 0) {
  Tensor t = Tensor::arange(shape_numel(shape), dtype).view(shape);
  return kernels::binary(Binary::Add, t, Tensor::scalar(start, dtype));
}

// Reference matmul in double by the definition.
std::vector<double> naive_matmul(const Tensor& a, const Tensor& b) {
  const auto m = a.size(0), k = a.size(1), n = b.size(1);
  std::vector<double> out(static_cast<std::size_t>(m * n), 0.0);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j)
      for (std::int64_t p = 0; p < k; ++p) out[static_cast<std::size_t>(i * n + j)] += a.at({i, p}) * b.at({p, j});
  return out;
}
}  // namespace

TEST(Kernels, BinaryBroadcasting) {
  Tensor a = iota({2, 3});                                   // 0..5
  Tensor row = Tensor::from_values({10, 20, 30}, {3}, DType::Float64);
  Tensor col = Tensor::from_values({1, 2}, {2, 1}, DType::Float64);
  EXPECT_EQ(kernels::binary(Binary::Add, a, row).to_vector(), (std::vector<double>{10, 21, 32, 13, 24, 35}));
  EXPECT_EQ(kernels::binary(Binary::Mul, a, col).to_vector(), (std::vector<double>{0, 1, 2, 6, 8, 10}));
  EXPECT_EQ(kernels::binary(Binary::Sub, row, a).to_vector(), (std::vector<double>{10, 19, 28, 7, 16, 25}));
  EXPECT_EQ(kernels::binary(Binary::Div, a, col).at({1, 2}), 2.5);
  // Non-contiguous operands.
  Tensor t = a.transpose(0, 1);   // [3, 2]
  EXPECT_EQ(kernels::binary(Binary::Add, t, t).to_vector(), (std::vector<double>{0, 6, 2, 8, 4, 10}));
  try {
    kernels::binary(Binary::Add, Tensor::zeros({2, 3}), Tensor::zeros({4}));
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("add: shapes [2, 3] and [4]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(kernels::binary(Binary::Add, Tensor::zeros({2}), Tensor::zeros({2}, DType::Float64)),
               InvalidArgument);
}

// A contiguous [70, 45] plus a transposed view of a [45, 70] (the tied embedding's two gradients):
// the tiled path, with partial tiles at both edges, must give each element's own sum.
TEST(Kernels, BinaryWithTransposedOperandTakesTilesAndStaysExact) {
  const Tensor a = random::randn({70, 45}, 11, DType::Float64);
  const Tensor bt = random::randn({45, 70}, 12, DType::Float64).transpose(0, 1);   // [70, 45], strides (1, 70)
  for (Binary op : {Binary::Add, Binary::Sub, Binary::Mul, Binary::Div}) {
    const Tensor ab = kernels::binary(op, a, bt);
    const Tensor ba = kernels::binary(op, bt, a);
    for (std::int64_t i = 0; i < 70; ++i) {
      for (std::int64_t j = 0; j < 45; ++j) {
        const double x = a.at({i, j}), y = bt.at({i, j});
        auto apply = [op](double l, double r) {
          return op == Binary::Add ? l + r : op == Binary::Sub ? l - r : op == Binary::Mul ? l * r : l / r;
        };
        ASSERT_EQ(ab.at({i, j}), apply(x, y)) << i << "," << j;
        ASSERT_EQ(ba.at({i, j}), apply(y, x)) << i << "," << j;
      }
    }
  }
  // In place into the transposed view (out strided too).
  Tensor base = random::randn({45, 70}, 13, DType::Float64);
  Tensor view = base.transpose(0, 1);
  const Tensor before = view.contiguous();
  kernels::binary_(Binary::Add, view, a);
  for (std::int64_t i = 0; i < 70; ++i) {
    for (std::int64_t j = 0; j < 45; ++j) ASSERT_EQ(base.at({j, i}), before.at({i, j}) + a.at({i, j}));
  }
}

TEST(Kernels, InPlaceAndAxpy) {
  Tensor a = iota({2, 2});
  kernels::binary_(Binary::Add, a, Tensor::from_values({1, 1}, {2}, DType::Float64));
  EXPECT_EQ(a.to_vector(), (std::vector<double>{1, 2, 3, 4}));
  kernels::axpy_(a, -2.0, Tensor::ones({2, 2}, DType::Float64));
  EXPECT_EQ(a.to_vector(), (std::vector<double>{-1, 0, 1, 2}));
  EXPECT_THROW(kernels::binary_(Binary::Add, a, Tensor::zeros({3, 2}, DType::Float64)), InvalidArgument);
}

TEST(Kernels, SumOverDims) {
  Tensor a = iota({2, 3, 4});
  EXPECT_EQ(kernels::sum(a, {}, false).item(), 276.0);
  Tensor s1 = kernels::sum(a, {1}, false);
  EXPECT_EQ(s1.shape(), (Shape{2, 4}));
  EXPECT_EQ(s1.at({1, 2}), 14.0 + 18.0 + 22.0);
  Tensor s02 = kernels::sum(a, {0, -1}, true);
  EXPECT_EQ(s02.shape(), (Shape{1, 3, 1}));
  // dim 1 index 1: elements 4..7 and 16..19 -> 22 + 70.
  EXPECT_EQ(s02.at({0, 1, 0}), 92.0);
  EXPECT_EQ(kernels::sum_to(a, {3, 1}).at({2, 0}), (8 + 9 + 10 + 11) + (20 + 21 + 22 + 23));
  EXPECT_THROW(kernels::sum(a, {3}, false), InvalidArgument);
}

TEST(Kernels, MatmulMatchesDefinitionForEveryLayout) {
  for (DType dt : {DType::Float32, DType::Float64}) {
    Tensor a = random::randn({5, 7}, 1, dt);
    Tensor b = random::randn({7, 3}, 2, dt);
    const auto expected = naive_matmul(a, b);
    const double tol = dt == DType::Float32 ? 1e-5 : 1e-12;
    auto check = [&](const Tensor& x, const Tensor& y) {
      auto got = kernels::matmul(x, y).to_vector();
      ASSERT_EQ(got.size(), expected.size());
      for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], expected[i], tol) << i;
    };
    check(a, b);
    // Transposed storage passed as views: BLAS gets a transpose flag.
    check(a.transpose(0, 1).contiguous().transpose(0, 1), b);
    check(a, b.transpose(0, 1).contiguous().transpose(0, 1));
    // A strided (narrowed) operand with a leading dimension larger than its width.
    Tensor wide = random::randn({5, 10}, 1, dt);
    Tensor an = wide.narrow(1, 0, 7);
    auto got = kernels::matmul(an, b).to_vector();
    auto ref = naive_matmul(an, b);
    for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], ref[i], tol);
  }
}

TEST(Kernels, BatchedMatmulBroadcastsBatchDims) {
  Tensor a = random::randn({2, 3, 4, 5}, 3, DType::Float64);
  Tensor b = random::randn({3, 5, 2}, 4, DType::Float64);
  Tensor c = kernels::matmul(a, b);
  EXPECT_EQ(c.shape(), (Shape{2, 3, 4, 2}));
  for (std::int64_t i = 0; i < 2; ++i)
    for (std::int64_t j = 0; j < 3; ++j) {
      auto ref = naive_matmul(a.select(0, i).select(0, j), b.select(0, j));
      auto got = c.select(0, i).select(0, j).contiguous().to_vector();
      for (std::size_t e = 0; e < ref.size(); ++e) EXPECT_NEAR(got[e], ref[e], 1e-12);
    }
  Tensor w = random::randn({5, 6}, 5, DType::Float64);
  Tensor y = kernels::matmul(a, w);   // [2,3,4,5] @ [5,6]: one GEMM over all rows
  EXPECT_EQ(y.shape(), (Shape{2, 3, 4, 6}));
  auto ref = naive_matmul(a.select(0, 1).select(0, 2), w);
  auto got = y.select(0, 1).select(0, 2).contiguous().to_vector();
  for (std::size_t e = 0; e < ref.size(); ++e) EXPECT_NEAR(got[e], ref[e], 1e-12);
  EXPECT_THROW(kernels::matmul(a, Tensor::zeros({4, 2}, DType::Float64)), InvalidArgument);
}

// Batch matrices taken as views of permuted and transposed tensors (attention's q k^T), and a
// batch operand whose matrices BLAS cannot read (inner stride 2) that must be packed once.
TEST(Kernels, BatchedMatmulTakesStridedBatchMatrices) {
  const Tensor q = random::randn({2, 5, 3, 4}, 21, DType::Float64).permute({0, 2, 1, 3});   // [2, 3, 5, 4]
  const Tensor kt = random::randn({2, 3, 6, 4}, 22, DType::Float64).transpose(-2, -1);   // [2, 3, 4, 6]
  const Tensor every_other = random::randn({2, 3, 4, 6, 2}, 23, DType::Float64).select(4, 0);   // strides (.., 12, 2)
  for (const Tensor& rhs : {kt, every_other}) {
    const Tensor c = kernels::matmul(q, rhs);
    ASSERT_EQ(c.shape(), (Shape{2, 3, 5, 6}));
    for (std::int64_t i = 0; i < 2; ++i) {
      for (std::int64_t j = 0; j < 3; ++j) {
        const auto ref = naive_matmul(q.select(0, i).select(0, j), rhs.select(0, i).select(0, j));
        const auto got = c.select(0, i).select(0, j).contiguous().to_vector();
        for (std::size_t e = 0; e < ref.size(); ++e) ASSERT_NEAR(got[e], ref[e], 1e-12) << i << "," << j;
      }
    }
  }
  // Empty inner dim: zeros.
  const Tensor z = kernels::matmul(Tensor::ones({2, 3, 0}, DType::Float64), Tensor::ones({2, 0, 4}, DType::Float64));
  EXPECT_EQ(z.to_vector(), std::vector<double>(24, 0.0));
}

TEST(Kernels, CatAlongAnyDim) {
  Tensor a = iota({2, 2});
  Tensor b = iota({2, 1}, DType::Float64, 10);
  Tensor c = kernels::cat({a, b}, 1);
  EXPECT_EQ(c.to_vector(), (std::vector<double>{0, 1, 10, 2, 3, 11}));
  Tensor d = kernels::cat({a, a}, 0);
  EXPECT_EQ(d.shape(), (Shape{4, 2}));
  EXPECT_THROW(kernels::cat({a, b}, 0), InvalidArgument);
}

TEST(Random, ElementDependsOnlyOnSeedAndIndex) {
  Tensor full = random::randn({6, 10}, 42, DType::Float64);
  // Any shard (any rank count, uneven) equals the slice of the unsharded tensor, bit for bit.
  for (int parts : {1, 2, 3, 4}) {
    for (int r = 0; r < parts; ++r) {
      const ShardRange cols = shard_range(10, parts, r);
      Tensor shard = random::randn({6, 10}, 42, DType::Float64, 0.0, 1.0, {{0, 6}, cols});
      EXPECT_TRUE(bitwise_equal(shard, full.narrow(1, cols.offset, cols.size))) << parts << " " << r;
    }
  }
  Tensor other = random::randn({6, 10}, 43, DType::Float64);
  EXPECT_FALSE(bitwise_equal(full, other));
  // Moments of a large sample (loose bounds: 4 standard errors).
  Tensor big = random::randn({100000}, 7, DType::Float64);
  double s = 0, s2 = 0;
  for (double v : big.to_vector()) {
    s += v;
    s2 += v * v;
  }
  EXPECT_NEAR(s / 1e5, 0.0, 4 * 1 / std::sqrt(1e5));
  EXPECT_NEAR(s2 / 1e5, 1.0, 4 * std::sqrt(2.0 / 1e5));
  Tensor u = random::rand({1000}, 9, DType::Float32, -1, 1);
  for (double v : u.to_vector()) {
    EXPECT_GE(v, -1.0);
    EXPECT_LT(v, 1.0);
  }
  Tensor ids = random::randint({1000}, 3, 17);
  for (auto v : ids.to_int64_vector()) {
    EXPECT_GE(v, 0);
    EXPECT_LT(v, 17);
  }
}

TEST(Random, GeneratorAdvancesAndReplays) {
  random::Generator g(5);
  const auto s0 = g.next_seed();
  const auto s1 = g.next_seed();
  EXPECT_NE(s0, s1);
  g.set_counter(0);
  EXPECT_EQ(g.next_seed(), s0);
}

TEST(Shard, UnevenRule) {
  EXPECT_EQ(shard_sizes(10, 4), (std::vector<std::int64_t>{3, 3, 2, 2}));
  EXPECT_EQ(shard_range(10, 4, 2).offset, 6);
  EXPECT_EQ(shard_range(10, 4, 3).offset, 8);
  EXPECT_EQ(shard_sizes(3, 4), (std::vector<std::int64_t>{1, 1, 1, 0}));
  EXPECT_THROW(shard_range(10, 4, 4), InvalidArgument);
}

TEST(Blas, ThreadCountCanBeSet) {
  const int before = blas::num_threads();
  blas::set_num_threads(1);
  EXPECT_EQ(blas::num_threads(), 1);
  blas::set_num_threads(before);
  EXPECT_GE(blas::available_cores(), 1);
}

// The banner line names the kernel table in use and why it is that one.
TEST(Blas, KernelDescriptionNamesTheTableInUseAndItsCause) {
  const std::string core = blas::kernel_core();
  EXPECT_EQ(core, std::string(openblas_get_corename()));
  const std::string d = blas::kernel_description();
  EXPECT_EQ(d.rfind(fmt::format("OpenBLAS {} kernels (", core), 0), 0u) << d;
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  if (forced && *forced)
    EXPECT_NE(d.find(fmt::format("OPENBLAS_CORETYPE={} in the environment", forced)), std::string::npos) << d;
  else {
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("avx512cd");
    const bool avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    EXPECT_NE(d.find(fmt::format("(OpenBLAS's choice for this CPU{})", blas::unrecognised_cpu_hint(core, avx2_fma,
                                                                                                   avx512))),
              std::string::npos)
        << d;
  }
}

// OpenBLAS's detection falls back to its SSE3 table on a CPU it does not know (a virtual machine's
// generic model); the banner then names the OPENBLAS_CORETYPE whose kernels use the CPU's width, and
// says nothing when the table already does.
TEST(Blas, AnUnrecognisedCpuNamesTheCoreTypeToSet) {
  const std::string avx512_hint = blas::unrecognised_cpu_hint("Prescott", true, true);
  EXPECT_NE(avx512_hint.find("this CPU has AVX-512"), std::string::npos) << avx512_hint;
  EXPECT_NE(avx512_hint.find("OPENBLAS_CORETYPE=SkylakeX"), std::string::npos) << avx512_hint;
  EXPECT_NE(avx512_hint.find("Prescott's"), std::string::npos) << avx512_hint;
  const std::string avx2_hint = blas::unrecognised_cpu_hint("Sandybridge", true, false);
  EXPECT_NE(avx2_hint.find("this CPU has AVX2 and FMA"), std::string::npos) << avx2_hint;
  EXPECT_NE(avx2_hint.find("OPENBLAS_CORETYPE=Haswell"), std::string::npos) << avx2_hint;
  EXPECT_EQ(avx2_hint.find("SkylakeX"), std::string::npos) << avx2_hint;
  // Tables that use the CPU's width, and CPUs without AVX2, get no hint.
  for (const char* core : {"SkylakeX", "Cooperlake", "SapphireRapids", "Haswell", "Zen"})
    EXPECT_EQ(blas::unrecognised_cpu_hint(core, true, true), "") << core;
  EXPECT_EQ(blas::unrecognised_cpu_hint("Haswell", true, false), "");
  EXPECT_EQ(blas::unrecognised_cpu_hint("Prescott", false, false), "");
  EXPECT_EQ(blas::unrecognised_cpu_hint("Nehalem", false, false), "");
}

// Whatever table was chosen computes GEMMs right: every transpose combination, beta != 0, odd sizes
// that leave edge tiles in every direction, against a double reference by the definition. float32
// bound: |error| <= 4 K eps32 sum_p |a_ip b_pj| (the worst case of a K-term float sum, with room for
// the kernel's FMA order); float64 the same with eps64.
template <typename T>
void check_gemm_against_definition(double eps) {
  const std::int64_t m = 67, n = 45, k = 129;
  std::uint64_t draw = 0;
  const auto next = [&] { return static_cast<T>(random::normal(11, draw++)); };
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      std::vector<T> a(static_cast<std::size_t>(m * k)), b(static_cast<std::size_t>(k * n)),
          c(static_cast<std::size_t>(m * n));
      for (auto& x : a) x = next();
      for (auto& x : b) x = next();
      for (auto& x : c) x = next();
      const std::vector<T> c0 = c;
      // Stored layouts: A is [m, k] or, transposed, [k, m]; B is [k, n] or [n, k].
      const auto A = [&](std::int64_t i, std::int64_t p) { return double(ta ? a[p * m + i] : a[i * k + p]); };
      const auto B = [&](std::int64_t p, std::int64_t j) { return double(tb ? b[j * k + p] : b[p * n + j]); };
      blas::gemm(ta, tb, m, n, k, T(1.5), a.data(), ta ? m : k, b.data(), tb ? k : n, T(-0.5), c.data(), n);
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = 0; j < n; ++j) {
          double exact = -0.5 * double(c0[i * n + j]), scale = std::abs(exact);
          for (std::int64_t p = 0; p < k; ++p) {
            exact += 1.5 * A(i, p) * B(p, j);
            scale += std::abs(1.5 * A(i, p) * B(p, j));
          }
          ASSERT_LE(std::abs(double(c[i * n + j]) - exact), 4.0 * k * eps * scale)
              << blas::kernel_description() << " ta=" << ta << " tb=" << tb << " at (" << i << ", " << j << ")";
        }
    }
}

TEST(Blas, GemmMatchesTheDefinitionOnTheChosenKernels) {
  // On the caller's thread: OpenBLAS's own worker threads synchronise in code ThreadSanitizer cannot
  // see (this file runs under TSan), and the kernels, not OpenBLAS's threading, are what is tested.
  const int before = blas::num_threads();
  blas::set_num_threads(1);
  check_gemm_against_definition<float>(0x1p-24);
  check_gemm_against_definition<double>(0x1p-53);
  blas::set_num_threads(before);
}

TEST(Blas, ThreadsPerRankSharesTheCoresAndRestores) {
  const int cores = blas::available_cores();
  blas::set_num_threads(3);
  {
    blas::ThreadsPerRank one(1);
    EXPECT_EQ(blas::num_threads(), cores);
    {
      // More ranks than cores: still one thread each, never zero.
      blas::ThreadsPerRank many(4 * cores);
      EXPECT_EQ(blas::num_threads(), 1);
      EXPECT_EQ(many.threads(), 1);
      EXPECT_EQ(blas::thread_policy(), fmt::format("1 BLAS thread per rank ({} usable core{} / {} ranks on this node)",
                                                   cores, cores == 1 ? "" : "s", 4 * cores));
    }
    EXPECT_EQ(blas::num_threads(), cores);
    EXPECT_NE(blas::thread_policy().find("/ 1 rank on this node"), std::string::npos) << blas::thread_policy();
  }
  EXPECT_EQ(blas::num_threads(), 3);
  EXPECT_EQ(blas::thread_policy(), "3 BLAS threads (no launch policy in effect)");
  EXPECT_THROW(blas::ThreadsPerRank(0), InvalidArgument);
}

// A run's own count (train's --blas-threads) replaces the automatic one inside the launch scope,
// says so in the banner's policy, and the scope's end restores the count from before it.
TEST(Blas, SetThreadsPerRankOverridesTheLaunchPolicyUntilItsEnd) {
  const int cores = blas::available_cores();
  blas::set_num_threads(3);
  {
    blas::ThreadsPerRank scope(4 * cores, 1);   // automatic: 1
    blas::set_threads_per_rank(2, "--blas-threads 2");
    EXPECT_EQ(blas::num_threads(), 2);
    EXPECT_EQ(blas::thread_policy(),
              fmt::format("2 BLAS threads per rank (--blas-threads 2; automatic: 1 = {} usable core{} / {} ranks on "
                          "this node)", cores, cores == 1 ? "" : "s", 4 * cores));
    blas::set_threads_per_rank(2, "--blas-threads 2");   // the other ranks: the same count, nothing changes
    EXPECT_EQ(blas::num_threads(), 2);
  }
  EXPECT_EQ(blas::num_threads(), 3);
  EXPECT_EQ(blas::thread_policy(), "3 BLAS threads (no launch policy in effect)");
  // Outside a scope it only sets the count; out of range is refused naming the source.
  blas::set_threads_per_rank(1, "test");
  EXPECT_EQ(blas::num_threads(), 1);
  EXPECT_THROW(blas::set_threads_per_rank(0, "--blas-threads 0"), InvalidArgument);
  EXPECT_THROW(blas::set_threads_per_rank(blas::kMaxThreadsPerRank + 1, "x"), InvalidArgument);
  EXPECT_THROW(blas::ThreadsPerRank(1, 2), InvalidArgument);   // more ranks in the process than on the node
}

// The attention kernel splits (batch, head) pairs over blas::num_threads() threads: the split must
// not change a bit of the result (heads are independent), and under TSan (make test-tsan) the
// workers must not race. T = 70 crosses a tile boundary.
TEST(Kernels, CausalAttentionIsTheSameOnOneOrSeveralThreads) {
  const Tensor q = random::randn({2, 3, 70, 8}, 31, DType::Float32);
  const Tensor k = random::randn({2, 3, 70, 8}, 32, DType::Float32);
  const Tensor v = random::randn({2, 3, 70, 8}, 33, DType::Float32);
  const Tensor g = random::randn({2, 3, 70, 8}, 34, DType::Float32);
  const int before = blas::num_threads();
  auto run = [&](int threads) {
    blas::set_num_threads(threads);
    kernels::AttentionForward f = kernels::causal_attention_forward(q, k, v, 0.35);
    kernels::AttentionGrads d = kernels::causal_attention_backward(g, q, k, v, f, 0.35, true, true, true);
    return std::vector<std::vector<double>>{f.out.to_vector(), f.lse.to_vector(), d.dq.to_vector(),
                                            d.dk.to_vector(), d.dv.to_vector()};
  };
  const auto one = run(1);
  const auto four = run(4);
  blas::set_num_threads(before);
  for (std::size_t i = 0; i < one.size(); ++i) EXPECT_EQ(one[i], four[i]) << "result " << i;
  // Only the wanted gradients are computed.
  blas::set_num_threads(1);
  const kernels::AttentionGrads only_dv =
      kernels::causal_attention_backward(g, q, k, v, kernels::causal_attention_forward(q, k, v, 0.35), 0.35, false,
                                         false, true);
  blas::set_num_threads(before);
  EXPECT_FALSE(only_dv.dq.defined());
  EXPECT_FALSE(only_dv.dk.defined());
  EXPECT_EQ(only_dv.dv.to_vector(), four[4]);
}

// Incremental decoding: the last T_q queries against all T keys give exactly those rows of the full
// causal attention (the rows the full pass computes for them), and a single query computes T scores,
// not T^2. T = 66 puts the cached queries across a tile boundary (a key tile entirely after the
// first query, row 63, is skipped for it).
TEST(Kernels, CausalAttentionWithLongerKeysIsTheLastRowsOfTheFullPass) {
  const std::int64_t b = 2, h = 3, t = 66, d = 8;
  const Tensor q = random::randn({b, h, t, d}, 41, DType::Float64);
  const Tensor k = random::randn({b, h, t, d}, 42, DType::Float64);
  const Tensor v = random::randn({b, h, t, d}, 43, DType::Float64);
  const kernels::AttentionForward full = kernels::causal_attention_forward(q, k, v, 0.35);
  EXPECT_GE(full.scores, b * h * t * (t + 1) / 2);
  for (const std::int64_t tq : {std::int64_t{1}, std::int64_t{3}, std::int64_t{40}, t}) {
    const kernels::AttentionForward last = kernels::causal_attention_forward(q.narrow(2, t - tq, tq), k, v, 0.35);
    ASSERT_EQ(last.out.shape(), (Shape{b, h, tq, d}));
    const auto got = last.out.to_vector(), want = full.out.narrow(2, t - tq, tq).to_vector();
    const auto got_lse = last.lse.to_vector(), want_lse = full.lse.narrow(2, t - tq, tq).to_vector();
    for (std::size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-12) << "T_q " << tq << " element " << i;
    for (std::size_t i = 0; i < want_lse.size(); ++i) ASSERT_NEAR(got_lse[i], want_lse[i], 1e-12) << "T_q " << tq;
    if (tq == 1) {
      EXPECT_EQ(last.scores, b * h * t) << "one query must touch each of the T keys once";
    }
  }
  // Keys shorter than the queries, or of another batch / head / width, are refused.
  EXPECT_THROW(kernels::causal_attention_forward(q, k.narrow(2, 0, 5), v.narrow(2, 0, 5), 0.35), InvalidArgument);
  EXPECT_THROW(kernels::causal_attention_forward(q.narrow(1, 0, 2), k, v, 0.35), InvalidArgument);
}

// `first` places the queries after an earlier piece of keys (the cp ring's pieces): queries at
// positions [2L, 3L) against keys [L, 3L) given with first = L are the full pass's rows when the
// window (L) keeps keys [0, L) out of every query's view; a piece wholly before the window (keys
// [0, L), first = 2L) is the empty part: out 0 and lse -inf. Backward with first likewise.
TEST(Kernels, CausalAttentionOfAnEarlierPieceOfKeys) {
  const std::int64_t b = 1, h = 2, l = 40, d = 8, w = 40;
  const Tensor q = random::randn({b, h, 3 * l, d}, 61, DType::Float64);
  const Tensor k = random::randn({b, h, 3 * l, d}, 62, DType::Float64);
  const Tensor v = random::randn({b, h, 3 * l, d}, 63, DType::Float64);
  const Tensor qc = q.narrow(2, 2 * l, l);
  const kernels::AttentionForward full = kernels::causal_attention_forward(qc, k, v, 0.35, w);
  const Tensor kp = k.narrow(2, l, 2 * l), vp = v.narrow(2, l, 2 * l);
  const kernels::AttentionForward piece = kernels::causal_attention_forward(qc, kp, vp, 0.35, w, l);
  const auto got = piece.out.to_vector(), want = full.out.to_vector();
  for (std::size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-12) << i;
  const auto got_lse = piece.lse.to_vector(), want_lse = full.lse.to_vector();
  for (std::size_t i = 0; i < want_lse.size(); ++i) ASSERT_NEAR(got_lse[i], want_lse[i], 1e-12) << i;
  const kernels::AttentionForward empty =
      kernels::causal_attention_forward(qc, k.narrow(2, 0, l), v.narrow(2, 0, l), 0.35, w, 2 * l);
  for (const double x : empty.out.to_vector()) ASSERT_EQ(x, 0.0);
  for (const double x : empty.lse.to_vector()) ASSERT_EQ(x, -INFINITY);
  // Backward of the piece with the whole attention's out and lse: dq is the full pass's, dk and dv
  // the full pass's rows of the piece's keys.
  const Tensor g = random::randn({b, h, l, d}, 64, DType::Float64);
  const kernels::AttentionGrads whole = kernels::causal_attention_backward(g, qc, k, v, full, 0.35, true, true, true, w);
  const kernels::AttentionGrads part =
      kernels::causal_attention_backward(g, qc, kp, vp, full, 0.35, true, true, true, w, l);
  const std::vector<std::pair<Tensor, Tensor>> pairs{
      {part.dq, whole.dq}, {part.dk, whole.dk.narrow(2, l, 2 * l)}, {part.dv, whole.dv.narrow(2, l, 2 * l)}};
  for (const auto& [got_t, want_t] : pairs) {
    const auto a = got_t.to_vector(), e = want_t.contiguous().to_vector();
    for (std::size_t i = 0; i < e.size(); ++i) ASSERT_NEAR(a[i], e[i], 1e-12) << i;
  }
}

// A chunk of queries against every key up to its end (a context-parallel rank's chunk): its
// gradients are the full pass's for a loss that reads only those rows: dq is those rows of the full
// dq, dk and dv the full ones (keys after the chunk get none). Within 1e-12 anywhere; bit for bit
// when the chunk starts on a tile boundary (64) and is whole tiles, where it visits the same tiles
// and the full pass only adds exact zeros from the rows before it.
TEST(Kernels, CausalAttentionBackwardOfAChunkIsTheFullPassForItsRows) {
  const std::int64_t b = 1, h = 2, t = 192, d = 8;
  const Tensor q = random::randn({b, h, t, d}, 51, DType::Float64);
  const Tensor k = random::randn({b, h, t, d}, 52, DType::Float64);
  const Tensor v = random::randn({b, h, t, d}, 53, DType::Float64);
  struct Chunk {
    std::int64_t start, rows, keys;
    bool bitwise;
  };
  for (const Chunk c : {Chunk{64, 64, 128, true}, Chunk{128, 64, 192, true}, Chunk{30, 50, 80, false},
                        Chunk{100, 92, 192, false}}) {
    const Tensor g = random::randn({b, h, c.rows, d}, 54, DType::Float64);
    Tensor g_full = Tensor::zeros({b, h, c.keys, d}, DType::Float64);
    g_full.narrow(2, c.start, c.rows).copy_from(g);
    const Tensor kq = q.narrow(2, 0, c.keys), kk = k.narrow(2, 0, c.keys), kv = v.narrow(2, 0, c.keys);
    const kernels::AttentionGrads full =
        kernels::causal_attention_backward(g_full, kq, kk, kv, kernels::causal_attention_forward(kq, kk, kv, 0.35), 0.35,
                                           true, true, true);
    const Tensor qc = q.narrow(2, c.start, c.rows);
    const kernels::AttentionForward fwd = kernels::causal_attention_forward(qc, kk, kv, 0.35);
    const kernels::AttentionGrads chunk = kernels::causal_attention_backward(g, qc, kk, kv, fwd, 0.35, true, true, true);
    ASSERT_EQ(chunk.dq.shape(), qc.shape());
    ASSERT_EQ(chunk.dk.shape(), kk.shape());
    const std::vector<std::pair<Tensor, Tensor>> pairs{
        {chunk.dq, full.dq.narrow(2, c.start, c.rows)}, {chunk.dk, full.dk}, {chunk.dv, full.dv}};
    for (const auto& [got_t, want_t] : pairs) {
      const auto got = got_t.to_vector(), want = want_t.contiguous().to_vector();
      for (std::size_t i = 0; i < want.size(); ++i) {
        if (c.bitwise) {
          ASSERT_EQ(got[i], want[i]) << "chunk at " << c.start << ": element " << i;
        } else {
          ASSERT_NEAR(got[i], want[i], 1e-12) << "chunk at " << c.start << ": element " << i;
        }
      }
    }
  }
  // A gradient of the keys' length, or keys shorter than the queries, is refused.
  const kernels::AttentionForward f = kernels::causal_attention_forward(q.narrow(2, 0, 10), k, v, 0.35);
  EXPECT_THROW(kernels::causal_attention_backward(random::randn({b, h, t, d}, 55, DType::Float64), q.narrow(2, 0, 10), k,
                                                  v, f, 0.35, true, true, true),
               InvalidArgument);
  EXPECT_THROW(kernels::causal_attention_backward(q, q, k.narrow(2, 0, 5), v.narrow(2, 0, 5),
                                                  kernels::causal_attention_forward(q, k, v, 0.35), 0.35, true, true, true),
               InvalidArgument);
}

// ---- elementwise work split over a rank's cores (tensor/parallel.hpp) --------------------------------

TEST(Parallel, ForRangesCoversEveryIndexOnceAndRethrows) {
  for (int workers : {1, 2, 3, 7}) {
    for (std::int64_t n : {0, 1, 5, 1000}) {
      std::vector<int> hits(static_cast<std::size_t>(n), 0);
      parallel::for_ranges(n, workers, [&](std::int64_t b, std::int64_t e) {
        for (std::int64_t i = b; i < e; ++i) ++hits[static_cast<std::size_t>(i)];
      });
      for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<std::size_t>(i)], 1) << "n " << n << " workers " << workers;
    }
  }
  // The split is taken from the rank's thread count, and only from kMinElements up.
  const int before = blas::num_threads();
  blas::set_num_threads(2);
  EXPECT_EQ(parallel::workers_for(parallel::kMinElements), 2);
  EXPECT_EQ(parallel::workers_for(parallel::kMinElements - 1), 1);
  blas::set_num_threads(1);
  EXPECT_EQ(parallel::workers_for(parallel::kMinElements), 1);
  blas::set_num_threads(before);
  EXPECT_THROW(parallel::for_ranges(100, 3,
                                    [](std::int64_t b, std::int64_t) {
                                      if (b > 0) throw InvalidArgument("from a helper range");
                                    }),
               InvalidArgument);
}

namespace {
bool same_bytes(const Tensor& a, const Tensor& b) {
  const Tensor x = a.contiguous(), y = b.contiguous();
  return x.shape() == y.shape() && x.dtype() == y.dtype() &&
         std::memcmp(x.raw_data(), y.raw_data(), static_cast<std::size_t>(x.numel()) * dtype_size(x.dtype())) == 0;
}

// Runs f once on one thread and once on two, and returns both results.
template <class F>
std::pair<Tensor, Tensor> one_and_two_threads(F&& f) {
  const int before = blas::num_threads();
  blas::set_num_threads(1);
  Tensor one = f();
  blas::set_num_threads(2);
  Tensor two = f();
  blas::set_num_threads(before);
  return {one, two};
}
}  // namespace

// Splitting over threads changes no bit: GELU and its backward, binary ops with broadcasting, a
// transposed operand, a leading dim of 1 (the split takes the next one) and in place; both dtypes.
TEST(Parallel, ElementwiseKernelsGiveTheSameBytesOnOneAndTwoThreads) {
  for (DType dt : {DType::Float32, DType::Float64}) {
    const Tensor x = random::randn({1, 600, 700}, 1, dt);   // 420,000 elements: above kMinElements
    const Tensor g = random::randn({1, 600, 700}, 2, dt);
    const Tensor row = random::randn({700}, 3, dt);
    const Tensor xt = random::randn({700, 600}, 4, dt).transpose(0, 1);
    ASSERT_GE(x.numel(), parallel::kMinElements);
    const auto check = [&](const char* what, auto&& f) {
      auto [one, two] = one_and_two_threads(f);
      EXPECT_TRUE(same_bytes(one, two)) << what << " " << dtype_name(dt);
    };
    check("gelu", [&] { return kernels::unary(kernels::Unary::Gelu, x); });
    check("exp", [&] { return kernels::unary(kernels::Unary::Exp, x); });
    check("gelu_backward", [&] { return kernels::gelu_backward(g, x); });
    check("add row", [&] { return kernels::binary(Binary::Add, x, row); });
    check("mul transposed", [&] { return kernels::binary(Binary::Mul, x.select(0, 0), xt); });
    check("sub in place", [&] {
      Tensor y = x.clone();
      kernels::binary_(Binary::Sub, y, g);
      return y;
    });
  }
}

// LayerNorm backward with row blocks (TP-invariant mode's weight gradients per token block): block
// i's dweight and dbias rows are bitwise the column sums of that block's rows alone, dx is the
// unblocked dx, empty blocks give zero rows, and blocks that do not cover the rows are refused.
TEST(Kernels, LayerNormBackwardRowBlocksAreEachBlocksOwnColumnSums) {
  for (DType dtype : {DType::Float32, DType::Float64}) {
    const std::int64_t rows = 12, cols = 9;
    const Tensor x = random::randn({rows, cols}, 1, dtype);
    const Tensor w = random::randn({cols}, 2, dtype);
    const Tensor b = random::randn({cols}, 3, dtype);
    const Tensor dy = random::randn({rows, cols}, 4, dtype);
    const kernels::LayerNormForward f = kernels::layer_norm_forward(x, w, b, 1e-5);
    const std::vector<std::int64_t> blocks{3, 0, 5, 4};
    const kernels::LayerNormGrads blocked =
        kernels::layer_norm_backward(dy, x, w, f.mean, f.rstd, true, true, true, blocks);
    const kernels::LayerNormGrads whole = kernels::layer_norm_backward(dy, x, w, f.mean, f.rstd, true, true, true);
    ASSERT_EQ(blocked.dweight.shape(), (Shape{4, cols}));
    ASSERT_EQ(blocked.dbias.shape(), (Shape{4, cols}));
    EXPECT_TRUE(same_bytes(blocked.dx, whole.dx));
    std::int64_t start = 0;
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      const std::int64_t n = blocks[i];
      const kernels::LayerNormGrads one = kernels::layer_norm_backward(
          dy.narrow(0, start, n), x.narrow(0, start, n), w, f.mean.narrow(0, start, n), f.rstd.narrow(0, start, n),
          false, true, true);
      EXPECT_TRUE(same_bytes(blocked.dweight.select(0, static_cast<std::int64_t>(i)).contiguous(), one.dweight))
          << "block " << i;
      EXPECT_TRUE(same_bytes(blocked.dbias.select(0, static_cast<std::int64_t>(i)).contiguous(), one.dbias))
          << "block " << i;
      start += n;
    }
    EXPECT_EQ(blocked.dbias.select(0, 1).to_vector(), std::vector<double>(cols, 0.0));
    EXPECT_THROW(kernels::layer_norm_backward(dy, x, w, f.mean, f.rstd, true, true, true, {3, 5}), InvalidArgument);
  }
}

}  // namespace test_kernels
