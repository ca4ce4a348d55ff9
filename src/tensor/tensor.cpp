#include "meshgrad/tensor/tensor.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <numeric>
#include <optional>

#include "meshgrad/tensor/allocator.hpp"
#include "meshgrad/tensor/shard.hpp"

#include "meshgrad/tensor/iter.hpp"

namespace meshgrad {

// ---- storage --------------------------------------------------------------------------------------

// Blocks come from the caching allocator (allocator.hpp): 64-byte aligned (whole cache lines
// and full AVX-512 vectors for every tensor start), reused across training steps.
Storage::Storage(std::size_t nbytes)
    : data_(static_cast<std::byte*>(memory::allocate(nbytes))), nbytes_(nbytes),
      memory_domain_(memory::current_domain()) {}

Storage::Storage(std::byte* external, std::size_t nbytes, std::function<void()> release)
    : data_(external), nbytes_(nbytes), release_(std::move(release)), memory_domain_(-1) {}

Storage::~Storage() {
  if (release_) {
    release_();
  } else if (!released_) {
    memory::deallocate(data_, nbytes_, memory_domain_);
  }
}

void Storage::release_memory() {
  MG_CHECK(!release_, "Storage::release_memory: the memory is not the storage's own (an external buffer)");
  if (released_) return;
  memory::deallocate(data_, nbytes_, memory_domain_);
  data_ = nullptr;
  released_ = true;
}

void Storage::restore_memory() {
  if (!released_) return;
  data_ = static_cast<std::byte*>(memory::allocate(nbytes_));
  memory_domain_ = memory::current_domain();
  released_ = false;
}

Tensor Tensor::from_external(void* data, std::size_t nbytes, DType dtype, Shape shape, Strides strides,
                             std::function<void()> release) {
  MG_CHECK(shape.size() == strides.size(), "from_external: {} sizes and {} strides", shape.size(), strides.size());
  std::int64_t last = 0;
  bool empty = false;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    MG_CHECK(shape[d] >= 0 && strides[d] >= 0, "from_external: negative size or stride in dim {}", d);
    if (shape[d] == 0) empty = true;
    else last += (shape[d] - 1) * strides[d];
  }
  MG_CHECK(empty || static_cast<std::size_t>(last + 1) * dtype_size(dtype) <= nbytes,
           "from_external: shape {} with strides reaches past the {} bytes given", shape_str(shape), nbytes);
  auto storage = std::make_shared<Storage>(static_cast<std::byte*>(data), nbytes, std::move(release));
  return make_tensor(std::move(storage), dtype, std::move(shape), std::move(strides), 0);
}

Tensor make_tensor(std::shared_ptr<Storage> storage, DType dtype, Shape shape, Strides strides, std::int64_t offset) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::move(storage);
  impl->dtype = dtype;
  impl->shape = std::move(shape);
  impl->strides = std::move(strides);
  impl->offset = offset;
  return Tensor(std::move(impl));
}

namespace {

template <class F>
decltype(auto) dispatch_all(DType t, F&& f) {
  switch (t) {
    case DType::Float32: return f.template operator()<float>();
    case DType::Float64: return f.template operator()<double>();
    case DType::Int64: return f.template operator()<std::int64_t>();
    case DType::BFloat16: return f.template operator()<bfloat16>();
  }
  throw InvalidArgument("unknown dtype");
}

// Byte offset of a multi-index; throws naming the op when out of range.
std::int64_t element_offset(const TensorImpl& t, std::initializer_list<std::int64_t> index, const char* op) {
  MG_CHECK(index.size() == t.shape.size(), "{}: index has {} dims, tensor has shape {}", op, index.size(),
           shape_str(t.shape));
  std::int64_t off = t.offset;
  std::size_t d = 0;
  for (std::int64_t i : index) {
    MG_CHECK(i >= 0 && i < t.shape[d], "{}: index {} out of range for dim {} of shape {}", op, i, d,
             shape_str(t.shape));
    off += i * t.strides[d];
    ++d;
  }
  return off;
}

// Copies src into dst elementwise (dst shape; src broadcast to it), converting types.
template <class D, class S>
void copy_convert(const Tensor& dst, const Tensor& src) {
  const Strides src_strides = broadcast_strides(src.shape(), src.strides(), dst.shape());
  D* d = reinterpret_cast<D*>(dst.storage()->data()) + dst.offset();
  const S* s = reinterpret_cast<const S*>(src.storage()->data()) + src.offset();
  for_each_row<2>(dst.shape(), {&dst.strides(), &src_strides},
                  [&](const std::array<std::int64_t, 2>& off, std::int64_t n, const std::array<std::int64_t, 2>& st) {
                    D* dp = d + off[0];
                    const S* sp = s + off[1];
                    if (st[0] == 1 && st[1] == 1) {
                      if constexpr (std::is_same_v<D, S>) {
                        std::memcpy(dp, sp, static_cast<std::size_t>(n) * sizeof(D));
                      } else {
                        for (std::int64_t i = 0; i < n; ++i) dp[i] = static_cast<D>(sp[i]);
                      }
                    } else {
                      for (std::int64_t i = 0; i < n; ++i) dp[i * st[0]] = static_cast<D>(sp[i * st[1]]);
                    }
                  });
}

void copy_any(const Tensor& dst, const Tensor& src) {
  dispatch_all(dst.dtype(), [&]<class D>() {
    dispatch_all(src.dtype(), [&]<class S>() { copy_convert<D, S>(dst, src); });
  });
}

}  // namespace

// ---- factories ------------------------------------------------------------------------------------

Tensor Tensor::empty(const Shape& shape, DType dtype) {
  for (std::int64_t d : shape) MG_CHECK(d >= 0, "Tensor::empty: negative dim in shape {}", shape_str(shape));
  const auto bytes = static_cast<std::size_t>(shape_numel(shape)) * dtype_size(dtype);
  return make_tensor(std::make_shared<Storage>(bytes), dtype, shape, contiguous_strides(shape), 0);
}

Tensor Tensor::zeros(const Shape& shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  std::memset(t.raw_data(), 0, static_cast<std::size_t>(t.numel()) * dtype_size(dtype));
  return t;
}

Tensor Tensor::ones(const Shape& shape, DType dtype) { return full(shape, 1.0, dtype); }

Tensor Tensor::full(const Shape& shape, double value, DType dtype) {
  Tensor t = empty(shape, dtype);
  t.fill_(value);
  return t;
}

Tensor Tensor::scalar(double value, DType dtype) { return full({}, value, dtype); }

Tensor Tensor::from_values(std::span<const double> values, const Shape& shape, DType dtype) {
  MG_CHECK(static_cast<std::int64_t>(values.size()) == shape_numel(shape),
           "Tensor::from_values: {} values for shape {} ({} elements)", values.size(), shape_str(shape),
           shape_numel(shape));
  Tensor t = empty(shape, dtype);
  dispatch_all(dtype, [&]<class T>() {
    T* p = t.data<T>();
    for (std::size_t i = 0; i < values.size(); ++i) p[i] = static_cast<T>(values[i]);
  });
  return t;
}

Tensor Tensor::from_values(std::initializer_list<double> values, const Shape& shape, DType dtype) {
  return from_values(std::span<const double>(values.begin(), values.size()), shape, dtype);
}

Tensor Tensor::from_int64(std::span<const std::int64_t> values, const Shape& shape) {
  MG_CHECK(static_cast<std::int64_t>(values.size()) == shape_numel(shape),
           "Tensor::from_int64: {} values for shape {}", values.size(), shape_str(shape));
  Tensor t = empty(shape, DType::Int64);
  std::copy(values.begin(), values.end(), t.data<std::int64_t>());
  return t;
}

Tensor Tensor::arange(std::int64_t n, DType dtype) {
  Tensor t = empty({n}, dtype);
  dispatch_all(dtype, [&]<class T>() {
    T* p = t.data<T>();
    for (std::int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(i);
  });
  return t;
}

// ---- metadata -------------------------------------------------------------------------------------

TensorImpl& Tensor::impl() const {
  if (!impl_) throw InvalidArgument("use of an undefined Tensor");
  return *impl_;
}

std::int64_t Tensor::size(std::int64_t d) const { return shape()[normalize_dim(d, shape(), "Tensor::size")]; }

bool Tensor::is_contiguous() const {
  const auto& t = impl();
  std::int64_t expected = 1;
  for (std::size_t i = t.shape.size(); i-- > 0;) {
    if (t.shape[i] != 1 && t.strides[i] != expected) return false;
    expected *= t.shape[i];
  }
  return true;
}

std::string Tensor::str() const {
  if (!defined()) return "undefined";
  return fmt::format("{}{}", dtype_name(dtype()), shape_str(shape()));
}

void* Tensor::raw_data() const {
  return impl().storage->data() + impl().offset * static_cast<std::int64_t>(dtype_size(impl().dtype));
}

double Tensor::at(std::initializer_list<std::int64_t> index) const {
  const std::int64_t off = element_offset(impl(), index, "Tensor::at");
  return dispatch_all(dtype(), [&]<class T>() {
    return static_cast<double>(reinterpret_cast<const T*>(storage()->data())[off]);
  });
}

double Tensor::at_flat(std::int64_t logical_index) const {
  MG_CHECK(logical_index >= 0 && logical_index < numel(), "Tensor::at_flat: index {} out of range for shape {}",
           logical_index, shape_str(shape()));
  std::int64_t off = offset();
  std::int64_t rest = logical_index;
  for (std::size_t d = shape().size(); d-- > 0;) {
    off += (rest % shape()[d]) * strides()[d];
    rest /= shape()[d];
  }
  return dispatch_all(dtype(), [&]<class T>() {
    return static_cast<double>(reinterpret_cast<const T*>(storage()->data())[off]);
  });
}

void Tensor::set(std::initializer_list<std::int64_t> index, double value) {
  const std::int64_t off = element_offset(impl(), index, "Tensor::set");
  bump_version();
  dispatch_all(dtype(), [&]<class T>() { reinterpret_cast<T*>(storage()->data())[off] = static_cast<T>(value); });
}

double Tensor::item() const {
  MG_CHECK(numel() == 1, "Tensor::item: tensor {} has {} elements, expected 1", str(), numel());
  return at_flat(0);
}

std::vector<double> Tensor::to_vector() const {
  Tensor packed = to(DType::Float64).contiguous();
  const double* p = packed.data<double>();
  return std::vector<double>(p, p + numel());
}

std::vector<std::int64_t> Tensor::to_int64_vector() const {
  Tensor packed = to(DType::Int64).contiguous();
  const std::int64_t* p = packed.data<std::int64_t>();
  return std::vector<std::int64_t>(p, p + numel());
}

// ---- views ----------------------------------------------------------------------------------------

namespace {

Shape infer_shape(const Shape& requested, std::int64_t numel, const char* op, const Shape& from) {
  Shape shape = requested;
  int infer = -1;
  std::int64_t known = 1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      MG_CHECK(infer < 0, "{}: more than one -1 in shape {}", op, shape_str(requested));
      infer = static_cast<int>(i);
    } else {
      MG_CHECK(shape[i] >= 0, "{}: invalid dim {} in shape {}", op, shape[i], shape_str(requested));
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    MG_CHECK(known != 0 && numel % known == 0, "{}: cannot view shape {} as {}", op, shape_str(from),
             shape_str(requested));
    shape[static_cast<std::size_t>(infer)] = numel / known;
  }
  MG_CHECK(shape_numel(shape) == numel, "{}: shape {} has {} elements, tensor of shape {} has {}", op,
           shape_str(requested), shape_numel(shape), shape_str(from), numel);
  return shape;
}

// Strides for viewing (shape, strides) as new_shape without copying, or empty when impossible.
// Groups old dims into runs that are contiguous among themselves and maps new dims onto them.
std::optional<Strides> view_strides(const Shape& shape, const Strides& strides, const Shape& new_shape) {
  // Zero or one element (a scalar included): any shape of that size is a view.
  if (shape_numel(shape) <= 1) return contiguous_strides(new_shape);
  Strides out(new_shape.size());
  std::int64_t view_d = static_cast<std::int64_t>(new_shape.size()) - 1;
  std::int64_t chunk_base_stride = strides.empty() ? 1 : strides.back();
  std::int64_t tensor_numel = 1;
  std::int64_t view_numel = 1;
  for (std::int64_t d = static_cast<std::int64_t>(shape.size()) - 1; d >= 0; --d) {
    tensor_numel *= shape[d];
    const bool chunk_ends = d == 0 || (shape[d - 1] != 1 && strides[d - 1] != tensor_numel * chunk_base_stride);
    if (chunk_ends) {
      while (view_d >= 0 && (view_numel < tensor_numel || new_shape[view_d] == 1)) {
        out[view_d] = view_numel * chunk_base_stride;
        view_numel *= new_shape[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (d > 0) {
        chunk_base_stride = strides[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return out;
}

}  // namespace

Tensor Tensor::view(const Shape& requested) const {
  const Shape shape = infer_shape(requested, numel(), "view", this->shape());
  auto st = view_strides(this->shape(), strides(), shape);
  MG_CHECK(st.has_value(), "view: tensor of shape {} and strides {} cannot be viewed as {} without a copy "
           "(use reshape or contiguous)", shape_str(this->shape()), shape_str(strides()), shape_str(shape));
  return make_tensor(storage(), dtype(), shape, *st, offset());
}

Tensor Tensor::reshape(const Shape& requested) const {
  const Shape shape = infer_shape(requested, numel(), "reshape", this->shape());
  if (auto st = view_strides(this->shape(), strides(), shape)) {
    return make_tensor(storage(), dtype(), shape, *st, offset());
  }
  return contiguous().view(shape);
}

Tensor Tensor::transpose(std::int64_t d0, std::int64_t d1) const {
  const int a = normalize_dim(d0, shape(), "transpose");
  const int b = normalize_dim(d1, shape(), "transpose");
  Shape s = shape();
  Strides st = strides();
  std::swap(s[a], s[b]);
  std::swap(st[a], st[b]);
  return make_tensor(storage(), dtype(), s, st, offset());
}

Tensor Tensor::permute(const std::vector<std::int64_t>& dims) const {
  MG_CHECK(dims.size() == shape().size(), "permute: {} dims given for shape {}", dims.size(), shape_str(shape()));
  Shape s(dims.size());
  Strides st(dims.size());
  std::vector<bool> seen(dims.size(), false);
  for (std::size_t i = 0; i < dims.size(); ++i) {
    const int d = normalize_dim(dims[i], shape(), "permute");
    MG_CHECK(!seen[d], "permute: dim {} repeated in {}", d, shape_str(dims));
    seen[d] = true;
    s[i] = shape()[d];
    st[i] = strides()[d];
  }
  return make_tensor(storage(), dtype(), s, st, offset());
}

Tensor Tensor::narrow(std::int64_t dim, std::int64_t start, std::int64_t length) const {
  const int d = normalize_dim(dim, shape(), "narrow");
  MG_CHECK(start >= 0 && length >= 0 && start + length <= shape()[d],
           "narrow: range [{}, {}) out of bounds for dim {} of shape {}", start, start + length, d,
           shape_str(shape()));
  Shape s = shape();
  s[d] = length;
  return make_tensor(storage(), dtype(), s, strides(), offset() + start * strides()[d]);
}

Tensor Tensor::select(std::int64_t dim, std::int64_t index) const {
  const int d = normalize_dim(dim, shape(), "select");
  MG_CHECK(index >= 0 && index < shape()[d], "select: index {} out of range for dim {} of shape {}", index, d,
           shape_str(shape()));
  Shape s = shape();
  Strides st = strides();
  const std::int64_t off = offset() + index * st[d];
  s.erase(s.begin() + d);
  st.erase(st.begin() + d);
  return make_tensor(storage(), dtype(), s, st, off);
}

Tensor Tensor::unsqueeze(std::int64_t dim) const {
  Shape probe = shape();
  probe.push_back(1);  // valid dims for unsqueeze: [-(nd+1), nd]
  const int d = normalize_dim(dim, probe, "unsqueeze");
  Shape s = shape();
  Strides st = strides();
  const std::int64_t stride = d < static_cast<int>(s.size()) ? st[d] * s[d] : 1;
  s.insert(s.begin() + d, 1);
  st.insert(st.begin() + d, stride);
  return make_tensor(storage(), dtype(), s, st, offset());
}

Tensor Tensor::squeeze(std::int64_t dim) const {
  const int d = normalize_dim(dim, shape(), "squeeze");
  MG_CHECK(shape()[d] == 1, "squeeze: dim {} of shape {} is not 1", d, shape_str(shape()));
  Shape s = shape();
  Strides st = strides();
  s.erase(s.begin() + d);
  st.erase(st.begin() + d);
  return make_tensor(storage(), dtype(), s, st, offset());
}

Tensor Tensor::expand(const Shape& target) const {
  MG_CHECK(target.size() >= shape().size(), "expand: cannot expand shape {} to fewer dims {}", shape_str(shape()),
           shape_str(target));
  const std::size_t lead = target.size() - shape().size();
  Shape s = target;
  for (std::size_t i = 0; i < shape().size(); ++i) {
    if (target[lead + i] == -1) s[lead + i] = shape()[i];
    MG_CHECK(shape()[i] == s[lead + i] || shape()[i] == 1, "expand: shape {} cannot be expanded to {}",
             shape_str(shape()), shape_str(target));
  }
  return make_tensor(storage(), dtype(), s, broadcast_strides(shape(), strides(), s), offset());
}

std::vector<Tensor> Tensor::split(std::int64_t dim, const std::vector<std::int64_t>& sizes) const {
  const int d = normalize_dim(dim, shape(), "split");
  std::int64_t total = 0;
  for (std::int64_t s : sizes) {
    MG_CHECK(s >= 0, "split: negative size in {}", shape_str(sizes));
    total += s;
  }
  MG_CHECK(total == shape()[d], "split: sizes {} sum to {}, dim {} of shape {} is {}", shape_str(sizes), total, d,
           shape_str(shape()), shape()[d]);
  std::vector<Tensor> parts;
  std::int64_t start = 0;
  for (std::int64_t s : sizes) {
    parts.push_back(narrow(d, start, s));
    start += s;
  }
  return parts;
}

std::vector<Tensor> Tensor::chunk(std::int64_t dim, int parts) const {
  const int d = normalize_dim(dim, shape(), "chunk");
  return split(d, shard_sizes(shape()[d], parts));
}

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  return clone();
}

Tensor Tensor::clone() const {
  Tensor out = empty(shape(), dtype());
  copy_any(out, *this);
  return out;
}

Tensor Tensor::to(DType target) const {
  if (target == dtype()) return *this;
  Tensor out = empty(shape(), target);
  copy_any(out, *this);
  return out;
}

Tensor Tensor::detach() const { return make_tensor(storage(), dtype(), shape(), strides(), offset()); }

void Tensor::copy_from(const Tensor& src) {
  check_same_dtype(*this, src, "copy_from");
  MG_CHECK(broadcast_shapes(src.shape(), shape(), "copy_from") == shape(),
           "copy_from: source shape {} does not broadcast to destination shape {}", shape_str(src.shape()),
           shape_str(shape()));
  bump_version();
  copy_any(*this, src);
}

void Tensor::fill_(double value) {
  bump_version();
  dispatch_all(dtype(), [&]<class T>() {
    T* base = reinterpret_cast<T*>(storage()->data()) + offset();
    const T v = static_cast<T>(value);
    for_each_row<1>(shape(), {&strides()},
                    [&](const std::array<std::int64_t, 1>& off, std::int64_t n, const std::array<std::int64_t, 1>& st) {
                      T* p = base + off[0];
                      for (std::int64_t i = 0; i < n; ++i) p[i * st[0]] = v;
                    });
  });
}

// ---- autograd state -------------------------------------------------------------------------------

AutogradMeta& Tensor::autograd_meta() const {
  auto& t = impl();
  if (!t.autograd) t.autograd = std::make_unique<AutogradMeta>();
  return *t.autograd;
}

bool Tensor::requires_grad() const {
  const AutogradMeta* m = autograd_meta_if_any();
  return m != nullptr && (m->requires_grad || m->grad_fn != nullptr);
}

Tensor& Tensor::set_requires_grad(bool value) {
  MG_CHECK(is_leaf(), "set_requires_grad: tensor {} is the output of an op (only leaves can be marked; "
           "use detach() first)", str());
  MG_CHECK(!value || is_floating(), "set_requires_grad: tensor {} is not floating point", str());
  autograd_meta().requires_grad = value;
  return *this;
}

bool Tensor::is_leaf() const {
  const AutogradMeta* m = autograd_meta_if_any();
  return m == nullptr || m->grad_fn == nullptr;
}

Tensor Tensor::grad() const {
  const AutogradMeta* m = autograd_meta_if_any();
  return m != nullptr && m->grad ? Tensor(m->grad) : Tensor();
}

void Tensor::set_grad(const Tensor& grad) {
  if (grad.defined()) {
    MG_CHECK(grad.shape() == shape() && grad.dtype() == dtype(), "set_grad: gradient {} does not match tensor {}",
             grad.str(), str());
  }
  autograd_meta().grad = grad.impl_ptr();
}

const std::shared_ptr<autograd::Node>& Tensor::grad_fn() const {
  static const std::shared_ptr<autograd::Node> none;
  const AutogradMeta* m = autograd_meta_if_any();
  return m != nullptr ? m->grad_fn : none;
}

std::uint32_t Tensor::output_nr() const {
  const AutogradMeta* m = autograd_meta_if_any();
  return m != nullptr ? m->output_nr : 0;
}

const std::string& Tensor::name() const {
  static const std::string none;
  const AutogradMeta* m = autograd_meta_if_any();
  return m != nullptr ? m->name : none;
}

Tensor& Tensor::set_name(std::string name) {
  autograd_meta().name = std::move(name);
  return *this;
}

void Tensor::register_post_accumulate_hook(PostAccumulateHook hook) {
  MG_CHECK(is_leaf() && requires_grad(), "register_post_accumulate_hook: tensor {} is not a leaf that requires grad",
           str());
  autograd_meta().post_accumulate_hooks.push_back(std::move(hook));
}


// ---- checks ---------------------------------------------------------------------------------------

void check_dtype(const Tensor& t, DType dtype, const char* op, const char* what) {
  MG_CHECK(t.defined(), "{}: {} is undefined", op, what);
  MG_CHECK(t.dtype() == dtype, "{}: {} has dtype {}, expected {} (shape {})", op, what, t.dtype(), dtype,
           shape_str(t.shape()));
}

void check_same_dtype(const Tensor& a, const Tensor& b, const char* op) {
  MG_CHECK(a.defined() && b.defined(), "{}: undefined operand", op);
  MG_CHECK(a.dtype() == b.dtype(), "{}: dtypes differ: {} vs {}", op, a.str(), b.str());
}

void check_floating(const Tensor& t, const char* op) {
  MG_CHECK(t.defined(), "{}: undefined operand", op);
  MG_CHECK(t.is_floating(), "{}: expected a float32 or float64 tensor, got {}", op, t.str());
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  const Tensor pa = a.contiguous();
  const Tensor pb = b.contiguous();
  return std::memcmp(pa.raw_data(), pb.raw_data(), static_cast<std::size_t>(a.numel()) * dtype_size(a.dtype())) == 0;
}

}  // namespace meshgrad
