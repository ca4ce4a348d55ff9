// GPT-2 config.json reading and its check against a weights file (contract in
// include/meshgrad/interop/gpt2_config.hpp).
#include "meshgrad/interop/gpt2_config.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>

#include "config_keys.hpp"
#include "meshgrad/io/json_input.hpp"

namespace meshgrad::interop {

namespace detail {

// The whole file, refusing what is not a regular file of at most max_bytes (a directory, a device
// such as /dev/zero) with a message naming it.
std::string read_config_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  MG_CHECK(fd >= 0, "config '{}' cannot be opened for reading: {}", path, std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  MG_CHECK(::fstat(fd, &st) == 0, "config '{}': cannot stat: {}", path, std::strerror(errno));
  MG_CHECK(S_ISREG(st.st_mode), "config '{}' is not a regular file{}", path, S_ISDIR(st.st_mode) ? " (a directory)" : "");
  const auto size = static_cast<std::uint64_t>(st.st_size);
  MG_CHECK(size <= kMaxConfigBytes, "config '{}' has {} bytes, more than the {} a config.json may have", path, size,
           kMaxConfigBytes);
  std::string text(static_cast<std::size_t>(size), '\0');
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t got = ::read(fd, text.data() + done, text.size() - done);
    if (got < 0 && errno == EINTR) continue;
    MG_CHECK(got >= 0, "config '{}': read error at byte {}: {}", path, done, std::strerror(errno));
    MG_CHECK(got > 0, "config '{}' ends at byte {} but had {} bytes (was it changed while reading?)", path, done, size);
    done += static_cast<std::size_t>(got);
  }
  return text;
}

// A key of the config as a positive int no larger than `max`.
int int_key(const json& j, const std::string& path, const char* key, std::int64_t max) {
  MG_CHECK(j.contains(key), "config '{}': missing key \"{}\"", path, key);
  const json& v = j.at(key);
  MG_CHECK(v.is_number_integer(), "config '{}': key \"{}\" must be an integer but is {}", path, key, io::json_excerpt(v));
  // Unsigned numbers beyond int64 arrive as number_unsigned; compare before any conversion.
  const bool too_large = v.is_number_unsigned() ? v.get<std::uint64_t>() > static_cast<std::uint64_t>(max)
                                                : v.get<std::int64_t>() > max;
  MG_CHECK(!too_large, "config '{}': key \"{}\" is {}, larger than the {} meshgrad supports", path, key, v.dump(), max);
  const std::int64_t value = v.get<std::int64_t>();
  MG_CHECK(value >= 1, "config '{}': key \"{}\" must be positive, got {}", path, key, value);
  return static_cast<int>(value);
}

double number_key(const json& j, const std::string& path, const char* key) {
  MG_CHECK(j.contains(key), "config '{}': missing key \"{}\"", path, key);
  const json& v = j.at(key);
  MG_CHECK(v.is_number(), "config '{}': key \"{}\" must be a number but is {}", path, key, io::json_excerpt(v));
  return v.get<double>();
}

// A key that changes what the model computes: absent (Hugging Face's default, which is meshgrad's)
// or the value meshgrad computes, else refused naming the key, the value and why.
void require_bool_key(const json& j, const std::string& path, const char* key, bool expected, const char* why) {
  if (!j.contains(key)) return;
  const json& v = j.at(key);
  MG_CHECK(v.is_boolean(), "config '{}': key \"{}\" must be true or false but is {}", path, key, io::json_excerpt(v));
  MG_CHECK(v.get<bool>() == expected, "config '{}': \"{}\": {} is not supported: {}", path, key, v.dump(), why);
}

nlohmann::json parse_config_object(const std::string& text, const std::string& path) {
  MG_CHECK(text.size() <= kMaxConfigBytes, "config '{}' has {} bytes, more than the {} a config.json may have", path,
           text.size(), kMaxConfigBytes);
  json j;
  try {
    j = io::parse_untrusted_json(text, kMaxConfigDepth);
  } catch (const io::JsonInputError& e) {
    if (e.kind() != io::JsonInputError::Kind::Syntax) throw InvalidArgument(fmt::format("config '{}': JSON {}", path, e.what()));
    const std::string at = e.byte() ? fmt::format(" (at byte {})", *e.byte()) : std::string();
    throw InvalidArgument(fmt::format("config '{}' is not valid JSON{}: {}", path, at, e.what()));
  }
  MG_CHECK(j.is_object(), "config '{}': expected a JSON object, got {}", path, io::json_excerpt(j));
  return j;
}

}  // namespace detail

using namespace detail;

nn::ModelConfig read_gpt2_config(const std::string& path) { return parse_gpt2_config(read_config_file(path), path); }

nn::ModelConfig parse_gpt2_config(const std::string& text, const std::string& path) {
  const json j = parse_config_object(text, path);
  nn::ModelConfig c;
  c.kind = "gpt";
  c.layers = int_key(j, path, "n_layer");
  c.heads = int_key(j, path, "n_head");
  // The MLP width is 4 * n_embd, an int too.
  c.hidden = int_key(j, path, "n_embd", std::numeric_limits<int>::max() / 4);
  c.vocab = int_key(j, path, "vocab_size");
  c.positions = int_key(j, path, "n_positions");
  c.layer_norm_epsilon = number_key(j, path, "layer_norm_epsilon");
  MG_CHECK(c.layer_norm_epsilon > 0, "config '{}': layer_norm_epsilon must be > 0, got {}", path, c.layer_norm_epsilon);
  MG_CHECK(c.hidden % c.heads == 0, "config '{}': n_embd = {} is not divisible by n_head = {}", path, c.hidden,
           c.heads);
  if (j.contains("n_inner") && !j.at("n_inner").is_null()) {
    c.ffn = int_key(j, path, "n_inner");
    if (c.ffn == 4 * c.hidden) c.ffn = 0;   // the default, spelled out
  }
  if (j.contains("activation_function")) {
    const json& v = j.at("activation_function");
    const bool tanh_gelu = v.is_string() && (v.get<std::string>() == "gelu_new" || v.get<std::string>() == "gelu_pytorch_tanh");
    MG_CHECK(tanh_gelu, "config '{}': \"activation_function\": {} is not supported: meshgrad's GPT-2 uses the tanh "
             "GELU (\"gelu_new\", the same as \"gelu_pytorch_tanh\")", path, io::json_excerpt(v));
  }
  require_bool_key(j, path, "scale_attn_weights", true, "meshgrad scales attention scores by 1/sqrt(head size)");
  require_bool_key(j, path, "scale_attn_by_inverse_layer_idx", false,
                   "meshgrad does not scale attention by the layer index");
  require_bool_key(j, path, "tie_word_embeddings", true,
                   "meshgrad's output layer is the token embedding (wte) transposed");
  require_bool_key(j, path, "add_cross_attention", false, "meshgrad's GPT-2 has no cross-attention");
  c.dropout = 0.0;
  return c;
}

std::string gpt2_config_json(const nn::ModelConfig& c, const Gpt2ConfigJsonOptions& o) {
  const json eot = o.eot_token ? json(*o.eot_token) : json(nullptr);
  // nlohmann::json keeps keys sorted, as transformers writes them (json.dumps(sort_keys=True)).
  const json j = {
      {"activation_function", "gelu_new"},
      {"architectures", {"GPT2LMHeadModel"}},
      {"attn_pdrop", 0.0},
      {"bos_token_id", eot},
      {"embd_pdrop", c.dropout},
      {"eos_token_id", eot},
      {"initializer_range", 0.02},
      {"layer_norm_epsilon", c.layer_norm_epsilon},
      {"model_type", "gpt2"},
      {"n_ctx", c.n_positions()},
      {"n_embd", c.hidden},
      {"n_head", c.heads},
      {"n_inner", c.ffn > 0 && c.ffn != 4 * c.hidden ? json(c.ffn) : json(nullptr)},
      {"n_layer", c.layers},
      {"n_positions", c.n_positions()},
      {"reorder_and_upcast_attn", false},
      {"resid_pdrop", c.dropout},
      {"scale_attn_by_inverse_layer_idx", false},
      {"scale_attn_weights", true},
      {"summary_activation", nullptr},
      {"summary_first_dropout", 0.1},
      {"summary_proj_to_labels", true},
      {"summary_type", "cls_index"},
      {"summary_use_proj", true},
      {"tie_word_embeddings", true},
      {"torch_dtype", o.torch_dtype.empty() ? std::string(dtype_name(c.dtype)) : o.torch_dtype},
      {"use_cache", true},
      {"vocab_size", c.vocab},
  };
  return j.dump(2) + "\n";
}

std::vector<std::pair<std::string, Shape>> gpt2_parameter_shapes(const nn::ModelConfig& c) {
  const std::int64_t C = c.hidden, F = c.ffn_size();
  std::vector<std::pair<std::string, Shape>> out{{"wte.weight", {c.vocab, C}}, {"wpe.weight", {c.n_positions(), C}}};
  for (int i = 0; i < c.layers; ++i) {
    const std::string h = fmt::format("h.{}.", i);
    for (auto& [name, shape] : std::vector<std::pair<std::string, Shape>>{
             {"ln_1.weight", {C}}, {"ln_1.bias", {C}},
             {"attn.c_attn.weight", {C, 3 * C}}, {"attn.c_attn.bias", {3 * C}},
             {"attn.c_proj.weight", {C, C}}, {"attn.c_proj.bias", {C}},
             {"ln_2.weight", {C}}, {"ln_2.bias", {C}},
             {"mlp.c_fc.weight", {C, F}}, {"mlp.c_fc.bias", {F}},
             {"mlp.c_proj.weight", {F, C}}, {"mlp.c_proj.bias", {C}}})
      out.emplace_back(h + name, std::move(shape));
  }
  out.emplace_back("ln_f.weight", Shape{C});
  out.emplace_back("ln_f.bias", Shape{C});
  return out;
}

void check_gpt2_config_against_weights(const nn::ModelConfig& c, const std::string& config_path,
                                       const io::SafetensorsFile& weights) {
  const auto expect = [&](const std::string& name, const Shape& shape, const char* keys) {
    MG_CHECK(weights.contains(name), "config '{}' ({}) does not match weights '{}': it has no tensor '{}'",
             config_path, keys, weights.path(), name);
    const Shape& got = weights.entry(name).shape;
    MG_CHECK(got == shape, "config '{}' does not match weights '{}': {} give '{}' the shape {} but the file's tensor "
             "has shape {}",
             config_path, weights.path(), keys, name, shape_str(shape), shape_str(got));
  };
  const std::int64_t hidden = c.hidden;
  expect("wte.weight", {c.vocab, hidden}, "vocab_size and n_embd");
  expect("wpe.weight", {c.n_positions(), hidden}, "n_positions and n_embd");
  expect("ln_f.weight", {hidden}, "n_embd");
  // Every block has at least two tensors: a file with fewer than 2 * n_layer cannot hold them
  // (and a huge n_layer is refused without a loop over it).
  const std::size_t tensors = weights.names().size();
  MG_CHECK(static_cast<std::uint64_t>(c.layers) * 2 <= tensors,
           "config '{}' does not match weights '{}': n_layer = {} blocks need more tensors than the file's {}",
           config_path, weights.path(), c.layers, tensors);
  for (int i = 0; i < c.layers; ++i) {
    expect(fmt::format("h.{}.ln_1.weight", i), {hidden}, "n_layer and n_embd");
    expect(fmt::format("h.{}.mlp.c_fc.weight", i), {hidden, c.ffn_size()}, "n_layer, n_embd and n_inner");
  }
}

}  // namespace meshgrad::interop
