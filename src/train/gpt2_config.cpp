// GPT-2 config.json reading and its check against a weights file (contract in
// include/meshgrad/train/gpt2_config.hpp).
#include "meshgrad/train/gpt2_config.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>

#include "meshgrad/train/json_input.hpp"

namespace meshgrad::train {

namespace {

using json = nlohmann::json;

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
int int_key(const json& j, const std::string& path, const char* key, std::int64_t max = std::numeric_limits<int>::max()) {
  MG_CHECK(j.contains(key), "config '{}': missing key \"{}\"", path, key);
  const json& v = j.at(key);
  MG_CHECK(v.is_number_integer(), "config '{}': key \"{}\" must be an integer but is {}", path, key, json_excerpt(v));
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
  MG_CHECK(v.is_number(), "config '{}': key \"{}\" must be a number but is {}", path, key, json_excerpt(v));
  return v.get<double>();
}

}  // namespace

nn::ModelConfig read_gpt2_config(const std::string& path) { return parse_gpt2_config(read_config_file(path), path); }

nn::ModelConfig parse_gpt2_config(const std::string& text, const std::string& path) {
  MG_CHECK(text.size() <= kMaxConfigBytes, "config '{}' has {} bytes, more than the {} a config.json may have", path,
           text.size(), kMaxConfigBytes);
  json j;
  try {
    j = parse_untrusted_json(text, kMaxConfigDepth);
  } catch (const JsonInputError& e) {
    if (e.kind() != JsonInputError::Kind::Syntax) throw InvalidArgument(fmt::format("config '{}': JSON {}", path, e.what()));
    const std::string at = e.byte() ? fmt::format(" (at byte {})", *e.byte()) : std::string();
    throw InvalidArgument(fmt::format("config '{}' is not valid JSON{}: {}", path, at, e.what()));
  }
  MG_CHECK(j.is_object(), "config '{}': expected a JSON object, got {}", path, json_excerpt(j));
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
  c.dropout = 0.0;
  return c;
}

std::string gpt2_config_json(const nn::ModelConfig& c) {
  const json j = {{"model_type", "gpt2"},
                  {"architectures", {"GPT2LMHeadModel"}},
                  {"activation_function", "gelu_new"},
                  {"n_layer", c.layers},
                  {"n_head", c.heads},
                  {"n_embd", c.hidden},
                  {"n_inner", c.ffn > 0 ? json(c.ffn) : json(nullptr)},
                  {"vocab_size", c.vocab},
                  {"n_positions", c.n_positions()},
                  {"n_ctx", c.n_positions()},
                  {"layer_norm_epsilon", c.layer_norm_epsilon}};
  return j.dump();
}

void check_gpt2_config_against_weights(const nn::ModelConfig& c, const std::string& config_path,
                                       const SafetensorsFile& weights) {
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
    expect(fmt::format("h.{}.mlp.c_fc.weight", i), {hidden, 4 * hidden}, "n_layer and n_embd");
  }
}

}  // namespace meshgrad::train
