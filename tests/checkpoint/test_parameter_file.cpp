// Parameters <-> safetensors over 1, 2 and 3 tensor-parallel ranks: saving from shards gives the
// full tensors, loading a full file gives exactly each rank's shard, for every kind of ShardSpec
// (replicated, dim 0, dim 1, 3 blocks of units of 2) with sizes that do not divide evenly.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "meshgrad/autograd/engine.hpp"
#include "meshgrad/comm/threads.hpp"
#include "meshgrad/distributed/mesh.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/checkpoint/parameter_file.hpp"

namespace meshgrad::checkpoint::test_parameter_file {
namespace {

namespace fs = std::filesystem;

// The parameter set: one of each ShardSpec kind, uneven over 2 and 3 ranks.
struct Case {
  std::string name;
  Shape full_shape;
  dist::Placement spec;   // on the tp axis of a (tp) mesh
};
const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {"rep.weight", {5, 3}, dist::Replicate()},                    // replicated
      {"gain", {}, dist::Replicate()},                              // replicated scalar
      {"row.weight", {7, 3}, dist::Shard(0)},                       // dim 0: 7 rows -> 4,3 / 3,2,2
      {"col.weight", {4, 5}, dist::Shard(1)},                       // dim 1: 5 columns -> 3,2 / 2,2,1
      {"qkv.weight", {3, 18}, dist::Placement::shard(1, 3, 2)},     // 3 blocks of 6 = 3 units of 2 -> 2,1 / 1,1,1 units
      {"bias", {7}, dist::Shard(0)},                                // 1-D, dim 0
  };
  return all;
}

// Distinct, exactly representable values: element i of case k is 1000 (k + 1) + i + offset.
Tensor reference(std::size_t k, DType dtype, double offset = 0.0) {
  const Case& c = cases()[k];
  std::vector<double> values(static_cast<std::size_t>(shape_numel(c.full_shape)));
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = 1000.0 * static_cast<double>(k + 1) + static_cast<double>(i) + offset;
  return Tensor::from_values(values, c.full_shape, dtype);
}

// The mesh of the rank thread running a test body (run_tp sets it): parameters carry their mesh.
thread_local dist::DeviceMeshPtr current_mesh;

nn::Parameter param_of(const Case& c, const Tensor& value) {
  return {c.name, value, c.full_shape, {c.spec}, current_mesh, Tensor()};
}

// This rank's piece of case k's reference (the parameter's layout on the current mesh).
Tensor shard_of(std::size_t k, const Tensor& full) {
  const Case& c = cases()[k];
  return nn::take_shard(full, param_of(c, Tensor()));
}

// Parameters for this rank: pieces of the reference (filled) or zeros.
std::vector<nn::Parameter> make_params(int, int, DType dtype, bool filled) {
  std::vector<nn::Parameter> params;
  for (std::size_t k = 0; k < cases().size(); ++k) {
    const Case& c = cases()[k];
    Tensor value = filled ? shard_of(k, reference(k, dtype))
                          : Tensor::zeros(param_of(c, Tensor()).layout().local_shape, dtype);
    value.set_requires_grad(true);
    params.push_back(param_of(c, value));
  }
  return params;
}

std::vector<nn::Parameter*> pointers(std::vector<nn::Parameter>& params) {
  std::vector<nn::Parameter*> out;
  for (auto& p : params) out.push_back(&p);
  return out;
}

// fn(tp group) on P rank threads with a mesh "tp=P". Short deadline: a broken collective fails the
// test instead of hanging it.
void run_tp(int ranks, const std::function<void(const dist::ProcessGroup&)>& fn) {
  comm::ThreadsOptions options;
  options.timeout = std::chrono::milliseconds(20000);
  comm::run_ranks(
      ranks,
      [&](const comm::CommunicatorPtr& world) {
        current_mesh = std::make_shared<const dist::DeviceMesh>(world, std::vector<dist::MeshAxis>{{"tp", ranks}});
        fn(current_mesh->group("tp"));
        current_mesh.reset();
      },
      options);
}

class CheckpointTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string leaf = fmt::format("meshgrad_ckpt_{}_{}", ::getpid(), info->name());
    for (char& ch : leaf)
      if (ch == '/') ch = '_';
    dir_ = fs::temp_directory_path() / leaf;
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& leaf) const { return (dir_ / leaf).string(); }

  // The reference tensors written as one full file.
  std::string write_reference(DType dtype, const std::string& leaf = "full.safetensors") {
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (std::size_t k = 0; k < cases().size(); ++k) tensors.emplace_back(cases()[k].name, reference(k, dtype));
    const std::string p = path(leaf);
    io::write_safetensors(p, tensors);
    return p;
  }

  fs::path dir_;
};

// Saving from tp=P shards writes the full tensors; loading that file at tp=1 gives them back.
TEST_P(CheckpointTest, SaveFromShardsThenLoadAtTp1GivesTheFullTensors) {
  const int P = GetParam();
  const std::string p = path("saved.safetensors");
  run_tp(P, [&](const dist::ProcessGroup& tp) {
    auto params = make_params(P, tp.rank(), DType::Float32, /*filled=*/true);
    save_parameters(p, pointers(params), tp, /*writer_rank=*/P - 1);
  });

  const io::SafetensorsFile file(p);
  EXPECT_EQ(file.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  const auto saved = io::read_safetensors(p);
  ASSERT_EQ(saved.size(), cases().size());
  for (std::size_t k = 0; k < cases().size(); ++k)
    EXPECT_TRUE(bitwise_equal(saved.at(cases()[k].name), reference(k, DType::Float32))) << cases()[k].name;

  run_tp(1, [&](const dist::ProcessGroup& tp) {
    auto single = make_params(1, 0, DType::Float32, /*filled=*/false);
    load_parameters(p, pointers(single), tp);
    for (std::size_t k = 0; k < cases().size(); ++k)
      EXPECT_TRUE(bitwise_equal(single[k].value, reference(k, DType::Float32))) << single[k].name;
  });
}

// Loading a full file at tp=P gives exactly take_shard's slices, in place, with no autograd history.
TEST_P(CheckpointTest, LoadFullFileGivesEachRankItsShard) {
  const int P = GetParam();
  const std::string p = write_reference(DType::Float32);
  run_tp(P, [&](const dist::ProcessGroup& tp) {
    auto params = make_params(P, tp.rank(), DType::Float32, /*filled=*/false);
    std::vector<const void*> storage_before;
    for (const auto& param : params) storage_before.push_back(param.value.storage().get());
    load_parameters(p, pointers(params), tp);
    for (std::size_t k = 0; k < params.size(); ++k) {
      const Tensor expected = shard_of(k, reference(k, DType::Float32));
      EXPECT_TRUE(bitwise_equal(params[k].value, expected)) << params[k].name << " rank " << tp.rank();
      EXPECT_EQ(params[k].value.storage().get(), storage_before[k]) << "not loaded in place: " << params[k].name;
      EXPECT_TRUE(params[k].value.is_leaf());
      EXPECT_TRUE(params[k].value.requires_grad());
      EXPECT_EQ(params[k].value.grad_fn(), nullptr);
    }
  });
}

// A file saved at one tp loads at another.
TEST_P(CheckpointTest, SaveAtTp3LoadAtTpP) {
  const int P = GetParam();
  const std::string p = path("tp3.safetensors");
  run_tp(3, [&](const dist::ProcessGroup& tp) {
    auto params = make_params(3, tp.rank(), DType::Float64, /*filled=*/true);
    save_parameters(p, pointers(params), tp);
  });
  run_tp(P, [&](const dist::ProcessGroup& tp) {
    auto params = make_params(P, tp.rank(), DType::Float64, /*filled=*/false);
    load_parameters(p, pointers(params), tp);
    for (std::size_t k = 0; k < params.size(); ++k)
      EXPECT_TRUE(bitwise_equal(params[k].value, shard_of(k, reference(k, DType::Float64))))
          << params[k].name;
  });
}

// Full gradients by name; an undefined grad counts as zeros.
TEST_P(CheckpointTest, GatherGradientsGivesFullGradients) {
  const int P = GetParam();
  run_tp(P, [&](const dist::ProcessGroup& tp) {
    auto params = make_params(P, tp.rank(), DType::Float32, /*filled=*/true);
    for (std::size_t k = 0; k < params.size(); ++k)
      if (params[k].name != "bias")
        params[k].value.set_grad(shard_of(k, reference(k, DType::Float32, 0.5)));
    const auto grads = gather_gradients(pointers(params), tp);
    ASSERT_EQ(grads.size(), params.size());
    for (std::size_t k = 0; k < grads.size(); ++k) {
      EXPECT_EQ(grads[k].first, params[k].name);
      const Tensor expected = params[k].name == "bias" ? Tensor::zeros(cases()[k].full_shape, DType::Float32)
                                                       : reference(k, DType::Float32, 0.5);
      EXPECT_TRUE(bitwise_equal(grads[k].second, expected)) << params[k].name << " rank " << tp.rank();
      // The dump is a copy: changing the live gradient afterwards does not change it.
      if (params[k].value.grad().defined()) {
        params[k].value.grad().fill_(-1.0);
        EXPECT_TRUE(bitwise_equal(grads[k].second, expected)) << "aliases the live grad: " << params[k].name;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Tp, CheckpointTest, ::testing::Values(1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& info) { return fmt::format("tp{}", info.param); });

// ---- shards against hand-computed slices (independent of take_shard) ------------------------------

using CheckpointFixed = CheckpointTest;

TEST_F(CheckpointFixed, ShardsMatchHandComputedSlices) {
  const std::string p = write_reference(DType::Float32);
  // qkv [3, 18] = 3 blocks of 6 columns (3 units of 2). tp=2: units 2,1 per block, so rank 0 holds
  // columns {0-3, 6-9, 12-15} and rank 1 {4-5, 10-11, 16-17}.
  // row [7, 3] over tp=2: rows 0-3 and 4-6.  col [4, 5] over tp=2: columns 0-2 and 3-4.
  run_tp(2, [&](const dist::ProcessGroup& tp) {
    auto params = make_params(2, tp.rank(), DType::Float32, /*filled=*/false);
    load_parameters(p, pointers(params), tp);
    const std::vector<int> qkv_cols = tp.rank() == 0 ? std::vector<int>{0, 1, 2, 3, 6, 7, 8, 9, 12, 13, 14, 15}
                                                     : std::vector<int>{4, 5, 10, 11, 16, 17};
    const Tensor& qkv = params[4].value;
    ASSERT_EQ(qkv.shape(), (Shape{3, static_cast<std::int64_t>(qkv_cols.size())}));
    for (int r = 0; r < 3; ++r)
      for (std::size_t j = 0; j < qkv_cols.size(); ++j)
        EXPECT_EQ(qkv.at({r, static_cast<std::int64_t>(j)}), 5000.0 + r * 18 + qkv_cols[j]) << "rank " << tp.rank();

    const Tensor& row = params[2].value;
    const int first_row = tp.rank() == 0 ? 0 : 4;
    ASSERT_EQ(row.shape(), (Shape{tp.rank() == 0 ? 4 : 3, 3}));
    for (int r = 0; r < row.size(0); ++r)
      for (int c = 0; c < 3; ++c) EXPECT_EQ(row.at({r, c}), 3000.0 + (first_row + r) * 3 + c);

    const Tensor& col = params[3].value;
    const int first_col = tp.rank() == 0 ? 0 : 3;
    ASSERT_EQ(col.shape(), (Shape{4, tp.rank() == 0 ? 3 : 2}));
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < col.size(1); ++c) EXPECT_EQ(col.at({r, c}), 4000.0 + r * 5 + first_col + c);

    EXPECT_EQ(params[1].value.item(), 2000.0);   // the replicated scalar
  });
}

// A float64 file loads into float32 parameters (rounded to nearest) and vice versa.
TEST_F(CheckpointFixed, LoadConvertsBetweenFloatDtypes) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (std::size_t k = 0; k < cases().size(); ++k) tensors.emplace_back(cases()[k].name, reference(k, DType::Float64, 0.1));
  const std::string p = path("f64.safetensors");
  io::write_safetensors(p, tensors);
  run_tp(2, [&](const dist::ProcessGroup& tp) {
    auto params = make_params(2, tp.rank(), DType::Float32, /*filled=*/false);
    load_parameters(p, pointers(params), tp);
    for (std::size_t k = 0; k < params.size(); ++k) {
      EXPECT_EQ(params[k].value.dtype(), DType::Float32);
      const Tensor expected = shard_of(k, reference(k, DType::Float64, 0.1).to(DType::Float32));
      EXPECT_TRUE(bitwise_equal(params[k].value, expected)) << params[k].name;
    }
  });
}

// Errors name the file and the parameter, and a failed load changes nothing.
TEST_F(CheckpointFixed, LoadErrorsNameFileAndParameterAndChangeNothing) {
  const auto expect_load_error = [&](const std::string& file, const std::vector<std::string>& needles) {
    run_tp(1, [&](const dist::ProcessGroup& tp) {
      auto params = make_params(1, 0, DType::Float32, /*filled=*/false);
      try {
        load_parameters(file, pointers(params), tp);
        ADD_FAILURE() << "no error loading " << file;
      } catch (const io::SafetensorsError& e) {
        const std::string message = e.what();
        EXPECT_NE(message.find("'" + file + "'"), std::string::npos) << message;
        for (const auto& needle : needles) EXPECT_NE(message.find(needle), std::string::npos) << needle << " in " << message;
      }
      for (const auto& param : params)
        EXPECT_TRUE(bitwise_equal(param.value, Tensor::zeros(param.value.shape(), DType::Float32)))
            << "changed by a failed load: " << param.name;
    });
  };

  // Missing name (the last parameter, so that earlier ones would have been loaded by a naive loop).
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (std::size_t k = 0; k + 1 < cases().size(); ++k) tensors.emplace_back(cases()[k].name, reference(k, DType::Float32));
  io::write_safetensors(path("missing.safetensors"), tensors);
  expect_load_error(path("missing.safetensors"), {"no tensor named 'bias'", "parameter 'bias'"});

  // Shape mismatch: expected full shape vs the file's.
  tensors.emplace_back("bias", Tensor::zeros({8}, DType::Float32));
  io::write_safetensors(path("shape.safetensors"), tensors);
  expect_load_error(path("shape.safetensors"), {"parameter 'bias'", "expects full shape [7]", "has shape [8]"});

  // Integer data for a floating parameter.
  tensors.back() = {"bias", Tensor::from_int64(std::vector<std::int64_t>(7, 1), {7})};
  io::write_safetensors(path("int.safetensors"), tensors);
  expect_load_error(path("int.safetensors"), {"parameter 'bias'", "float32", "int64"});

  // A malformed file.
  { std::ofstream(path("junk.safetensors")) << "junk"; }
  expect_load_error(path("junk.safetensors"), {"too short"});
}

TEST_F(CheckpointFixed, SaveWithBadWriterRankFailsOnEveryRank) {
  const std::string p = path("x.safetensors");
  EXPECT_THROW(run_tp(2,
                      [&](const dist::ProcessGroup& tp) {
                        auto params = make_params(2, tp.rank(), DType::Float32, true);
                        save_parameters(p, pointers(params), tp, /*writer_rank=*/2);
                      }),
               io::SafetensorsError);
  EXPECT_FALSE(fs::exists(p));
}

// Loading copies into the parameters' storage in place, which bumps their versions: a forward that
// saved the old values can no longer be backpropagated (it would mix old activations with new
// weights), and the error names the parameter.
TEST_F(CheckpointFixed, LoadingBetweenForwardAndBackwardIsRefused) {
  const std::string p = write_reference(DType::Float32);
  run_tp(1, [&](const dist::ProcessGroup& tp) {
    auto params = make_params(1, 0, DType::Float32, /*filled=*/false);
    nn::Parameter& rep = params[0];   // rep.weight, [5, 3]
    rep.value.set_name(rep.name);
    // x requires grad, so matmul saves the weight (for dx) as well as x.
    Tensor x = Tensor::ones({2, 5});
    x.set_requires_grad();
    Tensor loss = meshgrad::sum(meshgrad::matmul(x, rep.value));
    load_parameters(p, pointers(params), tp);
    try {
      meshgrad::backward(loss);
      ADD_FAILURE() << "backward through weights replaced by load_parameters must throw";
    } catch (const InvalidArgument& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("'rep.weight'"), std::string::npos) << message;
      EXPECT_NE(message.find("saved at version 0, now 1"), std::string::npos) << message;
    }
    // Without a load in between, the same graph backpropagates.
    Tensor again = meshgrad::sum(meshgrad::matmul(x, rep.value));
    meshgrad::backward(again);
    EXPECT_TRUE(rep.value.grad().defined());
  });
}

}  // namespace
}  // namespace meshgrad::checkpoint::test_parameter_file
