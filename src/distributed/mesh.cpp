#include "meshgrad/distributed/mesh.hpp"

#include <algorithm>
#include <charconv>
#include <cstdint>

namespace meshgrad::dist {

std::vector<MeshAxis> parse_mesh_spec(const std::string& spec) {
  std::vector<MeshAxis> axes;
  std::size_t pos = 0;
  MG_CHECK(!spec.empty(), "mesh: empty spec (expected e.g. tp=4 or dp=2,tp=2)");
  while (pos <= spec.size()) {
    const std::size_t comma = std::min(spec.find(',', pos), spec.size());
    const std::string item = spec.substr(pos, comma - pos);
    const std::size_t eq = item.find('=');
    MG_CHECK(eq != std::string::npos && eq > 0 && eq + 1 < item.size(),
             "mesh: '{}' in '{}' is not name=size (expected e.g. tp=4 or dp=2,tp=2)", item, spec);
    MeshAxis axis{item.substr(0, eq), 0};
    const char* first = item.data() + eq + 1;
    const char* last = item.data() + item.size();
    auto [end, ec] = std::from_chars(first, last, axis.size);
    MG_CHECK(ec == std::errc() && end == last && axis.size >= 1, "mesh: size of axis '{}' in '{}' must be a positive "
             "integer, got '{}'", axis.name, spec, item.substr(eq + 1));
    for (const auto& a : axes) MG_CHECK(a.name != axis.name, "mesh: axis '{}' appears twice in '{}'", axis.name, spec);
    axes.push_back(axis);
    pos = comma + 1;
  }
  return axes;
}

std::vector<MeshAxis> canonical_mesh_order(std::vector<MeshAxis> axes) {
  auto rank_of_name = [](const MeshAxis& a) { return a.name == "dp" ? 0 : a.name == "tp" ? 2 : 1; };
  std::stable_sort(axes.begin(), axes.end(),
                   [&](const MeshAxis& a, const MeshAxis& b) { return rank_of_name(a) < rank_of_name(b); });
  return axes;
}

std::string mesh_spec_str(const std::vector<MeshAxis>& axes) {
  std::string s;
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
             "DeviceMesh: mesh {} has more ranks than the communicator's {}", mesh_spec_str(axes_), world_->size());
  }
  MG_CHECK(product == world_->size(), "DeviceMesh: mesh {} has {} ranks but the communicator has {}",
           mesh_spec_str(axes_), product, world_->size());
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

std::string DeviceMesh::str() const {
  std::string s = "mesh(";
  for (std::size_t i = 0; i < axes_.size(); ++i) s += fmt::format("{}{}={}", i ? ", " : "", axes_[i].name, axes_[i].size);
  return s + ")";
}

}  // namespace meshgrad::dist
