#include "meshgrad/train/trace_file.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "meshgrad/tensor/error.hpp"
#include "meshgrad/tensor/trace.hpp"
#include "meshgrad/io/output_path.hpp"

namespace meshgrad::train {

namespace {

std::int64_t nanoseconds(trace::Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "unknown host";
  return buf;
}

// Text sent as int64 words (the dtype every backend moves), zero-padded.
std::vector<std::int64_t> to_words(const std::string& text) {
  std::vector<std::int64_t> words((text.size() + 7) / 8, 0);
  if (!text.empty()) std::memcpy(words.data(), text.data(), text.size());
  return words;
}

}  // namespace

TraceRecorder::TraceRecorder(std::string path, std::string option,
                             std::vector<std::pair<std::string, std::string>> about, bool announce)
    : path_(std::move(path)), about_(std::move(about)), announce_(announce) {
  if (path_.empty()) return;
  io::check_output_paths({{std::move(option), path_}}, {});
  trace::start();
}

TraceRecorder::~TraceRecorder() {
  if (!path_.empty()) trace::reset();
}

void TraceRecorder::write(const std::string& text) const {
  io::AtomicFileWriter out(path_);
  out.write(text.data(), text.size(), "the trace");
  out.commit();
  if (trace::dropped_events() > 0) {
    fmt::print(stderr, "meshgrad: warning: the trace kept its first {} events and dropped {} more (trace fewer steps)\n",
               trace::kMaxEvents, trace::dropped_events());
  }
  if (announce_) fmt::print(stderr, "trace written to {}\n", path_);
}

void TraceRecorder::finish_rank(comm::Communicator& world) {
  if (path_.empty() || world.backend() == "threads") return;
  done_ = true;
  // Every process has finished its work: align the clocks as the processes leave one barrier.
  world.barrier();
  const trace::Clock::time_point anchor = trace::Clock::now();
  trace::stop();   // the gathering below is not part of the run
  const int p = world.size(), me = world.rank();
  std::int64_t mine[2] = {nanoseconds(anchor), nanoseconds(trace::session_start())};
  std::vector<std::int64_t> all(static_cast<std::size_t>(2 * p));
  world.all_gather(comm::ConstBuffer{mine, 2, DType::Int64}, comm::MutableBuffer{all.data(), all.size(), DType::Int64});
  // On rank 0's clock process q started at start_q - anchor_q + anchor_0; time 0 is the earliest.
  std::int64_t origin0 = std::numeric_limits<std::int64_t>::max();
  for (int q = 0; q < p; ++q) origin0 = std::min(origin0, all[2 * q + 1] - all[2 * q] + all[0]);
  const std::int64_t my_origin = origin0 - all[0] + mine[0];   // the same instant on this clock

  trace::ProcessInfo info;
  info.pid = ::getpid();
  info.name = fmt::format("rank {} (pid {} on {})", me, info.pid, host_name());
  info.sort_index = me;
  info.origin = trace::Clock::time_point(std::chrono::duration_cast<trace::Clock::duration>(
      std::chrono::nanoseconds(my_origin)));
  const std::string fragment = trace::events_fragment(info);

  // Every fragment to rank 0: lengths first, then the text as int64 words, one process at a time.
  const std::int64_t my_length = static_cast<std::int64_t>(fragment.size());
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(p));
  world.all_gather(comm::ConstBuffer{&my_length, 1, DType::Int64},
                   comm::MutableBuffer{lengths.data(), lengths.size(), DType::Int64});
  if (me != 0) {
    const std::vector<std::int64_t> words = to_words(fragment);
    world.send(comm::ConstBuffer{words.data(), words.size(), DType::Int64}, 0, /*tag=*/0x7ace);
    return;
  }
  std::vector<std::string> fragments{fragment};
  for (int q = 1; q < p; ++q) {
    const auto length = static_cast<std::size_t>(lengths[static_cast<std::size_t>(q)]);
    std::vector<std::int64_t> words((length + 7) / 8);
    world.recv(comm::MutableBuffer{words.data(), words.size(), DType::Int64}, q, /*tag=*/0x7ace);
    fragments.emplace_back(reinterpret_cast<const char*>(words.data()), length);
  }
  auto about = about_;
  about.emplace_back("backend", std::string(world.backend()));
  about.emplace_back("processes", std::to_string(p));
  write(trace::trace_document(fragments, about));
}

void TraceRecorder::finish() {
  if (path_.empty() || done_) return;
  done_ = true;
  trace::stop();
  trace::ProcessInfo info;
  info.pid = ::getpid();
  info.name = fmt::format("meshgrad (pid {} on {})", info.pid, host_name());
  info.origin = trace::session_start();
  auto about = about_;
  about.emplace_back("processes", "1");
  write(trace::trace_document({trace::events_fragment(info)}, about));
}

}  // namespace meshgrad::train
