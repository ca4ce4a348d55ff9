// Causal self-attention, blocked like FlashAttention on a CPU. For each (batch, head) the
// [T, T] score matrix is visited as square tiles of kBlock x kBlock: query block i meets key
// blocks j <= i only (tiles above the diagonal are all masked and skipped), and each tile's
// scores live in a kBlock x kBlock scratch, never in a [T, T] tensor. Tile products are BLAS
// GEMMs on strided views of q, k, v (no copies when the head dim is unit-stride, as after the
// usual [B, T, H, D] -> [B, H, T, D] permute).
//
// Forward keeps, per query row, the running max m and running sum l of the exponentials (the
// online softmax): a new key tile with a larger max rescales the partial output by exp(m - m').
// It returns the output and lse = m + log l per row. Backward recomputes each tile's
// probabilities as exp(score - lse) and accumulates dV, dQ, dK tile by tile (FlashAttention-2's
// backward; D_t = <dO_t, O_t> stands in for the softmax Jacobian's row sum).
//
// Work is split over (batch, head) pairs between blas::num_threads() threads (the caller's
// thread is one of them): heads are independent, so results do not depend on the split.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/parallel.hpp"
#include "vec_math.hpp"

namespace meshgrad::kernels {

namespace {

constexpr std::int64_t kBlock = 64;   // tile side: 64 x 64 scores (16 KiB in float32) stay in L1/L2

// One [T, D] head matrix of a [B, H, T, D] tensor: element (t, d) at p[t * ld + d].
template <class T>
struct HeadMat {
  T* p;
  std::int64_t ld;
  T* row(std::int64_t t) const { return p + t * ld; }
};

// q, k, v, dout as BLAS can read them: unit stride along D and a row stride of at least D.
// Anything else (rare: an expanded or transposed head dim) is packed first.
Tensor blas_ready(const Tensor& t) {
  const Strides& s = t.strides();
  if (s[3] == 1 && s[2] >= t.size(3)) return t;
  return t.contiguous();
}

template <class T>
HeadMat<T> head(const Tensor& t, std::int64_t pair, std::int64_t heads) {
  const Strides& s = t.strides();
  T* base = reinterpret_cast<T*>(t.storage()->data()) + t.offset();
  return {base + (pair / heads) * s[0] + (pair % heads) * s[1], s[2]};
}

// Below this many multiply-adds per call (scores and weighted values, all pairs) the attention runs
// on the caller's thread: starting a thread costs tens of microseconds, more than a decode step's
// attention over a few hundred cached keys.
constexpr std::int64_t kParallelWork = std::int64_t{1} << 17;

// Runs work(pair) for pair in [0, pairs), split in contiguous ranges over up to
// blas::num_threads() threads (one when total_work < kParallelWork) by parallel::for_ranges. An
// exception in any worker is rethrown on the caller's thread.
template <class Work>
void for_each_pair(std::int64_t pairs, std::int64_t total_work, Work&& work) {
  const int workers = total_work < kParallelWork ? 1 : std::max(1, blas::num_threads());
  parallel::for_ranges(pairs, workers, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t p = begin; p < end; ++p) work(p);
  });
}

// q [B, H, T_q, D] and k, v one shape [B, H, T_k, D] with T_q <= T_k: query row r is position
// T_k - T_q + r of the sequence (T_q == T_k in training on one rank; fewer queries with a key/value
// cache, or a context-parallel rank's chunk against the keys up to it).
void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, const char* op) {
  check_floating(q, op);
  check_same_dtype(q, k, op);
  check_same_dtype(q, v, op);
  MG_CHECK(q.dim() == 4 && k.dim() == 4 && v.shape() == k.shape() && q.size(0) == k.size(0) &&
               q.size(1) == k.size(1) && q.size(3) == k.size(3) && q.size(2) <= k.size(2),
           "{}: q must be [B, H, T_q, D] and k, v one shape [B, H, T_k, D] with T_q <= T_k, got q {} k {} v {}", op,
           shape_str(q.shape()), shape_str(k.shape()), shape_str(v.shape()));
  MG_CHECK(q.size(3) > 0, "{}: head dim D must be positive, got q {}", op, shape_str(q.shape()));
}

// Scores of one tile: s[r, c] = scale * q[i0 + r] . k[j0 + c] for r < rows, c < cols
// (row stride kBlock).
template <class T>
void tile_scores(T* s, const HeadMat<const T>& q, const HeadMat<const T>& k, std::int64_t i0, std::int64_t j0,
                 std::int64_t rows, std::int64_t cols, std::int64_t dim, T scale) {
  blas::gemm(false, true, rows, cols, dim, scale, q.row(i0), q.ld, k.row(j0), k.ld, T(0), s, kBlock);
}

// The columns [lo, hi) of a tile covering keys [j0, j0 + cols) that query position t may see:
// keys s with s <= t and, with a sliding window w > 0, s > t - w (Hugging Face's Mistral mask:
// kv_idx > q_idx - sliding_window, so w keys counting t itself). Empty (hi <= lo) when every key of
// the tile is after t (decoding with a cache) or before the window.
struct Visible {
  std::int64_t lo, hi;
};
inline Visible visible(std::int64_t t, std::int64_t j0, std::int64_t cols, std::int64_t window) {
  const std::int64_t hi = std::min(cols, t - j0 + 1);
  const std::int64_t lo = window > 0 ? std::clamp<std::int64_t>(t - window + 1 - j0, 0, cols) : 0;
  return {lo, hi};
}

// The first key tile (a multiple of kBlock) that a query block starting at position p0 needs: 0,
// or with a window the tile holding p0's first visible key (earlier tiles are all masked).
inline std::int64_t first_key_tile(std::int64_t p0, std::int64_t window) {
  if (window <= 0 || p0 - window + 1 <= 0) return 0;
  return (p0 - window + 1) / kBlock * kBlock;
}

// queries rows of q are the last positions of a sequence of `keys` positions (queries <= keys):
// query row r is position keys - queries + r and sees keys 0 .. that position (with window > 0,
// only the last `window` of them). Training has queries == keys; incremental decoding passes the
// new positions' queries and every cached key.
// Returns the number of scores computed (tile entries, including masked ones inside a tile).
// first: the position of query row 0 counted from key 0 (keys - queries for the above; larger when
// the keys are an earlier piece of the sequence, whose every key may be visible). A row that sees
// no key of these (a piece outside its window) gets out 0 and lse -inf: a part that weighs 0 when
// parts are merged.
template <class T>
std::int64_t forward_head(const HeadMat<const T>& q, const HeadMat<const T>& k, const HeadMat<const T>& v,
                          const HeadMat<T>& out, T* lse, std::int64_t queries, std::int64_t keys, std::int64_t dim,
                          T scale, std::int64_t window, std::int64_t first) {
  std::vector<T> s(static_cast<std::size_t>(kBlock * kBlock));
  std::vector<T> acc(static_cast<std::size_t>(kBlock * dim));
  std::vector<T> m(static_cast<std::size_t>(kBlock)), l(static_cast<std::size_t>(kBlock));
  std::int64_t scores = 0;
  for (std::int64_t i0 = 0; i0 < queries; i0 += kBlock) {
    const std::int64_t rows = std::min(kBlock, queries - i0);
    const std::int64_t seen = std::min(keys, first + i0 + rows);   // keys the block's last query sees
    std::fill(acc.begin(), acc.end(), T(0));
    std::fill(m.begin(), m.end(), -std::numeric_limits<T>::infinity());
    std::fill(l.begin(), l.end(), T(0));
    for (std::int64_t j0 = first_key_tile(first + i0, window); j0 < seen; j0 += kBlock) {
      // With first == 0 (training) and no window these are the square tiles on and below the diagonal.
      const std::int64_t cols = std::min(kBlock, seen - j0);
      tile_scores(s.data(), q, k, i0, j0, rows, cols, dim, scale);
      scores += rows * cols;
      for (std::int64_t r = 0; r < rows; ++r) {
        T* row = s.data() + r * kBlock;
        const Visible seen_keys = visible(first + i0 + r, j0, cols, window);
        const std::int64_t lo = seen_keys.lo, hi = seen_keys.hi;   // (a lambda below reads lo: no structured binding)
        if (hi <= lo) {   // every key of the tile after this query (first > 0) or before its window
          std::fill(row, row + cols, T(0));
          continue;
        }
        const T m_new = std::max(m[r], detail::row_max(row + lo, hi - lo));
        for (std::int64_t c = lo; c < hi; ++c) row[c] = detail::exp_fast(row[c] - m_new);
        const T total = static_cast<T>(detail::row_sum<T>(hi - lo, [&](std::int64_t c) { return row[lo + c]; }));
        std::fill(row, row + lo, T(0));   // masked keys weigh exactly 0
        std::fill(row + hi, row + cols, T(0));
        // First tile: m = -inf, l = 0 and acc = 0, so the rescale is skipped (exp(-inf) is 0 anyway).
        if (m[r] != m_new && l[r] != T(0)) {
          const T correction = std::exp(m[r] - m_new);
          l[r] *= correction;
          T* a = acc.data() + r * dim;
          for (std::int64_t d = 0; d < dim; ++d) a[d] *= correction;
        }
        l[r] += total;
        m[r] = m_new;
      }
      blas::gemm(false, false, rows, dim, cols, T(1), s.data(), kBlock, v.row(j0), v.ld, T(1), acc.data(), dim);
    }
    for (std::int64_t r = 0; r < rows; ++r) {
      T* o = out.row(i0 + r);
      if (l[r] == T(0)) {   // no key visible: the empty part
        std::fill(o, o + dim, T(0));
        lse[i0 + r] = -std::numeric_limits<T>::infinity();
        continue;
      }
      const T inv = T(1) / l[r];
      const T* a = acc.data() + r * dim;
      for (std::int64_t d = 0; d < dim; ++d) o[d] = a[d] * inv;
      lse[i0 + r] = m[r] + std::log(l[r]);
    }
  }
  return scores;
}

template <class T>
struct BackwardHead {
  HeadMat<const T> q, k, v, out, dout;
  const T* lse;
  HeadMat<T> dq, dk, dv;   // p == nullptr: not wanted. Zero on entry; accumulated tile by tile.
};

// queries rows of q are the last positions of a sequence of `keys` positions, as in forward_head;
// dq is [queries, D], dk and dv [keys, D].
// first as in forward_head; out and lse are the whole attention's (all pieces merged) when the keys
// are one piece of it.
template <class T>
void backward_head(const BackwardHead<T>& h, std::int64_t queries, std::int64_t keys, std::int64_t dim, T scale,
                   std::int64_t window, std::int64_t first) {
  std::vector<T> p(static_cast<std::size_t>(kBlock * kBlock));
  std::vector<T> dp(static_cast<std::size_t>(kBlock * kBlock));
  // delta[t] = <dO_t, O_t> = sum_s P[t, s] dP[t, s], the row sum in the softmax backward.
  std::vector<T> delta(static_cast<std::size_t>(queries));
  for (std::int64_t t = 0; t < queries; ++t) {
    const T* o = h.out.row(t);
    const T* g = h.dout.row(t);
    const double dot = detail::row_sum<T>(dim, [&](std::int64_t d) { return o[d] * g[d]; });
    delta[static_cast<std::size_t>(t)] = static_cast<T>(dot);
  }
  const bool want_ds = h.dq.p != nullptr || h.dk.p != nullptr;
  for (std::int64_t i0 = 0; i0 < queries; i0 += kBlock) {
    const std::int64_t rows = std::min(kBlock, queries - i0);
    const std::int64_t seen = std::min(keys, first + i0 + rows);   // keys the block's last query sees
    // The forward's tiles: with first == 0 and no window, the square tiles on and below the diagonal.
    for (std::int64_t j0 = first_key_tile(first + i0, window); j0 < seen; j0 += kBlock) {
      const std::int64_t cols = std::min(kBlock, seen - j0);
      tile_scores(p.data(), h.q, h.k, i0, j0, rows, cols, dim, scale);
      for (std::int64_t r = 0; r < rows; ++r) {
        T* row = p.data() + r * kBlock;
        const Visible seen_keys = visible(first + i0 + r, j0, cols, window);
        const std::int64_t lo = seen_keys.lo, hi = seen_keys.hi;
        const T shift = h.lse[i0 + r];
        for (std::int64_t c = lo; c < hi; ++c) row[c] = detail::exp_fast(row[c] - shift);
        std::fill(row, row + std::min(lo, cols), T(0));
        std::fill(row + std::max(lo, hi), row + cols, T(0));
      }
      // dV_j += P^T dO_i
      if (h.dv.p != nullptr) {
        blas::gemm(true, false, cols, dim, rows, T(1), p.data(), kBlock, h.dout.row(i0), h.dout.ld, T(1),
                   h.dv.row(j0), h.dv.ld);
      }
      if (!want_ds) continue;
      // dP = dO_i V_j^T; dS = P * (dP - delta), 0 where masked since P is 0 there.
      blas::gemm(false, true, rows, cols, dim, T(1), h.dout.row(i0), h.dout.ld, h.v.row(j0), h.v.ld, T(0), dp.data(),
                 kBlock);
      for (std::int64_t r = 0; r < rows; ++r) {
        T* ds = dp.data() + r * kBlock;
        const T* pr = p.data() + r * kBlock;
        const T dl = delta[static_cast<std::size_t>(i0 + r)];
        for (std::int64_t c = 0; c < cols; ++c) ds[c] = pr[c] * (ds[c] - dl);
      }
      // dQ_i += scale * dS K_j,  dK_j += scale * dS^T Q_i
      if (h.dq.p != nullptr) {
        blas::gemm(false, false, rows, dim, cols, scale, dp.data(), kBlock, h.k.row(j0), h.k.ld, T(1), h.dq.row(i0),
                   h.dq.ld);
      }
      if (h.dk.p != nullptr) {
        blas::gemm(true, false, cols, dim, rows, scale, dp.data(), kBlock, h.q.row(i0), h.q.ld, T(1), h.dk.row(j0),
                   h.dk.ld);
      }
    }
  }
}

}  // namespace

AttentionForward causal_attention_forward(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, double scale,
                                          std::int64_t window, std::int64_t first_in) {
  const char* op = "causal_attention";
  MG_CHECK(window >= 0, "{}: the sliding window must be >= 0 (0: none), got {}", op, window);
  check_qkv(q_in, k_in, v_in, op);
  const Tensor q = blas_ready(q_in), k = blas_ready(k_in), v = blas_ready(v_in);
  const std::int64_t heads = q.size(1), queries = q.size(2), keys = k.size(2), dim = q.size(3);
  const std::int64_t first = first_in < 0 ? keys - queries : first_in;
  const std::int64_t pairs = q.size(0) * heads;
  AttentionForward r{Tensor::empty(q.shape(), q.dtype()), Tensor::empty({q.size(0), heads, queries}, q.dtype())};
  std::vector<std::int64_t> scores(static_cast<std::size_t>(pairs), 0);
  dispatch_floating(q.dtype(), op, [&]<class T>() {
    T* lse = r.lse.data<T>();
    for_each_pair(pairs, pairs * queries * keys * dim, [&](std::int64_t pair) {
      scores[static_cast<std::size_t>(pair)] =
          forward_head<T>(head<const T>(q, pair, heads), head<const T>(k, pair, heads), head<const T>(v, pair, heads),
                          head<T>(r.out, pair, heads), lse + pair * queries, queries, keys, dim, static_cast<T>(scale),
                          window, first);
    });
  });
  for (std::int64_t n : scores) r.scores += n;
  return r;
}

AttentionGrads causal_attention_backward(const Tensor& dout_in, const Tensor& q_in, const Tensor& k_in,
                                         const Tensor& v_in, const AttentionForward& fwd, double scale, bool want_dq,
                                         bool want_dk, bool want_dv, std::int64_t window, std::int64_t first_in) {
  const char* op = "causal_attention backward";
  check_qkv(q_in, k_in, v_in, op);
  check_same_dtype(q_in, dout_in, op);
  MG_CHECK(dout_in.shape() == q_in.shape() && fwd.out.shape() == q_in.shape() && fwd.lse.dtype() == q_in.dtype() &&
               fwd.lse.shape() == Shape({q_in.size(0), q_in.size(1), q_in.size(2)}) && fwd.lse.is_contiguous(),
           "causal_attention backward: grad {}, output {} and lse {} do not match q {}", dout_in.str(), fwd.out.str(),
           fwd.lse.str(), q_in.str());
  const Tensor q = blas_ready(q_in), k = blas_ready(k_in), v = blas_ready(v_in);
  const Tensor dout = blas_ready(dout_in), out = blas_ready(fwd.out);
  const std::int64_t heads = q.size(1), queries = q.size(2), keys = k.size(2), dim = q.size(3);
  const std::int64_t pairs = q.size(0) * heads;
  const std::int64_t first = first_in < 0 ? keys - queries : first_in;
  AttentionGrads g;
  if (want_dq) g.dq = Tensor::zeros(q.shape(), q.dtype());
  if (want_dk) g.dk = Tensor::zeros(k.shape(), q.dtype());
  if (want_dv) g.dv = Tensor::zeros(k.shape(), q.dtype());
  if (!want_dq && !want_dk && !want_dv) return g;
  dispatch_floating(q.dtype(), op, [&]<class T>() {
    const T* lse = fwd.lse.data<T>();
    auto grad_head = [&](const Tensor& t, std::int64_t pair) {
      return t.defined() ? head<T>(t, pair, heads) : HeadMat<T>{nullptr, 0};
    };
    // Backward is training-sized: always split.
    for_each_pair(pairs, std::numeric_limits<std::int64_t>::max(), [&](std::int64_t pair) {
      const BackwardHead<T> h{head<const T>(q, pair, heads),   head<const T>(k, pair, heads),
                              head<const T>(v, pair, heads),   head<const T>(out, pair, heads),
                              head<const T>(dout, pair, heads), lse + pair * queries,
                              grad_head(g.dq, pair),           grad_head(g.dk, pair),
                              grad_head(g.dv, pair)};
      backward_head<T>(h, queries, keys, dim, static_cast<T>(scale), window, first);
    });
  });
  return g;
}

}  // namespace meshgrad::kernels
