// The GELU MLP GPT-2 (gpt2.cpp) and the MLP stack (mlp_stack.cpp) share.
#pragma once

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "meshgrad/nn/model.hpp"
#include "meshgrad/nn/tp_plan.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/trace.hpp"

namespace meshgrad::nn {

// c_fc (hidden -> ffn), GELU (tanh), c_proj (ffn -> hidden): GPT-2's and Megatron's MLP, the block
// of the MLP stack too. x: [T(_local), B, hidden] -> the same.
class GeluMlp {
 public:
  // Its linears are name + ".c_fc" and name + ".c_proj", split as `plan` says.
  GeluMlp(const std::string& name, const ModelConfig& cfg, const TensorParallelPlan& plan, const ParallelContextPtr& ctx,
          std::uint64_t seed)
      : name_(name) {
    c_fc_ = plan.linear(name + ".c_fc", {.in = cfg.hidden, .out = cfg.ffn_size()}, ctx, seed, cfg.dtype);
    c_proj_ = plan.linear(name + ".c_proj",
                          {.in = cfg.ffn_size(), .out = cfg.hidden, .init_std = 0.02 / std::sqrt(2.0 * cfg.layers)},
                          ctx, seed, cfg.dtype);
  }
  Tensor forward(const Tensor& x, std::int64_t seq) const {
    trace::Scope scope(name_);
    return c_proj_->forward(gelu(c_fc_->forward(x, seq)), seq);
  }
  void collect(std::vector<Parameter*>& out) {
    c_fc_->collect(out);
    c_proj_->collect(out);
  }

 private:
  std::string name_;   // its trace scope
  std::unique_ptr<ParallelLinear> c_fc_, c_proj_;
};

}  // namespace meshgrad::nn
