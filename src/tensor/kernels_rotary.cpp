// Rotary position embedding in the rotate-half layout (contract in kernels.hpp): one pass over x,
// rows of D features split in (batch, head, position) ranges over the rank's threads. Every output
// element is computed by the same expression whichever thread computes it, so the bits do not
// depend on the split.
#include <algorithm>

#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/parallel.hpp"

namespace meshgrad::kernels {

Tensor rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse) {
  const char* op = inverse ? "rotary backward" : "rotary";
  check_floating(x, op);
  check_same_dtype(x, cos, op);
  check_same_dtype(x, sin, op);
  MG_CHECK(x.dim() == 4 && x.size(3) % 2 == 0 && x.size(3) > 0, "{}: x must be [B, H, T, D] with D even and > 0, got {}",
           op, shape_str(x.shape()));
  const Shape table{x.size(2), x.size(3)};
  MG_CHECK(cos.shape() == table && sin.shape() == table, "{}: cos and sin must be [T, D] = {} for x {}, got {} and {}",
           op, shape_str(table), shape_str(x.shape()), shape_str(cos.shape()), shape_str(sin.shape()));
  const Tensor c = cos.contiguous(), s = sin.contiguous();
  Tensor out = Tensor::empty(x.shape(), x.dtype());
  const std::int64_t heads = x.size(1), steps = x.size(2), d = x.size(3), half = d / 2;
  const std::int64_t rows = x.size(0) * heads * steps;
  const Strides& st = x.strides();
  dispatch_floating(x.dtype(), op, [&]<class T>() {
    const T* xp = x.data<T>();   // x.data() is at its offset
    const T* cp = c.data<T>();
    const T* sp = s.data<T>();
    T* op_ = out.data<T>();
    // Forward: y_i = x_i c_i + r_i s_i, r = [-x2, x1]. Inverse (the transpose, i.e. the backward of
    // the forward for a gradient dy): y_i = x_i c_i + r'_i with r'_i = x_{i+h} s_{i+h} (i < h) and
    // -x_{i-h} s_{i-h} (i >= h).
    parallel::for_ranges(rows, parallel::workers_for(x.numel()), [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t r = begin; r < end; ++r) {
        const std::int64_t t = r % steps, h = (r / steps) % heads, b = r / (steps * heads);
        const T* in = xp + b * st[0] + h * st[1] + t * st[2];
        const T* cr = cp + t * d;
        const T* sr = sp + t * d;
        T* o = op_ + r * d;
        for (std::int64_t i = 0; i < half; ++i) {
          const T lo = in[i * st[3]], hi = in[(i + half) * st[3]];
          if (!inverse) {
            o[i] = lo * cr[i] - hi * sr[i];
            o[i + half] = hi * cr[i + half] + lo * sr[i + half];
          } else {
            o[i] = lo * cr[i] + hi * sr[i + half];
            o[i + half] = hi * cr[i + half] - lo * sr[i];
          }
        }
      }
    });
  });
  return out;
}

}  // namespace meshgrad::kernels
