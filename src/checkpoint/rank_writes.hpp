// Internal to the checkpoint layer: steps 1 and 2 of a save (saver.hpp). One rank writes the pieces
// the plan gives it into its files in the stage directory, hashing every byte as it goes, and then
// tells every rank what it wrote, so that rank 0 can write the manifest and everyone knows who failed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/pieces.hpp"
#include "checkpoint/write_plan.hpp"
#include "meshgrad/checkpoint/manifest.hpp"
#include "meshgrad/comm/communicator.hpp"

namespace meshgrad::checkpoint {

// What one rank wrote.
struct RankReport {
  bool ok = false;                          // the rank wrote and flushed all its files
  std::vector<std::uint64_t> file_bytes;    // per file of the rank (files_per_rank of them)
  std::vector<std::string> file_sha256;     // 64 hex digits each
  std::vector<std::string> piece_xxh3;      // per piece the rank writes, in plan order: 32 hex digits each
};

// Writes rank's files_per_rank files (rank_file_name) into dir, each by a thread of its own (the
// caller's thread writes the first), through a FileSink: every piece `mine` lists (indices into plan,
// in plan order; data[i] holds the bytes of mine[i]) goes to its planned file at its planned offset.
// Returns the report of a rank that succeeded: each file's size and SHA-256, each piece's XXH3. Throws
// CheckpointError (the first failed file's, in file order) after every thread finished.
RankReport write_rank_files(const std::string& dir, int rank, int files_per_rank, const std::vector<PlannedPiece>& plan,
                            const std::vector<std::size_t>& mine, const std::vector<BoxBytes>& data);

// All-gathers every rank's report over comm (collective; `mine` is this rank's, with ok false when it
// failed, and then nothing else). Reports of failed ranks come back with ok false and nothing else.
// On the wire, a rank's report is int64 words: [ok ? 0 : 1, per file (bytes, 8 words of SHA-256 hex),
// per piece 8 words of XXH3 hex], its length known to all from the plan.
std::vector<RankReport> exchange_reports(comm::Communicator& comm, const RankReport& mine,
                                         const std::vector<PlannedPiece>& plan, int files_per_rank,
                                         const comm::CollectiveOptions& opt);

// The files (every rank's, in rank order) and every tensor's pieces (in plan order) of the manifest,
// from the reports of a save in which every rank succeeded. m.tensors lists the save's tensors in
// order already.
void add_written_files(Manifest& m, const std::vector<RankReport>& reports, const std::vector<PlannedPiece>& plan,
                       int files_per_rank);

}  // namespace meshgrad::checkpoint
