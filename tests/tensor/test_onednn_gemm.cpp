// Float32 products through oneDNN (src/tensor/onednn_gemm.cpp): right by the definition for every
// transpose, padded row strides, alpha and beta; the same bits call after call; and blas::gemm
// routes by blas::float32_gemm_library(), the shape and split work, as blas.hpp says.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/error.hpp"
#include "meshgrad/tensor/parallel.hpp"   // for_ranges opens a blas::SplitWorkScope per range
#include "meshgrad/tensor/random.hpp"
#include "tensor/onednn_gemm.hpp"

namespace test_onednn_gemm {

using namespace meshgrad;

namespace {

// A product of 131 x 130 x K (K = 129 by default), dimensions odd so every kernel tile has an edge,
// stored with row strides padded by 3 (or `pad`).
struct Case {
  bool ta, tb;
  std::int64_t m = 131, n = 130, k = 129, pad = 3;
  std::int64_t lda() const { return (ta ? m : k) + pad; }
  std::int64_t ldb() const { return (tb ? k : n) + pad; }
  std::int64_t ldc() const { return n + pad; }
  std::vector<float> a, b, c;
  Case(bool ta_, bool tb_, std::int64_t pad_ = 3, std::int64_t k_ = 129) : ta(ta_), tb(tb_), k(k_), pad(pad_) {
    std::uint64_t draw = 0;
    const auto fill = [&](std::vector<float>& v, std::size_t size) {
      v.resize(size);
      for (float& x : v) x = static_cast<float>(random::normal(21, draw++));
    };
    fill(a, static_cast<std::size_t>((ta ? k : m) * lda()));
    fill(b, static_cast<std::size_t>((tb ? n : k) * ldb()));
    fill(c, static_cast<std::size_t>(m * ldc()));
  }
  double A(std::int64_t i, std::int64_t p) const { return ta ? a[p * lda() + i] : a[i * lda() + p]; }
  double B(std::int64_t p, std::int64_t j) const { return tb ? b[j * ldb() + p] : b[p * ldb() + j]; }
};

bool built() { return blas::onednn::built(); }

TEST(OneDnnGemm, MatchesTheDefinitionForEveryTransposeStrideAlphaAndBeta) {
  if (!built()) GTEST_SKIP() << "built without oneDNN (MESHGRAD_ONEDNN=OFF)";
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (const auto& [alpha, beta] : {std::pair{1.0f, 0.0f}, std::pair{1.5f, -0.5f}, std::pair{1.0f, 1.0f}}) {
        Case t(ta, tb);
        const std::vector<float> c0 = t.c;
        blas::onednn::sgemm(ta, tb, t.m, t.n, t.k, alpha, t.a.data(), t.lda(), t.b.data(), t.ldb(), beta, t.c.data(),
                            t.ldc(), 2);
        for (std::int64_t i = 0; i < t.m; ++i) {
          for (std::int64_t j = 0; j < t.n; ++j) {
            double exact = beta * double(c0[i * t.ldc() + j]), scale = std::abs(exact);
            for (std::int64_t p = 0; p < t.k; ++p) {
              exact += alpha * t.A(i, p) * t.B(p, j);
              scale += std::abs(alpha * t.A(i, p) * t.B(p, j));
            }
            // A K-term float32 sum: |error| <= 4 K eps32 sum |terms| (blas' bound, test_kernels.cpp).
            ASSERT_LE(std::abs(double(t.c[i * t.ldc() + j]) - exact), 4.0 * t.k * 0x1p-24 * scale)
                << "ta=" << ta << " tb=" << tb << " alpha " << alpha << " beta " << beta << " at (" << i << ", " << j << ")";
          }
          // The padding between rows is not written.
          for (std::int64_t j = t.n; j < t.ldc(); ++j) ASSERT_EQ(t.c[i * t.ldc() + j], c0[i * t.ldc() + j]);
        }
      }
    }
  }
}

TEST(OneDnnGemm, TheSameInputsGiveTheSameBitsOnEveryCall) {
  if (!built()) GTEST_SKIP() << "built without oneDNN (MESHGRAD_ONEDNN=OFF)";
  for (const int threads : {1, 2}) {
    Case first(false, true), second(false, true);
    blas::onednn::sgemm(false, true, first.m, first.n, first.k, 1.0f, first.a.data(), first.lda(), first.b.data(),
                        first.ldb(), 0.0f, first.c.data(), first.ldc(), threads);
    for (int call = 0; call < 3; ++call) {
      std::vector<float> c = second.c;
      blas::onednn::sgemm(false, true, second.m, second.n, second.k, 1.0f, second.a.data(), second.lda(),
                          second.b.data(), second.ldb(), 0.0f, c.data(), second.ldc(), threads);
      ASSERT_EQ(std::memcmp(c.data(), first.c.data(), c.size() * sizeof(float)), 0) << threads << " threads, call " << call;
    }
  }
}

// The bits of blas::gemm are oneDNN's for a large product when it is chosen, OpenBLAS's otherwise,
// and OpenBLAS's on a thread running split work (whatever the choice).
TEST(OneDnnGemm, BlasGemmRoutesByTheChoiceTheShapeAndSplitWork) {
  if (!built()) GTEST_SKIP() << "built without oneDNN (MESHGRAD_ONEDNN=OFF)";
  const blas::GemmLibrary before = blas::float32_gemm_library();
  // Above kOneDnnMinProduct (18.7M multiply-adds); dense (padded rows take oneDNN's jit gemm, not
  // its brgemm); and K = 1100 longer than either
  // library's K block: a K within one block is the same chain of fused multiply-adds in both, bit
  // for bit, so this test could not tell them apart.
  const Case t(true, false, /*pad=*/0, /*k=*/1100);
  auto product = [&](auto&& compute) {
    std::vector<float> c = t.c;
    compute(c.data());
    return c;
  };
  const auto via_blas = [&](float* c) {
    blas::gemm(t.ta, t.tb, t.m, t.n, t.k, 1.0f, t.a.data(), t.lda(), t.b.data(), t.ldb(), 0.0f, c, t.ldc());
  };
  const std::vector<float> onednn = product([&](float* c) {
    blas::onednn::sgemm(t.ta, t.tb, t.m, t.n, t.k, 1.0f, t.a.data(), t.lda(), t.b.data(), t.ldb(), 0.0f, c, t.ldc(),
                        blas::num_threads());
  });
  blas::set_float32_gemm_library(blas::GemmLibrary::OpenBlas);
  const std::vector<float> openblas = product(via_blas);
  blas::set_float32_gemm_library(blas::GemmLibrary::OneDnn);
  const std::vector<float> chosen = product(via_blas);
  std::vector<float> split;
  parallel::for_ranges(2, 2, [&](std::int64_t begin, std::int64_t) {
    if (begin == 0) split = product(via_blas);
  });
  blas::set_float32_gemm_library(before);
  EXPECT_EQ(std::memcmp(chosen.data(), onednn.data(), chosen.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(split.data(), openblas.data(), split.size() * sizeof(float)), 0);
  // The two libraries round differently somewhere in 17,030 sums of 1,100 terms.
  EXPECT_NE(std::memcmp(onednn.data(), openblas.data(), onednn.size() * sizeof(float)), 0);
  EXPECT_NE(blas::gemm_description().find("oneDNN"), std::string::npos);
}

TEST(OneDnnGemm, ABuildWithoutItRefusesToBeAskedForIt) {
  if (built()) {
    EXPECT_NO_THROW(blas::set_float32_gemm_library(blas::float32_gemm_library()));
    return;
  }
  EXPECT_THROW(blas::set_float32_gemm_library(blas::GemmLibrary::OneDnn), InvalidArgument);
}

}  // namespace

}  // namespace test_onednn_gemm
