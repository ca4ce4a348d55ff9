// Checkpoint manifests (contract in include/meshgrad/checkpoint/manifest.hpp).
#include "meshgrad/checkpoint/manifest.hpp"

#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>

#include "meshgrad/io/file_io.hpp"
#include "meshgrad/io/json_input.hpp"

namespace meshgrad::checkpoint {

std::int64_t box_volume(const Box& box) {
  std::int64_t n = 1;
  for (const ShardRange& r : box) n *= r.size;
  return n;
}

bool boxes_overlap(const Box& a, const Box& b) {
  for (std::size_t d = 0; d < a.size() && d < b.size(); ++d) {
    if (a[d].offset + a[d].size <= b[d].offset || b[d].offset + b[d].size <= a[d].offset) return false;
  }
  return true;
}

std::string box_str(const Box& box) {
  std::string s = "[";
  for (std::size_t d = 0; d < box.size(); ++d) {
    s += fmt::format("{}{}:{}", d ? ", " : "", box[d].offset, box[d].offset + box[d].size);
  }
  return s + "]";
}

namespace {

constexpr std::uint64_t kMaxManifestBytes = 256ull << 20;   // far above any real manifest; bounds a bad file
constexpr int kMaxManifestDepth = 12;                       // the format needs 7; state objects a few more
constexpr std::size_t kMaxPiecesPerTensor = 1 << 16;
constexpr const char* kManifestName = "manifest.json";   // a data file may not take its name

[[noreturn]] void manifest_error(const std::string& path, const std::string& what) {
  throw CheckpointError(fmt::format("checkpoint manifest '{}': {}", path, what));
}

const nlohmann::json& field(const nlohmann::json& obj, const char* key, const std::string& where, const std::string& path) {
  if (!obj.is_object()) manifest_error(path, fmt::format("{} is not an object", where));
  const auto it = obj.find(key);
  if (it == obj.end()) manifest_error(path, fmt::format("{} has no \"{}\"", where, key));
  return *it;
}

std::int64_t nonneg_int(const nlohmann::json& v, const std::string& what, const std::string& path) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(INT64_MAX)) manifest_error(path, fmt::format("{} = {} is too large", what, u));
    return static_cast<std::int64_t>(u);
  }
  if (v.is_number_integer()) {
    const auto i = v.get<std::int64_t>();
    if (i < 0) manifest_error(path, fmt::format("{} = {} is negative", what, i));
    return i;
  }
  manifest_error(path, fmt::format("{} is not an integer", what));
}

std::string string_field(const nlohmann::json& v, const std::string& what, const std::string& path) {
  if (!v.is_string()) manifest_error(path, fmt::format("{} is not a string", what));
  return v.get<std::string>();
}

bool is_hex(const std::string& s, std::size_t digits) {
  return s.size() == digits && std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}
bool is_sha256_hex(const std::string& s) { return is_hex(s, 64); }

bool is_plain_file_name(const std::string& s) {
  return !s.empty() && s.size() <= 255 && s != "." && s != ".." && s.find('/') == std::string::npos &&
         s.find('\0') == std::string::npos;
}

}  // namespace

std::uint64_t ManifestPiece::bytes(DType dtype) const {
  return static_cast<std::uint64_t>(box_volume(box)) * dtype_size(dtype);
}

const ManifestTensor* Manifest::find(const std::string& name) const {
  for (const ManifestTensor& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

namespace {
// No two pieces share bytes of a file: an edited dtype or box would make a read of one piece take
// another's bytes. Both pieces are named with what sizes them (dtype and box), the usual cause.
void check_pieces_disjoint(const Manifest& m, const std::string& path) {
  struct UsedBytes {   // a piece's byte range in its file
    std::uint64_t offset, bytes;
    std::size_t tensor, piece;
    bool operator<(const UsedBytes& o) const { return offset < o.offset; }
  };
  std::vector<std::vector<UsedBytes>> used(m.files.size());
  for (std::size_t t = 0; t < m.tensors.size(); ++t) {
    for (std::size_t k = 0; k < m.tensors[t].pieces.size(); ++k) {
      const ManifestPiece& p = m.tensors[t].pieces[k];
      const std::uint64_t bytes = p.bytes(m.tensors[t].dtype);
      if (bytes > 0) used[p.file].push_back({p.offset, bytes, t, k});
    }
  }
  for (std::size_t f = 0; f < used.size(); ++f) {
    std::sort(used[f].begin(), used[f].end());
    for (std::size_t k = 1; k < used[f].size(); ++k) {
      const UsedBytes& a = used[f][k - 1];
      const UsedBytes& b = used[f][k];
      if (b.offset >= a.offset + a.bytes) continue;
      const auto describe = [&](const UsedBytes& u) {
        const ManifestTensor& t = m.tensors[u.tensor];
        return fmt::format("tensor {} piece {} ({} box {}, bytes [{}, +{}))", io::json_quote(t.name), u.piece,
                           dtype_name(t.dtype), box_str(t.pieces[u.piece].box), u.offset, u.bytes);
      };
      manifest_error(path, fmt::format("{} and {} overlap in file '{}': their sizes (dtype times box volume) do not "
                                       "fit the offsets the files were written with; the manifest was changed",
                                       describe(a), describe(b), m.files[f].name));
    }
  }
}
}  // namespace

Manifest parse_manifest(std::string_view text, const std::string& path) {
  nlohmann::json j;
  try {
    j = io::parse_untrusted_json(text, kMaxManifestDepth);
  } catch (const io::JsonInputError& e) {
    manifest_error(path, fmt::format("not valid JSON: {}", e.what()));
  }
  if (!j.is_object()) manifest_error(path, "the top level is not an object");
  if (string_field(field(j, "format", "the manifest", path), "\"format\"", path) != kCheckpointFormat)
    manifest_error(path, fmt::format("\"format\" is not \"{}\"", kCheckpointFormat));
  const std::int64_t version = nonneg_int(field(j, "version", "the manifest", path), "\"version\"", path);
  if (version != kCheckpointVersion)
    manifest_error(path, fmt::format("version {} is not the {} this meshgrad reads", version, kCheckpointVersion));
  Manifest m;
  m.step = nonneg_int(field(j, "step", "the manifest", path), "\"step\"", path);
  if (j.contains("commit")) m.commit = nonneg_int(j["commit"], "\"commit\"", path);
  if (m.commit > kMaxCommitNumber)
    manifest_error(path, fmt::format("\"commit\" = {} is out of range: a commit number is at most {} (the manifest was "
                                     "changed; the next commit, numbered one more, would not sort after it)",
                                     m.commit, kMaxCommitNumber));
  m.mesh = string_field(field(j, "mesh", "the manifest", path), "\"mesh\"", path);
  m.state = field(j, "state", "the manifest", path);
  if (!m.state.is_object()) manifest_error(path, "\"state\" is not an object");

  const nlohmann::json& files = field(j, "files", "the manifest", path);
  if (!files.is_array()) manifest_error(path, "\"files\" is not an array");
  std::set<std::string> file_names;
  for (std::size_t i = 0; i < files.size(); ++i) {
    const std::string where = fmt::format("files[{}]", i);
    ManifestFile f;
    f.name = string_field(field(files[i], "name", where, path), where + ".name", path);
    if (!is_plain_file_name(f.name) || f.name == kManifestName)
      manifest_error(path, fmt::format("{}.name {} is not a plain file name in the checkpoint directory", where, io::json_quote(f.name)));
    if (!file_names.insert(f.name).second) manifest_error(path, fmt::format("file {} is listed twice", io::json_quote(f.name)));
    f.bytes = static_cast<std::uint64_t>(nonneg_int(field(files[i], "bytes", where, path), where + ".bytes", path));
    f.sha256 = string_field(field(files[i], "sha256", where, path), where + ".sha256", path);
    if (!is_sha256_hex(f.sha256)) manifest_error(path, fmt::format("{}.sha256 is not 64 lowercase hex digits", where));
    m.files.push_back(std::move(f));
  }

  const nlohmann::json& tensors = field(j, "tensors", "the manifest", path);
  if (!tensors.is_array()) manifest_error(path, "\"tensors\" is not an array");
  std::set<std::string> names;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const nlohmann::json& tj = tensors[i];
    ManifestTensor t;
    t.name = string_field(field(tj, "name", fmt::format("tensors[{}]", i), path), fmt::format("tensors[{}].name", i), path);
    const std::string where = fmt::format("tensor {}", io::json_quote(t.name));
    if (t.name.empty() || !names.insert(t.name).second) manifest_error(path, fmt::format("{} is empty or named twice", where));
    const std::string dtype = string_field(field(tj, "dtype", where, path), where + " dtype", path);
    if (dtype == "float32") t.dtype = DType::Float32;
    else if (dtype == "float64") t.dtype = DType::Float64;
    else if (dtype == "int64") t.dtype = DType::Int64;
    else manifest_error(path, fmt::format("{} has dtype {} (float32, float64 or int64 expected)", where, io::json_quote(dtype)));
    const nlohmann::json& shape = field(tj, "shape", where, path);
    if (!shape.is_array() || shape.size() > 8) manifest_error(path, fmt::format("{}: shape is not an array of at most 8 sizes", where));
    std::int64_t numel = 1;
    for (const nlohmann::json& s : shape) {
      const std::int64_t n = nonneg_int(s, where + " shape", path);
      if (n > 0 && numel > (std::int64_t{1} << 50) / n) manifest_error(path, fmt::format("{}: shape too large", where));
      numel *= n;
      t.shape.push_back(n);
    }
    const nlohmann::json& pieces = field(tj, "pieces", where, path);
    if (!pieces.is_array() || pieces.size() > kMaxPiecesPerTensor)
      manifest_error(path, fmt::format("{}: pieces is not an array of at most {}", where, kMaxPiecesPerTensor));
    std::int64_t covered = 0;
    for (std::size_t k = 0; k < pieces.size(); ++k) {
      const std::string pw = fmt::format("{} piece {}", where, k);
      ManifestPiece p;
      const std::int64_t file = nonneg_int(field(pieces[k], "file", pw, path), pw + " file", path);
      if (static_cast<std::size_t>(file) >= m.files.size())
        manifest_error(path, fmt::format("{}: file index {} but there are {} files", pw, file, m.files.size()));
      p.file = static_cast<std::size_t>(file);
      p.offset = static_cast<std::uint64_t>(nonneg_int(field(pieces[k], "offset", pw, path), pw + " offset", path));
      const nlohmann::json& box = field(pieces[k], "box", pw, path);
      if (!box.is_array() || box.size() != t.shape.size())
        manifest_error(path, fmt::format("{}: box must have one [offset, size] per dim ({})", pw, t.shape.size()));
      for (std::size_t d = 0; d < box.size(); ++d) {
        if (!box[d].is_array() || box[d].size() != 2) manifest_error(path, fmt::format("{}: box dim {} is not [offset, size]", pw, d));
        const std::int64_t off = nonneg_int(box[d][0], pw + " box offset", path);
        const std::int64_t size = nonneg_int(box[d][1], pw + " box size", path);
        if (off > t.shape[d] || size > t.shape[d] - off)
          manifest_error(path, fmt::format("{}: box dim {} [{}, +{}) lies outside the tensor's size {}", pw, d, off, size, t.shape[d]));
        p.box.push_back({off, size});
      }
      p.xxh3 = string_field(field(pieces[k], "xxh3", pw, path), pw + " xxh3", path);
      if (!is_hex(p.xxh3, 32)) manifest_error(path, fmt::format("{}: xxh3 is not 32 lowercase hex digits", pw));
      const std::uint64_t bytes = p.bytes(t.dtype);
      const ManifestFile& f = m.files[p.file];
      if (p.offset > f.bytes || bytes > f.bytes - p.offset)
        manifest_error(path, fmt::format("{}: bytes [{}, +{}) lie outside file '{}' of {} bytes", pw, p.offset, bytes, f.name, f.bytes));
      for (const ManifestPiece& q : t.pieces) {
        if (box_volume(q.box) > 0 && box_volume(p.box) > 0 && boxes_overlap(p.box, q.box))
          manifest_error(path, fmt::format("{}: box {} overlaps box {} of another piece", pw, box_str(p.box), box_str(q.box)));
      }
      covered += box_volume(p.box);
      t.pieces.push_back(std::move(p));
    }
    if (covered != numel)
      manifest_error(path, fmt::format("{}: its pieces cover {} of its {} elements", where, covered, numel));
    m.tensors.push_back(std::move(t));
  }
  check_pieces_disjoint(m, path);
  return m;
}

std::string manifest_to_json(const Manifest& m) {
  nlohmann::json files = nlohmann::json::array();
  for (const ManifestFile& f : m.files) files.push_back({{"name", f.name}, {"bytes", f.bytes}, {"sha256", f.sha256}});
  nlohmann::json tensors = nlohmann::json::array();
  for (const ManifestTensor& t : m.tensors) {
    nlohmann::json pieces = nlohmann::json::array();
    for (const ManifestPiece& p : t.pieces) {
      nlohmann::json box = nlohmann::json::array();
      for (const ShardRange& r : p.box) box.push_back({r.offset, r.size});
      pieces.push_back({{"file", p.file}, {"offset", p.offset}, {"box", box}, {"xxh3", p.xxh3}});
    }
    tensors.push_back({{"name", t.name}, {"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"pieces", pieces}});
  }
  const nlohmann::json j{{"format", kCheckpointFormat}, {"version", kCheckpointVersion}, {"step", m.step},
                         {"commit", m.commit}, {"mesh", m.mesh}, {"state", m.state}, {"files", files},
                         {"tensors", tensors}};
  try {
    return j.dump(1) + "\n";
  } catch (const nlohmann::json::type_error& e) {
    // JSON text is UTF-8: a string of the state that is not (train refuses such options up front).
    throw CheckpointError(fmt::format("checkpoint: the manifest cannot be written: a text it records is not valid UTF-8 "
                                      "({})", e.what()));
  }
}

Manifest read_manifest_file(const std::string& path) {
  std::uint64_t size = 0;
  std::string text;
  try {
    const io::UniqueFd fd = io::open_regular_file(path, &size);   // never blocks on a FIFO
    if (size > kMaxManifestBytes)
      throw CheckpointError(fmt::format("checkpoint manifest '{}' has {} bytes, more than a manifest may have ({})", path,
                                        size, kMaxManifestBytes));
    text.resize(static_cast<std::size_t>(size));
    io::read_exact(fd.get(), text.data(), size, 0, path);
  } catch (const io::FileIoError& e) {
    throw CheckpointError(fmt::format("checkpoint manifest: {}", e.what()));
  }
  return parse_manifest(text, path);
}

}  // namespace meshgrad::checkpoint
