// The data kernels every backend's collectives run (comm/detail.hpp): the rank-order reduction and
// the copy, with cached and with streaming stores. Streaming stores are aligned on the destination
// (head and tail through memcpy), so every destination misalignment and length around the vector
// and block sizes is checked bit for bit against a scalar loop, in place too.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "comm/detail.hpp"

namespace meshgrad::comm::detail::test_reduce_kernels {
namespace {

template <class T>
T value(int rank, std::size_t i) {   // inexact: sums depend on their order
  return T(1) / static_cast<T>(rank + 3) + static_cast<T>(i) * T(1e-3) / static_cast<T>(7 + rank);
}

template <class T>
T reference(int n_in, std::size_t i, ReduceOp op) {
  T a = value<T>(0, i);
  for (int r = 1; r < n_in; ++r) {
    const T x = value<T>(r, i);
    if (op == ReduceOp::Sum || op == ReduceOp::Avg) a = a + x;
    if (op == ReduceOp::Max) a = x > a ? x : a;
    if (op == ReduceOp::Min) a = x < a ? x : a;
  }
  return op == ReduceOp::Avg ? a / static_cast<T>(n_in) : a;
}

template <class T>
void reduce_every_alignment_and_length() {
  const std::size_t block = 4096 / sizeof(T), vec = 64 / sizeof(T);
  for (Stores stores : {Stores::Cached, Stores::Streaming, Stores::Auto}) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
      for (std::size_t n : {std::size_t(0), std::size_t(1), vec - 1, vec, vec + 1, block - 1, block + vec + 3,
                            3 * block + 5}) {
        for (std::size_t shift : {std::size_t(0), std::size_t(1), std::size_t(3), vec - 1}) {
          const int n_in = 3;
          // Inputs and outputs at element offset `shift` of 64-byte aligned storage; output 1 is input 1
          // (in place), output 0 and 2 are separate and have different alignments.
          std::vector<std::vector<T>> in(n_in, std::vector<T>(n + 2 * vec));
          std::vector<T> out0(n + 2 * vec, T(-9)), out2(n + 2 * vec, T(-9));
          for (int r = 0; r < n_in; ++r) {
            for (std::size_t i = 0; i < n; ++i) in[r][shift + i] = value<T>(r, i);
          }
          const void* ins[3] = {in[0].data() + shift, in[1].data() + shift, in[2].data() + shift};
          void* outs[3] = {out0.data() + shift, in[1].data() + shift, out2.data() + (vec - shift) % vec};
          reduce_rank_order(dtype_of<T>(), op, n_in, ins, n_in, outs, 3, n, stores);
          if (stores == Stores::Streaming) stream_fence();
          for (std::size_t i = 0; i < n; ++i) {
            const T want = reference<T>(n_in, i, op);
            const T got[3] = {out0[shift + i], in[1][shift + i], out2[(vec - shift) % vec + i]};
            for (int k = 0; k < 3; ++k) {
              ASSERT_EQ(std::memcmp(&got[k], &want, sizeof(T)), 0)
                  << "output " << k << " element " << i << " of " << n << ", shift " << shift << ", op "
                  << reduce_op_name(op) << ", stores " << int(stores) << ": " << got[k] << " vs " << want;
            }
          }
          EXPECT_EQ(out0[shift + n], T(-9)) << "wrote past the end, n " << n << " shift " << shift;
          if (shift > 0) {
            EXPECT_EQ(out0[shift - 1], T(-9)) << "wrote before the start, n " << n << " shift " << shift;
          }
        }
      }
    }
  }
}

TEST(ReduceKernels, RankOrderBitsAtEveryAlignmentAndLengthFloat32) { reduce_every_alignment_and_length<float>(); }
TEST(ReduceKernels, RankOrderBitsAtEveryAlignmentAndLengthFloat64) { reduce_every_alignment_and_length<double>(); }

TEST(ReduceKernels, CopyBytesEqualsMemcpyAtEveryAlignment) {
  for (Stores stores : {Stores::Cached, Stores::Streaming, Stores::Auto}) {
    for (std::size_t n : {0, 1, 15, 16, 63, 64, 65, 255, 256, 257, 4096 + 37, 100000}) {
      for (std::size_t src_shift : {0, 5}) {
        for (std::size_t dst_shift : {0, 1, 17, 63}) {
          std::vector<unsigned char> src(n + 128), dst(n + 128, 0xEE);
          for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 131 + 7);
          copy_bytes(dst.data() + dst_shift, src.data() + src_shift, n, stores);
          if (stores == Stores::Streaming) stream_fence();
          ASSERT_EQ(std::memcmp(dst.data() + dst_shift, src.data() + src_shift, n), 0)
              << "n " << n << " src shift " << src_shift << " dst shift " << dst_shift << " stores " << int(stores);
          for (std::size_t i = 0; i < dst_shift; ++i) ASSERT_EQ(dst[i], 0xEE) << "before the start, n " << n;
          for (std::size_t i = dst_shift + n; i < dst.size(); ++i) ASSERT_EQ(dst[i], 0xEE) << "past the end, n " << n;
        }
      }
    }
  }
}

TEST(ReduceKernels, CopyToAllWritesEveryDestinationAtItsAlignment) {
  for (Stores stores : {Stores::Cached, Stores::Streaming, Stores::Auto}) {
    for (std::size_t n : {0, 1, 255, 256, 257, 4096 + 37, 100000}) {
      std::vector<unsigned char> src(n + 128);
      for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 131 + 7);
      const std::size_t shifts[3] = {0, 17, 63};
      std::vector<std::vector<unsigned char>> dst(3, std::vector<unsigned char>(n + 128, 0xEE));
      void* dsts[3] = {dst[0].data() + shifts[0], dst[1].data() + shifts[1], dst[2].data() + shifts[2]};
      copy_to_all(src.data() + 5, dsts, 3, n, stores);
      if (stores == Stores::Streaming) stream_fence();
      for (int k = 0; k < 3; ++k) {
        ASSERT_EQ(std::memcmp(dsts[k], src.data() + 5, n), 0) << "destination " << k << ", n " << n;
        for (std::size_t i = 0; i < shifts[k]; ++i) ASSERT_EQ(dst[k][i], 0xEE) << "before the start, n " << n;
        for (std::size_t i = shifts[k] + n; i < dst[k].size(); ++i) ASSERT_EQ(dst[k][i], 0xEE) << "past the end";
      }
    }
  }
}

}  // namespace
}  // namespace meshgrad::comm::detail::test_reduce_kernels
