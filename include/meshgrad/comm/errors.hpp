// Errors of the communication layer. Backend status codes (MPI error classes) are wrapped into
// these once, at the backend boundary.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshgrad/tensor/error.hpp"

namespace meshgrad::comm {

// Something went wrong while communicating. Carries where: backend, op, sequence number, rank.
class CommError : public Error {
 public:
  CommError(std::string message, std::string backend, std::string op, std::uint64_t sequence, int rank)
      : Error(std::move(message)), backend_(std::move(backend)), op_(std::move(op)), sequence_(sequence),
        rank_(rank) {}
  const std::string& backend() const { return backend_; }
  const std::string& op() const { return op_; }
  std::uint64_t sequence() const { return sequence_; }
  int rank() const { return rank_; }

 private:
  std::string backend_, op_;
  std::uint64_t sequence_;
  int rank_;
};

// The deadline of a wait passed. missing_ranks: the ranks that had not arrived (empty if unknown).
class CommTimeout : public CommError {
 public:
  CommTimeout(std::string message, std::string backend, std::string op, std::uint64_t sequence, int rank,
              std::vector<int> missing_ranks)
      : CommError(std::move(message), std::move(backend), std::move(op), sequence, rank),
        missing_ranks_(std::move(missing_ranks)) {}
  const std::vector<int>& missing_ranks() const { return missing_ranks_; }

 private:
  std::vector<int> missing_ranks_;
};

// Another rank failed (threw, exited or was killed); this rank gives up instead of hanging.
class PeerFailed : public CommError {
 public:
  using CommError::CommError;
};

// Debug mode: ranks called different collectives (or different dtypes / sizes) at one sequence number.
class CollectiveMismatch : public CommError {
 public:
  using CommError::CommError;
};

}  // namespace meshgrad::comm
