// Mixtral and Qwen2-MoE (sparse mixtures of experts; Qwen2-MoE with a gated shared expert, dense
// blocks among the sparse ones and the top-k weights not renormalised) through Hugging Face files and
// expert parallelism: `grads`
// with weights and gradients in Hugging Face's names (one nn.Linear per expert) against a PyTorch
// implementation of Hugging Face's Mixtral on every mesh the issue names, bitwise across ep with
// --mesh-invariant, and the refusals.
//
// Tolerances. float64 against PyTorch (tests/launch/hf_mixtral_reference.py, hf_qwen2_moe_reference.py,
// each with a --self-test of the wrong models it can tell): 1e-9 relative on the
// loss, the load-balancing loss and every gradient (largest element difference over the largest
// element). The same formulas in float64 in other orders (the experts' outputs added in expert
// order, rows exchanged between ranks, the products cut per expert) round to ~1e-15; the reference's
// self-test shows that each wrong model it knows (no renormalisation of the top-k weights, no aux
// loss, the aux loss on the kept probabilities, top-1) moves a figure by 1e-2 or more. The router's
// choice is a discrete function of the logits, which rounding could flip only at a near tie: the
// seed's logits have none. --mesh-invariant: bitwise.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "meshgrad/checkpoint/parameter_file.hpp"
#include "meshgrad/data/synthetic.hpp"
#include "meshgrad/interop/hf_config.hpp"
#include "meshgrad/interop/hf_weights.hpp"
#include "meshgrad/io/safetensors.hpp"
#include "meshgrad/launch/jobs.hpp"
#include "meshgrad/launch/launch.hpp"
#include "meshgrad/nn/layers.hpp"
#include "meshgrad/ops/ops.hpp"
#include <nlohmann/json.hpp>

namespace meshgrad::test_hf_mixtral {
namespace {

namespace fs = std::filesystem;
using Named = std::vector<std::pair<std::string, Tensor>>;

// 4 experts, top-2, grouped-query attention, the load-balancing loss on (a coefficient large
// enough that a wrong aux term shows).
nn::ModelConfig mixtral(DType dtype, const std::string& type = "mixtral") {
  nn::ModelConfig c;
  c.kind = "llama";
  c.model_type = type;
  c.layers = 2;
  c.hidden = 24;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = 8;
  c.ffn = 20;
  c.vocab = 64;
  c.positions = 16;
  c.seq = 8;
  c.batch = 4;
  c.layer_norm_epsilon = 1e-5;
  c.rope_theta = 1e6;
  c.experts = 4;
  c.experts_per_token = 2;
  c.router_aux_loss_coef = 0.02;
  c.output_router_logits = true;
  c.dtype = dtype;
  if (type == "qwen2_moe") {
    // Qwen2-MoE: q/k/v biases, routed experts narrower than the dense MLP, a gated shared expert,
    // the top-k weights not renormalised, and a dense block among the sparse ones.
    c.layers = 3;
    c.attention_bias = true;
    c.ffn = 40;
    c.expert_ffn = 20;
    c.shared_expert_ffn = 28;
    c.norm_topk_prob = false;
    c.mlp_only_layers = {1};
  }
  return c;
}

class Scratch {
 public:
  explicit Scratch(const std::string& name)
      : dir_(fs::temp_directory_path() / fmt::format("mg_hf_mixtral_{}_{}", ::getpid(), name)) {
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  ~Scratch() { fs::remove_all(dir_); }
  std::string operator()(const std::string& leaf) const { return (dir_ / leaf).string(); }

 private:
  fs::path dir_;
};

// The model make_model initialises from seed (router weights scaled up, so that the routing is
// decided by margins far above rounding), as full tensors of meshgrad's layout.
Named initial_parameters(const nn::ModelConfig& c, std::uint64_t seed) {
  Named full;
  launch::mesh_runner("threads", "tp=1")([&](const dist::DeviceMeshPtr& mesh) {
    auto model = nn::make_model(c, {}, mesh, seed);
    full = checkpoint::gather_full_parameters(model->parameters(), nn::tensor_parallel_group(*mesh));
  });
  for (auto& [name, t] : full) {
    if (name.ends_with("gate.weight")) t = scale(t, 50.0);
  }
  return full;
}

// config.json, weights (Hugging Face layout) and a batch with one ignored target, for grads.
launch::GradsJob write_inputs(const Scratch& s, const nn::ModelConfig& c) {
  launch::GradsJob job;
  job.config = s("config.json");
  job.weights = s("w.safetensors");
  job.batch = s("b.safetensors");
  std::ofstream(job.config) << interop::hf_config_json(c);
  interop::write_model_tensors(job.weights, c, initial_parameters(c, 5), {{"format", "pt"}});
  nn::Batch b = data::make_synthetic_batch(c, 1, 0, 31);
  std::vector<std::int64_t> t = b.targets.to_int64_vector();
  t[3] = -100;
  b.targets = Tensor::from_int64(t, b.targets.shape());
  io::write_safetensors(job.batch, {{"inputs", b.inputs}, {"targets", b.targets}});
  return job;
}

launch::GradsResult grads_on(const launch::GradsJob& job, const std::string& mesh) {
  return launch::run_grads_job(job, launch::mesh_runner("threads", mesh));
}

// Runs the PyTorch reference on r's gradients; its exit code (0: every figure within 1e-9).
int reference(const Scratch& s, const launch::GradsJob& job, const launch::GradsResult& r, const std::string& extra,
              std::string& log_text, const std::string& type = "mixtral") {
  Named out = r.gradients;
  out.emplace_back("loss", Tensor::scalar(r.loss, DType::Float64));
  if (r.aux_loss) out.emplace_back("aux_loss", Tensor::scalar(*r.aux_loss, DType::Float64));
  io::write_safetensors(s("g.safetensors"), out);
  const std::string log = s("reference.log");
  const std::string command =
      fmt::format("{} {}/tests/launch/hf_{}_reference.py {} {} {} {} {} > {} 2>&1", MESHGRAD_REFERENCE_PYTHON,
                  MESHGRAD_SOURCE_DIR, type, job.config, job.weights, job.batch, s("g.safetensors"), extra, log);
  const int rc = std::system(command.c_str());
  std::ifstream in(log);
  log_text.assign((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return rc;
}

class HfMoeGrads : public ::testing::TestWithParam<std::string> {};

TEST_P(HfMoeGrads, Float64GradientsEqualPyTorchOnEveryMesh) {
  const Scratch s("torch_" + GetParam());
  const nn::ModelConfig c = mixtral(DType::Float64, GetParam());
  const launch::GradsJob job = write_inputs(s, c);
  const bool qwen = GetParam() == "qwen2_moe";
  for (const std::string mesh : {"tp=1", "ep=2", "ep=4", "dp=2,ep=2", "ep=2,tp=2", "ep=2,tp=2+sp", "fsdp=2",
                                  "fsdp=2,ep=2", "fsdp=2,ep=2,tp=2", "cp=2", "ep=2,cp=2"}) {
    launch::GradsJob j = job;
    std::string m = mesh;
    if (m.ends_with("+sp")) {
      m = m.substr(0, m.size() - 3);
      j.sequence_parallel = true;
    }
    const launch::GradsResult r = grads_on(j, m);
    ASSERT_TRUE(r.has_result) << mesh;
    ASSERT_TRUE(r.aux_loss.has_value()) << mesh;
    EXPECT_GT(*r.aux_loss, 0.5) << mesh;   // its minimum is k = 2 (uniform mean router probabilities)
    // The layout is the file's: one nn.Linear [ffn, hidden] per expert (Qwen2-MoE: layer 1 is dense).
    int experts_seen = 0;
    const std::string prefix = qwen ? "model.layers.2.mlp.experts." : "model.layers.1.block_sparse_moe.experts.";
    for (const auto& [name, g] : r.gradients) {
      if (name.starts_with(prefix) && name.ends_with(qwen ? ".gate_proj.weight" : ".w1.weight")) {
        EXPECT_EQ(g.shape(), (Shape{20, 24})) << name;
        ++experts_seen;
      }
      EXPECT_FALSE(qwen && name.starts_with("model.layers.1.mlp.experts.")) << "layer 1 is dense: " << name;
    }
    EXPECT_EQ(experts_seen, 4) << mesh;
    std::string text;
    const int rc = reference(s, job, r, "", text, GetParam());
    std::fprintf(stderr, "%s:\n%s", mesh.c_str(), text.c_str());   // the measured differences, for the record
    EXPECT_EQ(rc, 0) << mesh << "\n" << text;
  }
}

TEST(HfMixtral, ACapacityFactorDropsTokensAsTheReferenceDoes) {
  const Scratch s("capacity");
  nn::ModelConfig c = mixtral(DType::Float64);
  const launch::GradsJob job = write_inputs(s, c);
  launch::GradsJob dropping = job;
  dropping.capacity_factor = 0.5;
  const launch::GradsResult r = grads_on(dropping, "tp=1");
  ASSERT_TRUE(r.has_result);
  std::string text;
  EXPECT_EQ(reference(s, job, r, "--capacity-factor=0.5", text), 0) << text;
  EXPECT_NE(text.find("dropped"), std::string::npos) << text;
  // Dropping changes the gradients: the dropless reference refuses them.
  EXPECT_NE(reference(s, job, r, "", text), 0) << text;
}

TEST_P(HfMoeGrads, MeshInvariantFloat32GradientsAreBitwiseTheSameAcrossEp) {
  const Scratch s("invariant_" + GetParam());
  const nn::ModelConfig c = mixtral(DType::Float32, GetParam());
  launch::GradsJob job = write_inputs(s, c);
  job.mesh_invariant = true;
  job.invariant_blocks = 2;   // the fixed tree nests in the shards of the 2 key/value heads
  const launch::GradsResult one = grads_on(job, "tp=1");
  for (const std::string mesh : {"ep=2", "ep=4", "dp=2,ep=2", "ep=2,tp=2", "dp=2", "fsdp=2", "fsdp=2,ep=2"}) {
    const launch::GradsResult r = grads_on(job, mesh);
    EXPECT_EQ(r.loss, one.loss) << mesh;
    ASSERT_TRUE(r.aux_loss.has_value());
    EXPECT_EQ(*r.aux_loss, *one.aux_loss) << mesh;
    ASSERT_EQ(r.gradients.size(), one.gradients.size()) << mesh;
    for (std::size_t i = 0; i < r.gradients.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(r.gradients[i].second, one.gradients[i].second)) << mesh << ": " << r.gradients[i].first;
    }
  }
  // Without the mode, ep=4 adds the experts' rows and the replicas in other orders: the check above
  // can fail.
  launch::GradsJob plain = job;
  plain.mesh_invariant = false;
  const launch::GradsResult a = grads_on(plain, "tp=1"), b = grads_on(plain, "ep=4");
  bool all_equal = a.loss == b.loss;
  for (std::size_t i = 0; i < a.gradients.size(); ++i) all_equal &= bitwise_equal(a.gradients[i].second, b.gradients[i].second);
  EXPECT_FALSE(all_equal) << "without --mesh-invariant ep=4 gives the same bits: the test shows nothing";
}

// Refused before any work, naming the option and the value.
TEST(HfMixtral, BadExpertSettingsAreRefusedByName) {
  const Scratch s("refusals");
  const nn::ModelConfig c = mixtral(DType::Float64);
  const launch::GradsJob job = write_inputs(s, c);
  const auto message = [&](const launch::GradsJob& j, const std::string& mesh) -> std::string {
    try {
      grads_on(j, mesh);
    } catch (const std::exception& e) {
      return e.what();
    }
    return "(no error)";
  };
  EXPECT_NE(message(job, "ep=3").find("ep = 3 does not divide the 4 experts"), std::string::npos) << message(job, "ep=3");
  EXPECT_NE(message(job, "ep=8").find("ep = 8 ranks split the experts, and the model has 4"), std::string::npos)
      << message(job, "ep=8");
  launch::GradsJob negative = job;
  negative.capacity_factor = -1;
  EXPECT_NE(message(negative, "tp=1").find("--capacity-factor -1"), std::string::npos) << message(negative, "tp=1");
  // num_experts_per_tok larger than the experts: the config is refused as it is read.
  nlohmann::json j = nlohmann::json::parse(interop::hf_config_json(c));
  j["num_experts_per_tok"] = 5;
  try {
    (void)interop::parse_hf_config(j.dump(), "config.json");
    ADD_FAILURE() << "num_experts_per_tok 5 of 4 experts was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("\"num_experts_per_tok\": 5 is more than the 4 experts"), std::string::npos)
        << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Types, HfMoeGrads, ::testing::Values("mixtral", "qwen2_moe"));

}  // namespace
}  // namespace meshgrad::test_hf_mixtral
