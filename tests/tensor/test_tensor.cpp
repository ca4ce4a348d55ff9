// Tensor storage, views, element access, errors.
#include <gtest/gtest.h>

#include "meshgrad/tensor/tensor.hpp"

namespace test_tensor {

using namespace meshgrad;

namespace {
Tensor iota(const Shape& shape, DType dtype = DType::Float64) {
  return Tensor::arange(shape_numel(shape), dtype).view(shape);
}
}  // namespace

TEST(Tensor, FactoriesShapeAndValues) {
  Tensor z = Tensor::zeros({2, 3});
  EXPECT_EQ(z.shape(), (Shape{2, 3}));
  EXPECT_EQ(z.strides(), (Strides{3, 1}));
  EXPECT_EQ(z.numel(), 6);
  EXPECT_EQ(z.dtype(), DType::Float32);
  EXPECT_TRUE(z.is_contiguous());
  for (double v : z.to_vector()) EXPECT_EQ(v, 0.0);
  Tensor f = Tensor::full({4}, 2.5, DType::Float64);
  EXPECT_EQ(f.to_vector(), (std::vector<double>{2.5, 2.5, 2.5, 2.5}));
  Tensor v = Tensor::from_values({1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_EQ(v.at({1, 2}), 6.0);
  EXPECT_EQ(Tensor::scalar(7.0).item(), 7.0);
}

TEST(Tensor, TransposeIsAViewWithSwappedStrides) {
  Tensor a = iota({2, 3});
  Tensor t = a.transpose(0, 1);
  EXPECT_EQ(t.shape(), (Shape{3, 2}));
  EXPECT_EQ(t.strides(), (Strides{1, 3}));
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_EQ(t.storage(), a.storage());
  EXPECT_EQ(t.at({2, 1}), a.at({1, 2}));
  a.set({1, 2}, 42.0);
  EXPECT_EQ(t.at({2, 1}), 42.0);   // shares storage
  EXPECT_EQ(t.contiguous().to_vector(), (std::vector<double>{0, 3, 1, 4, 2, 42}));
}

TEST(Tensor, NarrowSelectChunkSplit) {
  Tensor a = iota({4, 5});
  Tensor n = a.narrow(1, 1, 3);
  EXPECT_EQ(n.shape(), (Shape{4, 3}));
  EXPECT_EQ(n.at({2, 0}), 11.0);
  EXPECT_EQ(a.select(0, 3).to_vector(), (std::vector<double>{15, 16, 17, 18, 19}));
  // The shard rule: 5 over 3 -> 2, 2, 1.
  auto parts = a.chunk(1, 3);
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_EQ(parts[0].size(1), 2);
  EXPECT_EQ(parts[1].size(1), 2);
  EXPECT_EQ(parts[2].size(1), 1);
  EXPECT_EQ(parts[2].at({1, 0}), 9.0);
  auto s = a.split(0, {1, 3});
  EXPECT_EQ(s[1].at({0, 0}), 5.0);
  EXPECT_THROW(a.split(0, {1, 2}), InvalidArgument);
}

TEST(Tensor, ViewReshapeAndExpand) {
  Tensor a = iota({2, 3, 4});
  Tensor v = a.view({6, 4});
  EXPECT_EQ(v.storage(), a.storage());
  EXPECT_EQ(v.at({5, 3}), 23.0);
  EXPECT_EQ(a.view({-1}).numel(), 24);
  // A transposed tensor cannot be flattened without a copy: view refuses, reshape copies.
  Tensor t = a.transpose(1, 2);
  EXPECT_THROW(t.view({24}), InvalidArgument);
  Tensor r = t.reshape({24});
  EXPECT_NE(r.storage(), a.storage());
  EXPECT_EQ(r.at({1}), 4.0);
  // Merging dims that stay contiguous under a narrow works without a copy.
  Tensor n = a.narrow(0, 1, 1).view({3, 4});
  EXPECT_EQ(n.storage(), a.storage());
  EXPECT_EQ(n.at({0, 0}), 12.0);
  Tensor e = Tensor::from_values({1, 2, 3}, {3, 1}).expand({3, 4});
  EXPECT_EQ(e.strides()[1], 0);
  EXPECT_EQ(e.at({2, 3}), 3.0);
  EXPECT_THROW(Tensor::zeros({3, 2}).expand({3, 4}), InvalidArgument);
}

TEST(Tensor, PermuteUnsqueezeSqueeze) {
  Tensor a = iota({2, 3, 4});
  Tensor p = a.permute({2, 0, 1});
  EXPECT_EQ(p.shape(), (Shape{4, 2, 3}));
  EXPECT_EQ(p.at({3, 1, 2}), a.at({1, 2, 3}));
  EXPECT_THROW(a.permute({0, 0, 1}), InvalidArgument);
  EXPECT_EQ(a.unsqueeze(1).shape(), (Shape{2, 1, 3, 4}));
  EXPECT_EQ(a.unsqueeze(-1).shape(), (Shape{2, 3, 4, 1}));
  EXPECT_EQ(a.unsqueeze(1).squeeze(1).shape(), a.shape());
  EXPECT_THROW(a.squeeze(0), InvalidArgument);
}

TEST(Tensor, CopyFromBroadcastsAndConverts) {
  Tensor dst = Tensor::zeros({2, 3}, DType::Float64);
  dst.copy_from(Tensor::from_values({1, 2, 3}, {3}, DType::Float64));
  EXPECT_EQ(dst.to_vector(), (std::vector<double>{1, 2, 3, 1, 2, 3}));
  Tensor f = dst.to(DType::Float32);
  EXPECT_EQ(f.dtype(), DType::Float32);
  EXPECT_EQ(f.at({1, 2}), 3.0);
  EXPECT_THROW(dst.copy_from(Tensor::zeros({2, 3}, DType::Float32)), InvalidArgument);
}

TEST(Tensor, ErrorsNameTheOpAndShapes) {
  Tensor a = Tensor::zeros({2, 3});
  try {
    a.narrow(1, 2, 5);
    FAIL() << "narrow out of range did not throw";
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("narrow"), std::string::npos) << what;
    EXPECT_NE(what.find("[2, 3]"), std::string::npos) << what;
  }
  try {
    a.transpose(0, 2);
    FAIL() << "transpose with a bad dim did not throw";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("transpose"), std::string::npos);
  }
  EXPECT_THROW(a.at({2, 0}), InvalidArgument);
  EXPECT_THROW(Tensor().shape(), InvalidArgument);
  EXPECT_THROW(a.data<double>(), InvalidArgument);
}

TEST(Tensor, BitwiseEqualComparesValuesNotLayout) {
  Tensor a = iota({2, 3});
  Tensor b = a.transpose(0, 1).contiguous().transpose(0, 1);
  EXPECT_TRUE(bitwise_equal(a, b));
  b = b.contiguous();
  b.set({0, 0}, 1e-300);
  EXPECT_FALSE(bitwise_equal(a, b));
  EXPECT_FALSE(bitwise_equal(a, a.to(DType::Float32)));
}

TEST(Tensor, RequiresGradOnlyOnFloatingLeaves) {
  Tensor a = Tensor::zeros({2});
  a.set_requires_grad();
  EXPECT_TRUE(a.requires_grad());
  EXPECT_TRUE(a.is_leaf());
  Tensor idx = Tensor::from_int64(std::vector<std::int64_t>{1, 2}, {2});
  EXPECT_THROW(idx.set_requires_grad(), InvalidArgument);
  EXPECT_FALSE(a.detach().requires_grad());
}

TEST(Tensor, ScalarViewsAsAnyOneElementShape) {
  Tensor s = Tensor::scalar(3.0, DType::Float64);
  Tensor v = s.view({1, 1, 1});
  EXPECT_EQ(v.shape(), (Shape{1, 1, 1}));
  EXPECT_EQ(v.storage(), s.storage());
  EXPECT_EQ(v.at({0, 0, 0}), 3.0);
  EXPECT_EQ(v.view({}).item(), 3.0);
}

}  // namespace test_tensor
