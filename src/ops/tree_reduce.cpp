#include "meshgrad/ops/tree_reduce.hpp"

#include <algorithm>
#include <atomic>
#include <numeric>

#include "meshgrad/autograd/function.hpp"
#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/shard.hpp"

namespace meshgrad::tree {

namespace testing {
namespace {
std::atomic<bool> left_fold_on{false};
}  // namespace
void set_left_fold(bool on) { left_fold_on.store(on); }
bool left_fold() { return left_fold_on.load(std::memory_order_relaxed); }
}  // namespace testing

bool is_power_of_two(std::int64_t n) { return n > 0 && (n & (n - 1)) == 0; }

namespace {

struct AddTensors {
  Tensor operator()(const Tensor& a, const Tensor& b) const { return kernels::binary(kernels::Binary::Add, a, b); }
};
struct AddOps {
  Tensor operator()(const Tensor& a, const Tensor& b) const { return meshgrad::add(a, b); }
};

template <class Add>
Tensor sum_with(const std::vector<Tensor>& leaves) {
  MG_CHECK(!leaves.empty(), "tree sum: no leaves");
  PairwiseSum<Tensor, Add> s;
  for (const Tensor& leaf : leaves) s.push(leaf);
  return s.root();
}

}  // namespace

Tensor sum(const std::vector<Tensor>& leaves) { return sum_with<AddTensors>(leaves); }

Tensor sum_op(const std::vector<Tensor>& leaves) { return sum_with<AddOps>(leaves); }

std::vector<Tensor> StreamingSum::AddLists::operator()(const std::vector<Tensor>& a, const std::vector<Tensor>& b) const {
  MG_CHECK(a.size() == b.size(), "StreamingSum: a leaf of {} tensors after leaves of {}", b.size(), a.size());
  std::vector<Tensor> out(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!b[i].defined()) {
      out[i] = a[i];
    } else {
      out[i] = a[i].defined() ? kernels::binary(kernels::Binary::Add, a[i], b[i]) : b[i];
    }
  }
  return out;
}

void OrderedSum::push(std::vector<Tensor> values) {
  if (tree_) {
    sum_.push(std::move(values));   // StreamingSum checks that every leaf has the same length
    ++count_;
    return;
  }
  MG_CHECK(count_ == 0 || values.size() == running_.size(), "OrderedSum: a push of {} tensors after pushes of {}",
           values.size(), running_.size());
  ++count_;
  if (count_ == 1) {
    running_ = std::move(values);
    return;
  }
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (!values[i].defined()) continue;
    running_[i] = running_[i].defined() ? kernels::binary(kernels::Binary::Add, running_[i], values[i]) : values[i];
  }
}

std::vector<Tensor> OrderedSum::total() const {
  MG_CHECK(count_ > 0, "OrderedSum: nothing was pushed");
  return tree_ ? sum_.root() : running_;
}

void OrderedSum::clear() {
  count_ = 0;
  running_.clear();
  sum_ = StreamingSum();
}

// ---- plans -------------------------------------------------------------------------------------

SplitPlan SplitPlan::whole(std::int64_t local_extent) {
  MG_CHECK(local_extent >= 0, "SplitPlan::whole: extent {}", local_extent);
  SplitPlan plan;
  plan.full = local_extent;
  plan.segments = {Segment{0, local_extent, 0, 0}};
  return plan;
}

std::vector<Segment> SplitPlan::block_segments(int i) const {
  std::vector<Segment> out;
  for (const Segment& s : segments) {
    if (s.block == first_block + i) out.push_back(s);
  }
  return out;
}

std::vector<std::int64_t> SplitPlan::sizes() const {
  std::vector<std::int64_t> out;
  for (const Segment& s : segments) out.push_back(s.size);
  return out;
}

std::int64_t SplitPlan::local_extent() const {
  return segments.empty() ? 0 : segments.back().local_offset + segments.back().size;
}

namespace {

// The plan, or "" and the reason it does not nest.
std::string try_plan(SplitPlan& plan) {
  const std::int64_t per_part = plan.full / plan.parts;
  if (plan.full % plan.parts != 0 || per_part % plan.unit != 0) {
    return fmt::format("{} elements are not {} parts of whole units of {}", plan.full, plan.parts, plan.unit);
  }
  if (!is_power_of_two(plan.blocks)) return fmt::format("the block count {} is not a power of two", plan.blocks);
  if (plan.blocks % plan.tp != 0) return fmt::format("tp={} does not divide the {} blocks", plan.tp, plan.blocks);
  const std::int64_t units = per_part / plan.unit;
  const ShardRange mine = shard_range(units, plan.tp, plan.rank);
  const int first = plan.rank * plan.blocks / plan.tp, count = plan.blocks / plan.tp;
  const ShardRange first_range = shard_range(units, plan.blocks, first);
  const ShardRange last_range = shard_range(units, plan.blocks, first + count - 1);
  const ShardRange covered{first_range.offset, last_range.offset + last_range.size - first_range.offset};
  if (covered.offset != mine.offset || covered.size != mine.size) {
    return fmt::format("rank {} of tp={} holds units [{}, {}) of {}, which is not blocks {}..{} of {}", plan.rank,
                       plan.tp, mine.offset, mine.offset + mine.size, units, first, first + count - 1, plan.blocks);
  }
  plan.first_block = first;
  plan.local_blocks = count;
  plan.segments.clear();
  std::int64_t local = 0;
  for (int p = 0; p < plan.parts; ++p) {
    for (int b = first; b < first + count; ++b) {
      const ShardRange r = shard_range(units, plan.blocks, b);
      plan.segments.push_back({local, r.size * plan.unit, p, b});
      local += r.size * plan.unit;
    }
  }
  return "";
}

}  // namespace

bool nests(std::int64_t full, int parts, std::int64_t unit, int blocks, int tp) {
  for (int r = 0; r < tp; ++r) {
    SplitPlan plan;
    plan.full = full, plan.parts = parts, plan.unit = unit, plan.blocks = blocks, plan.tp = tp, plan.rank = r;
    if (!try_plan(plan).empty()) return false;
  }
  return true;
}

std::string nesting_degrees(std::int64_t full, int parts, std::int64_t unit, int blocks) {
  std::string out;
  for (int tp = 1; tp <= std::max(1, blocks); tp *= 2) {
    if (!nests(full, parts, unit, blocks, tp)) continue;
    out += out.empty() ? fmt::format("{}", tp) : fmt::format(", {}", tp);
  }
  return out.empty() ? "none" : out;
}

SplitPlan plan_split(const std::string& what, std::int64_t full, int parts, std::int64_t unit, int blocks, int tp,
                     int rank) {
  MG_CHECK(parts >= 1 && unit >= 1 && blocks >= 1 && tp >= 1 && rank >= 0 && rank < tp,
           "tree plan for {}: bad arguments (parts {}, unit {}, blocks {}, tp {}, rank {})", what, parts, unit, blocks,
           tp, rank);
  SplitPlan plan;
  plan.full = full, plan.parts = parts, plan.unit = unit, plan.blocks = blocks, plan.tp = tp, plan.rank = rank;
  const std::string why = try_plan(plan);
  MG_CHECK(why.empty(), "--tp-invariant: {} ({} elements) cannot keep the fixed tree of {} blocks at tp={}: {}. "
           "Degrees that work for this model dimension: {}", what, full, blocks, tp, why,
           nesting_degrees(full, parts, unit, blocks));
  return plan;
}

// ---- ops ---------------------------------------------------------------------------------------

namespace {

Tensor cols(const Tensor& m, const Segment& s) { return m.narrow(1, s.local_offset, s.size); }

std::vector<std::int64_t> checked_blocks(const std::vector<std::int64_t>& blocks, std::int64_t rows, const char* op);

// Inputs {x [..., in_local], w [in_local, out]} -> the tree over in segments s of x[:, s] w[s, :],
// per row block of x's rows (each block's products alone; the weight gradient the tree over the
// row blocks of theirs).
class LinearOverInputBlocksFn final : public autograd::Function {
 public:
  LinearOverInputBlocksFn(SplitPlan plan, std::vector<std::int64_t> row_blocks)
      : plan_(std::move(plan)), row_blocks_(std::move(row_blocks)) {}
  std::string_view name() const override { return "linear_over_input_blocks"; }

  TensorList forward(const TensorList& in) override {
    const Tensor& x = in[0];
    const Tensor& w = in[1];
    MG_CHECK(x.dim() >= 1 && w.dim() == 2 && x.size(-1) == w.size(0) && plan_.local_extent() == w.size(0),
             "linear_over_input_blocks: input {} and weight {} do not match the plan of {} input features",
             shape_str(x.shape()), shape_str(w.shape()), plan_.local_extent());
    // Under bf16 products: rounded once for every segment's product, and kept so for backward.
    const Tensor x2 = kernels::product_operand(x.contiguous().view({-1, w.size(0)}));
    row_blocks_ = checked_blocks(row_blocks_, x2.size(0), "linear_over_input_blocks");
    const Tensor w_operand = kernels::product_operand(w);   // once, for every segment
    Tensor y = Tensor::empty({x2.size(0), w.size(1)}, x.dtype());
    std::int64_t row = 0;
    for (const std::int64_t rows : row_blocks_) {
      const Tensor xb = x2.narrow(0, row, rows);
      PairwiseSum<Tensor, AddTensors> products;
      for (const Segment& s : plan_.segments) {
        Tensor leaf = Tensor::empty({rows, w.size(1)}, x.dtype());
        kernels::matmul_into(leaf, cols(xb, s), w_operand.narrow(0, s.local_offset, s.size), false);
        products.push(leaf);
      }
      y.narrow(0, row, rows).copy_from(products.root());
      row += rows;
    }
    save_for_backward({x2, w});   // w itself: backward rounds it again rather than keep a bf16 copy alive
    x_shape_ = x.shape();
    Shape out_shape = x.shape();
    out_shape.back() = w.size(1);
    return {y.view(out_shape)};
  }

  TensorList backward(const TensorList& g) override {
    const Tensor& x2 = saved()[0];
    const Tensor& w = saved()[1];
    const Tensor dy = kernels::product_operand(g[0].contiguous().view({-1, w.size(1)}));   // rounded once
    Tensor dx, dw;
    if (needs_input_grad(0)) {
      dx = Tensor::empty({dy.size(0), w.size(0)}, w.dtype());
      std::int64_t row = 0;
      for (const std::int64_t rows : row_blocks_) {
        for (const Segment& s : plan_.segments) {
          Tensor d = cols(dx.narrow(0, row, rows), s);
          kernels::matmul_into(d, dy.narrow(0, row, rows), w.narrow(0, s.local_offset, s.size).transpose(0, 1), false);
        }
        row += rows;
      }
      dx = dx.view(x_shape_);
    }
    if (needs_input_grad(1)) {
      PairwiseSum<Tensor, AddTensors> blocks;
      std::int64_t row = 0;
      for (const std::int64_t rows : row_blocks_) {
        Tensor leaf = Tensor::empty(w.shape(), w.dtype());
        for (const Segment& s : plan_.segments) {
          Tensor d = leaf.narrow(0, s.local_offset, s.size);
          kernels::matmul_into(d, cols(x2.narrow(0, row, rows), s).transpose(0, 1), dy.narrow(0, row, rows), false);
        }
        blocks.push(leaf);
        row += rows;
      }
      dw = blocks.root();
    }
    return {dx, dw};
  }

 private:
  SplitPlan plan_;
  std::vector<std::int64_t> row_blocks_;
  Shape x_shape_;
};

std::vector<std::int64_t> checked_blocks(const std::vector<std::int64_t>& blocks, std::int64_t rows, const char* op) {
  if (blocks.empty()) return {rows};
  std::int64_t total = 0;
  for (const std::int64_t b : blocks) {
    MG_CHECK(b >= 0, "{}: a row block of {} rows", op, b);
    total += b;
  }
  MG_CHECK(total == rows, "{}: the row blocks cover {} rows, the input has {}", op, total, rows);
  MG_CHECK(is_power_of_two(static_cast<std::int64_t>(blocks.size())), "{}: {} row blocks; the fixed tree needs a power "
           "of two", op, blocks.size());
  return blocks;
}

// Inputs {y [..., C], b [C]}: y + b; db = the tree over row blocks of the column sums of dy.
class AddBiasFn final : public autograd::Function {
 public:
  explicit AddBiasFn(std::vector<std::int64_t> row_blocks) : blocks_(std::move(row_blocks)) {}
  std::string_view name() const override { return "add_bias"; }
  TensorList forward(const TensorList& in) override {
    MG_CHECK(in[0].dim() >= 1 && in[1].dim() == 1 && in[0].size(-1) == in[1].size(0),
             "add_bias: activation {} and bias {} must be [..., C] and [C]", shape_str(in[0].shape()),
             shape_str(in[1].shape()));
    blocks_ = checked_blocks(blocks_, in[0].numel() / std::max<std::int64_t>(1, in[0].size(-1)), "add_bias");
    return {kernels::binary(kernels::Binary::Add, in[0], in[1])};
  }
  TensorList backward(const TensorList& g) override {
    Tensor db;
    if (needs_input_grad(1)) {
      const Tensor dy = g[0].contiguous();
      const Tensor rows = dy.view({-1, dy.size(-1)});
      PairwiseSum<Tensor, AddTensors> sums;
      std::int64_t offset = 0;
      for (const std::int64_t n : blocks_) {
        sums.push(kernels::sum(rows.narrow(0, offset, n), {0}, false));
        offset += n;
      }
      db = sums.root();
    }
    return {needs_input_grad(0) ? g[0] : Tensor(), db};
  }

 private:
  std::vector<std::int64_t> blocks_;
};

}  // namespace

Tensor linear_over_input_blocks(const Tensor& x, const Tensor& w, const SplitPlan& in_plan,
                                const std::vector<std::int64_t>& row_blocks) {
  check_floating(x, "linear_over_input_blocks");
  check_same_dtype(x, w, "linear_over_input_blocks");
  // One block of each: the plain product.
  if (in_plan.segments.size() == 1 && row_blocks.size() <= 1) return meshgrad::linear(x, w);
  return autograd::apply<LinearOverInputBlocksFn>({x, w}, in_plan, row_blocks)[0];
}

Tensor add_bias(const Tensor& y, const Tensor& bias, const std::vector<std::int64_t>& row_blocks) {
  check_floating(y, "add_bias");
  check_same_dtype(y, bias, "add_bias");
  return autograd::apply<AddBiasFn>({y, bias}, row_blocks)[0];
}

Tensor sum_over_blocks(const Tensor& x, const std::vector<std::int64_t>& row_blocks) {
  check_floating(x, "sum_over_blocks");
  MG_CHECK(x.dim() >= 1, "sum_over_blocks: input {} has no leading dim", shape_str(x.shape()));
  const std::vector<std::int64_t> blocks = checked_blocks(row_blocks, x.size(0), "sum_over_blocks");
  if (blocks.size() == 1) return meshgrad::sum(x);
  const TensorList pieces = meshgrad::split(x, 0, blocks);
  std::vector<Tensor> leaves;
  for (const Tensor& p : pieces) leaves.push_back(meshgrad::sum(p));
  return sum_op(leaves);
}

}  // namespace meshgrad::tree
