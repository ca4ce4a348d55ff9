// Ranks agreeing on a failure (contract in include/meshgrad/comm/agreement.hpp).
#include "meshgrad/comm/agreement.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <vector>

#include "meshgrad/tensor/error.hpp"

namespace meshgrad::comm {

std::optional<RankFailure> first_failure(Communicator& comm, const std::string& error, const CollectiveOptions& opt) {
  constexpr std::size_t kMaxMessage = 4096;
  // The lowest failed rank: MIN over ranks of (rank if failed, else size), exact in a double (the
  // backends reduce floating types only).
  double failed = error.empty() ? comm.size() : comm.rank();
  comm.all_reduce(MutableBuffer{&failed, 1, DType::Float64}, ReduceOp::Min, opt);
  if (failed == comm.size()) return std::nullopt;
  const int root = static_cast<int>(failed);
  // Its message: the length first, then the bytes as int64 words.
  std::int64_t length = comm.rank() == root ? static_cast<std::int64_t>(std::min(error.size(), kMaxMessage)) : 0;
  comm.broadcast(MutableBuffer{&length, 1, DType::Int64}, root, opt);
  std::vector<std::int64_t> words((static_cast<std::size_t>(length) + sizeof(std::int64_t) - 1) / sizeof(std::int64_t), 0);
  if (comm.rank() == root) std::memcpy(words.data(), error.data(), static_cast<std::size_t>(length));
  if (!words.empty()) comm.broadcast(MutableBuffer{words.data(), words.size(), DType::Int64}, root, opt);
  return RankFailure{root, std::string(reinterpret_cast<const char*>(words.data()), static_cast<std::size_t>(length))};
}

void run_agreed(Communicator& comm, const std::function<void()>& step, const CollectiveOptions& opt) {
  std::exception_ptr mine;
  std::string message;   // a tag ('I': InvalidArgument, 'E': any other), then the text
  try {
    step();
  } catch (const InvalidArgument& e) {
    mine = std::current_exception();
    message = std::string("I") + e.what();
  } catch (const std::exception& e) {
    mine = std::current_exception();
    message = std::string("E") + e.what();
  }
  if (message == "I" || message == "E") message += "(an error without a message)";
  const std::optional<RankFailure> failure = first_failure(comm, message, opt);
  if (!failure) return;
  if (mine) std::rethrow_exception(mine);
  const std::string text = failure->message.substr(1);
  if (failure->message.front() == 'I') throw InvalidArgument(text);
  throw Error(text);
}

}  // namespace meshgrad::comm
