// Reading sharded checkpoints on any mesh (contract in include/meshgrad/checkpoint/reader.hpp).
#include "meshgrad/checkpoint/reader.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <exception>
#include <functional>
#include <map>
#include <thread>

#include "checkpoint/pieces.hpp"
#include "checkpoint/piece_reads.hpp"

namespace meshgrad::checkpoint {

namespace {

// One saved piece to read for a request. It goes into the local tensor itself when it is exactly
// one of the rank's boxes (same mesh, or a replica), else into a piece-shaped buffer whose overlap
// with the rank's box is copied over after every read passed its check.
struct Read {
  const ManifestTensor* tensor;
  const ManifestPiece* piece;
  std::byte* target = nullptr;   // where the piece's bytes go: the local tensor or a piece buffer
  Tensor overlap_src;            // with a piece buffer: its part this rank holds (a view of it) ...
  Tensor overlap_dst;            // ... and where that goes in the local tensor
};

// What to read for the requests, and the tensors it lands in: locals[i] is targets[i], or, when the
// checkpoint holds another floating dtype, a tensor of the saved one converted at the end.
struct ReadPlan {
  std::vector<Read> reads;
  std::vector<Tensor> locals;
};

void check_targets(const std::vector<PieceRequest>& requests, const std::vector<Tensor>& targets) {
  MG_CHECK(targets.size() == requests.size(), "read_pieces_into: {} targets for {} requests", targets.size(), requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const Tensor& t = targets[i];
    MG_CHECK(t.defined() && t.is_contiguous() && t.shape() == requests[i].layout.local_shape && t.dtype() == requests[i].dtype,
             "read_pieces_into: the target of '{}' is {}{}, but the request is a contiguous {} of shape {}", requests[i].name,
             t.defined() ? t.str() : std::string("undefined"), t.defined() && !t.is_contiguous() ? " (not contiguous)" : "",
             dtype_name(requests[i].dtype), shape_str(requests[i].layout.local_shape));
  }
}

// The saved tensor a request names, refused when its full shape or its kind of dtype (integer or
// floating) differs.
const ManifestTensor& saved_tensor(const std::string& dir, const Manifest& manifest, const PieceRequest& req) {
  const ManifestTensor* t = manifest.find(req.name);
  if (t == nullptr) throw CheckpointError(fmt::format("checkpoint '{}' has no tensor '{}'", dir, req.name));
  if (t->shape != req.full_shape)
    throw CheckpointError(fmt::format("checkpoint '{}': tensor '{}' has shape {} but the model needs {}", dir, req.name,
                                      shape_str(t->shape), shape_str(req.full_shape)));
  const bool saved_int = t->dtype == DType::Int64, wanted_int = req.dtype == DType::Int64;
  if (saved_int != wanted_int)
    throw CheckpointError(fmt::format("checkpoint '{}': tensor '{}' is {} but the model needs {}", dir, req.name,
                                      dtype_name(t->dtype), dtype_name(req.dtype)));
  return *t;
}

// The reads of the saved pieces of t that overlap the rank's box lb of `local`.
void add_reads_for_box(const ManifestTensor& t, const LocalBox& lb, const Tensor& local, std::vector<Read>& reads) {
  const Tensor dst_box = local_view(local, lb);
  for (const ManifestPiece& p : t.pieces) {
    if (box_volume(p.box) == 0 || !boxes_overlap(p.box, lb.box)) continue;
    if (lb.split_dim < 0 && same_box(p.box, lb.box)) {
      reads.push_back({&t, &p, static_cast<std::byte*>(local.raw_data()), {}, {}});
      continue;
    }
    Shape shape;
    for (const ShardRange& r : p.box) shape.push_back(r.size);
    Tensor whole = Tensor::empty(shape, t.dtype);
    Tensor s = whole, d = dst_box;
    for (std::size_t k = 0; k < p.box.size(); ++k) {
      const std::int64_t lo = std::max(p.box[k].offset, lb.box[k].offset);
      const std::int64_t hi = std::min(p.box[k].offset + p.box[k].size, lb.box[k].offset + lb.box[k].size);
      s = s.narrow(static_cast<std::int64_t>(k), lo - p.box[k].offset, hi - lo);
      d = d.narrow(static_cast<std::int64_t>(k), lo - lb.box[k].offset, hi - lo);
    }
    reads.push_back({&t, &p, static_cast<std::byte*>(whole.raw_data()), s, d});   // s keeps whole alive
  }
}

// Every saved piece that overlaps one of the rank's boxes of each request. Throws CheckpointError for
// a request the checkpoint cannot serve, before anything is read.
ReadPlan plan_reads(const std::string& dir, const Manifest& manifest, const std::vector<PieceRequest>& requests,
                    const std::vector<Tensor>& targets) {
  ReadPlan plan;
  plan.locals.reserve(requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const PieceRequest& req = requests[i];
    const ManifestTensor& t = saved_tensor(dir, manifest, req);
    Tensor local = t.dtype == req.dtype ? targets[i] : Tensor::empty(req.layout.local_shape, t.dtype);
    for (const LocalBox& lb : local_boxes(req.layout)) {
      if (box_volume(lb.box) > 0) add_reads_for_box(t, lb, local, plan.reads);
    }
    plan.locals.push_back(local);
  }
  return plan;
}

// The reads, one thread per file (this one reads the first), each file read as one stream in offset
// order (read_file_pieces; at tp=1 a rank reads all of a checkpoint's files at once). The first error
// (in file order) is thrown after every thread finished.
void read_files_in_parallel(CheckpointFiles& files, std::map<std::size_t, std::vector<PieceRead>>& by_file) {
  std::vector<std::exception_ptr> errors(by_file.size());
  const auto read_file = [&](std::size_t slot, std::size_t file, std::vector<PieceRead>& list) {
    try {
      read_file_pieces(files, file, list);
    } catch (...) {
      errors[slot] = std::current_exception();
    }
  };
  {
    std::vector<std::thread> readers;
    std::size_t slot = 0;
    try {
      for (auto& [file, list] : by_file) {
        if (slot > 0) readers.emplace_back(read_file, slot, file, std::ref(list));
        ++slot;
      }
    } catch (...) {   // no thread for this file (system limits): the started ones finish first
      for (std::thread& t : readers) t.join();
      throw;
    }
    if (!by_file.empty()) read_file(0, by_file.begin()->first, by_file.begin()->second);
    for (std::thread& t : readers) t.join();
  }
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

// After every read passed: the overlaps of pieces that are not exactly this rank's boxes, then the
// conversions of other dtypes into the targets.
void place_reads(const ReadPlan& plan, const std::vector<PieceRequest>& requests, const std::vector<Tensor>& targets) {
  for (const Read& r : plan.reads) {
    if (r.overlap_dst.defined()) Tensor(r.overlap_dst).copy_from(r.overlap_src);
  }
  for (std::size_t i = 0; i < requests.size(); ++i) {
    if (plan.locals[i].dtype() != requests[i].dtype) Tensor(targets[i]).copy_from(plan.locals[i].to(requests[i].dtype));
  }
}

}  // namespace

void read_pieces_into(const std::string& dir, const Manifest& manifest, const std::vector<PieceRequest>& requests,
                      const std::vector<Tensor>& targets) {
  check_targets(requests, targets);
  CheckpointFiles files(dir, manifest);
  const ReadPlan plan = plan_reads(dir, manifest, requests, targets);
  std::map<std::size_t, std::vector<PieceRead>> by_file;
  for (const Read& r : plan.reads) by_file[r.piece->file].push_back({r.tensor, r.piece, r.target});
  // Every file opened and its size checked against the manifest before any target is written: a
  // missing or truncated file leaves the targets as they were.
  for (const auto& [file, list] : by_file) files.fd(file);
  // The reads write through raw pointers: a graph that saved a target's values refuses to use them.
  for (const Tensor& t : targets) t.bump_version();
  read_files_in_parallel(files, by_file);
  place_reads(plan, requests, targets);
}

std::vector<Tensor> read_pieces(const std::string& dir, const Manifest& manifest, const std::vector<PieceRequest>& requests) {
  // New tensors as the targets: whatever fails, the caller gets nothing, so nothing is half-loaded.
  std::vector<Tensor> out;
  out.reserve(requests.size());
  for (const PieceRequest& req : requests) out.push_back(Tensor::empty(req.layout.local_shape, req.dtype));
  read_pieces_into(dir, manifest, requests, out);
  return out;
}

std::vector<std::pair<std::string, Tensor>> read_full_tensors(const std::string& dir, const Manifest& manifest,
                                                              const std::vector<std::pair<std::string, Shape>>& names) {
  std::vector<PieceRequest> requests;
  for (const auto& [name, shape] : names) {
    const ManifestTensor* t = manifest.find(name);
    if (t == nullptr) throw CheckpointError(fmt::format("checkpoint '{}' has no tensor '{}'", dir, name));
    dist::PieceLayout whole;
    for (const std::int64_t n : shape) whole.ranges.push_back({ShardRange{0, n}});
    whole.local_shape = shape;
    requests.push_back({name, shape, whole, t->dtype});
  }
  std::vector<Tensor> read = read_pieces(dir, manifest, requests);
  std::vector<std::pair<std::string, Tensor>> out;
  for (std::size_t i = 0; i < names.size(); ++i) out.emplace_back(names[i].first, std::move(read[i]));
  return out;
}

}  // namespace meshgrad::checkpoint
