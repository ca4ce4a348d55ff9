// The version counter (Tensor::version): every in-place writer of the public API bumps it, every
// handle on the same storage sees the same counter, and reading never bumps.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/tensor.hpp"

namespace test_version {

using namespace meshgrad;

namespace {

Tensor values_2x3() { return Tensor::from_values({1, 2, 3, 4, 5, 6}, {2, 3}, DType::Float64); }

}  // namespace

TEST(Version, FreshTensorsStartAtZeroAndReadingDoesNotBump) {
  Tensor t = values_2x3();
  EXPECT_EQ(t.version(), 0u);
  // Every reader of the public API.
  (void)t.at({1, 2});
  (void)t.at_flat(4);
  (void)t.to_vector();
  (void)t.data<double>();
  (void)t.raw_data();
  (void)t.contiguous();
  (void)t.transpose(0, 1).contiguous();
  (void)t.clone();
  (void)t.to(DType::Float32);
  (void)kernels::binary(kernels::Binary::Add, t, t);
  (void)kernels::matmul(t, t.transpose(0, 1));
  EXPECT_EQ(t.version(), 0u);
}

TEST(Version, EveryInPlaceWriterBumpsOnce) {
  const Tensor other = Tensor::full({2, 3}, 2.0, DType::Float64);
  const Tensor square = Tensor::from_values({1, 0, 0, 0, 1, 0, 0, 0, 1}, {3, 3}, DType::Float64);
  const Tensor indices = Tensor::from_int64(std::vector<std::int64_t>{0, 1, 1}, {3});
  const Tensor rows = Tensor::from_values({1, 1, 1, 2, 2, 2, 3, 3, 3}, {3, 3}, DType::Float64);
  const std::vector<std::pair<std::string, std::function<void(Tensor&)>>> writers = {
      {"copy_from", [&](Tensor& t) { t.copy_from(other); }},
      {"fill_", [](Tensor& t) { t.fill_(3.0); }},
      {"zero_", [](Tensor& t) { t.zero_(); }},
      {"set", [](Tensor& t) { t.set({0, 1}, 9.0); }},
      {"binary_", [&](Tensor& t) { kernels::binary_(kernels::Binary::Mul, t, other); }},
      {"axpy_", [&](Tensor& t) { kernels::axpy_(t, 2.0, other); }},
      {"matmul_into", [&](Tensor& t) { kernels::matmul_into(t, t.clone(), square, true); }},
      {"embedding_backward_", [&](Tensor& t) { kernels::embedding_backward_(t, rows, indices); }},
      {"bump_version", [](Tensor& t) { t.bump_version(); }},
  };
  for (const auto& [name, write] : writers) {
    SCOPED_TRACE(name);
    Tensor t = values_2x3();
    const std::vector<double> before = t.to_vector();
    write(t);
    EXPECT_EQ(t.version(), 1u);
    // The writer really wrote (so the case is not vacuous), except the explicit bump.
    if (name != "bump_version") {
      EXPECT_NE(t.to_vector(), before);
    }
  }
}

TEST(Version, SharedByViewsAndDetachNotByCopies) {
  Tensor t = values_2x3();
  Tensor view = t.transpose(0, 1);
  Tensor row = t.select(0, 1);
  Tensor flat = t.view({6});
  Tensor detached = t.detach();
  Tensor copy = t.clone();
  // A write through one view is seen by every handle on the storage.
  row.fill_(0.0);
  for (const Tensor* h : {&t, &view, &row, &flat, &detached}) EXPECT_EQ(h->version(), 1u);
  kernels::axpy_(view, 1.0, Tensor::ones({3, 2}, DType::Float64));
  for (const Tensor* h : {&t, &view, &row, &flat, &detached}) EXPECT_EQ(h->version(), 2u);
  // A copy has its own storage and its own counter.
  EXPECT_EQ(copy.version(), 0u);
  copy.fill_(1.0);
  EXPECT_EQ(copy.version(), 1u);
  EXPECT_EQ(t.version(), 2u);
}

TEST(Version, RejectedWriteDoesNotBump) {
  // A writer that rejects its arguments throws before touching the data and before bumping:
  // the version still says "unchanged" because nothing changed.
  Tensor t = values_2x3();
  EXPECT_THROW(t.copy_from(Tensor::zeros({4}, DType::Float64)), InvalidArgument);
  EXPECT_THROW(kernels::axpy_(t, 1.0, Tensor::zeros({3, 2}, DType::Float64)), InvalidArgument);
  EXPECT_EQ(t.version(), 0u);
  EXPECT_EQ(t.to_vector(), (std::vector<double>{1, 2, 3, 4, 5, 6}));
}

}  // namespace test_version
