// One rank's files of a save and the reports of what every rank wrote (contract in rank_writes.hpp).
#include "checkpoint/rank_writes.hpp"

#include <algorithm>
#include <cstring>
#include <exception>
#include <filesystem>
#include <thread>

#include "checkpoint/direct_io.hpp"
#include "meshgrad/io/sha256.hpp"

namespace meshgrad::checkpoint {

namespace {

// Writes file `sub` of the rank: each of its pieces appended in plan order, its XXH3 (fast) taken
// and the file's SHA-256 fed with the same bytes in the staging buffer, while still in the cache.
void write_one_file(const std::string& path, std::size_t file_index, bool direct, const std::vector<PlannedPiece>& plan,
                    const std::vector<std::size_t>& mine, const std::vector<BoxBytes>& data, RankReport& report,
                    std::size_t sub) {
  FileSink sink(path, direct);
  io::Sha256 whole;
  PieceHash piece;
  for (std::size_t i = 0; i < mine.size(); ++i) {
    if (plan[mine[i]].file != file_index) continue;
    piece.reset();
    sink.append(data[i], whole, piece);
    report.piece_xxh3[i] = piece.hex();
  }
  report.file_bytes[sub] = sink.finish();
  report.file_sha256[sub] = whole.hex();
}

// A hex digest as kHashWords int64 words for the exchange, and back.
constexpr std::size_t kHashWords = 8;
void put_hash(const std::string& hex, std::int64_t* out) {
  std::memset(out, 0, kHashWords * sizeof(std::int64_t));
  std::memcpy(out, hex.data(), std::min<std::size_t>(hex.size(), kHashWords * sizeof(std::int64_t)));
}
std::string get_hash(const std::int64_t* in, std::size_t digits) { return std::string(reinterpret_cast<const char*>(in), digits); }

constexpr std::size_t kSha256Digits = 64, kXxh3Digits = 32;

// Words of a report before its pieces: the status, then per file its bytes and its hash.
std::size_t header_words(int files_per_rank) { return 1 + static_cast<std::size_t>(files_per_rank) * (1 + kHashWords); }

std::vector<std::int64_t> encode(const RankReport& r, std::size_t words, int files_per_rank) {
  std::vector<std::int64_t> out(words, 0);
  out[0] = r.ok ? 0 : 1;
  if (!r.ok) return out;
  for (std::size_t f = 0; f < static_cast<std::size_t>(files_per_rank); ++f) {
    out[1 + f * (1 + kHashWords)] = static_cast<std::int64_t>(r.file_bytes[f]);
    put_hash(r.file_sha256[f], &out[2 + f * (1 + kHashWords)]);
  }
  const std::size_t header = header_words(files_per_rank);
  for (std::size_t i = 0; i < r.piece_xxh3.size(); ++i) put_hash(r.piece_xxh3[i], &out[header + kHashWords * i]);
  return out;
}

RankReport decode(const std::int64_t* in, std::size_t words, int files_per_rank) {
  RankReport r;
  r.ok = in[0] == 0;
  if (!r.ok) return r;
  for (std::size_t f = 0; f < static_cast<std::size_t>(files_per_rank); ++f) {
    const std::int64_t* w = &in[1 + f * (1 + kHashWords)];
    r.file_bytes.push_back(static_cast<std::uint64_t>(w[0]));
    r.file_sha256.push_back(get_hash(w + 1, kSha256Digits));
  }
  for (std::size_t at = header_words(files_per_rank); at < words; at += kHashWords) r.piece_xxh3.push_back(get_hash(&in[at], kXxh3Digits));
  return r;
}

}  // namespace

RankReport write_rank_files(const std::string& dir, int rank, int files_per_rank, const std::vector<PlannedPiece>& plan,
                            const std::vector<std::size_t>& mine, const std::vector<BoxBytes>& data) {
  const auto k = static_cast<std::size_t>(files_per_rank);
  RankReport report;
  report.piece_xxh3.resize(mine.size());
  report.file_bytes.resize(k, 0);
  report.file_sha256.resize(k);
  std::vector<std::exception_ptr> errors(k);
  const bool direct = direct_io_wanted();
  const auto write_file = [&](std::size_t sub) {
    try {
      const std::size_t file_index = static_cast<std::size_t>(rank) * k + sub;
      const std::string path = (std::filesystem::path(dir) / rank_file_name(file_index, files_per_rank)).string();
      write_one_file(path, file_index, direct, plan, mine, data, report, sub);
    } catch (...) {
      errors[sub] = std::current_exception();
    }
  };
  std::vector<std::thread> writers;
  for (std::size_t sub = 1; sub < k; ++sub) writers.emplace_back(write_file, sub);
  write_file(0);
  for (std::thread& t : writers) t.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  report.ok = true;
  return report;
}

std::vector<RankReport> exchange_reports(comm::Communicator& comm, const RankReport& mine,
                                         const std::vector<PlannedPiece>& plan, int files_per_rank,
                                         const comm::CollectiveOptions& opt) {
  const auto world = static_cast<std::size_t>(comm.size());
  std::vector<std::size_t> counts(world, header_words(files_per_rank));
  for (const PlannedPiece& p : plan) counts[static_cast<std::size_t>(p.writer)] += kHashWords;
  const std::vector<std::int64_t> sent = encode(mine, counts[static_cast<std::size_t>(comm.rank())], files_per_rank);
  std::size_t total = 0;
  for (std::size_t c : counts) total += c;
  std::vector<std::int64_t> all(total, 0);
  comm.all_gather(comm::ConstBuffer{sent.data(), sent.size(), DType::Int64},
                  comm::MutableBuffer{all.data(), all.size(), DType::Int64}, counts, opt);
  std::vector<RankReport> reports;
  std::size_t start = 0;
  for (std::size_t r = 0; r < world; ++r) {
    reports.push_back(decode(&all[start], counts[r], files_per_rank));
    start += counts[r];
  }
  return reports;
}

void add_written_files(Manifest& m, const std::vector<RankReport>& reports, const std::vector<PlannedPiece>& plan,
                       int files_per_rank) {
  const auto k = static_cast<std::size_t>(files_per_rank);
  for (std::size_t r = 0; r < reports.size(); ++r) {
    for (std::size_t f = 0; f < k; ++f)
      m.files.push_back({rank_file_name(r * k + f, files_per_rank), reports[r].file_bytes[f], reports[r].file_sha256[f]});
  }
  std::vector<std::size_t> next(reports.size(), 0);   // each writer's next piece hash
  for (const PlannedPiece& p : plan) {
    const auto r = static_cast<std::size_t>(p.writer);
    m.tensors[p.tensor].pieces.push_back({p.file, p.offset, p.box, reports[r].piece_xxh3[next[r]++]});
  }
}

}  // namespace meshgrad::checkpoint
