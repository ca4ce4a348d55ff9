#include "meshgrad/distributed/mesh.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cstdint>
#include <string_view>

namespace meshgrad::dist {

namespace {

constexpr const char* kMeshExamples = "e.g. tp=2, dp=2,tp=2, fsdp=2,tp=2, pp=2,tp=2, cp=2,tp=2 or dp=2,tp=2x2";

// One size of a --mesh item: a positive integer, at most kMaxMeshRanks (so products of a few stay
// far from overflow; the product is checked separately).
std::int64_t parse_mesh_size(std::string_view text, const std::string& item, const std::string& spec) {
  const bool digits = !text.empty() && std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
  std::int64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  MG_CHECK(digits && (ec == std::errc::result_out_of_range || value >= 1),
           "--mesh '{}': the size in '{}' must be a positive integer, got '{}' ({})", spec, item, text, kMeshExamples);
  MG_CHECK(ec == std::errc() && value <= kMaxMeshRanks, "--mesh '{}': the size in '{}' is {}; meshgrad runs at most {} "
           "ranks", spec, item, text, kMaxMeshRanks);
  return value;
}

}  // namespace

// The axes a --mesh spec may name, outermost first: the order they take in the mesh (tp last, as the
// innermost: its ranks are neighbours). tp=RxC becomes tp_row, tp_col in tp's place.
constexpr std::array<std::string_view, 6> kMeshAxisNames{"pp", "dp", "fsdp", "ep", "cp", "tp"};
constexpr const char* kMeshAxisList = "pp, dp, fsdp, ep, cp and tp";

std::vector<MeshAxis> parse_mesh(const std::string& spec) {
  MG_CHECK(!spec.empty(), "--mesh is empty ({})", kMeshExamples);
  std::array<std::int64_t, kMeshAxisNames.size()> sizes{};   // 0 = not given
  std::int64_t tp_col = 0;
  bool two_d = false;
  std::size_t pos = 0;
  while (pos <= spec.size()) {
    const std::size_t comma = std::min(spec.find(',', pos), spec.size());
    const std::string item = spec.substr(pos, comma - pos);
    pos = comma + 1;
    const std::size_t eq = item.find('=');
    MG_CHECK(eq != std::string::npos && eq > 0,
             "--mesh '{}': '{}' is not axis=size; the axes are {} ({})", spec, item, kMeshAxisList, kMeshExamples);
    const std::string name = item.substr(0, eq);
    const std::string_view value = std::string_view(item).substr(eq + 1);
    const auto known = std::find(kMeshAxisNames.begin(), kMeshAxisNames.end(), name);
    if (known == kMeshAxisNames.end()) {
      std::string lower = name;
      for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      const bool miscased = std::find(kMeshAxisNames.begin(), kMeshAxisNames.end(), lower) != kMeshAxisNames.end();
      throw InvalidArgument(fmt::format("--mesh '{}': unknown axis '{}'{}; the valid axes are {} (names are "
                                        "case-sensitive; {})", spec, name,
                                        miscased ? fmt::format(" (did you mean '{}'?)", lower) : "", kMeshAxisList,
                                        kMeshExamples));
    }
    std::int64_t& first = sizes[static_cast<std::size_t>(known - kMeshAxisNames.begin())];
    MG_CHECK(first == 0, "--mesh '{}': axis '{}' appears twice", spec, name);
    const std::size_t x = value.find('x');
    if (name == "tp" && x != std::string_view::npos) {   // tp=RxC: a 2-D tensor-parallel grid
      first = parse_mesh_size(value.substr(0, x), item, spec);
      tp_col = parse_mesh_size(value.substr(x + 1), item, spec);
      two_d = true;
    } else {
      first = parse_mesh_size(value, item, spec);
    }
  }
  // Each size is <= kMaxMeshRanks (checked above), so this product of seven fits in int64.
  std::int64_t ranks = std::max<std::int64_t>(tp_col, 1);
  for (const std::int64_t n : sizes) ranks *= std::max<std::int64_t>(n, 1);
  MG_CHECK(ranks <= kMaxMeshRanks, "--mesh '{}' needs {} ranks; meshgrad runs at most {}", spec, ranks, kMaxMeshRanks);
  // dp and tp are always axes (size 1 when not given); pp, fsdp, ep and cp only when given, so that
  // meshes without them keep their axes (and their checkpoints' records).
  std::vector<MeshAxis> axes;
  for (std::size_t a = 0; a < kMeshAxisNames.size(); ++a) {
    const std::string name(kMeshAxisNames[a]);
    const int size = static_cast<int>(std::max<std::int64_t>(sizes[a], 1));
    if (name == "tp" && two_d) {
      axes.push_back({"tp_row", size});
      axes.push_back({"tp_col", static_cast<int>(tp_col)});
    } else if (name == "dp" || name == "tp" || sizes[a] != 0) {
      axes.push_back({name, size});
    }
  }
  return axes;
}

int mesh_world_size(const std::string& spec) {
  int n = 1;
  for (const auto& a : parse_mesh(spec)) n *= a.size;   // <= kMaxMeshRanks, checked
  return n;
}

std::string mesh_spec(const std::vector<MeshAxis>& axes) {
  // The grammar's layouts: the axes of kMeshAxisNames in that order, dp and tp always, tp or tp_row,
  // tp_col last. Anything else (a mesh built by hand) prints every axis as name=size.
  std::size_t t = 0;
  std::string s;
  for (const std::string_view name : kMeshAxisNames) {
    if (name == "tp") break;
    if (t < axes.size() && axes[t].name == name) {
      // dp=1 is left out (the default); every other given axis is written, size 1 included.
      if (name != "dp" || axes[t].size != 1) s += fmt::format("{}={},", name, axes[t].size);
      ++t;
    }
  }
  std::vector<std::string> rest;
  for (std::size_t i = t; i < axes.size(); ++i) rest.push_back(axes[i].name);
  if (rest == std::vector<std::string>{"tp"}) return s + fmt::format("tp={}", axes[t].size);
  if (rest == std::vector<std::string>{"tp_row", "tp_col"}) {
    return s + fmt::format("tp={}x{}", axes[t].size, axes[t + 1].size);
  }
  s.clear();
  for (const auto& a : axes) s += fmt::format("{}{}={}", s.empty() ? "" : ",", a.name, a.size);
  return s;
}

DeviceMesh::DeviceMesh(comm::CommunicatorPtr world, std::vector<MeshAxis> axes)
    : world_(std::move(world)), axes_(std::move(axes)) {
  MG_CHECK(world_ != nullptr, "DeviceMesh: no communicator given");
  MG_CHECK(!axes_.empty(), "DeviceMesh: a mesh needs at least one axis");
  // In int64 with an overflow check: an int product could wrap to the communicator's size.
  std::int64_t product = 1;
  for (const auto& a : axes_) {
    MG_CHECK(a.size >= 1, "DeviceMesh: axis '{}' has size {}", a.name, a.size);
    MG_CHECK(!__builtin_mul_overflow(product, std::int64_t{a.size}, &product) && product <= world_->size(),
             "DeviceMesh: mesh {} has more ranks than the communicator's {}", mesh_spec(axes_), world_->size());
  }
  MG_CHECK(product == world_->size(), "DeviceMesh: mesh {} has {} ranks but the communicator has {}",
           mesh_spec(axes_), product, world_->size());
  coords_ = coordinates_of(world_->rank());
  // One split per axis: ranks that agree on every other coordinate form the group; the color is
  // the rank with this axis' coordinate set to 0, the key the coordinate along the axis.
  for (int axis = 0; axis < ndim(); ++axis) {
    std::vector<int> base = coords_;
    base[static_cast<std::size_t>(axis)] = 0;
    auto sub = world_->split(rank_of(base), coords_[static_cast<std::size_t>(axis)]);
    sub->set_label(axes_[static_cast<std::size_t>(axis)].name);   // errors name the axis, not just "rank 1 of 2"
    groups_.push_back({std::move(sub), axes_[static_cast<std::size_t>(axis)].name, axis_bit(axis)});
  }
}

ProcessGroup DeviceMesh::make_group(const std::vector<int>& axes) const {
  MG_CHECK(!axes.empty(), "{}: make_group needs at least one axis", str());
  AxisMask mask = 0;
  for (int a : axes) {
    MG_CHECK(a >= 0 && a < ndim(), "{}: make_group: axis {} out of range", str(), a);
    MG_CHECK(!(mask & axis_bit(a)), "{}: make_group: axis {} given twice", str(), axes_[static_cast<std::size_t>(a)].name);
    mask |= axis_bit(a);
  }
  if (axes.size() == 1) return group(axes[0]);
  // Color: the rank with every grouped coordinate set to 0; key: the row-major index over the
  // grouped axes in mesh order.
  std::vector<int> base = coords_;
  int key = 0;
  std::string name;
  for (int a = 0; a < ndim(); ++a) {
    if (!(mask & axis_bit(a))) continue;
    base[static_cast<std::size_t>(a)] = 0;
    key = key * axes_[static_cast<std::size_t>(a)].size + coords_[static_cast<std::size_t>(a)];
    name += (name.empty() ? "" : "+") + axes_[static_cast<std::size_t>(a)].name;
  }
  comm::CommunicatorPtr sub = world_->split(rank_of(base), key);
  sub->set_label(name);
  return {std::move(sub), name, mask};
}

const ProcessGroup& DeviceMesh::flattened_group(const std::vector<int>& axes) const {
  if (axes.size() == 1) return group(axes[0]);
  AxisMask mask = 0;
  for (int a : axes) mask |= axis_bit(a);
  for (const ProcessGroup& g : flattened_) {
    if (g.axes == mask) return g;
  }
  flattened_.push_back(make_group(axes));
  return flattened_.back();
}

int DeviceMesh::axis_index(const std::string& name) const {
  for (int i = 0; i < ndim(); ++i) {
    if (axes_[static_cast<std::size_t>(i)].name == name) return i;
  }
  throw InvalidArgument(fmt::format("{} has no axis '{}'", str(), name));
}

bool DeviceMesh::has_axis(const std::string& name) const {
  return std::any_of(axes_.begin(), axes_.end(), [&](const MeshAxis& a) { return a.name == name; });
}

std::vector<int> DeviceMesh::coordinates_of(int rank) const {
  MG_CHECK(rank >= 0 && rank < size(), "{}: rank {} out of range", str(), rank);
  std::vector<int> coords(axes_.size());
  for (std::size_t i = axes_.size(); i-- > 0;) {
    coords[i] = rank % axes_[i].size;
    rank /= axes_[i].size;
  }
  return coords;
}

int DeviceMesh::rank_of(const std::vector<int>& coords) const {
  MG_CHECK(coords.size() == axes_.size(), "{}: {} coordinates given", str(), coords.size());
  int rank = 0;
  for (std::size_t i = 0; i < axes_.size(); ++i) {
    MG_CHECK(coords[i] >= 0 && coords[i] < axes_[i].size, "{}: coordinate {} out of range on axis {}", str(),
             coords[i], axes_[i].name);
    rank = rank * axes_[i].size + coords[i];
  }
  return rank;
}

std::string DeviceMesh::str() const { return mesh_spec(axes_); }

}  // namespace meshgrad::dist
