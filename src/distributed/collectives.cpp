#include "meshgrad/distributed/collectives.hpp"

#include <chrono>
#include <numeric>

#include "meshgrad/distributed/comm_counter.hpp"

namespace meshgrad::dist {

namespace {

comm::MutableBuffer buffer_of(const Tensor& t) {
  return {t.raw_data(), static_cast<std::size_t>(t.numel()), t.dtype()};
}

// Permutation moving dim d to the front, and its inverse.
std::vector<std::int64_t> front_perm(int nd, int d) {
  std::vector<std::int64_t> p{d};
  for (int i = 0; i < nd; ++i) {
    if (i != d) p.push_back(i);
  }
  return p;
}
std::vector<std::int64_t> inverse_perm(const std::vector<std::int64_t>& p) {
  std::vector<std::int64_t> inv(p.size());
  for (std::size_t i = 0; i < p.size(); ++i) inv[static_cast<std::size_t>(p[i])] = static_cast<std::int64_t>(i);
  return inv;
}

// Elements per unit of extent along dim (product of the other dims).
std::int64_t inner_elements(const Shape& shape, int d) {
  std::int64_t n = 1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (static_cast<int>(i) != d) n *= shape[i];
  }
  return n;
}

void check_sizes(const std::vector<std::int64_t>& sizes, const ProcessGroup& group, const char* op) {
  MG_CHECK(static_cast<int>(sizes.size()) == group.size(), "{} over {}: {} shard sizes given for {} ranks", op,
           group.axis, sizes.size(), group.size());
}

std::vector<std::size_t> element_counts(const std::vector<std::int64_t>& sizes, std::int64_t inner) {
  std::vector<std::size_t> counts;
  for (std::int64_t s : sizes) counts.push_back(static_cast<std::size_t>(s * inner));
  return counts;
}

}  // namespace

PendingTensor::PendingTensor(comm::WorkPtr work, std::function<Tensor()> finish)
    : finish_(std::move(finish)), work_(std::move(work)) {}

// The executor may hold its own reference to the Work, so dropping ours does not wait: an
// operation still in flight (an error path skipped wait()) is waited for here, before finish_
// frees the buffers it writes. Its error was or will be reported by the path that abandoned it.
void PendingTensor::settle() noexcept {
  if (work_ && !work_->is_completed()) {
    try {
      work_->wait();
    } catch (...) {
    }
  }
  work_.reset();
}

PendingTensor::~PendingTensor() { settle(); }

PendingTensor& PendingTensor::operator=(PendingTensor&& other) {
  if (this != &other) {
    settle();
    finish_ = std::move(other.finish_);
    work_ = std::move(other.work_);
  }
  return *this;
}

PendingTensor PendingTensor::ready(Tensor t) {
  return PendingTensor(nullptr, [t] { return t; });
}

Tensor PendingTensor::wait() {
  MG_CHECK(valid(), "PendingTensor::wait: no collective in flight");
  if (work_) {
    const auto start = std::chrono::steady_clock::now();
    work_->wait();
    add_comm_blocked_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return finish_();
}

namespace {
// Options for a call: blocking callers let the backend run the operation on the calling thread.
// The layer label (CommLabelScope) goes with the operation into a trace.
comm::CollectiveOptions options_for(bool blocking) {
  comm::CollectiveOptions opt;
  opt.caller_waits = blocking;
  opt.trace_label = current_comm_label();
  return opt;
}

// The element types a reduction takes: float32, float64, and bfloat16 (the --reduce-dtype bf16
// gradients, summed in float32 by the communicator and rounded once).
void check_reducible(const Tensor& x, const char* op) {
  MG_CHECK(x.defined(), "{}: undefined tensor", op);
  MG_CHECK(x.is_floating() || x.dtype() == DType::BFloat16, "{}: expected a float32, float64 or bfloat16 tensor, got {}",
           op, x.str());
}

PendingTensor launch_all_reduce(const Tensor& x, const ProcessGroup& group, comm::ReduceOp op, bool blocking,
                                bool in_place = false) {
  check_reducible(x, "all_reduce");
  if (group.size() == 1) return PendingTensor::ready(x);   // nothing moves: not recorded
  MG_CHECK(!in_place || x.is_contiguous(), "all_reduce in place over {}: tensor {} is not contiguous", group.axis,
           x.str());
  record_collective("all_reduce", group.axis, x.nbytes());
  Tensor in = x.contiguous();
  Tensor out = in_place ? x : Tensor::empty(x.shape(), x.dtype());
  if (in_place) x.bump_version();   // written through raw_data() by the communicator
  auto work = group.comm->all_reduce_async(buffer_of(in), buffer_of(out), op, options_for(blocking));
  // `in` is captured so it outlives the operation.
  return PendingTensor(std::move(work), [in, out] { return out; });
}

PendingTensor launch_all_gather(const Tensor& local, const ProcessGroup& group, std::int64_t dim,
                                const std::vector<std::int64_t>& sizes, const Tensor& reuse, bool blocking) {
  const int d = normalize_dim(dim, local.shape(), "all_gather");
  check_sizes(sizes, group, "all_gather");
  MG_CHECK(local.size(d) == sizes[static_cast<std::size_t>(group.rank())],
           "all_gather over {}: rank {} holds extent {} along dim {} (shape {}) but its shard size is {}", group.axis,
           group.rank(), local.size(d), d, shape_str(local.shape()), sizes[static_cast<std::size_t>(group.rank())]);
  const std::int64_t full = std::accumulate(sizes.begin(), sizes.end(), std::int64_t{0});
  const std::int64_t inner = inner_elements(local.shape(), d);
  if (group.size() == 1) return PendingTensor::ready(local);
  record_collective("all_gather", group.axis, full * inner * static_cast<std::int64_t>(dtype_size(local.dtype())));
  const auto perm = front_perm(local.dim(), d);
  Tensor in = local.permute(perm).contiguous();
  Shape gathered_shape = in.shape();
  gathered_shape[0] = full;
  const bool reusable = d == 0 && reuse.defined() && reuse.shape() == gathered_shape &&
                        reuse.dtype() == local.dtype() && reuse.is_contiguous();
  Tensor out = reusable ? reuse : Tensor::empty(gathered_shape, local.dtype());
  auto counts = std::make_shared<std::vector<std::size_t>>(element_counts(sizes, inner));
  auto work = group.comm->all_gather_async(buffer_of(in), buffer_of(out), *counts, options_for(blocking));
  return PendingTensor(std::move(work), [in, out, counts, d, perm] {
    return d == 0 ? out : out.permute(inverse_perm(perm)).contiguous();
  });
}

PendingTensor launch_reduce_scatter(const Tensor& full, const ProcessGroup& group, std::int64_t dim,
                                    const std::vector<std::int64_t>& sizes, bool blocking) {
  const int d = normalize_dim(dim, full.shape(), "reduce_scatter");
  check_sizes(sizes, group, "reduce_scatter");
  const std::int64_t total = std::accumulate(sizes.begin(), sizes.end(), std::int64_t{0});
  MG_CHECK(full.size(d) == total, "reduce_scatter over {}: extent {} along dim {} (shape {}) but shard sizes sum to {}",
           group.axis, full.size(d), d, shape_str(full.shape()), total);
  check_reducible(full, "reduce_scatter");
  if (group.size() == 1) return PendingTensor::ready(full);
  record_collective("reduce_scatter", group.axis, full.nbytes());
  const auto perm = front_perm(full.dim(), d);
  Tensor in = full.permute(perm).contiguous();
  Shape shard_shape = in.shape();
  shard_shape[0] = sizes[static_cast<std::size_t>(group.rank())];
  Tensor out = Tensor::empty(shard_shape, full.dtype());
  auto counts = std::make_shared<std::vector<std::size_t>>(element_counts(sizes, inner_elements(full.shape(), d)));
  auto work =
      group.comm->reduce_scatter_async(buffer_of(in), buffer_of(out), comm::ReduceOp::Sum, *counts, options_for(blocking));
  return PendingTensor(std::move(work), [in, out, counts, d, perm] {
    return d == 0 ? out : out.permute(inverse_perm(perm)).contiguous();
  });
}

}  // namespace

PendingTensor all_reduce_async(const Tensor& x, const ProcessGroup& group, comm::ReduceOp op) {
  return launch_all_reduce(x, group, op, false);
}
PendingTensor all_reduce_in_place_async(const Tensor& x, const ProcessGroup& group, comm::ReduceOp op) {
  return launch_all_reduce(x, group, op, false, true);
}
// Blocking forms: the backend may run the operation inside the launch call (caller_waits), so the
// launch counts as blocked time too.
template <class Launch>
Tensor run_blocking(Launch&& launch) {
  const auto start = std::chrono::steady_clock::now();
  PendingTensor pending = launch();
  add_comm_blocked_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return pending.wait();
}

Tensor all_reduce(const Tensor& x, const ProcessGroup& group, comm::ReduceOp op) {
  return run_blocking([&] { return launch_all_reduce(x, group, op, true); });
}
PendingTensor all_gather_async(const Tensor& local, const ProcessGroup& group, std::int64_t dim,
                               const std::vector<std::int64_t>& sizes, const Tensor& out) {
  return launch_all_gather(local, group, dim, sizes, out, false);
}
Tensor all_gather(const Tensor& local, const ProcessGroup& group, std::int64_t dim,
                  const std::vector<std::int64_t>& sizes) {
  return run_blocking([&] { return launch_all_gather(local, group, dim, sizes, Tensor(), true); });
}
PendingTensor reduce_scatter_async(const Tensor& full, const ProcessGroup& group, std::int64_t dim,
                                   const std::vector<std::int64_t>& sizes) {
  return launch_reduce_scatter(full, group, dim, sizes, false);
}
Tensor reduce_scatter(const Tensor& full, const ProcessGroup& group, std::int64_t dim,
                      const std::vector<std::int64_t>& sizes) {
  return run_blocking([&] { return launch_reduce_scatter(full, group, dim, sizes, true); });
}

Tensor all_to_all(const Tensor& x, const ProcessGroup& group, std::int64_t split_dim, std::int64_t cat_dim,
                  const std::vector<std::int64_t>& cat_sizes) {
  const int s = normalize_dim(split_dim, x.shape(), "all_to_all");
  const int c = normalize_dim(cat_dim, x.shape(), "all_to_all");
  MG_CHECK(s != c, "all_to_all over {}: split and cat dims are both {}", group.axis, s);
  check_sizes(cat_sizes, group, "all_to_all");
  const int p = group.size();
  const int me = group.rank();
  MG_CHECK(x.size(c) == cat_sizes[static_cast<std::size_t>(me)],
           "all_to_all over {}: rank {} holds extent {} along cat dim {} (shape {}) but its shard size is {}",
           group.axis, me, x.size(c), c, shape_str(x.shape()), cat_sizes[static_cast<std::size_t>(me)]);
  if (p == 1) return x;
  record_collective("all_to_all", group.axis, x.nbytes());
  const auto split_sizes = shard_sizes(x.size(s), p);
  // Send: the piece for rank j is x narrowed to j's shard along split_dim, packed.
  std::vector<Tensor> send_pieces = x.split(s, split_sizes);
  std::vector<std::size_t> send_counts, recv_counts;
  for (auto& piece : send_pieces) {
    piece = piece.contiguous();
    send_counts.push_back(static_cast<std::size_t>(piece.numel()));
  }
  Tensor send = Tensor::empty({x.numel()}, x.dtype());
  {
    std::int64_t off = 0;
    for (const auto& piece : send_pieces) {
      send.narrow(0, off, piece.numel()).copy_from(piece.view({-1}));
      off += piece.numel();
    }
  }
  // Receive: from rank i, my shard along split_dim and i's extent along cat_dim.
  std::vector<Shape> recv_shapes;
  std::int64_t recv_total = 0;
  for (int i = 0; i < p; ++i) {
    Shape sh = x.shape();
    sh[static_cast<std::size_t>(s)] = split_sizes[static_cast<std::size_t>(me)];
    sh[static_cast<std::size_t>(c)] = cat_sizes[static_cast<std::size_t>(i)];
    recv_counts.push_back(static_cast<std::size_t>(shape_numel(sh)));
    recv_total += shape_numel(sh);
    recv_shapes.push_back(sh);
  }
  Tensor recv = Tensor::empty({recv_total}, x.dtype());
  const auto start = std::chrono::steady_clock::now();
  group.comm->all_to_all(buffer_of(send), send_counts, buffer_of(recv), recv_counts, options_for(true));
  add_comm_blocked_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  std::vector<Tensor> parts;
  std::int64_t off = 0;
  for (int i = 0; i < p; ++i) {
    const std::int64_t n = shape_numel(recv_shapes[static_cast<std::size_t>(i)]);
    parts.push_back(recv.narrow(0, off, n).view(recv_shapes[static_cast<std::size_t>(i)]));
    off += n;
  }
  Shape out_shape = x.shape();
  out_shape[static_cast<std::size_t>(s)] = split_sizes[static_cast<std::size_t>(me)];
  out_shape[static_cast<std::size_t>(c)] = std::accumulate(cat_sizes.begin(), cat_sizes.end(), std::int64_t{0});
  Tensor out = Tensor::empty(out_shape, x.dtype());
  off = 0;
  for (const auto& part : parts) {
    out.narrow(c, off, part.size(c)).copy_from(part);
    off += part.size(c);
  }
  return out;
}

Tensor exchange_rows(const Tensor& x, const ProcessGroup& group, const std::vector<std::int64_t>& send_rows,
                       const std::vector<std::int64_t>& recv_rows) {
  const auto p = static_cast<std::size_t>(group.size());
  MG_CHECK(x.dim() >= 1 && send_rows.size() == p && recv_rows.size() == p, "exchange_rows over {}: {} send and {} "
           "receive counts for a group of {} (x {})", group.axis, send_rows.size(), recv_rows.size(), p,
           shape_str(x.shape()));
  const std::int64_t sent = std::accumulate(send_rows.begin(), send_rows.end(), std::int64_t{0});
  const std::int64_t received = std::accumulate(recv_rows.begin(), recv_rows.end(), std::int64_t{0});
  MG_CHECK(sent == x.size(0), "exchange_rows over {}: the send counts add up to {} rows, x has {}", group.axis, sent,
           x.size(0));
  if (p == 1) return x;
  const Tensor send = x.contiguous();
  std::int64_t row_elems = 1;   // elements per row
  for (int d = 1; d < x.dim(); ++d) row_elems *= x.size(d);
  Shape out_shape = x.shape();
  out_shape[0] = received;
  Tensor recv = Tensor::empty(out_shape, x.dtype());
  std::vector<std::size_t> send_counts, recv_counts;
  for (std::size_t r = 0; r < p; ++r) {
    send_counts.push_back(static_cast<std::size_t>(send_rows[r] * row_elems));
    recv_counts.push_back(static_cast<std::size_t>(recv_rows[r] * row_elems));
  }
  record_collective("all_to_all", group.axis, send.nbytes());
  const auto start = std::chrono::steady_clock::now();
  group.comm->all_to_all(buffer_of(send), send_counts, buffer_of(recv), recv_counts, options_for(true));
  add_comm_blocked_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return recv;
}

std::vector<std::int64_t> all_gather_counts(const std::vector<std::int64_t>& local, const ProcessGroup& group) {
  if (group.size() == 1) return local;
  std::vector<std::int64_t> all(local.size() * static_cast<std::size_t>(group.size()));
  record_collective("all_gather(sizes)", group.axis, static_cast<std::int64_t>(all.size() * sizeof(std::int64_t)));
  group.comm->all_gather(comm::ConstBuffer{local.data(), local.size(), DType::Int64},
                         comm::MutableBuffer{all.data(), all.size(), DType::Int64}, {}, options_for(true));
  return all;
}

Tensor local_shard(const Tensor& full, const ProcessGroup& group, std::int64_t dim) {
  const int d = normalize_dim(dim, full.shape(), "local_shard");
  const ShardRange r = shard_range(full.size(d), group.size(), group.rank());
  if (group.size() == 1) return full;
  return full.narrow(d, r.offset, r.size);
}

std::vector<std::int64_t> exchange_sizes(std::int64_t local, const ProcessGroup& group) {
  if (group.size() == 1) return {local};
  std::vector<std::int64_t> all(static_cast<std::size_t>(group.size()));
  record_collective("all_gather(sizes)", group.axis, static_cast<std::int64_t>(all.size() * sizeof(std::int64_t)));
  group.comm->all_gather(comm::ConstBuffer{&local, 1, DType::Int64},
                         comm::MutableBuffer{all.data(), all.size(), DType::Int64}, {}, options_for(true));
  return all;
}

}  // namespace meshgrad::dist
