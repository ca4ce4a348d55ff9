// The gradient-check case table: at least one case per op of ops.hpp, each on random small shapes
// and float64 values drawn from (seed, case name). Small dims (mostly 1..4) keep full-Jacobian mode
// fast: the largest case has a few hundred Jacobian entries per input.
//
// Value conventions, so that finite differences see a smooth function at every input:
//   normal()    N(0, 1) with |x| < 0.01 pushed out to +-0.01: away from the kink of relu (and of
//               anything abs-like) by 1e4 steps h.
//   away_from_zero()  |x| in [0.5, 2] with a random sign: divisors.
//   positive()  uniform [0.5, 2]: arguments of log.
#include <algorithm>
#include <cmath>
#include <functional>
#include <string_view>

#include "meshgrad/ops/gradcheck.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/ops/tree_reduce.hpp"
#include "meshgrad/tensor/error.hpp"
#include "meshgrad/tensor/random.hpp"

namespace meshgrad {
namespace {

std::uint64_t fnv1a(std::string_view text) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (char ch : text) {
    h ^= static_cast<unsigned char>(ch);
    h *= 0x100000001b3ULL;
  }
  return h;
}

// Draws the shapes and values of one case. Every draw uses its own counter-based stream, so a case
// depends only on (seed, case name).
class Draw {
 public:
  Draw(std::uint64_t seed, std::string_view name) : key_(random::splitmix64(seed ^ fnv1a(name))) {}

  // Uniform integer in [lo, hi].
  std::int64_t dim(std::int64_t lo, std::int64_t hi) {
    const double u = random::uniform(key_, counter_++);
    return std::min(hi, lo + static_cast<std::int64_t>(u * static_cast<double>(hi - lo + 1)));
  }

  // Float64 leaf requiring grad, N(0, 1) away from 0.
  Tensor normal(const Shape& shape) {
    return map(shape, [](double x) { return std::abs(x) < 0.01 ? x + (x < 0 ? -0.01 : 0.01) : x; });
  }
  Tensor away_from_zero(const Shape& shape) {
    return map(shape, [](double x) { return (x < 0 ? -1.0 : 1.0) * (0.5 + 1.5 * std::min(1.0, std::abs(x) / 3)); });
  }
  Tensor positive(const Shape& shape) {
    return leaf(random::rand(shape, next_seed(), DType::Float64, 0.5, 2.0));
  }
  // int64 in [0, high).
  Tensor indices(const Shape& shape, std::int64_t high) { return random::randint(shape, next_seed(), high); }

 private:
  std::uint64_t next_seed() { return random::splitmix64(key_ + 0x1000 + counter_++); }

  template <class F>
  Tensor map(const Shape& shape, F&& f) {
    std::vector<double> values = random::randn(shape, next_seed(), DType::Float64).to_vector();
    for (double& x : values) x = f(x);
    return leaf(Tensor::from_values(values, shape, DType::Float64));
  }
  static Tensor leaf(Tensor t) {
    t.set_requires_grad(true);
    return t;
  }

  std::uint64_t key_;
  std::uint64_t counter_ = 0;
};

// What a case builder fills in (name and op come from the table).
struct Built {
  TensorList inputs;
  std::vector<std::string> names;
  GradcheckFn fn;
};

struct Spec {
  const char* name;
  const char* op;
  std::function<Built(Draw&)> build;
};

// Builder shorthands.
Built unary(Tensor x, std::function<Tensor(const Tensor&)> op) {
  return {{std::move(x)}, {"x"}, [op = std::move(op)](const TensorList& in) { return op(in[0]); }};
}
// Inputs as a braced list: drawn left to right (function arguments have no evaluation order).
Built binary(TensorList ab, Tensor (*op)(const Tensor&, const Tensor&)) {
  return {std::move(ab), {"a", "b"}, [op](const TensorList& in) { return op(in[0], in[1]); }};
}

// The multi-output ops (split, chunk) reduce to one tensor by concatenating the pieces in reverse
// order, piece p scaled by p + 1: a gradient routed to the wrong piece changes the result.
Tensor reverse_weighted_cat(const TensorList& pieces, std::int64_t dim) {
  TensorList parts;
  for (std::size_t p = pieces.size(); p-- > 0;) parts.push_back(scale(pieces[p], static_cast<double>(p + 1)));
  return cat(parts, dim);
}

// ---- elementwise with broadcasting --------------------------------------------------------------
std::vector<Spec> elementwise_specs() {
  return {
    {"add.same", "add", [](Draw& d) { Shape s{d.dim(1, 5), d.dim(1, 5)}; return binary({d.normal(s), d.normal(s)}, add); }},
    {"add.broadcast", "add",
     [](Draw& d) {
       auto m = d.dim(1, 5), n = d.dim(1, 5);
       return binary({d.normal({m, n}), d.normal({n})}, add);
     }},
    {"add.broadcast_both", "add",
     [](Draw& d) {
       auto m = d.dim(1, 4), n = d.dim(2, 4), k = d.dim(1, 4);
       return binary({d.normal({m, 1, k}), d.normal({n, 1})}, add);   // -> [m, n, k]
     }},
    {"sub.same", "sub", [](Draw& d) { Shape s{d.dim(1, 5), d.dim(1, 5)}; return binary({d.normal(s), d.normal(s)}, sub); }},
    {"sub.broadcast", "sub",
     [](Draw& d) {
       auto m = d.dim(1, 5), n = d.dim(2, 5);
       return binary({d.normal({m, n}), d.normal({m, 1})}, sub);
     }},
    {"mul.same", "mul", [](Draw& d) { Shape s{d.dim(1, 5), d.dim(1, 5)}; return binary({d.normal(s), d.normal(s)}, mul); }},
    {"mul.broadcast", "mul",
     [](Draw& d) {
       auto m = d.dim(1, 5), n = d.dim(1, 5);
       return binary({d.normal({n}), d.normal({m, n})}, mul);
     }},
    // The same tensor on both sides: the two gradients must be summed into one.
    {"mul.self", "mul",
     [](Draw& d) { return unary(d.normal({d.dim(1, 5), d.dim(1, 5)}), [](const Tensor& x) { return mul(x, x); }); }},
    {"div.same", "div",
     [](Draw& d) { Shape s{d.dim(1, 5), d.dim(1, 5)}; return binary({d.normal(s), d.away_from_zero(s)}, div); }},
    {"div.broadcast", "div",
     [](Draw& d) {
       auto m = d.dim(2, 5), n = d.dim(2, 5);
       return binary({d.normal({1, n}), d.away_from_zero({m, 1})}, div);   // -> [m, n]
     }},
    {"neg", "neg", [](Draw& d) { return unary(d.normal({d.dim(1, 5), d.dim(1, 5)}), neg); }},
    {"scale", "scale",
     [](Draw& d) { return unary(d.normal({d.dim(1, 5), d.dim(1, 5)}), [](const Tensor& x) { return scale(x, -1.75); }); }},
    {"add_scalar", "add_scalar",
     [](Draw& d) {
       return unary(d.normal({d.dim(1, 5), d.dim(1, 5)}), [](const Tensor& x) { return add_scalar(x, 2.5); });
     }},
  };
}

// ---- matrix products ----------------------------------------------------------------------------
std::vector<Spec> matmul_specs() {
  return {
    {"matmul.2d", "matmul",
     [](Draw& d) {
       auto m = d.dim(1, 5), k = d.dim(1, 5), n = d.dim(1, 5);
       return binary({d.normal({m, k}), d.normal({k, n})}, matmul);
     }},
    {"matmul.batched", "matmul",
     [](Draw& d) {
       auto b = d.dim(1, 4), m = d.dim(1, 4), k = d.dim(1, 4), n = d.dim(1, 4);
       return binary({d.normal({b, m, k}), d.normal({b, k, n})}, matmul);
     }},
    {"matmul.broadcast_batch", "matmul",
     [](Draw& d) {
       auto b = d.dim(2, 4), m = d.dim(1, 4), k = d.dim(1, 4), n = d.dim(1, 4);
       return binary({d.normal({b, m, k}), d.normal({k, n})}, matmul);   // b: [k, n] shared by the batch
     }},
    // Transposed operands are views (strides swapped) that reach BLAS as transpose flags.
    {"matmul.transposed_a", "matmul",
     [](Draw& d) {
       auto m = d.dim(1, 5), k = d.dim(2, 5), n = d.dim(1, 5);
       return Built{{d.normal({k, m}), d.normal({k, n})}, {"a_t", "b"},
                    [](const TensorList& in) { return matmul(transpose(in[0], 0, 1), in[1]); }};
     }},
    {"matmul.transposed_b", "matmul",
     [](Draw& d) {
       auto m = d.dim(1, 5), k = d.dim(2, 5), n = d.dim(1, 5);
       return Built{{d.normal({m, k}), d.normal({n, k})}, {"a", "b_t"},
                    [](const TensorList& in) { return matmul(in[0], transpose(in[1], 0, 1)); }};
     }},
    {"matmul.transposed_both", "matmul",
     [](Draw& d) {
       auto m = d.dim(2, 5), k = d.dim(2, 5), n = d.dim(2, 5);
       return Built{{d.normal({k, m}), d.normal({n, k})}, {"a_t", "b_t"}, [](const TensorList& in) {
                      return matmul(transpose(in[0], 0, 1), transpose(in[1], 0, 1));
                    }};
     }},
    {"matmul.batched_transposed", "matmul",
     [](Draw& d) {
       auto b = d.dim(1, 4), m = d.dim(1, 4), k = d.dim(2, 4), n = d.dim(1, 4);
       return Built{{d.normal({b, m, k}), d.normal({b, n, k})}, {"a", "b_t"},
                    [](const TensorList& in) { return matmul(in[0], transpose(in[1], 1, 2)); }};
     }},
    {"linear.bias", "linear",
     [](Draw& d) {
       auto b = d.dim(1, 2), t = d.dim(1, 4), in = d.dim(1, 5), out = d.dim(1, 5);
       return Built{{d.normal({b, t, in}), d.normal({in, out}), d.normal({out})}, {"x", "weight", "bias"},
                    [](const TensorList& x) { return linear(x[0], x[1], x[2]); }};
     }},
    {"linear.no_bias", "linear",
     [](Draw& d) {
       auto n = d.dim(1, 5), in = d.dim(1, 5), out = d.dim(1, 5);
       return Built{{d.normal({n, in}), d.normal({in, out})}, {"x", "weight"},
                    [](const TensorList& x) { return linear(x[0], x[1]); }};
     }},
  };
}

// ---- reductions ---------------------------------------------------------------------------------
std::vector<Spec> reduction_specs() {
  return {
    {"sum.all", "sum",
     [](Draw& d) { return unary(d.normal({d.dim(1, 4), d.dim(1, 4), d.dim(1, 4)}), [](const Tensor& x) { return sum(x); }); }},
    {"sum.dim", "sum",
     [](Draw& d) {
       return unary(d.normal({d.dim(1, 4), d.dim(2, 4), d.dim(1, 4)}), [](const Tensor& x) { return sum(x, {1}); });
     }},
    {"sum.dims_keepdim", "sum",
     [](Draw& d) {
       return unary(d.normal({d.dim(1, 4), d.dim(1, 4), d.dim(1, 4)}),
                    [](const Tensor& x) { return sum(x, {0, 2}, true); });
     }},
    {"sum.last_keepdim", "sum",
     [](Draw& d) {
       return unary(d.normal({d.dim(1, 5), d.dim(2, 5)}), [](const Tensor& x) { return sum(x, {-1}, true); });
     }},
    {"mean.all", "mean",
     [](Draw& d) { return unary(d.normal({d.dim(1, 4), d.dim(1, 4), d.dim(1, 4)}), [](const Tensor& x) { return mean(x); }); }},
    {"mean.dim", "mean",
     [](Draw& d) {
       return unary(d.normal({d.dim(1, 4), d.dim(2, 4), d.dim(1, 4)}), [](const Tensor& x) { return mean(x, {1}); });
     }},
    {"mean.dims_keepdim", "mean",
     [](Draw& d) {
       return unary(d.normal({d.dim(1, 4), d.dim(1, 4), d.dim(1, 4)}),
                    [](const Tensor& x) { return mean(x, {0, 2}, true); });
     }},
    {"mean.last", "mean",
     [](Draw& d) { return unary(d.normal({d.dim(1, 5), d.dim(2, 5)}), [](const Tensor& x) { return mean(x, {-1}); }); }},
  };
}

// ---- shape ops ----------------------------------------------------------------------------------
std::vector<Spec> shape_specs() {
  return {
    {"reshape.merge", "reshape",
     [](Draw& d) {
       auto m = d.dim(1, 4), n = d.dim(1, 4), k = d.dim(1, 4);
       return unary(d.normal({m, n, k}), [m, n, k](const Tensor& x) { return reshape(x, {m * n, k}); });
     }},
    {"reshape.infer", "reshape",
     [](Draw& d) {
       auto m = d.dim(1, 5), n = d.dim(1, 5);
       return unary(d.normal({m, n}), [n](const Tensor& x) { return reshape(x, {n, -1}); });
     }},
    // Reshaping a transposed view cannot be a view: exercises the copying path.
    {"reshape.noncontiguous", "reshape",
     [](Draw& d) {
       auto m = d.dim(2, 5), n = d.dim(2, 5);
       return unary(d.normal({m, n}), [](const Tensor& x) { return reshape(transpose(x, 0, 1), {-1}); });
     }},
    {"transpose", "transpose",
     [](Draw& d) {
       return unary(d.normal({d.dim(1, 4), d.dim(1, 4), d.dim(1, 4)}), [](const Tensor& x) { return transpose(x, 0, 2); });
     }},
    {"permute", "permute",
     [](Draw& d) {
       return unary(d.normal({d.dim(1, 4), d.dim(1, 4), d.dim(1, 4)}),
                    [](const Tensor& x) { return permute(x, {2, 0, 1}); });
     }},
    {"narrow", "narrow",
     [](Draw& d) {
       auto m = d.dim(1, 4), n = d.dim(2, 5);
       auto start = d.dim(0, n - 1);
       auto length = d.dim(1, n - start);
       return unary(d.normal({m, n}), [start, length](const Tensor& x) { return narrow(x, 1, start, length); });
     }},
    {"expand.leading", "expand",
     [](Draw& d) {
       auto m = d.dim(2, 5), n = d.dim(1, 5);
       return unary(d.normal({n}), [m, n](const Tensor& x) { return expand(x, {m, n}); });
     }},
    {"expand.middle", "expand",
     [](Draw& d) {
       auto m = d.dim(1, 4), n = d.dim(2, 4), k = d.dim(1, 4);
       return unary(d.normal({m, 1, k}), [m, n, k](const Tensor& x) { return expand(x, {m, n, k}); });
     }},
    {"contiguous", "contiguous",
     [](Draw& d) {
       return unary(d.normal({d.dim(2, 5), d.dim(2, 5)}), [](const Tensor& x) { return contiguous(transpose(x, 0, 1)); });
     }},
    {"cat.dim0", "cat",
     [](Draw& d) {
       auto n = d.dim(1, 4);
       return Built{{d.normal({d.dim(1, 4), n}), d.normal({d.dim(1, 4), n}), d.normal({d.dim(1, 4), n})},
                    {"a", "b", "c"},
                    [](const TensorList& in) { return cat(in, 0); }};
     }},
    {"cat.dim1", "cat",
     [](Draw& d) {
       auto m = d.dim(1, 4);
       return Built{{d.normal({m, d.dim(1, 4)}), d.normal({m, d.dim(1, 4)})}, {"a", "b"},
                    [](const TensorList& in) { return cat(in, -1); }};
     }},
    {"split", "split",
     [](Draw& d) {
       const std::vector<std::int64_t> sizes{d.dim(1, 2), d.dim(1, 4), d.dim(1, 2)};
       const auto n = sizes[0] + sizes[1] + sizes[2];
       return unary(d.normal({d.dim(1, 4), n}),
                    [sizes](const Tensor& x) { return reverse_weighted_cat(split(x, 1, sizes), 1); });
     }},
    {"chunk", "chunk",
     [](Draw& d) {
       auto n = d.dim(4, 7);   // uneven over 3 parts for n = 4, 5, 7
       return unary(d.normal({n, d.dim(1, 4)}),
                    [](const Tensor& x) { return reverse_weighted_cat(chunk(x, 0, 3), 0); });
     }},
  };
}

// ---- pointwise nonlinearities -------------------------------------------------------------------
std::vector<Spec> nonlinearity_specs() {
  return {
    {"relu", "relu", [](Draw& d) { return unary(d.normal({d.dim(1, 5), d.dim(1, 5)}), relu); }},
    {"gelu", "gelu", [](Draw& d) { return unary(d.normal({d.dim(1, 5), d.dim(1, 5)}), gelu); }},
    {"silu", "silu", [](Draw& d) { return unary(d.normal({d.dim(1, 5), d.dim(1, 5)}), silu); }},
    {"tanh", "tanh", [](Draw& d) { return unary(d.normal({d.dim(1, 5), d.dim(1, 5)}), meshgrad::tanh); }},
    {"exp", "exp", [](Draw& d) { return unary(d.normal({d.dim(1, 5), d.dim(1, 5)}), meshgrad::exp); }},
    {"log", "log", [](Draw& d) { return unary(d.positive({d.dim(1, 5), d.dim(1, 5)}), meshgrad::log); }},
  };
}

// ---- normalisation and probabilities ------------------------------------------------------------
// Four row blocks of 1..2 rows each (a norm's weight gradient is then the tree of their column sums).
std::vector<std::int64_t> draw_row_blocks(Draw& d) {
  std::vector<std::int64_t> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(d.dim(1, 2));
  return blocks;
}
std::int64_t row_count(const std::vector<std::int64_t>& blocks) {
  std::int64_t rows = 0;
  for (const std::int64_t b : blocks) rows += b;
  return rows;
}

std::vector<Spec> normalisation_specs() {
  return {
    {"softmax.2d", "softmax", [](Draw& d) { return unary(d.normal({d.dim(1, 5), d.dim(2, 5)}), softmax); }},
    {"softmax.3d", "softmax",
     [](Draw& d) { return unary(d.normal({d.dim(1, 2), d.dim(1, 4), d.dim(2, 5)}), softmax); }},
    {"log_softmax.2d", "log_softmax",
     [](Draw& d) { return unary(d.normal({d.dim(1, 5), d.dim(2, 5)}), log_softmax); }},
    {"log_softmax.3d", "log_softmax",
     [](Draw& d) { return unary(d.normal({d.dim(1, 2), d.dim(1, 4), d.dim(2, 5)}), log_softmax); }},
    {"layer_norm.affine", "layer_norm",
     [](Draw& d) {
       auto n = d.dim(1, 4), c = d.dim(2, 5);
       return Built{{d.normal({n, c}), d.normal({c}), d.normal({c})}, {"x", "weight", "bias"},
                    [](const TensorList& in) { return layer_norm(in[0], in[1], in[2], 1e-5); }};
     }},
    {"layer_norm.plain", "layer_norm",
     [](Draw& d) {
       return unary(d.normal({d.dim(1, 2), d.dim(1, 4), d.dim(2, 5)}),
                    [](const Tensor& x) { return layer_norm(x, Tensor(), Tensor(), 1e-5); });
     }},
    {"rms_norm.affine", "rms_norm",
     [](Draw& d) {
       auto n = d.dim(1, 4), c = d.dim(2, 5);
       return Built{{d.normal({n, c}), d.normal({c})}, {"x", "weight"},
                    [](const TensorList& in) { return rms_norm(in[0], in[1], 1e-6); }};
     }},
    {"rms_norm.row_blocks", "rms_norm",
     [](Draw& d) {
       const std::vector<std::int64_t> blocks = draw_row_blocks(d);
       auto c = d.dim(2, 4);
       return Built{{d.normal({row_count(blocks), c}), d.normal({c})}, {"x", "weight"},
                    [blocks](const TensorList& in) { return rms_norm(in[0], in[1], 1e-6, blocks); }};
     }},
    // Four row blocks (sizes 1..2 each): the weight and bias gradients are the tree of the blocks'
    // column sums.
    {"layer_norm.row_blocks", "layer_norm",
     [](Draw& d) {
       const std::vector<std::int64_t> blocks = draw_row_blocks(d);
       auto c = d.dim(2, 4);
       return Built{{d.normal({row_count(blocks), c}), d.normal({c}), d.normal({c})}, {"x", "weight", "bias"},
                    [blocks](const TensorList& in) { return layer_norm(in[0], in[1], in[2], 1e-5, blocks); }};
     }},
  };
}

// ---- computed per fixed block, summed in the tree (tree_reduce.hpp) -----------------------------
std::vector<Spec> blocked_specs() {
  return {
    // Four input-feature segments of 1..2 features: one GEMM per segment, the products in the tree.
    {"linear_over_input_blocks", "linear_over_input_blocks",
     [](Draw& d) {
       tree::SplitPlan plan;
       std::int64_t in = 0;
       for (int b = 0; b < 4; ++b) {
         const std::int64_t size = d.dim(1, 2);
         plan.segments.push_back({in, size, 0, b});
         in += size;
       }
       plan.full = in, plan.blocks = 4, plan.local_blocks = 4;
       auto n = d.dim(1, 3), out = d.dim(1, 4);
       return Built{{d.normal({n, 2, in}), d.normal({in, out})}, {"x", "w"},
                    [plan](const TensorList& in) { return tree::linear_over_input_blocks(in[0], in[1], plan); }};
     }},
    // Two input segments and four row blocks (--mesh-invariant's sequence blocks): every product per
    // row block, the weight gradient the tree of the blocks'.
    {"linear_over_input_blocks.row_blocks", "linear_over_input_blocks",
     [](Draw& d) {
       tree::SplitPlan plan;
       const std::int64_t a = d.dim(1, 2), b = d.dim(1, 2);
       plan.segments = {{0, a, 0, 0}, {a, b, 0, 1}};
       plan.full = a + b, plan.blocks = 2, plan.local_blocks = 2;
       auto t = d.dim(1, 2), out = d.dim(1, 4);
       return Built{{d.normal({4 * t, 2, a + b}), d.normal({a + b, out})}, {"x", "w"},
                    [plan, t](const TensorList& in) {
                      return tree::linear_over_input_blocks(in[0], in[1], plan, {2 * t, 2 * t, 2 * t, 2 * t});
                    }};
     }},
    // y [2t, 2, c] as 4t rows in 4 blocks of t.
    {"add_bias.row_blocks", "add_bias",
     [](Draw& d) {
       auto t = d.dim(1, 2), c = d.dim(1, 4);
       return Built{{d.normal({2 * t, 2, c}), d.normal({c})}, {"y", "bias"},
                    [t](const TensorList& in) { return tree::add_bias(in[0], in[1], {t, t, t, t}); }};
     }},
    {"sum_over_blocks", "sum_over_blocks",
     [](Draw& d) {
       auto a = d.dim(1, 2), b = d.dim(1, 2), c = d.dim(1, 3);
       return unary(d.normal({a + b, c}), [a, b](const Tensor& x) { return tree::sum_over_blocks(x, {a, b}); });
     }},
  };
}

// ---- embedding and loss -------------------------------------------------------------------------
std::vector<Spec> loss_specs() {
  return {
    // More lookups than rows on average: repeated indices must accumulate.
    {"embedding", "embedding",
     [](Draw& d) {
       auto v = d.dim(1, 5), c = d.dim(1, 4);
       Shape idx_shape{d.dim(1, 4), d.dim(1, 4)};
       return Built{{d.normal({v, c}), d.indices(idx_shape, v)}, {"weight", "indices"},
                    [](const TensorList& in) { return embedding(in[0], in[1]); }};
     }},
    // The same lookups in two blocks of indices (--mesh-invariant's sequence blocks): a row read in
    // both gets the tree of the two blocks' sums.
    {"embedding.row_blocks", "embedding",
     [](Draw& d) {
       auto v = d.dim(1, 3), c = d.dim(1, 4), t = d.dim(1, 3);
       return Built{{d.normal({v, c}), d.indices({2 * t, 2}, v)}, {"weight", "indices"},
                    [t](const TensorList& in) { return embedding(in[0], in[1], {2 * t, 2 * t}); }};
     }},
    {"cross_entropy.mean", "cross_entropy",
     [](Draw& d) {
       auto n = d.dim(1, 5), v = d.dim(2, 5);
       return Built{{d.normal({n, v}), d.indices({n}, v)}, {"logits", "targets"},
                    [](const TensorList& in) { return cross_entropy(in[0], in[1]); }};
     }},
    // Target 0 is ignored (default ignore_index -100): the mean runs over the others only.
    {"cross_entropy.ignore_index", "cross_entropy",
     [](Draw& d) {
       auto n = d.dim(2, 5), v = d.dim(2, 5);
       std::vector<std::int64_t> targets = d.indices({n}, v).to_int64_vector();
       targets[0] = -100;
       return Built{{d.normal({n, v}), Tensor::from_int64(targets, {n})}, {"logits", "targets"},
                    [](const TensorList& in) { return cross_entropy(in[0], in[1]); }};
     }},
    {"cross_entropy.custom_ignore", "cross_entropy",
     [](Draw& d) {
       auto n = d.dim(2, 5), v = d.dim(2, 5);
       std::vector<std::int64_t> targets = d.indices({n}, v).to_int64_vector();
       targets[static_cast<std::size_t>(n - 1)] = -1;
       return Built{{d.normal({n, v}), Tensor::from_int64(targets, {n})}, {"logits", "targets"},
                    [](const TensorList& in) { return cross_entropy(in[0], in[1], -1); }};
     }},
    // Every target ignored: the loss is 0 and so is its gradient (no 0/0).
    {"cross_entropy.all_ignored", "cross_entropy",
     [](Draw& d) {
       auto n = d.dim(1, 4), v = d.dim(2, 5);
       std::vector<std::int64_t> targets(static_cast<std::size_t>(n), -100);
       return Built{{d.normal({n, v}), Tensor::from_int64(targets, {n})}, {"logits", "targets"},
                    [](const TensorList& in) { return cross_entropy(in[0], in[1]); }};
     }},
  };
}

// ---- regularisation -----------------------------------------------------------------------------
std::vector<Spec> regularisation_specs() {
  return {
    // A Generator made inside f with a fixed seed: every evaluation draws the same mask.
    {"dropout", "dropout",
     [](Draw& d) {
       return unary(d.normal({d.dim(2, 5), d.dim(2, 5)}), [](const Tensor& x) {
         random::Generator gen(1234);
         return dropout(x, 0.4, gen, /*training=*/true);
       });
     }},
    {"dropout.eval", "dropout",
     [](Draw& d) {
       return unary(d.normal({d.dim(1, 5), d.dim(1, 5)}), [](const Tensor& x) {
         random::Generator gen(1234);
         return dropout(x, 0.4, gen, /*training=*/false);
       });
     }},
  };
}

// ---- attention ----------------------------------------------------------------------------------
std::vector<Spec> attention_specs() {
  return {
    {"causal_attention", "causal_attention",
     [](Draw& d) {
       Shape s{d.dim(1, 2), d.dim(1, 2), d.dim(1, 5), d.dim(1, 4)};   // [B, H, T, D]
       return Built{{d.normal(s), d.normal(s), d.normal(s)}, {"q", "k", "v"},
                    [](const TensorList& in) { return causal_attention(in[0], in[1], in[2]); }};
     }},
    // T in [65, 100]: two 64-row tiles of the blocked kernel, the second partial.
    {"causal_attention.tiles", "causal_attention",
     [](Draw& d) {
       Shape s{1, 1, d.dim(65, 100), d.dim(1, 3)};   // [B, H, T, D]
       return Built{{d.normal(s), d.normal(s), d.normal(s)}, {"q", "k", "v"},
                    [](const TensorList& in) { return causal_attention(in[0], in[1], in[2]); }};
     }},
    // RoPE on strided heads ([B, T, H, D] permuted), random tables (the op is linear in x for any).
    {"rotary", "rotary",
     [](Draw& d) {
       const std::int64_t b = d.dim(1, 2), t = d.dim(1, 4), h = d.dim(1, 3), half = d.dim(1, 3);
       Tensor cos = d.normal({t, 2 * half}), sin = d.normal({t, 2 * half});
       return Built{{d.normal({b, t, h, 2 * half})}, {"x"}, [cos, sin](const TensorList& in) {
                      return rotary(permute(in[0], {0, 2, 1, 3}), cos, sin);
                    }};
     }},
    // A sliding window inside and across the two tiles (Mistral's attention).
    {"causal_attention.window", "causal_attention",
     [](Draw& d) {
       Shape s{1, 1, d.dim(65, 100), d.dim(1, 3)};   // [B, H, T, D]
       const std::int64_t window = d.dim(1, 70);
       return Built{{d.normal(s), d.normal(s), d.normal(s)}, {"q", "k", "v"},
                    [window](const TensorList& in) { return causal_attention(in[0], in[1], in[2], window); }};
     }},
    // Fewer queries than keys (a context-parallel chunk): the last T_q of T_k positions, across the
    // key tiles, with and without a window.
    {"causal_attention.chunk", "causal_attention",
     [](Draw& d) {
       const std::int64_t keys = d.dim(65, 140), queries = d.dim(1, keys), dim = d.dim(1, 3);
       const std::int64_t window = d.dim(0, 1) == 0 ? 0 : d.dim(1, 80);
       return Built{{d.normal({1, 2, queries, dim}), d.normal({1, 2, keys, dim}), d.normal({1, 2, keys, dim})},
                    {"q", "k", "v"},
                    [window](const TensorList& in) { return causal_attention(in[0], in[1], in[2], window); }};
     }},
  };
}

// ---- a composition: the pieces of a GPT block chained, one loss ---------------------------------
std::vector<Spec> composite_specs() {
  return {
    {"composite.mlp_loss", "composite",
     [](Draw& d) {
       auto n = d.dim(2, 4), c = d.dim(2, 4), h = d.dim(2, 5), v = d.dim(2, 5);
       return Built{{d.normal({n, c}), d.normal({c}), d.normal({c}), d.normal({c, h}), d.normal({h}),
                     d.normal({h, v}), d.indices({n}, v)},
                    {"x", "ln_weight", "ln_bias", "w1", "b1", "w2", "targets"},
                    [](const TensorList& in) {
                      Tensor y = layer_norm(in[0], in[1], in[2]);
                      y = gelu(linear(y, in[3], in[4]));
                      return cross_entropy(linear(y, in[5]), in[6]);
                    }};
     }},
  };
}

// Every case, family by family.
const std::vector<Spec>& table() {
  static const std::vector<Spec> specs = [] {
    std::vector<Spec> all;
    for (auto family : {elementwise_specs, matmul_specs, reduction_specs, shape_specs, nonlinearity_specs,
                        normalisation_specs, blocked_specs, loss_specs, regularisation_specs, attention_specs,
                        composite_specs}) {
      std::vector<Spec> specs = family();
      all.insert(all.end(), std::make_move_iterator(specs.begin()), std::make_move_iterator(specs.end()));
    }
    return all;
  }();
  return specs;
}

const Spec* find_spec(const std::string& name) {
  for (const Spec& s : table()) {
    if (name == s.name) return &s;
  }
  return nullptr;
}

}  // namespace

std::vector<std::string> gradcheck_case_names() {
  std::vector<std::string> names;
  for (const Spec& s : table()) names.emplace_back(s.name);
  return names;
}

std::vector<std::string> gradcheck_op_names() {
  std::vector<std::string> ops;
  for (const Spec& s : table()) {
    if (std::find(ops.begin(), ops.end(), s.op) == ops.end()) ops.emplace_back(s.op);
  }
  return ops;
}

GradcheckCase make_gradcheck_case(const std::string& name, std::uint64_t seed) {
  const Spec* spec = find_spec(name);
  MG_CHECK(spec != nullptr, "gradcheck: unknown case '{}' (cases: {})", name, fmt::join(gradcheck_case_names(), ", "));
  Draw draw(seed, spec->name);
  Built built = spec->build(draw);
  return {spec->name, spec->op, std::move(built.inputs), std::move(built.names), std::move(built.fn)};
}

std::vector<GradcheckCase> gradcheck_cases(std::uint64_t seed) {
  std::vector<GradcheckCase> cases;
  for (const Spec& s : table()) cases.push_back(make_gradcheck_case(s.name, seed));
  return cases;
}

std::vector<GradcheckCase> select_gradcheck_cases(std::uint64_t seed, const std::vector<std::string>& selection) {
  for (const std::string& wanted : selection) {
    const bool known = std::any_of(table().begin(), table().end(),
                                   [&](const Spec& s) { return wanted == s.op || wanted == s.name; });
    MG_CHECK(known, "gradcheck: unknown op '{}' (ops: {})", wanted, fmt::join(gradcheck_op_names(), ", "));
  }
  std::vector<GradcheckCase> cases;
  for (const Spec& s : table()) {
    const bool selected =
        selection.empty() || std::any_of(selection.begin(), selection.end(),
                                         [&](const std::string& w) { return w == s.op || w == s.name; });
    if (selected) cases.push_back(make_gradcheck_case(s.name, seed));
  }
  return cases;
}

GradcheckResult run_case(const GradcheckCase& c, GradcheckMode mode) { return run_case(c, mode, GradcheckOptions{}); }

GradcheckResult run_case(const GradcheckCase& c, GradcheckMode mode, GradcheckOptions options) {
  options.op = c.name;
  options.input_names = c.input_names;
  return gradcheck(c.fn, c.inputs, mode, options);
}

}  // namespace meshgrad
