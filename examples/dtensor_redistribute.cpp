// A DTensor on a dp=2 x tp=2 mesh (4 rank threads) moved through placements — sharded on both
// axes, all-to-all to the other dim, replicated, partial sums reduced — and checked on every rank
// against the full tensor it came from. Exit status 0 when every stage matches exactly.
#include <fmt/core.h>

#include <atomic>

#include "example_check.hpp"
#include "meshgrad/launch/launch.hpp"
#include "meshgrad/distributed/dtensor.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/random.hpp"

using namespace meshgrad;
using dist::Partial;
using dist::Replicate;
using dist::Shard;

int main() {
  try {
    const Tensor full = random::randn({6, 10}, 3, DType::Float64);   // 6 rows over dp=2, 10 cols over tp=2
    std::atomic<bool> ok{true};
    launch::mesh_runner("threads", "dp=2,tp=2")([&](const dist::DeviceMeshPtr& mesh) {   // placements: {dp, tp}
      const bool leader = mesh->rank() == 0;
      auto check = [&](const char* what, const Tensor& got, const Tensor& want) {
        const double d = example::max_abs_diff(got, want);
        const bool good = leader ? example::report(what, d, 0.0) : d == 0.0;
        if (!good) ok = false;
      };
      // Rows over dp, columns over tp: each rank holds its [3, 5] block of the full tensor.
      const Tensor block = full.narrow(0, 3 * mesh->coordinate("dp"), 3).narrow(1, 5 * mesh->coordinate("tp"), 5);
      const dist::DTensor blocks = dist::from_local(block.contiguous(), mesh, {Shard(0), Shard(1)}, full.shape());
      check("S(0),S(1): full_tensor", dist::full_tensor(blocks), full);
      // tp: columns -> rows (all-to-all); dp: rows -> replicated (all-gather).
      const dist::DTensor moved = dist::redistribute(blocks, {Replicate(), Shard(0)});
      check("R,S(0): local piece", moved.local(), full.narrow(0, 3 * mesh->coordinate("tp"), 3));
      check("R,S(0): full_tensor", dist::full_tensor(moved), full);
      // Partial over tp: each tp rank holds a part of the value (halves: their sum is exact);
      // redistributing to R sums the parts.
      const dist::DTensor partial = dist::from_local(scale(full, 0.5), mesh, {Replicate(), Partial()});
      check("R,P -> R,R: reduced", dist::full_tensor(dist::redistribute(partial, {Replicate(), Replicate()})), full);
    });
    fmt::print("{}\n", ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "dtensor_redistribute: error: {}\n", e.what());
    return 1;
  }
}
