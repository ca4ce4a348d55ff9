// Non-differentiable compute kernels on Tensors (CPU). Results are new contiguous tensors unless the
// name ends in '_' (in place; these and matmul_into bump the written tensor's version, see
// Tensor::version). The differentiable ops in ops/ call these in forward and backward.
// Floating kernels take float32 or float64 (operands of one op share a dtype) and throw
// InvalidArgument naming the op, dtypes and shapes otherwise.
#pragma once

#include <cstdint>
#include <vector>

#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::kernels {

enum class Binary { Add, Sub, Mul, Div };
// out = a (op) b with NumPy broadcasting.
Tensor binary(Binary op, const Tensor& a, const Tensor& b);
// a (op)= b in place; b broadcasts to a's shape.
void binary_(Binary op, Tensor& a, const Tensor& b);
// a += alpha * b in place (b broadcast to a).
void axpy_(Tensor& a, double alpha, const Tensor& b);
// a * s
Tensor scale(const Tensor& a, double s);

enum class Unary { Neg, Exp, Log, Tanh, Sqrt, Relu, Gelu };
Tensor unary(Unary op, const Tensor& a);
// Gradients of pointwise nonlinearities: grad * f'(x).
Tensor relu_backward(const Tensor& grad, const Tensor& x);
Tensor gelu_backward(const Tensor& grad, const Tensor& x);   // tanh approximation (GPT-2)
Tensor tanh_backward(const Tensor& grad, const Tensor& y);   // y = tanh(x)

// Sum over dims (empty = all dims). keepdim keeps reduced dims as size 1. Accumulates in the
// tensor's dtype, in row-major order (deterministic).
Tensor sum(const Tensor& a, const std::vector<std::int64_t>& dims, bool keepdim);
// Sums `g` down to `shape` (the reverse of broadcasting `shape` to g's shape).
Tensor sum_to(const Tensor& g, const Shape& shape);
// Max over the last dim, keepdim.
Tensor max_last(const Tensor& a);

// Matrix product with BLAS. a: [..., m, k], b: [..., k, n] -> [..., m, n]; batch dims broadcast;
// a 2-D operand whose layout is a transpose of a contiguous matrix is passed to BLAS with the
// transpose flag, not copied.
Tensor matmul(const Tensor& a, const Tensor& b);
// c (+)= a @ b for 2-D operands: accumulate=true adds into c (beta = 1).
void matmul_into(Tensor& c, const Tensor& a, const Tensor& b, bool accumulate);

// Concatenation along dim; every other dim must match.
Tensor cat(const std::vector<Tensor>& parts, std::int64_t dim);

// Rows of `weight` ([V, C]) picked by int64 `indices` (any shape) -> [..., C]. Out-of-range index
// throws naming it.
Tensor embedding(const Tensor& weight, const Tensor& indices);
// grad_weight[indices[i]] += grad[i] (rows), in index order (deterministic).
void embedding_backward_(Tensor& grad_weight, const Tensor& grad, const Tensor& indices);

// Softmax / log-softmax over the last dim (max-subtracted).
Tensor softmax_last(const Tensor& x);
Tensor log_softmax_last(const Tensor& x);
// Given y = softmax(x) and dy: dx = y * (dy - sum(dy * y)).
Tensor softmax_backward_last(const Tensor& grad, const Tensor& y);
// Given y = log_softmax(x) and dy: dx = dy - exp(y) * sum(dy).
Tensor log_softmax_backward_last(const Tensor& grad, const Tensor& y);

}  // namespace meshgrad::kernels
