// model_tensors(config) lists exactly the parameters nn::make_model builds, by name, full shape and
// order, for GPT-2 and the Llama family's variants; the file layout transposes exactly the linears.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "distributed/dist_test_util.hpp"
#include "meshgrad/interop/model_tensors.hpp"
#include "meshgrad/nn/model.hpp"
#include "meshgrad/tensor/error.hpp"
#include "meshgrad/tensor/random.hpp"

namespace test_model_tensors {

using namespace meshgrad;

namespace {

nn::ModelConfig llama(int kv_heads, bool tied, bool bias) {
  nn::ModelConfig c;
  c.kind = "llama";
  c.layers = 2;
  c.hidden = 24;
  c.heads = 4;
  c.kv_heads = kv_heads;
  c.head_dim = 8;   // heads * head_dim = 32 != hidden: o_proj is [32, 24]
  c.ffn = 40;
  c.vocab = 50;
  c.positions = 16;
  c.seq = 8;
  c.batch = 2;
  c.tie_word_embeddings = tied;
  c.attention_bias = bias;
  c.dtype = DType::Float32;
  return c;
}

nn::ModelConfig gpt() {
  nn::ModelConfig c;
  c.kind = "gpt";
  c.layers = 2;
  c.hidden = 16;
  c.heads = 2;
  c.vocab = 30;
  c.positions = 8;
  c.seq = 8;
  c.batch = 2;
  return c;
}

void expect_model_parameters(const nn::ModelConfig& cfg) {
  const std::vector<interop::ModelTensor> specs = interop::model_tensors(cfg);
  meshgrad::testing::run_on_mesh(1, [&](const dist::DeviceMeshPtr& mesh) {
    auto model = nn::make_model(cfg, {}, mesh, 1);
    const std::vector<nn::Parameter*> params = model->parameters();
    ASSERT_EQ(params.size(), specs.size());
    for (std::size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(params[i]->name, specs[i].name) << "parameter " << i;
      EXPECT_EQ(params[i]->full_shape, specs[i].shape) << specs[i].name;
    }
  });
}

TEST(ModelTensors, ListTheModelsParametersInOrder) {
  expect_model_parameters(gpt());
  expect_model_parameters(llama(2, false, false));
  expect_model_parameters(llama(1, true, true));   // MQA, tied, q/k/v biases (Qwen2)
  expect_model_parameters(llama(4, false, true));
}

TEST(ModelTensors, LlamaLinearsAreTransposedInFilesAndNothingElse) {
  for (const interop::ModelTensor& t : interop::model_tensors(llama(2, false, true))) {
    const bool linear_weight = t.name.find("_proj.weight") != std::string::npos || t.name == "lm_head.weight";
    EXPECT_EQ(t.transposed, linear_weight) << t.name;
  }
  for (const interop::ModelTensor& t : interop::model_tensors(gpt())) EXPECT_FALSE(t.transposed) << t.name;
  const interop::ModelTensor q{"model.layers.0.self_attn.q_proj.weight", {3, 5}, true};
  EXPECT_EQ(q.file_shape(), Shape({5, 3}));
}

TEST(ModelTensors, FileLayoutRoundTripsExactlyAndChecksShapes) {
  const interop::ModelTensor q{"model.layers.0.self_attn.q_proj.weight", {3, 5}, true};
  const Tensor w = random::randn({3, 5}, 7, DType::Float32);
  const Tensor in_file = interop::to_file_layout(q, w);
  ASSERT_EQ(in_file.shape(), Shape({5, 3}));
  EXPECT_EQ(in_file.data<float>()[1 * 3 + 2], w.data<float>()[2 * 5 + 1]);   // file[j, i] = w[i, j]
  const Tensor back = interop::from_file_layout(q, in_file);
  for (std::int64_t i = 0; i < w.numel(); ++i) EXPECT_EQ(back.data<float>()[i], w.data<float>()[i]);
  EXPECT_THROW(interop::from_file_layout(q, w), InvalidArgument);   // [3, 5] is meshgrad's shape, not the file's
  EXPECT_THROW(interop::to_file_layout(q, in_file), InvalidArgument);
  nn::ModelConfig mlp = gpt();
  mlp.kind = "mlp";
  EXPECT_THROW(interop::model_tensors(mlp), InvalidArgument);
}

}  // namespace

}  // namespace test_model_tensors
