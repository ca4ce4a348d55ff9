// oneDNN float32 products (contract in onednn_gemm.hpp).
#include "onednn_gemm.hpp"

#include <fmt/format.h>

#include "meshgrad/tensor/error.hpp"

#ifdef MESHGRAD_HAVE_ONEDNN
// GNU OpenMP's, which Debian's oneDNN runs on (declared here: meshgrad is not compiled with -fopenmp).
extern "C" void omp_set_num_threads(int threads);

#include <oneapi/dnnl/dnnl.hpp>
#include <tuple>
#include <unordered_map>
#endif

namespace meshgrad::blas::onednn {

#ifndef MESHGRAD_HAVE_ONEDNN

bool built() { return false; }
std::string version() { return ""; }
std::string description() { return ""; }
void sgemm(bool, bool, std::int64_t m, std::int64_t n, std::int64_t k, float, const float*, std::int64_t, const float*,
           std::int64_t, float, float*, std::int64_t, int) {
  throw InvalidArgument(fmt::format("gemm {}x{}x{}: this build has no oneDNN (configure with MESHGRAD_ONEDNN=ON)", m,
                                    n, k));
}
void bf16gemm(bool, bool, std::int64_t m, std::int64_t n, std::int64_t k, float, const std::uint16_t*, std::int64_t,
              const std::uint16_t*, std::int64_t, float, float*, std::int64_t, int) {
  throw InvalidArgument(fmt::format("bf16 gemm {}x{}x{}: this build has no oneDNN (configure with MESHGRAD_ONEDNN=ON)",
                                    m, n, k));
}
std::string bf16_kernel() { return ""; }

#else

namespace {

using dims = dnnl::memory::dims;
using dt = dnnl::memory::data_type;

// Everything that makes two products different primitives.
struct Key {
  bool trans_a, trans_b;
  std::int64_t m, n, k, lda, ldb, ldc;
  float alpha, beta;
  bool bf16;   // operands bf16 (else float32); the output is float32 either way
  bool operator==(const Key& o) const {
    return std::tie(trans_a, trans_b, m, n, k, lda, ldb, ldc, alpha, beta, bf16) ==
           std::tie(o.trans_a, o.trans_b, o.m, o.n, o.k, o.lda, o.ldb, o.ldc, o.alpha, o.beta, o.bf16);
  }
};

struct KeyHash {
  std::size_t operator()(const Key& key) const {
    std::size_t h = (key.trans_a ? 1u : 0u) | (key.trans_b ? 2u : 0u) | (key.bf16 ? 4u : 0u);
    for (const std::int64_t v : {key.m, key.n, key.k, key.lda, key.ldb, key.ldc}) {
      h = h * 1000003u ^ std::hash<std::int64_t>{}(v);
    }
    return h * 1000003u ^ std::hash<float>{}(key.alpha) ^ (std::hash<float>{}(key.beta) << 1);
  }
};

struct Product {
  dnnl::memory::desc a, b, c;
  dnnl::matmul primitive;
};

// A row-major matrix of `rows` x `cols` stored with row stride ld, or its transpose stored so.
dnnl::memory::desc matrix(std::int64_t rows, std::int64_t cols, std::int64_t ld, bool transposed, dt type = dt::f32) {
  return dnnl::memory::desc(dims{rows, cols}, type, transposed ? dims{1, ld} : dims{ld, 1});
}

// Per calling thread (a rank): its engine, stream and primitives. oneDNN primitives may be executed
// from several threads, but keeping each rank's own needs no lock on the step's hot path.
struct ThreadState {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::unordered_map<Key, Product, KeyHash> products;
};

ThreadState& state() {
  thread_local ThreadState s;
  return s;
}

Product make_product(const ThreadState& s, const Key& key) {
  const dt operands = key.bf16 ? dt::bf16 : dt::f32;
  Product p{matrix(key.m, key.k, key.lda, key.trans_a, operands), matrix(key.k, key.n, key.ldb, key.trans_b, operands),
            matrix(key.m, key.n, key.ldc, false), {}};
  dnnl::primitive_attr attr;
  if (key.alpha != 1.0f) attr.set_output_scales(0, {key.alpha});
  if (key.beta != 0.0f) {
    dnnl::post_ops ops;
    ops.append_sum(key.beta);
    attr.set_post_ops(ops);
  }
  try {
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(p.a, p.b, p.c), attr, s.engine);
    p.primitive = dnnl::matmul(pd);
  } catch (const dnnl::error& e) {
    throw InvalidArgument(fmt::format("gemm {}x{}x{} (trans_a {}, trans_b {}, lda {}, ldb {}, ldc {}): oneDNN has no "
                                      "{} matmul for it: {}",
                                      key.m, key.n, key.k, key.trans_a, key.trans_b, key.lda, key.ldb, key.ldc,
                                      key.bf16 ? "bf16" : "float32", e.what()));
  }
  return p;
}

}  // namespace

bool built() { return true; }

std::string version() {
  const dnnl_version_t* v = dnnl_version();
  return fmt::format("{}.{}.{}", v->major, v->minor, v->patch);
}

std::string description() {
  std::string impl;
  try {
    const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
    const dnnl::memory::desc md(dims{1024, 1024}, dt::f32, dnnl::memory::format_tag::ab);
    impl = dnnl::matmul::primitive_desc(dnnl::matmul::desc(md, md, md), engine).impl_info_str();
  } catch (const dnnl::error& e) {
    impl = std::string("no float32 matmul: ") + e.what();
  }
  return fmt::format("oneDNN {} {}", version(), impl);
}

namespace {

void run(const Key& key, const void* a, const void* b, float* c, int threads) {
  ThreadState& s = state();
  auto it = s.products.find(key);
  if (it == s.products.end()) it = s.products.emplace(key, make_product(s, key)).first;
  const Product& p = it->second;
  // OpenMP's thread count is the calling thread's own setting: each rank thread sets its share.
  omp_set_num_threads(threads);
  dnnl::memory ma(p.a, s.engine, const_cast<void*>(a)), mb(p.b, s.engine, const_cast<void*>(b)), mc(p.c, s.engine, c);
  p.primitive.execute(s.stream, {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}});
  s.stream.wait();
}

}  // namespace

void sgemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
           std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc, int threads) {
  run(Key{trans_a, trans_b, m, n, k, lda, ldb, ldc, alpha, beta, false}, a, b, c, threads);
}

void bf16gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
              const std::uint16_t* a, std::int64_t lda, const std::uint16_t* b, std::int64_t ldb, float beta, float* c,
              std::int64_t ldc, int threads) {
  run(Key{trans_a, trans_b, m, n, k, lda, ldb, ldc, alpha, beta, true}, a, b, c, threads);
}

std::string bf16_kernel() {
  try {
    const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
    const dnnl::memory::desc in(dims{1024, 1024}, dt::bf16, dnnl::memory::format_tag::ab);
    const dnnl::memory::desc out(dims{1024, 1024}, dt::f32, dnnl::memory::format_tag::ab);
    return dnnl::matmul::primitive_desc(dnnl::matmul::desc(in, in, out), engine).impl_info_str();
  } catch (const dnnl::error&) {
    return "";
  }
}

#endif

}  // namespace meshgrad::blas::onednn
