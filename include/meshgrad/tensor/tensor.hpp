// Tensor: a typed, strided view of shared CPU storage, plus the autograd metadata the engine in
// autograd/ reads and writes (requires_grad, grad, the node that made it, hooks).
//
// A Tensor is a cheap handle (shared_ptr to TensorImpl). Copying a Tensor aliases; views (reshape,
// transpose, narrow, expand, ...) share storage without copying. An undefined Tensor (default
// constructed) stands for "no tensor / no gradient".
//
// The methods here are not differentiable; differentiable versions of every op are in ops/ops.hpp.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "meshgrad/tensor/annotation.hpp"
#include "meshgrad/tensor/dtype.hpp"
#include "meshgrad/tensor/shape.hpp"

namespace meshgrad {

namespace autograd {
class Node;
}

class Tensor;
using TensorList = std::vector<Tensor>;

// Raw storage: 64-byte aligned bytes, plus the version counter of the data (Tensor::version).
class Storage {
 public:
  explicit Storage(std::size_t nbytes);
  // Memory the storage does not own (a numpy array's, say): release() is called instead of freeing
  // it when the storage dies. The memory must stay valid until then.
  Storage(std::byte* external, std::size_t nbytes, std::function<void()> release);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  std::byte* data() const { return data_; }
  std::size_t nbytes() const { return nbytes_; }

  // FSDP's reshard (nn/fsdp.hpp): release_memory() gives the bytes back while every handle on the
  // storage stays valid (a graph that saved a gathered parameter keeps its handle); restore_memory()
  // takes fresh bytes of the same size, whose contents are undefined until written (the gather that
  // refills them). In between data() is nullptr, so the owner must restore before anyone reads.
  // Owned memory only; each call is a no-op when the storage already is in that state.
  void release_memory();
  void restore_memory();
  bool resident() const { return !released_; }

  // How many in-place writes these bytes have seen. Atomic (relaxed): rank threads of the threads
  // backend may hold handles to one storage, and a counter must never tear or lose a bump even
  // where the data writes themselves are ordered by the caller. Relaxed is enough: the counter
  // orders nothing, it only has to differ after a write.
  std::uint64_t version() const { return version_.load(std::memory_order_relaxed); }
  void bump_version() { version_.fetch_add(1, std::memory_order_relaxed); }

 private:
  std::byte* data_;
  std::size_t nbytes_;
  std::function<void()> release_;   // set for external memory
  bool released_ = false;           // release_memory() gave the bytes back
  int memory_domain_;   // the allocator's accounting domain it was counted in (allocator.hpp)
  std::atomic<std::uint64_t> version_{0};
};

// A gradient hook: sees the gradient flowing into a tensor; may return a replacement (or an
// undefined Tensor to keep it as it is).
using GradHook = std::function<Tensor(const Tensor& grad)>;
// Called after a leaf's .grad was accumulated for this backward pass (data-parallel all-reduces
// start from here as gradients become ready).
using PostAccumulateHook = std::function<void(Tensor& leaf)>;

// Autograd state of a tensor. Created on first use: most tensors never need it.
struct AutogradMeta {
  bool requires_grad = false;
  std::shared_ptr<autograd::Node> grad_fn;       // set on outputs of recorded ops (non-leaves)
  std::uint32_t output_nr = 0;                   // which output of grad_fn this tensor is
  std::weak_ptr<autograd::Node> grad_accumulator;  // leaves: the node accumulating into grad
  std::shared_ptr<struct TensorImpl> grad;       // leaves: accumulated gradient
  std::vector<GradHook> hooks;                   // leaves: run before accumulation
  std::vector<PostAccumulateHook> post_accumulate_hooks;
  std::string name;                              // optional, used in error messages and reports
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  DType dtype = DType::Float32;
  Shape shape;
  Strides strides;
  std::int64_t offset = 0;
  std::unique_ptr<AutogradMeta> autograd;
  AnnotationPtr annotation;   // see annotation.hpp; not copied by views or detach()
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // ---- factories ----------------------------------------------------------------------------------
  static Tensor empty(const Shape& shape, DType dtype = DType::Float32);
  static Tensor zeros(const Shape& shape, DType dtype = DType::Float32);
  static Tensor ones(const Shape& shape, DType dtype = DType::Float32);
  static Tensor full(const Shape& shape, double value, DType dtype = DType::Float32);
  static Tensor scalar(double value, DType dtype = DType::Float32);
  // Copies values (converted to dtype) into a new contiguous tensor; values.size() must equal
  // the shape's element count.
  static Tensor from_values(std::span<const double> values, const Shape& shape, DType dtype = DType::Float32);
  static Tensor from_values(std::initializer_list<double> values, const Shape& shape,
                            DType dtype = DType::Float32);
  static Tensor from_int64(std::span<const std::int64_t> values, const Shape& shape);
  // 0, 1, ..., n-1
  static Tensor arange(std::int64_t n, DType dtype = DType::Float32);
  // A tensor over memory it does not own (no copy): `nbytes` from `data` hold elements of `dtype`
  // laid out by `strides` (in elements, non-negative); release() runs when the last tensor or view
  // over it dies. Throws InvalidArgument when the layout reaches past nbytes.
  static Tensor from_external(void* data, std::size_t nbytes, DType dtype, Shape shape, Strides strides,
                              std::function<void()> release);

  // ---- metadata -------------------------------------------------------------------------------
  bool defined() const { return impl_ != nullptr; }
  DType dtype() const { return impl().dtype; }
  const Shape& shape() const { return impl().shape; }
  const Strides& strides() const { return impl().strides; }
  std::int64_t offset() const { return impl().offset; }
  int dim() const { return static_cast<int>(impl().shape.size()); }
  std::int64_t size(std::int64_t d) const;  // d may be negative
  std::int64_t numel() const { return shape_numel(impl().shape); }
  // The bytes of its elements (numel x the dtype's size), what a collective of it moves.
  std::int64_t nbytes() const { return numel() * static_cast<std::int64_t>(dtype_size(dtype())); }
  bool is_contiguous() const;
  // float32 or float64: the dtypes arithmetic and autograd take (bfloat16 is storage and products only)
  bool is_floating() const { return dtype() == DType::Float32 || dtype() == DType::Float64; }
  const std::shared_ptr<Storage>& storage() const { return impl().storage; }
  // "float32[2, 3]"
  std::string str() const;

  // ---- data -----------------------------------------------------------------------------------
  // Pointer to element 0 (storage + offset). Throws if T does not match the dtype.
  template <class T>
  T* data() const;
  void* raw_data() const;
  // Element access for tests and small tools (slow: computes the strided address).
  double at(std::initializer_list<std::int64_t> index) const;
  double at_flat(std::int64_t logical_index) const;   // index in row-major logical order
  void set(std::initializer_list<std::int64_t> index, double value);
  double item() const;   // the single element of a one-element tensor
  std::vector<double> to_vector() const;            // row-major logical order, any dtype
  std::vector<std::int64_t> to_int64_vector() const;

  // ---- views and copies (not recorded by autograd) --------------------------------------------
  // A view with the given shape; -1 infers one dim. Requires a layout where the view exists
  // without copying (throws otherwise: use contiguous() first).
  Tensor view(const Shape& shape) const;
  // view() when possible, else a contiguous copy reshaped.
  Tensor reshape(const Shape& shape) const;
  Tensor transpose(std::int64_t d0, std::int64_t d1) const;
  Tensor permute(const std::vector<std::int64_t>& dims) const;
  Tensor narrow(std::int64_t dim, std::int64_t start, std::int64_t length) const;
  Tensor select(std::int64_t dim, std::int64_t index) const;   // drops dim
  Tensor unsqueeze(std::int64_t dim) const;
  Tensor squeeze(std::int64_t dim) const;
  // Broadcast to shape with stride 0 on expanded dims (NumPy rules).
  Tensor expand(const Shape& shape) const;
  std::vector<Tensor> split(std::int64_t dim, const std::vector<std::int64_t>& sizes) const;
  std::vector<Tensor> chunk(std::int64_t dim, int parts) const;   // uneven by the shard rule
  Tensor contiguous() const;   // this if already contiguous, else a packed copy
  Tensor clone() const;        // always a packed copy, no autograd history
  Tensor to(DType dtype) const;   // converted copy (this when dtype matches)
  // A new handle to the same data without autograd history (shares storage).
  Tensor detach() const;
  // Copies src (broadcast to this shape, same dtype) into this tensor's elements.
  void copy_from(const Tensor& src);
  void fill_(double value);
  void zero_() { fill_(0.0); }

  // ---- version counter (what autograd checks saved tensors against) ----------------------------
  // The number of in-place writes to this tensor's storage. Shared by every handle on the same
  // storage (views, detach()), like PyTorch's version counter: a write through any view changes
  // the version all of them see. copy_from, fill_, zero_, set and the in-place kernels (names
  // ending in '_', matmul_into) bump it; a fresh tensor starts at 0; reading never bumps.
  std::uint64_t version() const { return impl().storage->version(); }
  // For code that writes through data<T>() / raw_data() into a tensor it did not just create
  // (optimizer steps, loaders, in-place collectives): call once per write, so that a backward
  // that saved this tensor refuses to use the changed values. const like data(): the handle is
  // not changed, the data is.
  void bump_version() const { impl().storage->bump_version(); }

  // ---- autograd state (the engine is in autograd/; ops in ops/) --------------------------------
  bool requires_grad() const;
  // Marks a leaf as a parameter / input that gets a .grad. Throws on a non-leaf or int64 tensor.
  Tensor& set_requires_grad(bool value = true);
  bool is_leaf() const;
  Tensor grad() const;
  void set_grad(const Tensor& grad);
  void zero_grad() { set_grad(Tensor()); }
  const std::shared_ptr<autograd::Node>& grad_fn() const;
  std::uint32_t output_nr() const;
  // (A hook on the gradient of any tensor is autograd::register_hook: it needs the graph node.)
  // Leaves only: runs hook after this leaf's .grad was accumulated.
  void register_post_accumulate_hook(PostAccumulateHook hook);
  const std::string& name() const;
  Tensor& set_name(std::string name);
  // Upper-layer metadata (see annotation.hpp), e.g. the placement of a gradient.
  const AnnotationPtr& annotation() const { return impl().annotation; }
  void set_annotation(AnnotationPtr a) const { impl().annotation = std::move(a); }

  TensorImpl& impl() const;
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  AutogradMeta& autograd_meta() const;          // creates it on first use
  AutogradMeta* autograd_meta_if_any() const { return impl_ ? impl_->autograd.get() : nullptr; }
  bool same_as(const Tensor& other) const { return impl_ == other.impl_; }

 private:
  std::shared_ptr<TensorImpl> impl_;
};

// Makes a tensor from parts (used by views and kernels).
Tensor make_tensor(std::shared_ptr<Storage> storage, DType dtype, Shape shape, Strides strides, std::int64_t offset);

// Checks that every tensor is defined and has the given dtype; the message names op and the tensor.
void check_dtype(const Tensor& t, DType dtype, const char* op, const char* what);
void check_same_dtype(const Tensor& a, const Tensor& b, const char* op);
void check_floating(const Tensor& t, const char* op);

// True when shapes, dtypes and every element are equal (bitwise for floats, NaN == NaN).
bool bitwise_equal(const Tensor& a, const Tensor& b);

template <class T>
T* Tensor::data() const {
  check_dtype(*this, dtype_of<T>(), "Tensor::data", "tensor");
  return reinterpret_cast<T*>(impl().storage->data()) + impl().offset;
}

}  // namespace meshgrad
