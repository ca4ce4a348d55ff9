// The write plan of a save (contract in write_plan.hpp).
#include "checkpoint/write_plan.hpp"

#include <fmt/format.h>

#include <map>
#include <utility>

#include "checkpoint/pieces.hpp"

namespace meshgrad::checkpoint {

namespace {

// A tensor's distinct non-empty boxes over all ranks, in rank order of first appearance, each with
// the ranks that hold it.
std::vector<std::pair<Box, std::vector<int>>> distinct_boxes(const StateTensor& t, const std::vector<int>& ranks,
                                                             const dist::DeviceMesh& mesh) {
  std::map<std::vector<std::pair<std::int64_t, std::int64_t>>, std::size_t> index;
  std::vector<std::pair<Box, std::vector<int>>> unique;
  for (const int r : ranks) {
    const dist::PieceLayout layout = dist::piece_layout(t.full_shape, mesh, t.placements, mesh.coordinates_of(r));
    for (const LocalBox& lb : local_boxes(layout)) {
      if (box_volume(lb.box) == 0) continue;
      std::vector<std::pair<std::int64_t, std::int64_t>> key;
      for (const ShardRange& s : lb.box) key.emplace_back(s.offset, s.size);
      auto [it, fresh] = index.emplace(key, unique.size());
      if (fresh) unique.emplace_back(lb.box, std::vector<int>{});
      unique[it->second].second.push_back(r);
    }
  }
  return unique;
}

}  // namespace

std::vector<PlannedPiece> plan_pieces(const std::vector<StateTensor>& tensors,
                                      const std::vector<std::vector<int>>& holders, const dist::DeviceMesh& mesh,
                                      int files_per_rank) {
  MG_CHECK(holders.size() == tensors.size(), "checkpoint: internal error: {} holder lists for {} tensors", holders.size(),
           tensors.size());
  std::vector<PlannedPiece> plan;
  const std::size_t k = static_cast<std::size_t>(files_per_rank);
  std::vector<std::uint64_t> file_end(static_cast<std::size_t>(mesh.size()) * k, 0);
  std::size_t counter = 0;   // spreads replicated pieces over their holders
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const StateTensor& t = tensors[i];
    for (auto& [box, holding] : distinct_boxes(t, holders[i], mesh)) {
      PlannedPiece p;
      p.tensor = i;
      p.box = box;
      p.writer = holding[counter++ % holding.size()];
      p.bytes = static_cast<std::uint64_t>(box_volume(box)) * dtype_size(t.local.dtype());
      const std::size_t first = static_cast<std::size_t>(p.writer) * k;
      p.file = first;
      for (std::size_t f = first + 1; f < first + k; ++f) {
        if (file_end[f] < file_end[p.file]) p.file = f;
      }
      p.offset = file_end[p.file];
      file_end[p.file] += p.bytes;
      plan.push_back(std::move(p));
    }
  }
  return plan;
}

std::string rank_file_name(std::size_t file, int files_per_rank) {
  const std::size_t rank = file / static_cast<std::size_t>(files_per_rank);
  if (files_per_rank == 1) return fmt::format("rank_{:05d}.bin", rank);
  return fmt::format("rank_{:05d}_{}.bin", rank, file % static_cast<std::size_t>(files_per_rank));
}

}  // namespace meshgrad::checkpoint
