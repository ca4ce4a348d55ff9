// Hugging Face GPT-2 in and out (interop/hf_io.hpp): export -> init-from round trips at tp = 1, 2, 4
// with GPT-2's vocabulary of 50257 (uneven shards), bitwise in F32 and equal to the rounded values
// in F16 / BF16; names with and without "transformer.", a tied lm_head and old mask buffers
// ignored; every refusal names what is wrong; export never clobbers; the tokenizer travels along.
// (python/tests/test_hf_gpt2.py checks the exported model against an independent PyTorch GPT-2.)
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "meshgrad/autograd/grad_mode.hpp"
#include "meshgrad/comm/threads.hpp"
#include "meshgrad/nn/layers.hpp"
#include "meshgrad/checkpoint/parameter_file.hpp"
#include "meshgrad/data/dataset.hpp"
#include "meshgrad/interop/gpt2_config.hpp"
#include "meshgrad/interop/hf_io.hpp"
#include "meshgrad/launch/jobs.hpp"
#include "meshgrad/data/prepare.hpp"
#include "meshgrad/train/trainer.hpp"
#include "text/gpt2_test_files.hpp"

namespace meshgrad::launch::test_hf_io {
namespace {

namespace fs = std::filesystem;
using Tensors = std::vector<std::pair<std::string, Tensor>>;

void run_mesh(int dp, int tp, const std::function<void(const dist::DeviceMeshPtr&)>& fn) {
  comm::ThreadsOptions options;
  options.timeout = std::chrono::milliseconds(60000);
  comm::run_ranks(
      dp * tp,
      [&](const comm::CommunicatorPtr& world) {
        fn(std::make_shared<const dist::DeviceMesh>(world, std::vector<dist::MeshAxis>{{"dp", dp}, {"tp", tp}}));
      },
      options);
}

// GPT-2's vocabulary (50257 = 7 * 43 * 167: uneven over tp = 2 and 4), everything else tiny.
nn::ModelConfig gpt2_vocab_config() {
  nn::ModelConfig c;
  c.kind = "gpt";
  c.layers = 1;
  c.hidden = 16;
  c.heads = 4;
  c.vocab = 50257;
  c.positions = 8;
  c.seq = 8;
  c.batch = 2;
  c.layer_norm_epsilon = 1e-5;
  return c;
}

// The full parameters of a model, by name (collective over tp).
Tensors full_parameters(nn::Model& model, const dist::DeviceMesh& mesh) {
  (void)mesh;
  autograd::NoGradGuard no_grad;
  Tensors out;
  for (nn::Parameter* p : model.parameters()) {
    Tensor full = nn::gather_full(p->value.detach(), *p);
    out.emplace_back(p->name, full.storage() == p->value.storage() ? full.clone() : full);
  }
  return out;
}

std::map<std::string, Tensor> by_name(const Tensors& tensors) { return {tensors.begin(), tensors.end()}; }

// Bitwise equality of two float tensors (NaN patterns included).
::testing::AssertionResult same_bits(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape())
    return ::testing::AssertionFailure() << a.str() << " vs " << b.str();
  const Tensor ca = a.contiguous(), cb = b.contiguous();
  if (std::memcmp(ca.raw_data(), cb.raw_data(), static_cast<std::size_t>(ca.numel()) * dtype_size(ca.dtype())) != 0) {
    for (std::int64_t i = 0; i < ca.numel(); ++i) {
      const double x = ca.dtype() == DType::Float32 ? ca.data<float>()[i] : ca.data<double>()[i];
      const double y = cb.dtype() == DType::Float32 ? cb.data<float>()[i] : cb.data<double>()[i];
      if (x != y) return ::testing::AssertionFailure() << "element " << i << ": " << x << " vs " << y;
    }
    return ::testing::AssertionFailure() << "bytes differ";
  }
  return ::testing::AssertionSuccess();
}

// A safetensors file from raw entries, for dtypes meshgrad does not write (U8 masks).
struct RawTensor {
  std::string name, dtype;
  Shape shape;
  std::string bytes;
};
void write_raw(const std::string& path, const std::vector<RawTensor>& tensors) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  std::string data;
  for (const RawTensor& t : tensors) {
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data += t.bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  std::ofstream(path, std::ios::binary) << out << text << data;
}
RawTensor raw_f32(const std::string& name, const Tensor& t) {
  const Tensor c = t.to(DType::Float32).contiguous();
  return {name, "F32", c.shape(), std::string(static_cast<const char*>(c.raw_data()), static_cast<std::size_t>(4 * c.numel()))};
}

// An InvalidArgument from fn whose message holds every needle.
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected " << ::testing::PrintToString(needles);
  } catch (const InvalidArgument& e) {
    const std::string message = e.what();
    for (const auto& n : needles) EXPECT_NE(message.find(n), std::string::npos) << "no \"" << n << "\" in: " << message;
  }
}

class HfIoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / fmt::format("meshgrad_hf_{}_{}", ::getpid(), info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& leaf) const { return (dir_ / leaf).string(); }

  // A checkpoint as `train --save` writes one (full tensors, gpt2_config metadata) of the model of
  // config initialised from seed on one rank; returns its tensors.
  Tensors write_checkpoint(const std::string& leaf, const nn::ModelConfig& config, std::uint64_t seed) {
    Tensors tensors;
    run_mesh(1, 1, [&](const dist::DeviceMeshPtr& mesh) {
      auto model = nn::make_model(config, {}, mesh, seed);
      tensors = full_parameters(*model, *mesh);
      checkpoint::save_parameters(path(leaf), model->parameters(), nn::tensor_parallel_group(*mesh), 0,
                      {{"format", "pt"}, {"gpt2_config", interop::gpt2_config_json(config)}, {"data_tokens", "bytes"}});
    });
    return tensors;
  }

  // A Hugging Face directory: config.json + model.safetensors with the given tensors.
  std::string write_hf_dir(const std::string& leaf, const nn::ModelConfig& config, const Tensors& tensors) {
    const fs::path d = dir_ / leaf;
    fs::create_directories(d);
    std::ofstream(d / "config.json") << interop::gpt2_config_json(config);
    io::write_safetensors((d / "model.safetensors").string(), tensors, {{"format", "pt"}});
    return d.string();
  }

  // The model of DIR loaded at dp x tp as `train --init-from` builds it, as full tensors (rank 0's).
  Tensors load_on(const std::string& hf_dir, int tp, DType dtype = DType::Float32) {
    Tensors out;
    nn::ModelConfig requested;
    requested.layers = requested.hidden = requested.heads = requested.vocab = 0;
    requested.seq = 8;
    requested.dtype = dtype;
    const nn::ModelConfig config = interop::hf_init_config(hf_dir, requested, false);
    run_mesh(1, tp, [&](const dist::DeviceMeshPtr& mesh) {
      auto model = nn::make_model(config, {}, mesh, /*seed=*/12345);   // not the checkpoint's seed
      interop::hf_load_parameters(hf_dir, model->parameters(), nn::tensor_parallel_group(*mesh));
      Tensors full = full_parameters(*model, *mesh);
      if (mesh->rank() == 0) out = std::move(full);
    });
    return out;
  }

  fs::path dir_;
};

// ---- the configuration -------------------------------------------------------------------------------

TEST(Gpt2ParameterShapes, AreTheModelsParameters) {
  for (int ffn : {0, 24}) {
    nn::ModelConfig c = gpt2_vocab_config();
    c.layers = 2;
    c.ffn = ffn;
    const auto shapes = interop::gpt2_parameter_shapes(c);
    run_mesh(1, 1, [&](const dist::DeviceMeshPtr& mesh) {
      auto model = nn::make_model(c, {}, mesh, 1);
      const auto params = model->parameters();
      ASSERT_EQ(params.size(), shapes.size());
      for (std::size_t i = 0; i < params.size(); ++i) {
        EXPECT_EQ(params[i]->name, shapes[i].first);
        EXPECT_EQ(params[i]->full_shape, shapes[i].second) << shapes[i].first;
      }
    });
  }
}

TEST(Gpt2ConfigJson, IsReadBackAndHasTheKeysTransformersWrites) {
  nn::ModelConfig c = gpt2_vocab_config();
  c.layers = 3;
  c.hidden = 24;
  c.heads = 4;
  c.positions = 64;
  c.layer_norm_epsilon = 1e-6;
  c.dropout = 0.1;
  for (int ffn : {0, 40}) {
    c.ffn = ffn;
    const std::string text = interop::gpt2_config_json(c, {"bfloat16", 50256});
    const nn::ModelConfig back = interop::parse_gpt2_config(text, "test");
    EXPECT_EQ(back.layers, c.layers);
    EXPECT_EQ(back.hidden, c.hidden);
    EXPECT_EQ(back.heads, c.heads);
    EXPECT_EQ(back.vocab, c.vocab);
    EXPECT_EQ(back.positions, c.positions);
    EXPECT_EQ(back.ffn_size(), c.ffn_size());
    EXPECT_EQ(back.layer_norm_epsilon, c.layer_norm_epsilon);
    const auto j = nlohmann::json::parse(text);
    EXPECT_EQ(j["model_type"], "gpt2");
    EXPECT_EQ(j["architectures"], nlohmann::json::array({"GPT2LMHeadModel"}));
    EXPECT_EQ(j["activation_function"], "gelu_new");
    EXPECT_EQ(j["n_ctx"], 64);
    EXPECT_EQ(j["n_positions"], 64);
    EXPECT_EQ(j["torch_dtype"], "bfloat16");
    EXPECT_EQ(j["bos_token_id"], 50256);
    EXPECT_EQ(j["eos_token_id"], 50256);
    EXPECT_EQ(j["resid_pdrop"], 0.1);
    EXPECT_EQ(j["attn_pdrop"], 0.0);
    EXPECT_EQ(j["tie_word_embeddings"], true);
    EXPECT_EQ(j["n_inner"], ffn == 0 ? nlohmann::json(nullptr) : nlohmann::json(40));
  }
  EXPECT_TRUE(nlohmann::json::parse(interop::gpt2_config_json(c))["bos_token_id"].is_null());
}

TEST(Gpt2ConfigJson, KeysThatChangeTheModelAreRefused) {
  const nn::ModelConfig c = gpt2_vocab_config();
  const auto with = [&](const std::string& key, const nlohmann::json& value) {
    auto j = nlohmann::json::parse(interop::gpt2_config_json(c));
    j[key] = value;
    return j.dump();
  };
  EXPECT_NO_THROW(interop::parse_gpt2_config(with("activation_function", "gelu_pytorch_tanh"), "cfg"));
  expect_error([&] { interop::parse_gpt2_config(with("activation_function", "gelu"), "cfg"); },
               {"cfg", "\"activation_function\"", "gelu", "tanh GELU"});
  expect_error([&] { interop::parse_gpt2_config(with("tie_word_embeddings", false), "cfg"); }, {"\"tie_word_embeddings\": false"});
  expect_error([&] { interop::parse_gpt2_config(with("scale_attn_weights", false), "cfg"); }, {"\"scale_attn_weights\": false"});
  expect_error([&] { interop::parse_gpt2_config(with("scale_attn_by_inverse_layer_idx", true), "cfg"); },
               {"\"scale_attn_by_inverse_layer_idx\": true"});
  expect_error([&] { interop::parse_gpt2_config(with("add_cross_attention", true), "cfg"); }, {"\"add_cross_attention\""});
  expect_error([&] { interop::parse_gpt2_config(with("n_inner", -3), "cfg"); }, {"\"n_inner\" must be positive"});
  EXPECT_EQ(interop::parse_gpt2_config(with("n_inner", 64), "cfg").ffn, 0);   // 4 n_embd, spelled out
}

// ---- export -> init-from -------------------------------------------------------------------------------

TEST_F(HfIoTest, ExportThenInitFromGivesTheSameParametersAtAnyTp) {
  const nn::ModelConfig config = gpt2_vocab_config();
  const Tensors saved = write_checkpoint("ck.safetensors", config, 7);
  for (const char* dtype : {"float32", "float16", "bfloat16"}) {
    SCOPED_TRACE(dtype);
    const std::string out = path(std::string("hf-") + dtype);
    const interop::ExportResult r = interop::export_hf({path("ck.safetensors"), out, dtype, "", ""});
    EXPECT_EQ(r.files, (std::vector<std::string>{"config.json", "model.safetensors"}));
    EXPECT_TRUE(r.tokenizer.empty());
    EXPECT_NE(r.note.find("bytes"), std::string::npos) << r.note;
    // The file as Hugging Face's hub gpt2 has it: names without "transformer.", no lm_head, "pt".
    const io::SafetensorsFile file(out + "/model.safetensors");
    EXPECT_EQ(file.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
    EXPECT_EQ(file.names().size(), saved.size());
    EXPECT_TRUE(file.contains("h.0.attn.c_attn.weight"));
    EXPECT_FALSE(file.contains("lm_head.weight"));
    const std::string stored = std::string(dtype) == "float32" ? "F32" : std::string(dtype) == "float16" ? "F16" : "BF16";
    EXPECT_EQ(file.entry("wte.weight").stored, stored);
    EXPECT_EQ(nlohmann::json::parse(testing::file_bytes(out + "/config.json"))["torch_dtype"], dtype);

    const auto expected = by_name(saved);
    for (int tp : {1, 2, 4}) {
      SCOPED_TRACE(fmt::format("tp={}", tp));
      const Tensors loaded = load_on(out, tp);
      ASSERT_EQ(loaded.size(), saved.size());
      for (const auto& [name, t] : loaded) {
        Tensor want = expected.at(name).contiguous();
        if (stored != "F32") {   // the checkpoint's values rounded to the stored type
          want = want.clone();
          float* w = want.data<float>();
          for (std::int64_t i = 0; i < want.numel(); ++i)
            w[i] = stored == "F16" ? io::f16_to_float(io::float_to_f16(w[i])) : io::bf16_to_float(io::float_to_bf16(w[i]));
          // Independently of the encoder: within half a unit in the last place of the format.
          const float* original = expected.at(name).contiguous().data<float>();
          for (std::int64_t i = 0; i < want.numel(); ++i) {
            const int e = std::max(std::ilogb(original[i]), stored == "F16" ? -14 : -126);
            ASSERT_LE(std::fabs(w[i] - original[i]), std::ldexp(1.0, e - (stored == "F16" ? 10 : 7) - 1))
                << name << "[" << i << "]";
          }
        }
        EXPECT_TRUE(same_bits(t, want)) << name;
      }
    }
  }
  // Into a float64 model: the same values, widened exactly.
  const Tensors wide = load_on(path("hf-float32"), 2, DType::Float64);
  for (const auto& [name, t] : wide) EXPECT_TRUE(same_bits(t, by_name(saved).at(name).to(DType::Float64))) << name;
}

TEST_F(HfIoTest, TransformerPrefixTiedHeadAndMaskBuffersLoad) {
  const nn::ModelConfig config = gpt2_vocab_config();
  const Tensors saved = write_checkpoint("ck.safetensors", config, 3);
  const auto expected = by_name(saved);
  // GPT2LMHeadModel.save_pretrained's names, with the tied head and old F32 mask buffers.
  Tensors prefixed;
  for (const auto& [name, t] : saved) prefixed.emplace_back("transformer." + name, t);
  prefixed.emplace_back("lm_head.weight", expected.at("wte.weight"));
  prefixed.emplace_back("transformer.h.0.attn.bias", Tensor::ones({1, 1, 8, 8}));
  prefixed.emplace_back("transformer.h.0.attn.masked_bias", Tensor::scalar(-1e4));
  const std::string hf = write_hf_dir("prefixed", config, prefixed);
  for (const auto& [name, t] : load_on(hf, 2)) EXPECT_TRUE(same_bits(t, expected.at(name))) << name;

  // Without the prefix, with uint8 masks (a dtype meshgrad does not read) and a BF16 copy of the head.
  std::vector<RawTensor> raw;
  for (const auto& [name, t] : saved) raw.push_back(raw_f32(name, t));
  raw.push_back({"h.0.attn.bias", "U8", {1, 1, 8, 8}, std::string(64, '\1')});
  const std::string plain = (dir_ / "plain").string();
  fs::create_directories(plain);
  std::ofstream(plain + "/config.json") << interop::gpt2_config_json(config);
  write_raw(plain + "/model.safetensors", raw);
  for (const auto& [name, t] : load_on(plain, 4)) EXPECT_TRUE(same_bits(t, expected.at(name))) << name;
}

TEST_F(HfIoTest, AnUntiedHeadIsRefused) {
  const nn::ModelConfig config = gpt2_vocab_config();
  const Tensors saved = write_checkpoint("ck.safetensors", config, 3);
  Tensors tensors = saved;
  Tensor head = by_name(saved).at("wte.weight").clone();
  head.data<float>()[2 * 16 + 5] += 1.0f;
  tensors.emplace_back("lm_head.weight", head);
  const std::string hf = write_hf_dir("untied", config, tensors);
  expect_error([&] { load_on(hf, 1); }, {"'lm_head.weight' differs from 'wte.weight'", "[2, 5]", "untied"});
}

TEST_F(HfIoTest, BadWeightsAreRefusedNamingTheTensors) {
  const nn::ModelConfig config = gpt2_vocab_config();
  const Tensors saved = write_checkpoint("ck.safetensors", config, 3);
  const auto without = [&](const std::vector<std::string>& drop) {
    Tensors out;
    for (const auto& [name, t] : saved)
      if (std::find(drop.begin(), drop.end(), name) == drop.end()) out.emplace_back(name, t);
    return out;
  };
  const auto requested = [] {
    nn::ModelConfig r;
    r.layers = r.hidden = r.heads = r.vocab = 0;
    r.seq = 8;
    return r;
  }();
  expect_error([&] { interop::hf_init_config(write_hf_dir("missing", config, without({"h.0.mlp.c_fc.bias", "ln_f.bias"})), requested, false); },
               {"miss 2 tensors", "'h.0.mlp.c_fc.bias', 'ln_f.bias'", "n_layer 1, n_embd 16"});
  Tensors wrong = without({"wpe.weight"});
  wrong.emplace_back("wpe.weight", Tensor::zeros({9, 16}));
  expect_error([&] { interop::hf_init_config(write_hf_dir("shape", config, wrong), requested, false); },
               {"tensor 'wpe.weight' has shape [9, 16]", "gives it [8, 16]"});
  Tensors both = saved;
  both.emplace_back("transformer.wte.weight", by_name(saved).at("wte.weight"));
  expect_error([&] { interop::hf_init_config(write_hf_dir("both", config, both), requested, false); }, {"ambiguous"});
  Tensors extra = saved;
  extra.emplace_back("h.1.ln_1.weight", Tensor::ones({16}));
  expect_error([&] { interop::hf_init_config(write_hf_dir("extra", config, extra), requested, false); },
               {"hold 'h.1.ln_1.weight'", "n_layer = 1"});
  Tensors ints = without({"ln_f.bias"});
  ints.emplace_back("ln_f.bias", Tensor::from_int64(std::vector<std::int64_t>(16, 0), {16}));
  expect_error([&] { interop::hf_init_config(write_hf_dir("ints", config, ints), requested, false); },
               {"'ln_f.bias' is I64", "F32, F64, F16 or BF16"});
  expect_error([&] { interop::hf_init_config(write_hf_dir("empty", config, {{"x", Tensor::ones({1})}}), requested, false); },
               {"no 'wte.weight'", "not GPT-2 weights"});
  fs::create_directories(dir_ / "noweights");
  std::ofstream(dir_ / "noweights" / "config.json") << interop::gpt2_config_json(config);
  expect_error([&] { interop::hf_init_config(path("noweights"), requested, false); }, {"has no model.safetensors"});
}

TEST_F(HfIoTest, SizesThatDisagreeWithConfigJsonAreRefusedNamingTheOption) {
  const nn::ModelConfig config = gpt2_vocab_config();
  const std::string hf = write_hf_dir("hf", config, write_checkpoint("ck.safetensors", config, 3));
  nn::ModelConfig r;
  r.layers = r.hidden = r.heads = r.vocab = 0;
  r.seq = 8;
  const nn::ModelConfig ok = interop::hf_init_config(hf, r, false);
  EXPECT_EQ(ok.vocab, 50257);
  EXPECT_EQ(ok.positions, 8);
  nn::ModelConfig same = r;
  same.layers = 1;
  same.hidden = 16;
  EXPECT_NO_THROW(interop::hf_init_config(hf, same, false));
  for (const auto& [field, option, key] :
       {std::tuple{&nn::ModelConfig::layers, "--layers 2", "n_layer = 1"}, std::tuple{&nn::ModelConfig::hidden, "--hidden 2", "n_embd = 16"},
        std::tuple{&nn::ModelConfig::heads, "--heads 2", "n_head = 4"}, std::tuple{&nn::ModelConfig::vocab, "--vocab 2", "vocab_size = 50257"}}) {
    nn::ModelConfig bad = r;
    bad.*field = 2;
    expect_error([&] { interop::hf_init_config(hf, bad, false); }, {option, key, "disagrees", "config.json"});
  }
  nn::ModelConfig long_seq = r;
  long_seq.seq = 9;
  expect_error([&] { interop::hf_init_config(hf, long_seq, false); }, {"--seq 9 exceeds n_positions = 8"});
}

// train --init-from: step 1's loss is the loaded model's loss on step 1's batch (float64, tp=2 against
// a tp=1 reference), and check_train_options takes 0 for the sizes it reads from the file.
TEST_F(HfIoTest, TrainStartsFromTheLoadedWeights) {
  const nn::ModelConfig config = gpt2_vocab_config();
  write_checkpoint("ck.safetensors", config, 11);
  const std::string hf = path("hf");
  interop::export_hf({path("ck.safetensors"), hf, "float32", "", ""});

  train::TrainOptions o;
  o.model.layers = o.model.hidden = o.model.heads = o.model.vocab = 0;
  o.model.seq = 8;
  o.model.batch = 4;
  o.model.dtype = DType::Float64;
  o.steps = 2;
  o.progress = false;
  o.init_from = hf;
  o.save_path = path("after.safetensors");
  const train::TrainResult result = run_train_job(o, [](const std::function<void(const dist::DeviceMeshPtr&)>& fn) { run_mesh(1, 2, fn); });

  double reference = 0;
  const data::TokenDataset data("", 4, 8, o.seed);
  run_mesh(1, 1, [&](const dist::DeviceMeshPtr& mesh) {
    nn::ModelConfig c = interop::hf_init_config(hf, o.model, false);
    auto model = nn::make_model(c, {}, mesh, 99);
    interop::hf_load_parameters(hf, model->parameters(), nn::tensor_parallel_group(*mesh));
    autograd::NoGradGuard no_grad;
    const nn::Batch batch = data.next_batch(0);
    reference = model->loss(batch, train::count_loss_targets(batch.targets)).item();
  });
  ASSERT_EQ(result.losses.size(), 2u);
  EXPECT_NEAR(result.losses[0], reference, 1e-12 * reference);
  EXPECT_GT(std::fabs(result.losses[0] - std::log(50257.0)), 1e-3);   // not a fresh model's ~ln V by chance

  // The saved file describes itself: its gpt2_config metadata is the model's config.json.
  const io::SafetensorsFile saved(o.save_path);
  const nn::ModelConfig back = interop::parse_gpt2_config(saved.metadata().at("gpt2_config"), "metadata");
  EXPECT_EQ(back.vocab, 50257);
  EXPECT_EQ(back.layers, 1);
  EXPECT_EQ(saved.metadata().at("data_tokens"), "bytes");
  EXPECT_EQ(saved.metadata().at("format"), "pt");

  train::TrainOptions no_init = o;
  no_init.init_from.clear();
  expect_error([&] { check_train_options(no_init); }, {"--layers must be >= 1"});
}

// ---- export: tokenizer, never clobbering ----------------------------------------------------------------

TEST_F(HfIoTest, TheTokenizerOfPreparedDataTravelsWithTheExport) {
  ASSERT_TRUE(testing::gpt2_files_present());
  std::ofstream(path("text.txt")) << std::string(40, 'x') + " The quick brown fox jumps over the lazy dog. " +
                                         "Tensor parallelism splits matrices over ranks.\n";
  data::PrepareOptions p;
  p.vocab = testing::gpt2_vocab();
  p.merges = testing::gpt2_merges();
  p.out_dir = path("data");
  p.val_fraction = 0;
  p.inputs = {path("text.txt")};
  data::prepare_dataset(p);

  train::TrainOptions o;
  o.model = gpt2_vocab_config();
  o.model.vocab = 0;   // from meta.json: 50257
  o.model.positions = 0;
  o.model.batch = 2;
  o.steps = 1;
  o.progress = false;
  o.data_path = path("data");
  o.save_path = path("ck.safetensors");
  run_train_job(o, [](const std::function<void(const dist::DeviceMeshPtr&)>& fn) { run_mesh(1, 2, fn); });
  EXPECT_EQ(io::SafetensorsFile(o.save_path).metadata().at("data_meta"), fs::absolute(path("data/meta.json")).string());

  const interop::ExportResult r = interop::export_hf({o.save_path, path("hf"), "float32", "", ""});
  EXPECT_EQ(r.files, (std::vector<std::string>{"config.json", "model.safetensors", "vocab.json", "merges.txt",
                                               "tokenizer_config.json"}));
  EXPECT_TRUE(r.note.empty()) << r.note;
  EXPECT_EQ(testing::file_bytes(path("hf/vocab.json")), testing::file_bytes(testing::gpt2_vocab()));
  EXPECT_EQ(testing::file_bytes(path("hf/merges.txt")), testing::file_bytes(testing::gpt2_merges()));
  const auto config = nlohmann::json::parse(testing::file_bytes(path("hf/config.json")));
  EXPECT_EQ(config["eos_token_id"], 50256);
  EXPECT_EQ(config["vocab_size"], 50257);
  const auto tok = nlohmann::json::parse(testing::file_bytes(path("hf/tokenizer_config.json")));
  EXPECT_EQ(tok["tokenizer_class"], "GPT2Tokenizer");
  EXPECT_EQ(tok["eos_token"], "<|endoftext|>");
  EXPECT_EQ(tok["model_max_length"], 8);
  const auto saved = io::read_safetensors(o.save_path);
  for (const auto& [name, t] : load_on(path("hf"), 4)) EXPECT_TRUE(same_bits(t, saved.at(name))) << name;

  // A tokenizer copy changed since the data was prepared is refused; a gone data directory is a note.
  std::ofstream(path("data/merges.txt"), std::ios::app) << "x y\n";
  expect_error([&] { interop::export_hf({o.save_path, path("hf2"), "float32", "", ""}); },
               {"merges.txt", "does not match the sha256", "--tokenizer"});
  EXPECT_FALSE(fs::exists(path("hf2")));
  fs::remove_all(path("data"));
  const interop::ExportResult gone = interop::export_hf({o.save_path, path("hf3"), "float32", "", ""});
  EXPECT_NE(gone.note.find("is gone; give --tokenizer DIR"), std::string::npos) << gone.note;
  EXPECT_EQ(gone.files.size(), 2u);
  // --tokenizer: OpenAI's file names (encoder.json + vocab.bpe) come out as vocab.json + merges.txt.
  const interop::ExportResult given = interop::export_hf({o.save_path, path("hf4"), "bfloat16", "", testing::gpt2_dir()});
  EXPECT_EQ(given.files.size(), 5u);
  EXPECT_EQ(testing::file_bytes(path("hf4/vocab.json")), testing::file_bytes(testing::gpt2_vocab()));
}

TEST_F(HfIoTest, ExportNeverClobbersAndLeavesNothingBehindOnError) {
  const nn::ModelConfig config = gpt2_vocab_config();
  write_checkpoint("ck.safetensors", config, 3);
  const std::string ck = path("ck.safetensors");
  const auto listing = [&] {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  };

  fs::create_directories(path("full"));
  std::ofstream(path("full/keep.txt")) << "mine";
  expect_error([&] { interop::export_hf({ck, path("full"), "float32", "", ""}); }, {"--out", "not empty", "never overwrites"});
  EXPECT_EQ(testing::file_bytes(path("full/keep.txt")), "mine");
  std::ofstream(path("file")) << "mine";
  expect_error([&] { interop::export_hf({ck, path("file"), "float32", "", ""}); }, {"exists and is not a directory"});
  fs::create_directory_symlink(path("empty-target"), path("link"));
  expect_error([&] { interop::export_hf({ck, path("link"), "float32", "", ""}); }, {"symbolic link"});
  expect_error([&] { interop::export_hf({ck, path("no/such/dir"), "float32", "", ""}); }, {"parent", "is not a directory"});
  expect_error([&] { interop::export_hf({ck, path("x"), "float8", "", ""}); }, {"float8"});
  expect_error([&] { interop::export_hf({path("full"), path("x"), "float32", "", ""}); }, {"is a directory but not a training checkpoint"});
  // Failing after the checks (a tokenizer too large for the model): no temporary left, no --out.
  ASSERT_TRUE(testing::gpt2_files_present());
  nn::ModelConfig small = config;
  small.vocab = 256;
  write_checkpoint("small.safetensors", small, 3);
  const auto before = listing();
  expect_error([&] { interop::export_hf({path("small.safetensors"), path("x"), "float32", "", testing::gpt2_dir()}); },
               {"50257 ids", "vocabulary is 256"});
  EXPECT_EQ(listing(), before);
  // A checkpoint without gpt2_config takes --config.
  {
    Tensors plain;
    for (const auto& [name, tensor] : io::read_safetensors(ck)) plain.emplace_back(name, tensor);
    io::write_safetensors(path("bare.safetensors"), plain);
  }
  expect_error([&] { interop::export_hf({path("bare.safetensors"), path("x"), "float32", "", ""}); },
               {"no \"gpt2_config\" metadata", "--config"});
  std::ofstream(path("config.json")) << interop::gpt2_config_json(config);
  fs::create_directories(path("empty"));
  const interop::ExportResult r = interop::export_hf({path("bare.safetensors"), path("empty"), "float16", path("config.json"), ""});
  EXPECT_EQ(r.files.size(), 2u);
  EXPECT_TRUE(fs::is_regular_file(path("empty/model.safetensors")));
}

}  // namespace
}  // namespace meshgrad::launch::test_hf_io
