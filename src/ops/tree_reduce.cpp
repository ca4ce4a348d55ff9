#include "meshgrad/ops/tree_reduce.hpp"

#include <algorithm>

#include "meshgrad/ops/ops.hpp"
#include "meshgrad/tensor/blas.hpp"
#include "meshgrad/tensor/kernels.hpp"
#include "meshgrad/tensor/shard.hpp"

namespace meshgrad::tree {

bool is_power_of_two(std::int64_t n) { return n > 0 && (n & (n - 1)) == 0; }

namespace {

template <class Add>
Tensor pairwise(std::vector<Tensor> level, Add&& add) {
  MG_CHECK(is_power_of_two(static_cast<std::int64_t>(level.size())),
           "tree sum: {} leaves; the fixed tree needs a power of two", level.size());
  while (level.size() > 1) {
    std::vector<Tensor> next;
    next.reserve(level.size() / 2);
    for (std::size_t i = 0; i < level.size(); i += 2) next.push_back(add(level[i], level[i + 1]));
    level = std::move(next);
  }
  return level.front();
}

}  // namespace

Tensor sum(const std::vector<Tensor>& leaves) {
  return pairwise(leaves, [](const Tensor& a, const Tensor& b) { return kernels::binary(kernels::Binary::Add, a, b); });
}

Tensor sum_op(const std::vector<Tensor>& leaves) {
  return pairwise(leaves, [](const Tensor& a, const Tensor& b) { return meshgrad::add(a, b); });
}

void StreamingSum::push(std::vector<Tensor> leaf) {
  stack_.push_back({0, std::move(leaf)});
  ++leaves_;
  // Two partial sums of the same level are siblings in the tree (the earlier one on the left).
  while (stack_.size() >= 2 && stack_[stack_.size() - 2].level == stack_.back().level) {
    Partial right = std::move(stack_.back());
    stack_.pop_back();
    Partial& left = stack_.back();
    MG_CHECK(left.values.size() == right.values.size(), "StreamingSum: a leaf of {} tensors after leaves of {}",
             right.values.size(), left.values.size());
    for (std::size_t i = 0; i < left.values.size(); ++i) {
      const Tensor& a = left.values[i];
      const Tensor& b = right.values[i];
      if (!b.defined()) continue;
      left.values[i] = a.defined() ? kernels::binary(kernels::Binary::Add, a, b) : b;
    }
    ++left.level;
  }
}

const std::vector<Tensor>& StreamingSum::root() const {
  MG_CHECK(stack_.size() == 1, "StreamingSum: {} leaves pushed; the fixed tree needs a power of two (>= 1)", leaves_);
  return stack_.front().values;
}

std::vector<Segment> SplitPlan::block_segments(int i) const {
  std::vector<Segment> out;
  for (const Segment& s : segments) {
    if (s.block == first_block() + i) out.push_back(s);
  }
  return out;
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
  const ShardRange covered{shard_range(units, plan.blocks, first).offset,
                           shard_range(units, plan.blocks, first + count - 1).offset +
                               shard_range(units, plan.blocks, first + count - 1).size -
                               shard_range(units, plan.blocks, first).offset};
  if (covered.offset != mine.offset || covered.size != mine.size) {
    return fmt::format("rank {} of tp={} holds units [{}, {}) of {}, which is not blocks {}..{} of {}", plan.rank,
                       plan.tp, mine.offset, mine.offset + mine.size, units, first, first + count - 1, plan.blocks);
  }
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
    SplitPlan plan{full, parts, unit, blocks, tp, r, {}};
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
  SplitPlan plan{full, parts, unit, blocks, tp, rank, {}};
  const std::string why = try_plan(plan);
  MG_CHECK(why.empty(), "--tp-invariant: {} ({} elements) cannot keep the fixed tree of {} blocks at tp={}: {}. "
           "Degrees that work for this model dimension: {}", what, full, blocks, tp, why,
           nesting_degrees(full, parts, unit, blocks));
  return plan;
}

namespace {

struct Operand {
  bool trans = false;
  std::int64_t ld = 0;
};

Operand layout_of(const Tensor& t, const char* what) {
  const std::int64_t rows = t.size(0), cols = t.size(1), s0 = t.strides()[0], s1 = t.strides()[1];
  if ((s1 == 1 || cols == 1) && (s0 >= std::max<std::int64_t>(1, cols) || rows == 1)) {
    return {false, std::max<std::int64_t>({s0, cols, 1})};
  }
  if ((s0 == 1 || rows == 1) && (s1 >= std::max<std::int64_t>(1, rows) || cols == 1)) {
    return {true, std::max<std::int64_t>({s1, rows, 1})};
  }
  throw InvalidArgument(fmt::format("tree::gemm_into: operand {} {} has no BLAS layout", what, t.str()));
}

template <class T>
T* base(const Tensor& t) {
  return reinterpret_cast<T*>(t.storage()->data()) + t.offset();
}

}  // namespace

void gemm_into(Tensor& c, const Tensor& a, const Tensor& b, bool accumulate) {
  MG_CHECK(a.dim() == 2 && b.dim() == 2 && c.dim() == 2 && a.size(1) == b.size(0) && c.size(0) == a.size(0) &&
               c.size(1) == b.size(1),
           "tree::gemm_into: shapes {} @ {} -> {} do not match", shape_str(a.shape()), shape_str(b.shape()),
           shape_str(c.shape()));
  MG_CHECK(a.dtype() == b.dtype() && a.dtype() == c.dtype(), "tree::gemm_into: dtypes differ");
  MG_CHECK(c.size(1) <= 1 || c.strides()[1] == 1, "tree::gemm_into: output {} needs unit column stride", c.str());
  const std::int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  if (m == 0 || n == 0) return;
  if (k == 0) {
    MG_CHECK(accumulate, "tree::gemm_into: empty inner dimension");
    return;
  }
  const Operand la = layout_of(a, "a"), lb = layout_of(b, "b");
  const std::int64_t ldc = std::max<std::int64_t>({c.strides()[0], n, 1});
  dispatch_floating(a.dtype(), "tree::gemm_into", [&]<class T>() {
    blas::gemm(la.trans, lb.trans, m, n, k, T(1), base<T>(a), la.ld, base<T>(b), lb.ld, accumulate ? T(1) : T(0),
               base<T>(c), ldc);
  });
}

}  // namespace meshgrad::tree
