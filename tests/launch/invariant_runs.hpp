// What the invariance tests (test_tp_invariant.cpp, test_mesh_invariant.cpp) share: the small GPT
// they train and the bits a run leaves.
#pragma once

#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "meshgrad/nn/model.hpp"

namespace meshgrad::launch::testing {

// Two blocks (a pipeline of two stages fits), an uneven vocabulary: 61 = 16+15+15+15 over 4 blocks,
// and tp=2 holds 31 and 30, which nests.
inline nn::ModelConfig small_gpt(DType dtype, int batch = 4) {
  nn::ModelConfig c;
  c.kind = "gpt";
  c.layers = 2;
  c.hidden = 32;
  c.heads = 4;
  c.vocab = 61;
  c.seq = 8;
  c.batch = batch;
  c.dtype = dtype;
  return c;
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// What a training run leaves that must agree to the bit.
struct RunBits {
  std::vector<double> losses, grad_norms;
  std::string parameters;   // the saved safetensors file
};

inline bool same_doubles(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

}  // namespace meshgrad::launch::testing
