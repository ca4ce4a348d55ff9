// Errors of meshgrad, first tier: misuse (shapes, dtypes, dims, ranks) detected by a check that
// throws with the op and the offending values in the message. Backend status codes (BLAS, MPI) are
// wrapped once at their boundary into the same types (see comm/errors.hpp).
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <stdexcept>
#include <string>

namespace meshgrad {

// Base of every error meshgrad throws on purpose.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A value a caller passed is not acceptable: shapes that do not match, a dim out of range, a dtype
// an op does not take. The message names the op and the values.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

}  // namespace meshgrad

// MG_CHECK(cond, "op: fmt string {}", args...) throws meshgrad::InvalidArgument with the formatted
// message when cond is false. Use it for every precondition a user can violate.
#define MG_CHECK(cond, ...)                                                \
  do {                                                                     \
    if (!(cond)) [[unlikely]] {                                            \
      throw ::meshgrad::InvalidArgument(::fmt::format(__VA_ARGS__));       \
    }                                                                      \
  } while (0)
