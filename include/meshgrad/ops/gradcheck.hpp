// Gradient checker: compares the gradients autograd computes for a function f: TensorList -> Tensor
// with central finite differences, in float64.
//
//   full mode        every entry of the Jacobian d out / d x_k, for every input k that requires
//                    grad: 2 evaluations of f per input element, one backward per output element.
//   projection mode  random scalar projections v^T J_k u_k (u_k a unit direction of input k, v a
//                    unit weighting of the outputs): 2 evaluations and 1 backward per projection and
//                    input, whatever the sizes. For inputs too large for the full Jacobian. A failing
//                    projection is narrowed to one element by bisection over the direction's support.
//
// Inputs: float64 tensors with requires_grad are checked; float tensors without requires_grad and
// int64 tensors (indices, targets) are passed to f unchanged and never perturbed. f must be
// deterministic: it is evaluated many times and must give the same bits for the same inputs (build
// a dropout Generator with a fixed seed inside f). The caller's tensors are never modified: the
// checker works on copies.
//
// The case table of every op in ops.hpp (gradcheck_cases) is what `meshgrad gradcheck` and the test
// suite (tests/ops/test_gradcheck.cpp) run.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad {

// The function under test. Called with the inputs in the order given to gradcheck.
using GradcheckFn = std::function<Tensor(const TensorList& inputs)>;

enum class GradcheckMode { Full, Projection };
std::string_view gradcheck_mode_name(GradcheckMode mode);   // "full" / "projection"
// Parses "full" / "projection"; throws InvalidArgument naming the text otherwise.
GradcheckMode parse_gradcheck_mode(std::string_view text);

struct GradcheckOptions {
  // Central-difference step h. The error of (f(x+h) - f(x-h)) / 2h is truncation h^2 |f'''| / 6
  // (~1e-12 for h = 1e-6 and |f'''| ~ 1) plus rounding ~ eps_64 |f| / h (~2.2e-16 * |f| / 1e-6 ~
  // 2e-10 for |f| ~ 1). h = 1e-6 sits near the optimum (eps / h = h^2 at h ~ 6e-6) of both terms.
  double eps = 1e-6;
  // An entry passes when |analytic - numeric| <= atol + rtol * |numeric|. With the error above
  // ~1e-10, atol = 1e-7 and rtol = 1e-6 leave three orders of magnitude of headroom for outputs of
  // magnitude up to ~100 while still catching any real bug: a wrong backward is off by O(|grad|),
  // not by 1e-7.
  double atol = 1e-7;
  double rtol = 1e-6;
  // Projection mode: number of random (u, v) pairs and the seed they are drawn from.
  int projections = 6;
  std::uint64_t seed = 0x5eed;
  // Names used in messages: the op, and each input (empty or missing: the tensor's own name, else
  // "input k").
  std::string op = "f";
  std::vector<std::string> input_names;
};

// The first entry (full mode) or projection (projection mode) that failed.
struct GradcheckFailure {
  std::size_t input_index = 0;
  std::string input_name;
  std::vector<std::int64_t> element;         // multi-index into the input
  std::vector<std::int64_t> output_element;  // full mode: multi-index into the output; projection: empty
  double numeric = 0;   // full: d out[i] / d x[j]; projection: d (v . out) / d x[j] at the localized j
  double analytic = 0;
  std::string message;  // names op, input, element, numeric and analytic value
};

struct GradcheckResult {
  std::string op;
  std::string shapes;   // "a=float64[2, 3] b=float64[3]" (every input, checked or not)
  GradcheckMode mode = GradcheckMode::Full;
  double max_abs_error = 0;   // max |analytic - numeric| over everything compared
  double max_rel_error = 0;   // max |a - n| / max(|a|, |n|, tiny)
  std::int64_t compared = 0;  // Jacobian entries (full) or projections x inputs (projection) compared
  bool passed = true;
  std::optional<GradcheckFailure> first_failure;
  // The first failure's message, or a message when f itself misbehaves (not deterministic, output
  // not floating); empty when passed.
  std::string message;
};

// Checks f at `inputs`. Throws InvalidArgument (naming the op and input) when an input that
// requires grad is not float64 or when no input requires grad; exceptions thrown by f propagate.
GradcheckResult gradcheck(const GradcheckFn& f, const TensorList& inputs, GradcheckMode mode,
                          const GradcheckOptions& options = {});

// "float64[2, 3]" for each input, prefixed by its name: "a=float64[2, 3] idx=int64[4]".
std::string describe_inputs(const TensorList& inputs, const std::vector<std::string>& names);

// ---- the suite: one or more cases per op of ops.hpp ------------------------------------------------

struct GradcheckCase {
  std::string name;   // unique: "matmul.batched"
  std::string op;     // the ops.hpp function it exercises: "matmul"
  TensorList inputs;  // float64 with requires_grad, or int64 / non-grad pass-through inputs
  std::vector<std::string> input_names;
  GradcheckFn fn;
};

// Names of every case, in table order (no tensors are built).
std::vector<std::string> gradcheck_case_names();
// The op name of every case, deduplicated, in table order.
std::vector<std::string> gradcheck_op_names();
// One case with shapes and values drawn from (seed, case name): the same case is built whatever
// else is selected. Throws InvalidArgument naming an unknown case.
GradcheckCase make_gradcheck_case(const std::string& name, std::uint64_t seed);
// Every case of the table.
std::vector<GradcheckCase> gradcheck_cases(std::uint64_t seed);
// The cases whose op or name is in `selection` (empty: all). Throws InvalidArgument naming the
// first entry that is neither a known op nor a known case name.
std::vector<GradcheckCase> select_gradcheck_cases(std::uint64_t seed, const std::vector<std::string>& selection);
// Runs gradcheck on the case with default options (op name = case name).
GradcheckResult run_case(const GradcheckCase& c, GradcheckMode mode);
GradcheckResult run_case(const GradcheckCase& c, GradcheckMode mode, GradcheckOptions options);

}  // namespace meshgrad
