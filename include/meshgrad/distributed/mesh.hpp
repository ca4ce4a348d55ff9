// DeviceMesh: the ranks of a communicator arranged as an N-dimensional array with named axes
// (e.g. dp=2 x tp=2). Ranks are laid out row-major over the axes in the order given, so the last
// axis varies fastest: with "dp=2,tp=2", ranks {0,1} and {2,3} are the tp groups and {0,2}, {1,3}
// the dp groups. Each axis has its own sub-communicator (built once, by split).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "meshgrad/comm/communicator.hpp"

namespace meshgrad::dist {

// Bit i set: mesh axis i. Used for the axes a group spans and the axes a gradient is partial on.
using AxisMask = std::uint32_t;
inline AxisMask axis_bit(int axis) { return AxisMask{1} << axis; }

// A communicator together with the mesh axes it spans: the name shows in counts and errors ("tp",
// or "tp_row+tp_col" for a group over two axes), the mask is what the one rule (rule.hpp) reads
// gradient placements against.
struct ProcessGroup {
  comm::CommunicatorPtr comm;
  std::string axis;
  AxisMask axes = 0;
  int rank() const { return comm->rank(); }
  int size() const { return comm->size(); }
};

struct MeshAxis {
  std::string name;
  int size;
};

// ---- the spelling of a mesh ----------------------------------------------------------------------
// One grammar, read by parse_mesh and written by mesh_spec, for --mesh, Python's mesh=, checkpoints,
// metrics files and messages: comma-separated axis=size items in any order.
//   "tp=N"          the axes [dp=1, tp=N]
//   "dp=M,tp=N"     [dp=M, tp=N]: dp outermost, tp innermost, so tp groups are adjacent ranks
//   "tp=RxC"        [dp=1, tp_row=R, tp_col=C]: 2-D tensor parallelism (no plain "tp" axis then)
//   "dp=M,tp=RxC"   [dp=M, tp_row=R, tp_col=C]
//   "fsdp=F,..."    adds [fsdp=F] after dp, before the tp axes: sharded data parallelism (the
//                   parameters, gradients and optimizer state split over it, nn/fsdp.hpp); "dp=M,fsdp=F"
//                   is HSDP, M replicas of an F-way sharded model. Present only when given.
//   "pp=S,..."      adds [pp=S] before every other axis: a pipeline of S stages (pipeline/), each a
//                   whole dp x fsdp x tp mesh of its own; outermost, so a stage's ranks are adjacent
//                   (one host per stage). Present only when given.
//   "ep=E,..."      adds [ep=E] after fsdp, before the tp axes: expert parallelism. Its ranks split the
//                   batch as dp does for the dense layers and split a mixture of experts' experts among
//                   themselves (nn/moe.hpp); tokens travel to their experts by all-to-all. Present only
//                   when given.
//   "cp=C,..."      adds [cp=C] after ep, before the tp axes: context parallelism. Its ranks split every
//                   sequence into 2C chunks and hold two each (nn/context_parallel.hpp); attention
//                   gathers the keys and values over it. Present only when given.
// A missing dp or tp is size 1, so models always find both. The axis names are pp, dp, fsdp, ep, cp and tp
// (case-sensitive): anything else is refused, since an unknown axis would be silently ignored.

// The most ranks a mesh may have. Checked before anything is allocated (the threads backend
// allocates P x P mailboxes), with every product computed in int64 with overflow checks.
inline constexpr int kMaxMeshRanks = 4096;

// The axes of a spec, in mesh order. Throws InvalidArgument naming the text and the valid axes on a
// malformed spec, an unknown or miscased axis, a repeated axis, a size < 1, or more than
// kMaxMeshRanks ranks.
std::vector<MeshAxis> parse_mesh(const std::string& spec);
// The number of ranks a spec needs (the product of its sizes, at most kMaxMeshRanks).
int mesh_world_size(const std::string& spec);
// The spec of a mesh's axes, the inverse of parse_mesh: "tp=2", "dp=2,tp=4", "dp=2,tp=2x2" (dp is
// written when it is not 1). Axes outside the grammar (a mesh built by hand with other names) are
// written name=size in their order.
std::string mesh_spec(const std::vector<MeshAxis>& axes);

class DeviceMesh {
 public:
  // Collective over world (every rank calls it): the product of the axis sizes must equal
  // world->size() (throws naming both otherwise).
  DeviceMesh(comm::CommunicatorPtr world, std::vector<MeshAxis> axes);

  int rank() const { return world_->rank(); }
  int size() const { return world_->size(); }
  int ndim() const { return static_cast<int>(axes_.size()); }
  const std::vector<MeshAxis>& axes() const { return axes_; }
  // Index of the axis called name; throws naming the mesh when there is none.
  int axis_index(const std::string& name) const;
  bool has_axis(const std::string& name) const;
  int axis_size(int axis) const { return axes_.at(static_cast<std::size_t>(axis)).size; }
  int axis_size(const std::string& name) const { return axis_size(axis_index(name)); }
  // This rank's coordinate along an axis.
  int coordinate(int axis) const { return coords_.at(static_cast<std::size_t>(axis)); }
  int coordinate(const std::string& name) const { return coordinate(axis_index(name)); }
  const std::vector<int>& coordinates() const { return coords_; }
  // rank <-> coordinates (row-major).
  std::vector<int> coordinates_of(int rank) const;
  int rank_of(const std::vector<int>& coords) const;

  // The group of ranks that differ from this one only along `axis`.
  const ProcessGroup& group(int axis) const { return groups_.at(static_cast<std::size_t>(axis)); }
  const ProcessGroup& group(const std::string& name) const { return group(axis_index(name)); }
  // A group over several axes at once (the ranks that agree on every other coordinate), ranked
  // row-major over the given axes in mesh order. Collective over world: every rank calls it, with
  // the same axes, in the same order. E.g. the whole tensor-parallel grid of a 2-D mesh.
  ProcessGroup make_group(const std::vector<int>& axes) const;
  // The same, built on first use and kept (every rank asks in the same order, as for make_group).
  const ProcessGroup& flattened_group(const std::vector<int>& axes) const;
  const comm::CommunicatorPtr& world() const { return world_; }
  std::string str() const;   // mesh_spec(axes()): "dp=2,tp=2"

 private:
  comm::CommunicatorPtr world_;
  std::vector<MeshAxis> axes_;
  std::vector<int> coords_;
  std::vector<ProcessGroup> groups_;
  // flattened_group's cache, by axis mask. Each rank owns its DeviceMesh object (one per rank
  // thread), so no lock.
  mutable std::deque<ProcessGroup> flattened_;   // a deque: references stay valid as it grows
};
using DeviceMeshPtr = std::shared_ptr<const DeviceMesh>;

// How a job gets its ranks: run_on_mesh(fn) calls fn(mesh) on every rank of a mesh it chose (the
// launch API builds one from --backend and --mesh, tests start rank threads), and returns when
// every rank has finished; a rank's error propagates as an exception. Jobs and checkers take one
// of these instead of starting ranks themselves.
using RunOnMesh = std::function<void(const std::function<void(const DeviceMeshPtr&)>&)>;

}  // namespace meshgrad::dist
