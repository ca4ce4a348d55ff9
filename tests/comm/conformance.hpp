// The conformance suite every communicator backend passes, written once. A Harness says how to run a
// body on every rank of a communicator of size P (threads: run_ranks(P); mpi: a split of the world);
// MESHGRAD_COMM_CONFORMANCE_TESTS(Suite, harness) instantiates every test for one backend.
//
// Inputs are rank-valued; expected values are closed forms (exact in float) or, for the bit-exactness
// tests, a rank-order loop ((x0 + x1) + x2) + ... in the buffer's dtype, compared bit for bit.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <thread>
#include <vector>

#include "meshgrad/comm/communicator.hpp"
#include "meshgrad/comm/errors.hpp"
#include "meshgrad/tensor/shard.hpp"

namespace meshgrad::comm::testing {

class Harness {
 public:
  virtual ~Harness() = default;
  // Runs body on every rank of a communicator of size P (ranks outside it, if any, do nothing).
  virtual void run(int P, const std::function<void(Communicator&)>& body) = 0;
  // The sizes this harness can make (threads: 1..4; mpi: 1..world size).
  virtual int max_size() const = 0;
};

inline std::vector<int> sizes_of(Harness& h) {
  std::vector<int> out;
  for (int p = 1; p <= std::min(4, h.max_size()); ++p) out.push_back(p);
  return out;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// Exact in float: small multiples of 1/4.
template <class T>
T exact_value(int rank, std::size_t i) {
  return static_cast<T>(rank + 1) * T(0.5) + static_cast<T>(i % 7) * T(0.25);
}
// Inexact: sums depend on the order of additions, so only a rank-order reduction matches the loop.
template <class T>
T inexact_value(int rank, std::size_t i) {
  return T(1) / static_cast<T>(rank + 3) + static_cast<T>(i) * T(1e-3) / static_cast<T>(7 + rank);
}

template <class T>
std::vector<T> rank_order_reference(int P, std::size_t n, ReduceOp op, T (*value)(int, std::size_t)) {
  std::vector<T> acc(n);
  for (std::size_t i = 0; i < n; ++i) {
    T a = value(0, i);
    for (int r = 1; r < P; ++r) {
      const T x = value(r, i);
      switch (op) {
        case ReduceOp::Sum:
        case ReduceOp::Avg: a = a + x; break;
        case ReduceOp::Max: a = x > a ? x : a; break;
        case ReduceOp::Min: a = x < a ? x : a; break;
      }
    }
    acc[i] = op == ReduceOp::Avg ? a / static_cast<T>(P) : a;
  }
  return acc;
}

// ---- test bodies ------------------------------------------------------------------------------------

template <class T>
void all_reduce_closed_form(Harness& h) {
  for (int P : sizes_of(h)) {
    for (std::size_t n : {std::size_t(0), std::size_t(1), std::size_t(12), std::size_t(13), std::size_t(1031)}) {
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
        h.run(P, [&](Communicator& c) {
          const int r = c.rank();
          std::vector<T> in(n), out(n, T(-99));
          for (std::size_t i = 0; i < n; ++i) in[i] = exact_value<T>(r, i);
          c.all_reduce(buffer(std::span<const T>(in)), buffer(std::span<T>(out)), op);
          for (std::size_t i = 0; i < n; ++i) {
            const T base = static_cast<T>(i % 7) * T(0.25);
            T expected{};
            switch (op) {
              case ReduceOp::Sum: expected = T(0.5) * T(P * (P + 1) / 2) + T(P) * base; break;
              case ReduceOp::Avg: expected = (T(0.5) * T(P * (P + 1) / 2) + T(P) * base) / T(P); break;
              case ReduceOp::Max: expected = T(0.5) * T(P) + base; break;
              case ReduceOp::Min: expected = T(0.5) + base; break;
            }
            ASSERT_EQ(out[i], expected) << "P=" << P << " n=" << n << " op=" << reduce_op_name(op) << " i=" << i
                                        << " rank " << r;
          }
        });
      }
    }
  }
}

template <class T>
void all_reduce_in_place_bits(Harness& h) {
  for (int P : sizes_of(h)) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
      const std::size_t n = 5003;  // uneven chunks for P = 2, 3, 4
      const auto expected = rank_order_reference<T>(P, n, op, &inexact_value<T>);
      h.run(P, [&](Communicator& c) {
        std::vector<T> buf(n);
        for (std::size_t i = 0; i < n; ++i) buf[i] = inexact_value<T>(c.rank(), i);
        c.all_reduce(buffer(std::span<T>(buf)), op);
        EXPECT_TRUE(same_bits(buf, expected)) << "in-place all_reduce bits differ from the rank-order loop, P=" << P
                                              << " op " << reduce_op_name(op) << " rank " << c.rank();
      });
    }
  }
}

template <class T>
void all_gather_even_uneven(Harness& h) {
  for (int P : sizes_of(h)) {
    for (bool uneven : {false, true}) {
      h.run(P, [&](Communicator& c) {
        const int r = c.rank();
        std::vector<std::size_t> counts(static_cast<std::size_t>(P));
        for (int q = 0; q < P; ++q) counts[q] = uneven ? std::size_t(q % 3 + (q == 1 ? 0 : 2)) : 5;
        if (uneven && P > 1) counts[1] = 0;  // an empty shard
        const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
        std::vector<T> in(counts[r]), out(total, T(-1));
        for (std::size_t i = 0; i < in.size(); ++i) in[i] = T(100 * r) + T(i);
        if (uneven) {
          c.all_gather(buffer(std::span<const T>(in)), buffer(std::span<T>(out)), counts);
        } else {
          c.all_gather(buffer(std::span<const T>(in)), buffer(std::span<T>(out)));
        }
        std::size_t k = 0;
        for (int q = 0; q < P; ++q) {
          for (std::size_t i = 0; i < counts[q]; ++i, ++k) {
            ASSERT_EQ(out[k], T(100 * q) + T(i)) << "P=" << P << " uneven=" << uneven << " from rank " << q;
          }
        }
      });
    }
  }
}

template <class T>
void reduce_scatter_even_uneven(Harness& h) {
  for (int P : sizes_of(h)) {
    for (bool uneven : {false, true}) {
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
        const std::size_t n = uneven ? 10 : std::size_t(4 * P);
        // uneven: the shard rule (10 over 4 -> 3, 3, 2, 2)
        std::vector<std::size_t> counts;
        for (auto s : shard_sizes(std::int64_t(n), P)) counts.push_back(std::size_t(s));
        const auto full = rank_order_reference<T>(P, n, op, &inexact_value<T>);
        h.run(P, [&](Communicator& c) {
          const int r = c.rank();
          std::vector<T> in(n), out(counts[r], T(-7));
          for (std::size_t i = 0; i < n; ++i) in[i] = inexact_value<T>(r, i);
          if (uneven) {
            c.reduce_scatter(buffer(std::span<const T>(in)), buffer(std::span<T>(out)), op, counts);
          } else {
            c.reduce_scatter(buffer(std::span<const T>(in)), buffer(std::span<T>(out)), op);
          }
          const auto range = shard_range(std::int64_t(n), P, r);
          std::vector<T> expected(full.begin() + range.offset, full.begin() + range.offset + range.size);
          EXPECT_TRUE(same_bits(out, expected)) << "P=" << P << " uneven=" << uneven << " op " << reduce_op_name(op)
                                                << " rank " << r;
        });
      }
    }
  }
}

// Buffers large enough that a backend cuts its work into many pieces (the threads backend: chunks
// of 16 KiB and up, claimed by whichever rank runs), with uneven blocks, an empty one and sizes
// that are not a whole number of vectors: every rank must get the rank-order bits.
template <class T>
void large_buffers_bits(Harness& h) {
  for (int P : sizes_of(h)) {
    const std::size_t n = 100003;
    std::vector<std::size_t> counts(static_cast<std::size_t>(P));
    for (int q = 0; q < P; ++q) counts[q] = n / (2 * P) + std::size_t(q) * 4099;
    if (P > 2) counts[1] = 0;  // an empty block between others
    counts.back() = n - std::accumulate(counts.begin(), counts.end() - 1, std::size_t{0});
    const auto sum = rank_order_reference<T>(P, n, ReduceOp::Sum, &inexact_value<T>);
    const auto avg = rank_order_reference<T>(P, n, ReduceOp::Avg, &inexact_value<T>);
    h.run(P, [&](Communicator& c) {
      const int r = c.rank();
      std::vector<T> in(n), out(n, T(-3));
      for (std::size_t i = 0; i < n; ++i) in[i] = inexact_value<T>(r, i);
      c.all_reduce(buffer(std::span<const T>(in)), buffer(std::span<T>(out)), ReduceOp::Sum);
      EXPECT_TRUE(same_bits(out, sum)) << "all_reduce, P=" << P << " rank " << r;
      c.all_reduce(buffer(std::span<T>(in)), ReduceOp::Avg);   // in place
      EXPECT_TRUE(same_bits(in, avg)) << "in-place all_reduce avg, P=" << P << " rank " << r;
      // all_gather of uneven blocks: block q holds inexact_value(q, i).
      std::vector<T> mine(counts[r]), gathered(n, T(-3));
      for (std::size_t i = 0; i < mine.size(); ++i) mine[i] = inexact_value<T>(r, i);
      c.all_gather(buffer(std::span<const T>(mine)), buffer(std::span<T>(gathered)), counts);
      std::size_t k = 0, wrong = 0;
      for (int q = 0; q < P; ++q) {
        for (std::size_t i = 0; i < counts[q]; ++i, ++k) wrong += gathered[k] != inexact_value<T>(q, i);
      }
      EXPECT_EQ(wrong, 0u) << "all_gather, P=" << P << " rank " << r;
      // reduce_scatter of the same uneven blocks.
      for (std::size_t i = 0; i < n; ++i) in[i] = inexact_value<T>(r, i);
      std::vector<T> shard(counts[r], T(-3));
      c.reduce_scatter(buffer(std::span<const T>(in)), buffer(std::span<T>(shard)), ReduceOp::Sum, counts);
      const std::size_t first = std::accumulate(counts.begin(), counts.begin() + r, std::size_t{0});
      EXPECT_TRUE(same_bits(shard, std::vector<T>(sum.begin() + first, sum.begin() + first + counts[r])))
          << "reduce_scatter, P=" << P << " rank " << r;
    });
  }
}

template <class T>
void broadcast_every_root(Harness& h) {
  for (int P : sizes_of(h)) {
    for (int root = 0; root < P; ++root) {
      h.run(P, [&](Communicator& c) {
        std::vector<T> buf(37);
        for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = T(c.rank() * 1000) + T(i);
        c.broadcast(buffer(std::span<T>(buf)), root);
        for (std::size_t i = 0; i < buf.size(); ++i) ASSERT_EQ(buf[i], T(root * 1000) + T(i)) << "P=" << P;
      });
    }
  }
}

template <class T>
void all_to_all_even_uneven(Harness& h) {
  for (int P : sizes_of(h)) {
    for (bool uneven : {false, true}) {
      // rank s sends count(s, d) elements to d; element i of that message is 1000 s + 10 d + i.
      auto count = [&](int s, int d) -> std::size_t { return uneven ? std::size_t((s + 2 * d) % 3) : 3; };
      h.run(P, [&](Communicator& c) {
        const int r = c.rank();
        std::vector<std::size_t> sc(P), rc(P);
        for (int q = 0; q < P; ++q) {
          sc[q] = count(r, q);
          rc[q] = count(q, r);
        }
        std::vector<T> in, out(std::accumulate(rc.begin(), rc.end(), std::size_t{0}), T(-1));
        for (int d = 0; d < P; ++d) {
          for (std::size_t i = 0; i < sc[d]; ++i) in.push_back(T(1000 * r + 10 * d) + T(i));
        }
        if (uneven) {
          c.all_to_all(buffer(std::span<const T>(in)), sc, buffer(std::span<T>(out)), rc);
        } else {
          c.all_to_all(buffer(std::span<const T>(in)), {}, buffer(std::span<T>(out)), {});
        }
        std::size_t k = 0;
        for (int s = 0; s < P; ++s) {
          for (std::size_t i = 0; i < rc[s]; ++i, ++k) {
            ASSERT_EQ(out[k], T(1000 * s + 10 * r) + T(i)) << "P=" << P << " uneven=" << uneven << " from " << s;
          }
        }
      });
    }
  }
}

inline void send_recv_tags(Harness& h) {
  for (int P : sizes_of(h)) {
    if (P < 2) continue;
    h.run(P, [&](Communicator& c) {
      const int r = c.rank(), next = (r + 1) % P, prev = (r + P - 1) % P;
      std::vector<double> a(9, 10.0 * r + 1), b(4, 10.0 * r + 2), got_a(9), got_b(4);
      // Receives are posted in the opposite tag order of the sends: tags must do the matching.
      auto rb = c.recv_async(buffer(std::span<double>(got_b)), prev, /*tag=*/2);
      auto ra = c.recv_async(buffer(std::span<double>(got_a)), prev, /*tag=*/1);
      auto sa = c.send_async(buffer(std::span<const double>(a)), next, 1);
      auto sb = c.send_async(buffer(std::span<const double>(b)), next, 2);
      sa->wait();
      sb->wait();
      ra->wait();
      rb->wait();
      for (double v : got_a) ASSERT_EQ(v, 10.0 * prev + 1);
      for (double v : got_b) ASSERT_EQ(v, 10.0 * prev + 2);
      // Two messages with the same tag arrive in posting order.
      std::vector<float> m1(3, float(r)), m2(3, float(r + 100)), g1(3), g2(3);
      auto s1 = c.send_async(buffer(std::span<const float>(m1)), next, 0);
      auto s2 = c.send_async(buffer(std::span<const float>(m2)), next, 0);
      c.recv(buffer(std::span<float>(g1)), prev, 0);
      c.recv(buffer(std::span<float>(g2)), prev, 0);
      s1->wait();
      s2->wait();
      EXPECT_EQ(g1[0], float(prev));
      EXPECT_EQ(g2[0], float(prev + 100));
    });
  }
}

// A receive posted for another number of elements than the matching send carries is an error on the
// receiving rank naming the mismatch (longer or shorter), never a partial or truncated fill.
inline void send_recv_size_mismatch(Harness& h) {
  h.run(2, [&](Communicator& c) {
    std::vector<double> six(6, 1.0), three(3, 2.0), got8(8, -1.0), got2(2, -1.0);
    if (c.rank() == 0) {
      for (auto* msg : {&six, &three}) {
        try {
          c.send(buffer(std::span<const double>(*msg)), 1, msg == &six ? 5 : 6);
        } catch (const std::exception&) {   // the threads backend fails both sides of a mismatch
        }
      }
      return;
    }
    for (auto [out, tag] : {std::pair{&got8, 5}, std::pair{&got2, 6}}) {
      std::string error;
      try {
        c.recv(buffer(std::span<double>(*out)), 0, tag);
      } catch (const std::exception& e) {
        error = e.what();
      }
      EXPECT_NE(error.find("does not match the recv of"), std::string::npos)
          << "tag " << tag << ": a receive of " << out->size() << " elements took a message of another size: '" << error
          << "'";
    }
  });
}

inline double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline void barrier_orders(Harness& h) {
  for (int P : sizes_of(h)) {
    h.run(P, [&](Communicator& c) {
      // Rank r arrives r x 15 ms late; nobody may leave the barrier before the last one arrived.
      // (steady_clock is the same clock in every process of this machine.)
      std::this_thread::sleep_for(std::chrono::milliseconds(15 * c.rank()));
      double arrived = seconds_now();
      c.barrier();
      const double left = seconds_now();
      std::vector<double> all(static_cast<std::size_t>(c.size()));
      c.all_gather(buffer(std::span<const double>(&arrived, 1)), buffer(std::span<double>(all)));
      EXPECT_GE(left, *std::max_element(all.begin(), all.end())) << "rank " << c.rank() << " left the barrier early";
    });
  }
}

// Blocking calls issued while async ones are still queued or running run after them, in issue order
// (the blocking forms run on the caller only when nothing is pending): rounds of a large async
// all_reduce, a small blocking all_reduce and all_gather right behind it (both small sizes, so a
// backend's small-message path is what is checked), then the wait; every value depends on the round.
inline void blocking_after_async_keeps_order(Harness& h) {
  for (int P : sizes_of(h)) {
    h.run(P, [&](Communicator& c) {
      const int r = c.rank();
      const std::size_t big = 1 << 15, small = 64;
      for (int round = 0; round < 40; ++round) {
        std::vector<float> a(big, float(r + round)), s(small, float(r * 3 + round)), g(small * std::size_t(P));
        std::vector<float> mine(small, float(r - round));
        auto w = c.all_reduce_async(buffer(std::span<const float>(a)), buffer(std::span<float>(a)), ReduceOp::Sum);
        c.all_reduce(buffer(std::span<const float>(s)), buffer(std::span<float>(s)), ReduceOp::Max);
        c.all_gather(buffer(std::span<const float>(mine)), buffer(std::span<float>(g)));
        w->wait();
        const float sum = float(P * (P - 1) / 2 + P * round);
        ASSERT_EQ(a[0], sum) << "round " << round;
        ASSERT_EQ(a[big - 1], sum) << "round " << round;
        ASSERT_EQ(s[small - 1], float((P - 1) * 3 + round)) << "round " << round;
        for (int q = 0; q < P; ++q) ASSERT_EQ(g[std::size_t(q) * small + 1], float(q - round)) << "round " << round;
      }
    });
  }
}

// Async: the op must make progress while the caller computes and never calls wait(): is_completed()
// turns true on its own (a backend that only progresses inside wait() fails this).
template <class T>
void async_overlaps_work(Harness& h) {
  for (int P : sizes_of(h)) {
    h.run(P, [&](Communicator& c) {
      const int r = c.rank();
      const std::size_t n = 1 << 16;
      std::vector<T> a(n), b(n), gathered(n * std::size_t(P));
      for (std::size_t i = 0; i < n; ++i) a[i] = exact_value<T>(r, i);
      std::vector<T> b_in(n, T(r + 1));
      auto w1 = c.all_reduce_async(buffer(std::span<const T>(a)), buffer(std::span<T>(a)), ReduceOp::Sum);
      auto w2 = c.all_reduce_async(buffer(std::span<const T>(b_in)), buffer(std::span<T>(b)), ReduceOp::Max);
      auto w3 = c.all_gather_async(buffer(std::span<const T>(b_in)), buffer(std::span<T>(gathered)));
      // Other work while the collectives run: a dependent chain the compiler cannot drop.
      double acc = 0;
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      do {
        for (int i = 0; i < 1000; ++i) acc = acc * 0.999 + 1.0;
        std::this_thread::yield();
      } while (!w3->is_completed() && std::chrono::steady_clock::now() < give_up);
      EXPECT_TRUE(w3->is_completed()) << "async all_gather made no progress while the caller worked";
      EXPECT_GT(acc, 0.0);
      w3->wait();  // out of order: fine
      w1->wait();
      w2->wait();
      EXPECT_TRUE(w1->is_completed());
      for (std::size_t i = 0; i < n; i += 97) {
        ASSERT_EQ(a[i], T(0.5) * T(P * (P + 1) / 2) + T(P) * static_cast<T>(i % 7) * T(0.25));
        ASSERT_EQ(b[i], T(P));
      }
      for (int q = 0; q < P; ++q) ASSERT_EQ(gathered[std::size_t(q) * n + 5], T(q + 1));
      w1->wait();  // again: returns at once
    });
  }
}

// P = 4 as a 2 x 2 mesh: rows {0,1} {2,3}, columns {0,2} {1,3}; P = 3: reversed keys and an excluded rank.
inline void split_rows_columns(Harness& h) {
  if (h.max_size() >= 4) {
    h.run(4, [&](Communicator& c) {
      const int r = c.rank();
      auto row = c.split(r / 2, r % 2);
      auto col = c.split(r % 2, r / 2);
      ASSERT_TRUE(row && col);
      EXPECT_EQ(row->size(), 2);
      EXPECT_EQ(row->rank(), r % 2);
      EXPECT_EQ(col->rank(), r / 2);
      double x = r, y = r;
      row->all_reduce(buffer(std::span<double>(&x, 1)), ReduceOp::Sum);
      col->all_reduce(buffer(std::span<double>(&y, 1)), ReduceOp::Sum);
      EXPECT_EQ(x, double(4 * (r / 2) + 1));  // {0,1} -> 1, {2,3} -> 5
      EXPECT_EQ(y, double(2 + 2 * (r % 2)));  // {0,2} -> 2, {1,3} -> 4
      // Sub-communicators and the parent interleave (each keeps its own sequence).
      float z = 1;
      c.all_reduce(buffer(std::span<float>(&z, 1)), ReduceOp::Sum);
      EXPECT_EQ(z, 4.0f);
      auto w = row->all_reduce_async(buffer(std::span<double>(&x, 1)), buffer(std::span<double>(&x, 1)), ReduceOp::Max);
      w->wait();
      EXPECT_EQ(x, double(4 * (r / 2) + 1));
    });
  }
  if (h.max_size() >= 3) {
    h.run(3, [&](Communicator& c) {
      const int r = c.rank();
      auto sub = c.split(r == 1 ? -1 : 0, /*key=*/-r);  // ranks 0 and 2, ordered by key: 2 first
      if (r == 1) {
        EXPECT_EQ(sub, nullptr);
        return;
      }
      ASSERT_TRUE(sub);
      EXPECT_EQ(sub->size(), 2);
      EXPECT_EQ(sub->rank(), r == 2 ? 0 : 1);
      std::vector<float> v(3, float(r));
      sub->broadcast(buffer(std::span<float>(v)), 0);
      EXPECT_EQ(v[2], 2.0f);
    });
  }
}

// Misuse found locally, before data moves: the output keeps its sentinel.
inline void misuse_local(Harness& h) {
  for (int P : sizes_of(h)) {
    h.run(P, [&](Communicator& c) {
      std::vector<std::int64_t> ints(4, 1);
      std::vector<float> f(4, -5.0f), g(4, -5.0f);
      std::vector<double> d(4, -5.0);
      auto expect_invalid = [&](auto&& call, std::string_view needle) {
        try {
          call();
          ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
        } catch (const InvalidArgument& e) {
          EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
        }
      };
      expect_invalid([&] { c.all_reduce(buffer(std::span<std::int64_t>(ints)), ReduceOp::Sum); }, "int64");
      expect_invalid([&] { c.all_reduce(buffer(std::span<const float>(f)), buffer(std::span<double>(d)), ReduceOp::Sum); },
                     "dtype");
      expect_invalid([&] {
        c.all_reduce(buffer(std::span<const float>(f)), buffer(std::span<float>(g).first(3)), ReduceOp::Sum);
      }, "elements");
      const std::vector<std::size_t> wrong_len(static_cast<std::size_t>(P + 1), 0);
      expect_invalid([&] { c.all_gather(buffer(std::span<const float>(f).first(0)), buffer(std::span<float>(g)), wrong_len); },
                     "entries");
      std::vector<std::size_t> wrong_sum(static_cast<std::size_t>(P), 5);  // sums to 5P, never 4
      expect_invalid([&] {
        c.reduce_scatter(buffer(std::span<const float>(f)), buffer(std::span<float>(g).first(1)), ReduceOp::Sum, wrong_sum);
      }, "sum to");
      expect_invalid([&] { c.broadcast(buffer(std::span<float>(g)), P); }, "root");
      expect_invalid([&] { c.send(buffer(std::span<const float>(f)), -1); }, "peer");
      expect_invalid([&] { c.recv(buffer(std::span<float>(g)), P + 3); }, "peer");
      if (P == 3) {
        expect_invalid([&] { c.all_gather(buffer(std::span<const float>(f).first(1)), buffer(std::span<float>(g))); },
                       "divisible");
      }
      EXPECT_EQ(g[0], -5.0f);
      EXPECT_EQ(d[0], -5.0);
      // Still usable afterwards: nothing was issued.
      float x = 1;
      c.all_reduce(buffer(std::span<float>(&x, 1)), ReduceOp::Sum);
      EXPECT_EQ(x, float(P));
    });
  }
}

}  // namespace meshgrad::comm::testing

#define MESHGRAD_COMM_CONFORMANCE_TESTS(Suite, harness_expr)                                          \
  TEST(Suite, AllReduceClosedFormFloat32) { ::meshgrad::comm::testing::all_reduce_closed_form<float>(harness_expr); } \
  TEST(Suite, AllReduceClosedFormFloat64) { ::meshgrad::comm::testing::all_reduce_closed_form<double>(harness_expr); } \
  TEST(Suite, AllReduceInPlaceRankOrderBitsFloat32) {                                               \
    ::meshgrad::comm::testing::all_reduce_in_place_bits<float>(harness_expr);                       \
  }                                                                                                 \
  TEST(Suite, AllReduceInPlaceRankOrderBitsFloat64) {                                               \
    ::meshgrad::comm::testing::all_reduce_in_place_bits<double>(harness_expr);                      \
  }                                                                                                 \
  TEST(Suite, AllGatherEvenUnevenFloat32) { ::meshgrad::comm::testing::all_gather_even_uneven<float>(harness_expr); } \
  TEST(Suite, AllGatherEvenUnevenFloat64) { ::meshgrad::comm::testing::all_gather_even_uneven<double>(harness_expr); } \
  TEST(Suite, ReduceScatterEvenUnevenFloat32) {                                                     \
    ::meshgrad::comm::testing::reduce_scatter_even_uneven<float>(harness_expr);                     \
  }                                                                                                 \
  TEST(Suite, ReduceScatterEvenUnevenFloat64) {                                                     \
    ::meshgrad::comm::testing::reduce_scatter_even_uneven<double>(harness_expr);                    \
  }                                                                                                 \
  TEST(Suite, LargeUnevenBuffersKeepRankOrderBitsFloat32) {                                          \
    ::meshgrad::comm::testing::large_buffers_bits<float>(harness_expr);                               \
  }                                                                                                   \
  TEST(Suite, LargeUnevenBuffersKeepRankOrderBitsFloat64) {                                          \
    ::meshgrad::comm::testing::large_buffers_bits<double>(harness_expr);                              \
  }                                                                                                   \
  TEST(Suite, BroadcastEveryRootFloat32) { ::meshgrad::comm::testing::broadcast_every_root<float>(harness_expr); } \
  TEST(Suite, BroadcastEveryRootFloat64) { ::meshgrad::comm::testing::broadcast_every_root<double>(harness_expr); } \
  TEST(Suite, AllToAllEvenUnevenFloat32) { ::meshgrad::comm::testing::all_to_all_even_uneven<float>(harness_expr); } \
  TEST(Suite, AllToAllEvenUnevenFloat64) { ::meshgrad::comm::testing::all_to_all_even_uneven<double>(harness_expr); } \
  TEST(Suite, SendRecvMatchesByTagInOrder) { ::meshgrad::comm::testing::send_recv_tags(harness_expr); } \
  TEST(Suite, SendRecvOfAnotherSizeIsAnErrorOnTheReceiver) {                                        \
    ::meshgrad::comm::testing::send_recv_size_mismatch(harness_expr);                               \
  }                                                                                                 \
  TEST(Suite, BarrierWaitsForTheLastRank) { ::meshgrad::comm::testing::barrier_orders(harness_expr); } \
  TEST(Suite, AsyncProgressesWhileCallerWorksFloat32) {                                             \
    ::meshgrad::comm::testing::async_overlaps_work<float>(harness_expr);                            \
  }                                                                                                 \
  TEST(Suite, AsyncProgressesWhileCallerWorksFloat64) {                                             \
    ::meshgrad::comm::testing::async_overlaps_work<double>(harness_expr);                           \
  }                                                                                                 \
  TEST(Suite, BlockingCallsRunAfterPendingAsyncOnes) {                                              \
    ::meshgrad::comm::testing::blocking_after_async_keeps_order(harness_expr);                       \
  }                                                                                                 \
  TEST(Suite, SplitRowsAndColumns) { ::meshgrad::comm::testing::split_rows_columns(harness_expr); } \
  TEST(Suite, MisuseIsRejectedBeforeDataMoves) { ::meshgrad::comm::testing::misuse_local(harness_expr); }
