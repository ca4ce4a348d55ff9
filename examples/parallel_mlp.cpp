// A Megatron MLP, y = row(gelu(column(x))), split over 2 rank threads (tensor parallel: the column
// layer holds half the hidden features, the row layer all-reduces its output), against the same
// MLP on one rank: the output, the input gradient and every full weight gradient must agree.
// Exit status 0 when they do (float64, 1e-12).
#include <fmt/core.h>

#include <map>
#include <mutex>
#include <string>

#include "example_check.hpp"
#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/launch/launch.hpp"
#include "meshgrad/nn/layers.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/random.hpp"

using namespace meshgrad;

namespace {

constexpr std::int64_t T = 8, B = 2, C = 16, H = 4 * C;   // [T, B, C] activations, hidden 4C
constexpr std::uint64_t kSeed = 7;                           // the same initial weights at any tp

struct Result {
  Tensor y, x_grad;
  std::map<std::string, Tensor> weight_grads;   // full gradients by parameter name
};

// Forward and backward of the MLP on `ranks` rank threads; rank 0's view of the results.
Result run_mlp(int ranks, const Tensor& x_full, const Tensor& dy) {
  Result out;
  std::mutex mu;
  launch::mesh_runner("threads", fmt::format("tp={}", ranks))([&](const dist::DeviceMeshPtr& mesh) {
    const auto ctx = nn::ParallelContext::on(mesh, nn::ParallelConfig{});
    nn::ColumnParallelLinear fc("mlp.c_fc", C, H, {}, ctx, kSeed, DType::Float64);
    nn::RowParallelLinear proj("mlp.c_proj", H, C, {}, ctx, kSeed, DType::Float64);

    Tensor x = x_full.clone();   // replicated input
    x.set_requires_grad();
    const Tensor y = proj.forward(gelu(fc.forward(x, T)));   // [T, B, C], all-reduced over tp
    backward(sum(mul(y, dy)));                               // loss = sum(y * dy): y's gradient is dy

    std::map<std::string, Tensor> grads;
    for (const nn::Parameter* p : {&fc.weight, &fc.bias, &proj.weight, &proj.bias}) {
      grads[p->name] = nn::gather_full(p->value.grad(), *p);   // collective: every rank takes part
    }
    if (mesh->rank() != 0) return;
    std::lock_guard<std::mutex> lock(mu);
    out = {y.detach(), x.grad(), grads};
  });
  return out;
}

}  // namespace

int main() {
  try {
    const Tensor x = random::randn({T, B, C}, 1, DType::Float64);
    const Tensor dy = random::randn({T, B, C}, 2, DType::Float64);
    const Result one = run_mlp(1, x, dy);
    const Result two = run_mlp(2, x, dy);
    bool ok = example::report("output y", example::max_abs_diff(two.y, one.y), 1e-12);
    ok = example::report("input gradient", example::max_abs_diff(two.x_grad, one.x_grad), 1e-12) && ok;
    for (const auto& [name, grad] : one.weight_grads) {
      ok = example::report(name + " gradient", example::max_abs_diff(two.weight_grads.at(name), grad), 1e-12) && ok;
    }
    fmt::print("{}\n", ok ? "PASS: tp=2 matches one rank" : "FAIL: tp=2 differs from one rank");
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "parallel_mlp: error: {}\n", e.what());
    return 1;
  }
}
