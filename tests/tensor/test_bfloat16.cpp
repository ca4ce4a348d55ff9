// bfloat16 storage and products (--precision bf16): the conversions round to nearest even as
// PyTorch, oneDNN and vcvtneps2bf16 do; bf16 products are right by the definition on both routes
// (oneDNN's bf16 kernels and the float32 kernels on widened operands), the same bits call after call;
// under a ProductPrecisionScope matmul rounds float32 operands and nothing else; and the fallback
// says why it is taken.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/random.hpp"
#include "meshgrad/tensor/tensor.hpp"
#include "tensor/onednn_gemm.hpp"

namespace test_bfloat16 {

using namespace meshgrad;

namespace {

// The reference rounding: of the two bf16 values around x (exact in double), the nearer; a tie to
// the one with an even last bit. Finite x only, below bf16's largest finite value.
std::uint16_t reference_bf16(double x) {
  const float f = static_cast<float>(x);   // only to find the neighbours: truncate its bits
  std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  std::uint16_t lo = static_cast<std::uint16_t>(u >> 16);
  // lo is the truncation of f; step it down when f rounded up past x.
  if (std::fabs(static_cast<double>(float_from_bf16_bits(lo))) > std::fabs(x)) --lo;
  const std::uint16_t hi = static_cast<std::uint16_t>(lo + 1);
  const double dl = std::fabs(x - static_cast<double>(float_from_bf16_bits(lo)));
  const double dh = std::fabs(static_cast<double>(float_from_bf16_bits(hi)) - x);
  if (dl < dh) return lo;
  if (dh < dl) return hi;
  return (lo & 1u) == 0 ? lo : hi;
}

TEST(BFloat16, RoundsFloatsAndDoublesToNearestEven) {
  // Ties: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7 (bf16 keeps 7 mantissa bits): to even, 1;
  // 1 + 3 x 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: to even, 1 + 2^-6.
  EXPECT_EQ(float(bfloat16(1.0f + std::ldexp(1.0f, -8))), 1.0f);
  EXPECT_EQ(float(bfloat16(1.0f + 3 * std::ldexp(1.0f, -8))), 1.0f + std::ldexp(1.0f, -6));
  // Just above a tie rounds up, in float and in double: the double path must not round twice (a
  // double 2^-40 above the tie rounds to the tie in float).
  EXPECT_EQ(float(bfloat16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20))), 1.0f + std::ldexp(1.0f, -7));
  EXPECT_EQ(float(bfloat16(1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40))), 1.0f + std::ldexp(1.0f, -7));
  EXPECT_EQ(float(bfloat16(-(1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40)))), -(1.0f + std::ldexp(1.0f, -7)));
  // Special values.
  EXPECT_TRUE(std::isnan(float(bfloat16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(float(bfloat16(std::numeric_limits<double>::signaling_NaN()))));
  EXPECT_EQ(float(bfloat16(std::numeric_limits<float>::infinity())), std::numeric_limits<float>::infinity());
  EXPECT_EQ(float(bfloat16(-std::numeric_limits<float>::max())), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(float(bfloat16(1e300)), std::numeric_limits<float>::infinity());
  EXPECT_EQ(bfloat16(-0.0f).bits, 0x8000u);
  // Random doubles and floats of every magnitude against the reference rounding.
  int checked = 0;
  for (std::uint64_t i = 0; i < 200000; ++i) {
    const double x = random::normal(7, i) * std::ldexp(1.0, static_cast<int>(i % 200) - 100);
    ASSERT_EQ(bfloat16(x).bits, reference_bf16(x)) << "double " << x;
    const float f = static_cast<float>(x);
    ASSERT_EQ(bfloat16(f).bits, reference_bf16(f)) << "float " << f;
    ++checked;
  }
  EXPECT_EQ(checked, 200000);
}

TEST(BFloat16, TensorsConvertBothWaysAndRefuseArithmetic) {
  const Tensor a = random::randn({3, 5}, 11, DType::Float32);
  const Tensor b = a.to(DType::BFloat16);
  EXPECT_EQ(b.dtype(), DType::BFloat16);
  EXPECT_EQ(dtype_size(b.dtype()), 2u);
  EXPECT_TRUE(bitwise_equal(kernels::to_bfloat16(a), b));
  const Tensor back = b.to(DType::Float32);
  const Tensor rounded = kernels::round_to_bfloat16(a);
  EXPECT_TRUE(bitwise_equal(back, rounded));
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    EXPECT_EQ(rounded.at_flat(i), double(float(bfloat16(static_cast<float>(a.at_flat(i))))));
    EXPECT_NE(rounded.at_flat(i), 0.0);
  }
  // Storage only: arithmetic and autograd refuse it by name.
  EXPECT_THROW(kernels::binary(kernels::Binary::Add, b, b), InvalidArgument);
  Tensor leaf = b;
  EXPECT_THROW(leaf.set_requires_grad(true), InvalidArgument);
  EXPECT_THROW(kernels::matmul(b, a.transpose(0, 1).to(DType::Float64)), InvalidArgument);
  try {
    parse_dtype("bfloat16");
    ADD_FAILURE() << "parse_dtype took bfloat16";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("--precision bf16"), std::string::npos) << e.what();
  }
}

// C = op(A) op(B) for bf16 A, B against the exact products of their values (double), for every
// transpose: an error within K x 2^-23 of sum |a b| (float32 accumulation of exact products).
void expect_bf16_product_right(std::int64_t m, std::int64_t n, std::int64_t k, const char* route) {
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      SCOPED_TRACE(fmt::format("{} {}x{}x{} ta={} tb={}", route, m, n, k, ta, tb));
      const Tensor a32 = random::randn(ta ? Shape{k, m} : Shape{m, k}, 3, DType::Float32);
      const Tensor b32 = random::randn(tb ? Shape{n, k} : Shape{k, n}, 4, DType::Float32);
      const Tensor a = a32.to(DType::BFloat16), b = b32.to(DType::BFloat16);
      const Tensor opa = ta ? a.transpose(0, 1) : a, opb = tb ? b.transpose(0, 1) : b;
      const Tensor c = kernels::matmul(opa, opb);
      ASSERT_EQ(c.dtype(), DType::Float32);
      const Tensor exact = kernels::matmul(opa.to(DType::Float64), opb.to(DType::Float64));
      const auto absolute = [](const Tensor& t) {
        Tensor out = t.to(DType::Float64).contiguous();
        double* p = out.data<double>();
        for (std::int64_t i = 0; i < out.numel(); ++i) p[i] = std::fabs(p[i]);
        return out;
      };
      const Tensor scale = kernels::matmul(absolute(opa), absolute(opb));
      double worst = 0;
      for (std::int64_t i = 0; i < m * n; ++i) {
        worst = std::max(worst, std::fabs(c.at_flat(i) - exact.at_flat(i)) / (scale.at_flat(i) + 1e-300));
      }
      EXPECT_LT(worst, static_cast<double>(k) * std::ldexp(1.0, -23));
      EXPECT_GT(worst, 0.0) << "no rounding at all: the product did not accumulate in float32";
      // Deterministic: the same bits again.
      EXPECT_TRUE(bitwise_equal(kernels::matmul(opa, opb), c));
    }
  }
}

// One OpenBLAS thread: ThreadSanitizer (make test-tsan) cannot see the synchronisation inside
// OpenBLAS's uninstrumented thread pool and would report its workers' writes as races.
struct OneBlasThread {
  int before = blas::num_threads();
  OneBlasThread() { blas::set_num_threads(1); }
  ~OneBlasThread() { blas::set_num_threads(before); }
};

TEST(BFloat16, ProductsAreRightOnTheFloat32KernelRoute) {
  const OneBlasThread one;
  const blas::GemmLibrary before = blas::float32_gemm_library();
  blas::set_float32_gemm_library(blas::GemmLibrary::OpenBlas);   // bf16_route: Float32Kernels
  EXPECT_EQ(blas::bf16_route(), blas::Bf16Route::Float32Kernels);
  expect_bf16_product_right(67, 45, 129, "float32 kernels");
  blas::set_float32_gemm_library(before);
}

TEST(BFloat16, ProductsAreRightOnOneDnnsBf16Kernels) {
  if (!blas::bf16_fallback_reason().empty()) GTEST_SKIP() << "bf16 products fall back: " << blas::bf16_fallback_reason();
  ASSERT_EQ(blas::bf16_route(), blas::Bf16Route::OneDnn);
  // Above kOneDnnMinProduct multiply-adds, so oneDNN runs it.
  expect_bf16_product_right(512, 256, 160, "oneDNN");
  EXPECT_NE(blas::onednn::bf16_kernel(), "");
}

TEST(BFloat16, BothRoutesAgreeWithinFloat32Accumulation) {
  if (!blas::bf16_fallback_reason().empty()) GTEST_SKIP() << "bf16 products fall back: " << blas::bf16_fallback_reason();
  const Tensor a = random::randn({512, 160}, 5, DType::Float32).to(DType::BFloat16);
  const Tensor b = random::randn({160, 256}, 6, DType::Float32).to(DType::BFloat16);
  const Tensor onednn = kernels::matmul(a, b);
  const blas::GemmLibrary before = blas::float32_gemm_library();
  blas::set_float32_gemm_library(blas::GemmLibrary::OpenBlas);
  const Tensor widened = kernels::matmul(a, b);
  blas::set_float32_gemm_library(before);
  double worst = 0;
  for (std::int64_t i = 0; i < onednn.numel(); ++i) worst = std::max(worst, std::fabs(onednn.at_flat(i) - widened.at_flat(i)));
  EXPECT_LT(worst, 160 * std::ldexp(1.0, -23) * 160 * 4);   // |a b| < ~4 per term for normal draws
}

TEST(BFloat16, APrecisionScopeRoundsFloat32OperandsOnly) {
  const Tensor a = random::randn({40, 24}, 8, DType::Float32);
  const Tensor b = random::randn({24, 30}, 9, DType::Float32);
  const Tensor full = kernels::matmul(a, b);
  Tensor in_scope;
  {
    const kernels::ProductPrecisionScope scope(kernels::ProductPrecision::BFloat16);
    EXPECT_EQ(kernels::product_precision(), kernels::ProductPrecision::BFloat16);
    in_scope = kernels::matmul(a, b);
    // matmul_into too, into a column slice of a wider output.
    Tensor wide = Tensor::zeros({40, 34}, DType::Float32);
    Tensor slice = wide.narrow(1, 2, 30);
    kernels::matmul_into(slice, a, b, false);
    EXPECT_TRUE(bitwise_equal(slice.contiguous(), in_scope));
    // float64 products are never rounded.
    const Tensor a64 = a.to(DType::Float64), b64 = b.to(DType::Float64);
    EXPECT_EQ(kernels::matmul(a64, b64).dtype(), DType::Float64);
    EXPECT_TRUE(bitwise_equal(kernels::matmul(a64, b64), [&] {
      const kernels::ProductPrecisionScope off(kernels::ProductPrecision::Float32);
      return kernels::matmul(a64, b64);
    }()));
  }
  EXPECT_EQ(kernels::product_precision(), kernels::ProductPrecision::Float32);
  EXPECT_TRUE(bitwise_equal(in_scope, kernels::matmul(a.to(DType::BFloat16), b.to(DType::BFloat16))));
  EXPECT_FALSE(bitwise_equal(in_scope, full));
  // A bf16 operand with a float32 one is a bf16 product outside a scope too (a saved bf16 copy
  // meeting a float32 gradient).
  EXPECT_TRUE(bitwise_equal(kernels::matmul(a.to(DType::BFloat16), b), in_scope));
}

TEST(BFloat16, TheFallbackSaysWhy) {
  using blas::GemmLibrary;
  EXPECT_EQ(blas::bf16_fallback_reason({true, false}, true, GemmLibrary::OneDnn), "");
  EXPECT_EQ(blas::bf16_fallback_reason({false, true}, true, GemmLibrary::OneDnn), "");
  EXPECT_NE(blas::bf16_fallback_reason({false, false}, true, GemmLibrary::OneDnn).find("neither AVX512_BF16 nor AMX-BF16"),
            std::string::npos);
  EXPECT_NE(blas::bf16_fallback_reason({true, true}, false, GemmLibrary::OneDnn).find("no oneDNN"), std::string::npos);
  EXPECT_NE(blas::bf16_fallback_reason({true, true}, true, GemmLibrary::OpenBlas).find("MESHGRAD_GEMM=openblas"),
            std::string::npos);
  // The description names the route taken.
  const std::string d = blas::bf16_description();
  if (blas::bf16_route() == blas::Bf16Route::OneDnn) {
    EXPECT_NE(d.find("oneDNN"), std::string::npos) << d;
  } else {
    EXPECT_NE(d.find("float32 kernels on bf16 operands ("), std::string::npos) << d;
  }
}

}  // namespace


namespace {

// A transposed float32 operand's bf16 copy stays transposed: OpenBLAS sums in another order for
// the other transpose choice, and the invariant modes need the float32 products' choices.
TEST(BFloat16, AProductOperandKeepsItsTranspose) {
  const Tensor w = random::randn({16, 48}, 12, DType::Float32);
  const kernels::ProductPrecisionScope scope(kernels::ProductPrecision::BFloat16);
  const Tensor t = kernels::product_operand(w.transpose(0, 1));
  ASSERT_EQ(t.dtype(), DType::BFloat16);
  EXPECT_EQ(t.shape(), (Shape{48, 16}));
  EXPECT_EQ(t.strides()[0], 1);
  EXPECT_TRUE(bitwise_equal(t.contiguous(), kernels::to_bfloat16(w).transpose(0, 1).contiguous()));
  const Tensor plain = kernels::product_operand(w);
  EXPECT_EQ(plain.strides()[1], 1);
}

}  // namespace

namespace {

// The probe behind MFU and `meshgrad bench peak`: a rate for every precision and library it takes,
// and a clear refusal otherwise (its speed is a benchmark's business, not a test's).
TEST(ProductPeak, MeasuresEachPrecisionAndRefusesWhatItCannot) {
  const OneBlasThread one;
  EXPECT_GT(blas::product_peak_gflops(DType::Float32, 128, 2, blas::GemmLibrary::OpenBlas), 0.0);
  EXPECT_GT(blas::product_peak_gflops(DType::Float64, 128, 2, blas::GemmLibrary::OpenBlas), 0.0);
  EXPECT_GT(blas::product_peak_gflops(DType::BFloat16, 128, 2, blas::float32_gemm_library()), 0.0);
  if (blas::onednn_built()) {
    EXPECT_GT(blas::product_peak_gflops(DType::Float32, 256, 2, blas::GemmLibrary::OneDnn), 0.0);
  } else {
    EXPECT_THROW(blas::product_peak_gflops(DType::Float32, 256, 2, blas::GemmLibrary::OneDnn), InvalidArgument);
  }
  EXPECT_THROW(blas::product_peak_gflops(DType::Int64, 128, 2, blas::GemmLibrary::OpenBlas), InvalidArgument);
  EXPECT_THROW(blas::product_peak_gflops(DType::Float32, 0, 2, blas::GemmLibrary::OpenBlas), InvalidArgument);
  EXPECT_THROW(blas::product_peak_gflops(DType::Float32, 128, 0, blas::GemmLibrary::OpenBlas), InvalidArgument);
}

}  // namespace

}  // namespace test_bfloat16
