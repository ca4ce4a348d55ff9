#include "meshgrad/data/dataset.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <nlohmann/json.hpp>
#include <tuple>

#include "meshgrad/data/shards.hpp"
#include "meshgrad/io/json_input.hpp"
#include "meshgrad/io/xxh128.hpp"
#include "meshgrad/tensor/random.hpp"
#include "meshgrad/tensor/shard.hpp"

namespace meshgrad::data {

namespace {

// Written for meshgrad and placed in the public domain. Plain ASCII prose with a small vocabulary
// and repeated phrasing, so a small byte-level model learns spelling and common words within a
// couple of hundred steps and its loss visibly falls from ln(256) ~ 5.55.
constexpr std::string_view kCorpus = R"(The river begins in the hills above the town, where the snow lies late into the spring. In the morning the water is cold and clear, and the light comes down through the trees in long bright lines. The old miller used to say that the river has three voices: a small voice in the hills, a strong voice at the mill, and a slow voice by the sea. He said that a patient man could learn all three, and that a wise man would listen more than he spoke.

The town is small. There is a bridge of grey stone, a market square, a school, a bakery, and a church with a clock that is always five minutes late. On market days the farmers come in from the valley with carts of apples, bread, cheese and wool. The children run between the stalls, and the dogs follow the children, and the baker stands at his door and laughs at all of them. In the evening the square is quiet again, and the only sound is the river under the bridge.

In the autumn the rain comes from the west. It rains for a day, and then for a week, and the river rises until it runs brown and fast under the bridge. The people of the town watch the water from the windows. They have seen floods before, and they know what to do. They carry the sacks of grain up to the high rooms, they tie the boats to the trees, and they wait. When the rain stops, the river falls, and the town goes back to work as if nothing had happened.

The teacher at the school was a tall woman with a quiet voice. She taught the children to read and to write, to add and to take away, and to draw the map of the valley from memory. She told them that a map is not the land, but a story about the land, and that every good story leaves something out. She asked them what the map of the river left out, and the children said: the cold, the sound, the fish, the light in the morning, and the smell of the rain.

One winter the bridge was damaged by ice. Great plates of ice came down the river and struck the stone, and one of the arches cracked. The town met in the church to decide what to do. Some wanted to build a new bridge of iron, and some wanted to mend the old one. They talked for a long time. At last the old miller stood up and said that the stone bridge had stood for three hundred years, and that it had earned the right to be mended. So they mended it, stone by stone, and it stands there still.

The work of mending took all of the spring. The masons came from the city with their tools, and the children of the town carried water and sand for them. Every evening the masons sat in the square and told stories of other bridges they had built, in other valleys, over other rivers. They said that every river is different, but that every bridge must do the same thing: it must carry the weight of the road and let the water pass beneath it. A bridge that fights the river will fall, they said, and a bridge that lets the river pass will stand.

In the summer the river is low and warm. The children swim in the deep pool below the mill, and the old men fish from the bank and say very little. The farmers cut the hay in the fields along the water, and the air is full of the smell of it. At night the stars are bright over the valley, and from the bridge you can hear the river talking to itself in its slow summer voice.

The baker rises before the sun. He lights the oven, he mixes the flour and the water and the salt, and he waits for the dough to rise. He says that bread cannot be hurried, and that the best bread is made by a man who knows how to wait. By the time the church clock strikes six, five minutes late, the first loaves are on the shelf, and the smell of them fills the square. The first customer is always the teacher, and the second is always the miller, and they always talk about the weather.

Years passed. The children grew up and some of them left the valley to work in the city. Some came back, and some did not. The teacher grew old and another teacher took her place. The miller died, and his son kept the mill. But the river did not change. It came down from the hills in the spring, it rose in the autumn rain, it froze at the edges in the winter, and it ran low and warm in the summer, as it had always done, and as it always will.

When the miller's son was asked what his father had taught him, he said that his father had taught him to listen to the river. He said that the river tells you when the rain is coming, when the ice is thin, and when the water is too high to cross. He said that if you listen long enough, the river will tell you everything you need to know, and that most people never learn to listen at all.
)";

}  // namespace

std::string_view builtin_corpus() { return kCorpus; }

namespace {

// What a stat mode is, for messages about paths that are not regular files.
const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a pipe or FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

struct stat stat_path(const std::string& path, const std::string& what) {
  struct stat st {};
  MG_CHECK(::stat(path.c_str(), &st) == 0, "{} '{}' cannot be opened for reading: {}", what, path,
           std::strerror(errno));
  return st;
}

bool has_llmc_magic(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::int32_t magic = 0;
  in.read(reinterpret_cast<char*>(&magic), 4);
  return in.gcount() == 4 && magic == kTokenFileMagic;
}

// What a dataset takes from a meta.json (written by meshgrad prepare): the vocabulary, and the
// content hashes of train.bin and val.bin where it records them (prepare has since it wrote them).
struct Meta {
  std::int64_t vocab = 0;
  std::map<std::string, std::string> file_hashes;   // "train.bin" -> XXH3-128 hex
  // "shards": {"train": [names], "val": [names]} of a sharded prepare, when recorded.
  std::map<std::string, std::vector<std::string>> shards;
};

// meta.json's "shards" (an object of string arrays), into meta.shards.
void read_meta_shards(const std::string& path, const nlohmann::json& j, Meta& meta) {
  const auto shards = j.find("shards");
  if (shards == j.end()) return;
  MG_CHECK(shards->is_object(), "data: '{}': \"shards\" must be an object, got {}", path, io::json_excerpt(*shards));
  for (const auto& [split, names] : shards->items()) {
    MG_CHECK(names.is_array(), "data: '{}': \"shards\" > {} must be an array of file names", path, io::json_quote(split));
    for (const auto& name : names) {
      MG_CHECK(name.is_string(), "data: '{}': \"shards\" > {} holds {}, not a file name", path, io::json_quote(split),
               io::json_excerpt(name));
      meta.shards[split].push_back(name.get<std::string>());
    }
  }
}

Meta read_meta(const std::string& path) {
  const std::string text = io::read_small_file(path, std::uint64_t{64} << 20, "data: meta.json");
  nlohmann::json j;
  try {
    j = io::parse_untrusted_json(text, 16);
  } catch (const io::JsonInputError& e) {
    throw InvalidArgument(fmt::format("data: '{}' is not valid JSON ({}{})", path, e.what(),
                                      e.byte() ? fmt::format(", byte offset {}", *e.byte()) : std::string()));
  }
  MG_CHECK(j.is_object() && j.contains("vocab_size") && j["vocab_size"].is_number_integer(),
           "data: '{}' has no integer \"vocab_size\" (is it a meta.json written by meshgrad prepare?)", path);
  Meta meta;
  meta.vocab = j["vocab_size"].get<std::int64_t>();
  MG_CHECK(meta.vocab >= 1 && meta.vocab <= INT32_MAX, "data: '{}': vocab_size must be in [1, 2^31 - 1], got {}", path,
           meta.vocab);
  if (const auto files = j.find("files"); files != j.end()) {
    MG_CHECK(files->is_object(), "data: '{}': \"files\" must be an object, got {}", path, io::json_excerpt(*files));
    for (const auto& [name, entry] : files->items()) {
      MG_CHECK(entry.is_object() && entry.contains("xxh128") && entry["xxh128"].is_string(),
               "data: '{}': \"files\" > {} has no string \"xxh128\"", path, io::json_quote(name));
      meta.file_hashes[name] = entry["xxh128"].get<std::string>();
    }
  }
  read_meta_shards(path, j, meta);
  return meta;
}

}  // namespace

void require_regular_file(const std::string& path, const std::string& what) {
  const struct stat st = stat_path(path, what);
  MG_CHECK(S_ISREG(st.st_mode), "{} '{}' is {}, not a regular file", what, path, file_kind(st.st_mode));
}

MappedFile::MappedFile(const std::string& path, const std::string& what) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MG_CHECK(fd >= 0, "{} '{}' cannot be opened for reading: {}", what, path, std::strerror(errno));
  struct stat st {};
  const bool stat_ok = ::fstat(fd, &st) == 0;
  const int stat_errno = errno;
  if (!stat_ok || !S_ISREG(st.st_mode)) {
    ::close(fd);
    MG_CHECK(stat_ok, "{} '{}' cannot be inspected: {}", what, path, std::strerror(stat_errno));
    throw InvalidArgument(fmt::format("{} '{}' is {}, not a regular file", what, path, file_kind(st.st_mode)));
  }
  size_ = static_cast<std::size_t>(st.st_size);
  if (size_ > 0) {
    data_ = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    const int map_errno = errno;
    ::close(fd);
    if (data_ == MAP_FAILED) {
      data_ = nullptr;
      throw InvalidArgument(fmt::format("{} '{}' ({} bytes) cannot be mapped into memory: {}", what, path, size_,
                                        std::strerror(map_errno)));
    }
  } else {
    ::close(fd);
  }
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(data_, size_);
}

namespace {

constexpr std::int64_t kScanChunkBytes = 1 << 20;

// Little-endian uint16 or uint32 tokens (as llm.c writes them, x86 and arm64) to int64.
void decode_tokens(const unsigned char* bytes, std::int64_t width, std::int64_t count, std::int64_t* out) {
  if (width == 2) {
    for (std::int64_t i = 0; i < count; ++i) out[i] = bytes[2 * i] | (bytes[2 * i + 1] << 8);
    return;
  }
  for (std::int64_t i = 0; i < count; ++i) {
    const unsigned char* b = bytes + 4 * i;
    out[i] = static_cast<std::int64_t>(std::uint32_t{b[0]} | (std::uint32_t{b[1]} << 8) | (std::uint32_t{b[2]} << 16) |
                                       (std::uint32_t{b[3]} << 24));
  }
}

}  // namespace

TokenFile::TokenFile(const std::string& path, Format format) : path_(path), format_(format) {
  std::uint64_t file_size = 0;
  io::UniqueFd fd;
  try {
    fd = io::open_regular_file(path, &file_size);
  } catch (const io::FileIoError& e) {
    throw InvalidArgument(fmt::format("data: {}", e.what()));
  }
  const auto file_bytes = static_cast<std::int64_t>(file_size);
  if (format == Format::Bytes) {
    size_ = file_bytes;
  } else {
    MG_CHECK(file_bytes >= kTokenFileHeaderBytes, "data '{}': {} bytes, shorter than the {}-byte header of an llm.c "
             "token file", path, file_bytes, kTokenFileHeaderBytes);
    std::int32_t header[3];
    io::read_exact(fd.get(), header, sizeof header, 0, path);
    MG_CHECK(header[0] == kTokenFileMagic, "data '{}': byte offset 0: magic {} is not the llm.c token file magic {}",
             path, header[0], kTokenFileMagic);
    token_bytes_ = token_file_token_bytes(header[1]);
    MG_CHECK(token_bytes_ != 0, "data '{}': byte offset 4: version {} is not supported (version {}: uint16 tokens, "
             "version {}: uint32 tokens)", path, header[1], kTokenFileVersion, kTokenFileVersionU32);
    const std::int64_t count = header[2];
    const std::int64_t payload = file_bytes - kTokenFileHeaderBytes;
    MG_CHECK(count >= 0 && payload == token_bytes_ * count, "data '{}': byte offset 8: the header says {} tokens ({} "
             "bytes) but the file has {} bytes after the header (version {}: {}-byte tokens)", path, count,
             token_bytes_ * count, payload, header[1], token_bytes_);
    size_ = count;
  }
  fd_ = std::move(fd);
  // One pass over the file: its hash, and (LlmC) its largest token. Byte files need no scan for the
  // vocabulary (255 is a bound).
  io::Xxh128 hash;
  std::vector<unsigned char> chunk(static_cast<std::size_t>(std::min(kScanChunkBytes, std::max<std::int64_t>(file_bytes, 1))));
  std::vector<std::int64_t> tokens;
  max_token_ = format == Format::Bytes && size_ > 0 ? 255 : -1;
  for (std::int64_t offset = 0; offset < file_bytes; offset += kScanChunkBytes) {
    const std::int64_t n = std::min(kScanChunkBytes, file_bytes - offset);
    read_file_bytes(offset, n, chunk.data());
    hash.update(chunk.data(), static_cast<std::size_t>(n));
    if (format == Format::Bytes) continue;
    // Whole tokens of this chunk past the header (chunks and the header are multiples of 4 bytes).
    const std::int64_t skip = std::max<std::int64_t>(0, kTokenFileHeaderBytes - offset);
    if (skip >= n) continue;
    tokens.resize(static_cast<std::size_t>((n - skip) / token_bytes_));
    decode_tokens(chunk.data() + skip, token_bytes_, static_cast<std::int64_t>(tokens.size()), tokens.data());
    for (std::int64_t t : tokens) max_token_ = std::max(max_token_, t);
  }
  content_hash_ = hash.hex();
}

void TokenFile::read_file_bytes(std::int64_t offset, std::int64_t n, void* out) const {
  try {
    io::read_exact(fd_.get(), out, static_cast<std::uint64_t>(n), static_cast<std::uint64_t>(offset), path_);
  } catch (const io::FileIoError& e) {
    if (e.reason() != "truncated") throw InvalidArgument(fmt::format("data: {}", e.what()));
    throw InvalidArgument(fmt::format("data '{}' ends before byte offset {} (of {} when the run opened it): the file "
                                      "shrank while the run was reading it; a data file must not change under a run",
                                      path_, offset + n, format_ == Format::Bytes ? size_ : kTokenFileHeaderBytes + token_bytes_ * size_));
  }
}

void TokenFile::read(std::int64_t start, std::int64_t count, std::int64_t* out) const {
  MG_CHECK(start >= 0 && count >= 0 && start + count <= size_, "TokenFile::read: tokens [{}, {}) of '{}' are outside "
           "its {} tokens", start, start + count, path_, size_);
  if (count == 0) return;
  if (format_ == Format::Bytes) {
    std::vector<unsigned char> bytes(static_cast<std::size_t>(count));
    read_file_bytes(start, count, bytes.data());
    for (std::int64_t i = 0; i < count; ++i) out[i] = bytes[static_cast<std::size_t>(i)];
    return;
  }
  std::vector<unsigned char> bytes(static_cast<std::size_t>(token_bytes_ * count));
  read_file_bytes(byte_offset(start), token_bytes_ * count, bytes.data());
  decode_tokens(bytes.data(), token_bytes_, count, out);
}

std::shared_ptr<const TokenFile> TokenFile::open(const std::string& path, Format format) {
  // One reader per (file identity, format) in the process, while anyone holds it.
  using Key = std::tuple<dev_t, ino_t, off_t, std::int64_t, std::int64_t, int>;
  static std::mutex mu;
  static std::map<Key, std::weak_ptr<const TokenFile>> open_files;
  require_regular_file(path, "data");
  const struct stat st = stat_path(path, "data");
  const Key key{st.st_dev, st.st_ino, st.st_size, st.st_mtim.tv_sec, st.st_mtim.tv_nsec, static_cast<int>(format)};
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = open_files.find(key); it != open_files.end()) {
    if (auto file = it->second.lock()) return file;
  }
  auto file = std::make_shared<const TokenFile>(path, format);
  std::erase_if(open_files, [](const auto& entry) { return entry.second.expired(); });
  open_files[key] = file;
  return file;
}

std::optional<std::int64_t> TokenFile::first_token_at_least(std::int64_t limit) const {
  if (max_token_ < limit) return std::nullopt;
  const std::int64_t per_chunk = kScanChunkBytes / token_bytes_;
  std::vector<std::int64_t> tokens(static_cast<std::size_t>(std::min(per_chunk, size_)));
  for (std::int64_t start = 0; start < size_; start += per_chunk) {
    const std::int64_t n = std::min(per_chunk, size_ - start);
    read(start, n, tokens.data());
    for (std::int64_t i = 0; i < n; ++i) {
      if (tokens[static_cast<std::size_t>(i)] >= limit) return start + i;
    }
  }
  return std::nullopt;
}

std::int64_t TokenFile::byte_offset(std::int64_t i) const {
  return format_ == Format::Bytes ? i : kTokenFileHeaderBytes + token_bytes_ * i;
}

namespace {

template <class T>
std::string write_tokens(const std::string& path, const std::vector<T>& tokens, std::int32_t version) {
  MG_CHECK(tokens.size() <= static_cast<std::size_t>(INT32_MAX), "write_token_file '{}': {} tokens do not fit the "
           "int32 count of the llm.c header", path, tokens.size());
  std::int32_t header[256] = {kTokenFileMagic, version, static_cast<std::int32_t>(tokens.size())};
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  MG_CHECK(out.good(), "'{}' cannot be opened for writing: {}", path, std::strerror(errno));
  out.write(reinterpret_cast<const char*>(header), sizeof header);
  out.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(sizeof(T) * tokens.size()));
  out.close();
  MG_CHECK(out.good(), "'{}': write failed (disk full?)", path);
  io::Xxh128 hash;
  hash.update(header, sizeof header);
  hash.update(tokens.data(), sizeof(T) * tokens.size());   // little-endian in memory on the machines meshgrad runs on
  return hash.hex();
}

}  // namespace

std::string write_token_file(const std::string& path, const std::vector<std::uint16_t>& tokens) {
  return write_tokens(path, tokens, kTokenFileVersion);
}

std::string write_token_file(const std::string& path, const std::vector<std::uint32_t>& tokens) {
  return write_tokens(path, tokens, kTokenFileVersionU32);
}

namespace {

// What a --data (or validation) path names: its files, read in order.
struct Resolved {
  std::vector<std::shared_ptr<const TokenFile>> train, val;   // val: a directory's validation split
  bool builtin = false;
  bool sharded = false;     // a sharded directory or a glob: read in order
  bool directory = false;
  std::string meta;         // the meta.json that describes the files, "" for none
  std::string description;
};

std::vector<std::shared_ptr<const TokenFile>> open_all(const std::vector<std::string>& paths, TokenFile::Format format) {
  std::vector<std::shared_ptr<const TokenFile>> files;
  for (const std::string& p : paths) files.push_back(TokenFile::open(p, format));
  return files;
}

std::vector<std::string> file_names(const std::vector<std::string>& paths) {
  std::vector<std::string> names;
  for (const std::string& p : paths) names.push_back(std::filesystem::path(p).filename().string());
  return names;
}

Resolved resolve_glob(const std::string& pattern, const std::string& what) {
  namespace fs = std::filesystem;
  const std::vector<std::string> paths = expand_glob(pattern, what);
  const auto is_llmc = [](const std::string& p) { return fs::path(p).extension() == ".bin" || has_llmc_magic(p); };
  const bool llmc = is_llmc(paths.front());
  for (const std::string& p : paths) {
    MG_CHECK(is_llmc(p) == llmc, "{} '{}' matches '{}' ({}) and '{}' ({}): the matched files must all be llm.c token "
             "files or all text", what, pattern, paths.front(), llmc ? "llm.c tokens" : "text", p,
             llmc ? "text" : "llm.c tokens");
  }
  Resolved r;
  r.train = open_all(paths, llmc ? TokenFile::Format::LlmC : TokenFile::Format::Bytes);
  r.sharded = true;
  r.description = fmt::format("{} file(s) matching a pattern, {}", paths.size(), llmc ? "llm.c tokens" : "bytes");
  const fs::path dir = fs::path(paths.front()).parent_path();
  const bool one_dir = std::all_of(paths.begin(), paths.end(), [&](const std::string& p) { return fs::path(p).parent_path() == dir; });
  if (llmc && one_dir && fs::is_regular_file(dir / "meta.json")) r.meta = (dir / "meta.json").string();
  return r;
}

Resolved resolve_sharded_directory(const std::string& path, const std::string& what,
                                   const std::vector<std::string>& train_shards) {
  namespace fs = std::filesystem;
  const fs::path dir(path);
  MG_CHECK(!fs::exists(dir / "train.bin"), "{} '{}' has both train.bin and train_*.bin shards ({} ...): a data "
           "directory holds one dataset; prepare it again into an empty directory (or with --overwrite)", what, path,
           fs::path(train_shards.front()).filename().string());
  MG_CHECK(fs::exists(dir / "meta.json"), "{} '{}' is a directory of shards without meta.json: a data directory is "
           "the output of `meshgrad prepare` (train_*.bin, val_*.bin, meta.json)", what, path);
  const std::vector<std::string> val_shards = list_shards(path, "val");
  Resolved r;
  r.meta = (dir / "meta.json").string();
  const Meta meta = read_meta(r.meta);
  for (const auto& [split, found] : {std::pair{"train", &train_shards}, std::pair{"val", &val_shards}}) {
    const auto recorded = meta.shards.find(split);
    if (recorded == meta.shards.end()) continue;
    MG_CHECK(recorded->second == file_names(*found), "{} '{}' holds {} {} shard(s) ({}) but its meta.json lists {} "
             "({}): shards were added or removed after `meshgrad prepare` (prepare it again)", what, path,
             found->size(), split, fmt::join(file_names(*found), ", "), recorded->second.size(),
             fmt::join(recorded->second, ", "));
  }
  r.train = open_all(train_shards, TokenFile::Format::LlmC);
  r.val = open_all(val_shards, TokenFile::Format::LlmC);
  r.sharded = r.directory = true;
  r.description = fmt::format("prepared directory, {} + {} shards", r.train.size(), r.val.size());
  return r;
}

Resolved resolve_directory(const std::string& path, const std::string& what) {
  namespace fs = std::filesystem;
  const std::vector<std::string> train_shards = list_shards(path, "train");
  if (!train_shards.empty()) return resolve_sharded_directory(path, what, train_shards);
  const fs::path dir(path);
  for (const char* name : {"train.bin", "val.bin", "meta.json"}) {
    MG_CHECK(fs::exists(dir / name), "{} '{}' is a directory without {}: a data directory is the output of "
             "`meshgrad prepare` (train.bin, val.bin, meta.json; or train_*.bin, val_*.bin, meta.json)", what, path,
             name);
  }
  Resolved r;
  r.train.push_back(TokenFile::open((dir / "train.bin").string(), TokenFile::Format::LlmC));
  r.val.push_back(TokenFile::open((dir / "val.bin").string(), TokenFile::Format::LlmC));
  r.meta = (dir / "meta.json").string();
  r.directory = true;
  r.description = "prepared directory";
  return r;
}

// What `path` names (top of dataset.hpp); `what` ("data", "validation data") starts its messages.
Resolved resolve(const std::string& path, const std::string& what) {
  namespace fs = std::filesystem;
  if (path.empty()) {
    Resolved builtin;
    builtin.builtin = true;
    builtin.description = "bytes";
    return builtin;
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 && has_glob_characters(path)) return resolve_glob(path, what);
  st = stat_path(path, what);
  if (S_ISDIR(st.st_mode)) return resolve_directory(path, what);
  MG_CHECK(S_ISREG(st.st_mode), "{} '{}' is {}, not a regular file: --data takes a text file, an llm.c .bin "
           "token file, a directory written by meshgrad prepare or a glob of shards", what, path, file_kind(st.st_mode));
  const bool llmc = fs::path(path).extension() == ".bin" || has_llmc_magic(path);
  Resolved r;
  r.train.push_back(TokenFile::open(path, llmc ? TokenFile::Format::LlmC : TokenFile::Format::Bytes));
  r.description = llmc ? "llm.c tokens" : "bytes";
  const fs::path beside = fs::path(path).parent_path() / "meta.json";
  if (llmc && fs::is_regular_file(beside)) r.meta = beside.string();
  return r;
}

// The vocabulary of files without a meta.json: 256 for bytes, else the largest token + 1.
std::int64_t inferred_vocab(const std::vector<std::shared_ptr<const TokenFile>>& files) {
  std::int64_t largest = -1;
  for (const auto& f : files) {
    if (f->format() == TokenFile::Format::Bytes) return 256;
    largest = std::max(largest, f->max_token());
  }
  return largest + 1;
}

// A token file whose hash is not the one its meta.json records was changed after prepare (a
// train.bin copied in from elsewhere): its vocabulary and tokenizer may not fit. A file the
// meta.json beside it does not list at all (a stray shard a glob matched, reliability-3 N94, or
// another file named beside it) was not written by that prepare: refused the same way, for every
// path kind through this one check (a directory's own listing is checked against "shards" too).
void check_hashes(const Meta& meta, const std::string& meta_path, const std::vector<std::shared_ptr<const TokenFile>>& files) {
  std::set<std::string> listed;   // "files" (every token file prepare wrote) and "shards"
  for (const auto& [name, hash] : meta.file_hashes) listed.insert(name);
  for (const auto& [split, names] : meta.shards) listed.insert(names.begin(), names.end());
  for (const auto& f : files) {
    const std::string name = std::filesystem::path(f->path()).filename().string();
    // A meta.json that lists nothing (written by another tool) cannot tell.
    if (!listed.empty() && !listed.contains(name)) {
      std::vector<std::string> shown(listed.begin(), std::next(listed.begin(), std::min<std::ptrdiff_t>(6, std::ssize(listed))));
      if (listed.size() > shown.size()) shown.push_back(fmt::format("... {} in all", listed.size()));
      throw InvalidArgument(fmt::format("data '{}' is not one of the files its meta.json '{}' lists ({}): it was not "
                                        "written by the `meshgrad prepare` that wrote the directory (remove it, or "
                                        "prepare again)", f->path(), meta_path, fmt::join(shown, ", ")));
    }
    const auto it = meta.file_hashes.find(name);
    MG_CHECK(it == meta.file_hashes.end() || it->second == f->content_hash(),
             "data '{}' is not the file its meta.json '{}' describes: its XXH3-128 is {} but meta.json records {}; "
             "the directory changed after `meshgrad prepare` wrote it (prepare it again)",
             f->path(), meta_path, f->content_hash(), it->second);
  }
}

// The vocabulary of a resolved path's files and how it is known, for messages.
struct Vocab {
  std::int64_t size = 256;
  bool known = true;   // false: inferred from an llm.c file's largest token
  std::string how;
};

Vocab vocab_of(const Resolved& r, const std::vector<std::shared_ptr<const TokenFile>>& files) {
  if (!r.meta.empty()) {
    const Meta meta = read_meta(r.meta);
    check_hashes(meta, r.meta, r.train);
    check_hashes(meta, r.meta, r.val);
    return {meta.vocab, true, fmt::format("the vocabulary size {} of '{}'", meta.vocab, r.meta)};
  }
  if (r.builtin || files.empty() || files.front()->format() == TokenFile::Format::Bytes) {
    return {256, true, "256 (bytes as tokens)"};
  }
  const std::int64_t n = inferred_vocab(files);
  return {n, false, fmt::format("{} (largest token + 1; no meta.json)", n)};
}

}  // namespace

TokenDataset::TokenDataset(const std::string& path, int batch, int seq, std::uint64_t seed, const std::string& val_path)
    : batch_(batch), seq_(seq), seed_(seed) {
  MG_CHECK(batch >= 1 && seq >= 1, "TokenDataset: batch and seq must be >= 1, got batch={} seq={}", batch, seq);
  const Resolved r = resolve(path, "data");
  source_ = path.empty() ? "the built-in corpus" : "'" + path + "'";
  description_ = r.description;
  sequential_ = r.sharded;
  train_.files = r.train;
  train_.sharded = r.sharded;
  if (r.builtin) train_.bytes = kCorpus;
  val_.files = r.val;
  val_.sharded = r.sharded;
  const Vocab vocab = vocab_of(r, r.train);
  vocab_ = vocab.size;
  vocab_known_ = vocab.known;
  if (!r.meta.empty()) {
    metas_.push_back(r.meta);
    require_tokens_below(vocab_, vocab.how);
  }
  if (!val_path.empty()) use_validation_data(val_path, vocab.how);
  train_.index_windows(seq);
  val_.index_windows(seq);
  if (sequential_) {
    std::int64_t largest = 0;
    for (std::size_t i = 0; i < train_.pieces(); ++i) largest = std::max(largest, train_.piece_size(i));
    MG_CHECK(train_.windows() > 0, "data {}: none of its {} training shard(s) has a window of seq + 1 = {} tokens "
             "(the largest has {}); a window does not cross a shard boundary", source_, train_.pieces(), seq + 1, largest);
  }
  MG_CHECK(train_.size() >= static_cast<std::int64_t>(seq) + 1,
           "data {} has {} {} but a training window needs seq + 1 = {} (T inputs and T shifted targets)", source_,
           train_.size(), description_ == "bytes" ? "bytes" : "training tokens", seq + 1);
  identity_.train_hash = train_.hash();
  identity_.train_tokens = train_.size();
  identity_.val_hash = val_.hash();
  identity_.val_tokens = val_.size();
}

void TokenDataset::use_validation_data(const std::string& val_path, const std::string& data_vocab_how) {
  const Resolved r = resolve(val_path, "validation data");
  Tokens val;
  val.files = r.directory ? r.val : r.train;
  val.sharded = r.sharded;
  const Vocab vocab = vocab_of(r, val.files);
  if (!r.meta.empty()) metas_.push_back(r.meta);
  const std::string both = fmt::format("validation data '{}' has vocabulary {}, data {} has {}", val_path, vocab.how,
                                       source_, data_vocab_how);
  if (vocab.known && vocab_known_) {
    MG_CHECK(vocab.size == vocab_, "{}: the two must agree (tokens of one tokenizer)", both);
  } else if (vocab.known) {
    // Only the validation side knows its vocabulary: the training tokens must fit it.
    check_tokens_below(train_, vocab.size, fmt::format("the validation data's vocabulary ({})", both));
    vocab_ = vocab.size;
    vocab_known_ = true;
  } else if (!vocab_known_) {
    vocab_ = std::max(vocab_, vocab.size);   // both inferred: the larger holds both
  }
  check_tokens_below(val, vocab_, fmt::format("the data's vocabulary ({})", both));
  val_ = std::move(val);
}

std::int64_t TokenDataset::Tokens::piece_size(std::size_t i) const {
  return files.empty() ? static_cast<std::int64_t>(bytes.size()) : files[i]->size();
}

std::int64_t TokenDataset::Tokens::size() const {
  std::int64_t n = 0;
  for (std::size_t i = 0; i < pieces(); ++i) n += piece_size(i);
  return n;
}

void TokenDataset::Tokens::read(std::size_t piece, std::int64_t start, std::int64_t count, std::int64_t* out) const {
  if (!files.empty()) return files[piece]->read(start, count, out);
  for (std::int64_t i = 0; i < count; ++i) out[i] = static_cast<unsigned char>(bytes[static_cast<std::size_t>(start + i)]);
}

void TokenDataset::Tokens::index_windows(std::int64_t seq) {
  first_window.assign(1, 0);
  for (std::size_t i = 0; i < pieces(); ++i) {
    const std::int64_t n = piece_size(i);
    first_window.push_back(first_window.back() + (n >= seq + 1 ? (n - 1) / seq : 0));
  }
}

std::pair<std::size_t, std::int64_t> TokenDataset::Tokens::window(std::int64_t k, std::int64_t seq) const {
  // The last piece whose first window is <= k (pieces without windows share their successor's).
  const auto it = std::upper_bound(first_window.begin(), first_window.end() - 1, k) - 1;
  const auto piece = static_cast<std::size_t>(it - first_window.begin());
  return {piece, (k - *it) * seq};
}

std::string TokenDataset::Tokens::hash() const {
  if (files.empty()) return bytes.empty() ? "" : io::xxh128_hex(bytes.data(), bytes.size());
  if (files.size() == 1 && !sharded) return files.front()->content_hash();
  std::vector<std::string> hashes;
  for (const auto& f : files) hashes.push_back(f->content_hash());
  return hash_of_hashes(hashes);
}

nn::Batch TokenDataset::windows(const Tokens& tokens, const std::vector<std::pair<std::size_t, std::int64_t>>& starts) const {
  const std::int64_t B = static_cast<std::int64_t>(starts.size()), T = seq_;
  std::vector<std::int64_t> inputs(static_cast<std::size_t>(B * T)), targets(static_cast<std::size_t>(B * T));
  std::vector<std::int64_t> window(static_cast<std::size_t>(T + 1));
  for (std::int64_t b = 0; b < B; ++b) {
    const auto& [piece, offset] = starts[static_cast<std::size_t>(b)];
    tokens.read(piece, offset, T + 1, window.data());
    std::copy(window.begin(), window.end() - 1, inputs.begin() + b * T);
    std::copy(window.begin() + 1, window.end(), targets.begin() + b * T);
  }
  return {Tensor::from_int64(inputs, {B, T}), Tensor::from_int64(targets, {B, T})};
}

nn::Batch TokenDataset::next_batch(std::int64_t step) const {
  MG_CHECK(step >= 0, "TokenDataset::next_batch: step must be >= 0, got {}", step);
  const std::int64_t B = batch_, T = seq_;
  if (sequential_) return batch_at_position(step * B * T);
  // Window starts 0 .. size - T - 1 inclusive: the targets reach index start + T.
  const std::int64_t starts = size() - T;
  std::vector<std::pair<std::size_t, std::int64_t>> rows(static_cast<std::size_t>(B));
  for (std::int64_t b = 0; b < B; ++b) {
    const double u = random::uniform(seed_, static_cast<std::uint64_t>(step * B + b));
    rows[static_cast<std::size_t>(b)] = {0, std::min(starts - 1, static_cast<std::int64_t>(u * static_cast<double>(starts)))};
  }
  return windows(train_, rows);
}

nn::Batch TokenDataset::batch_at_position(std::int64_t position) const {
  MG_CHECK(position >= 0, "TokenDataset::batch_at_position: the position must be >= 0, got {}", position);
  const std::int64_t W = train_.windows(), first = position / seq_;
  std::vector<std::pair<std::size_t, std::int64_t>> rows(static_cast<std::size_t>(batch_));
  for (std::int64_t b = 0; b < batch_; ++b) rows[static_cast<std::size_t>(b)] = train_.window((first + b) % W, seq_);
  return windows(train_, rows);
}

std::int64_t TokenDataset::next_position(std::int64_t position) const {
  return position + static_cast<std::int64_t>(batch_) * seq_;
}

nlohmann::json TokenDataset::position_json(std::int64_t position) const {
  MG_CHECK(position >= 0, "TokenDataset::position_json: the position must be >= 0, got {}", position);
  const std::int64_t W = train_.windows(), k = position / seq_;
  const auto [piece, offset] = train_.window(k % W, seq_);
  const std::string shard = train_.files.empty() ? std::string("the built-in corpus")
                                                 : std::filesystem::path(train_.files[piece]->path()).filename().string();
  return {{"tokens", position}, {"epoch", k / W}, {"shard", shard}, {"offset", offset}};
}

void TokenDataset::check_tokens_below(const Tokens& tokens, std::int64_t limit, const std::string& what) const {
  if (tokens.files.empty()) {
    MG_CHECK(tokens.bytes.empty() || limit >= 256, "data {}: byte tokens reach 255, not below {}", source_, what);
    return;
  }
  for (const auto& file : tokens.files) {
    const std::optional<std::int64_t> bad = file->first_token_at_least(limit);
    if (!bad) continue;
    std::int64_t token = 0;
    file->read(*bad, 1, &token);
    throw InvalidArgument(fmt::format("data '{}': token {} at position {} (byte offset {}) is not below {}",
                                      file->path(), token, *bad, file->byte_offset(*bad), what));
  }
}

void TokenDataset::require_tokens_below(std::int64_t limit, const std::string& what) const {
  check_tokens_below(train_, limit, what);
  check_tokens_below(val_, limit, what);
}

std::vector<std::string> TokenDataset::input_files() const {
  std::vector<std::string> files;
  for (const Tokens* t : {&train_, &val_}) {
    for (const auto& f : t->files) files.push_back(f->path());
  }
  files.insert(files.end(), metas_.begin(), metas_.end());
  return files;
}

bool TokenDataset::has_validation() const { return val_.windows() > 0; }

std::int64_t TokenDataset::validation_batches() const { return (val_.windows() + batch_ - 1) / batch_; }

nn::Batch TokenDataset::validation_batch(std::int64_t index) const {
  MG_CHECK(has_validation(), "data {}: no validation split with a window of seq + 1 = {} tokens ({}; a directory "
           "written by meshgrad prepare with --val-fraction > 0 has one, or give validation data)", source_, seq_ + 1,
           val_.files.empty() ? std::string("only prepared directories have one")
                              : fmt::format("the validation split has {} tokens in {} file(s)", val_.size(), val_.files.size()));
  MG_CHECK(index >= 0, "TokenDataset::validation_batch: index must be >= 0, got {}", index);
  const std::int64_t W = val_.windows();
  std::vector<std::pair<std::size_t, std::int64_t>> rows(static_cast<std::size_t>(batch_));
  for (std::int64_t b = 0; b < batch_; ++b) rows[static_cast<std::size_t>(b)] = val_.window((index * batch_ + b) % W, seq_);
  return windows(val_, rows);
}

nlohmann::json DataIdentity::to_json() const {
  return {{"train_xxh128", train_hash}, {"val_xxh128", val_hash}, {"train_tokens", train_tokens}, {"val_tokens", val_tokens}};
}

DataIdentity DataIdentity::from_json(const nlohmann::json& j) {
  DataIdentity id;
  if (!j.is_object()) return id;
  const auto text = [&](const char* key) {
    const auto it = j.find(key);
    return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  const auto count = [&](const char* key) {
    const auto it = j.find(key);
    return it != j.end() && it->is_number_integer() ? it->get<std::int64_t>() : std::int64_t{-1};
  };
  id.train_hash = text("train_xxh128");
  id.val_hash = text("val_xxh128");
  id.train_tokens = count("train_tokens");
  id.val_tokens = count("val_tokens");
  return id;
}

std::string DataIdentity::str() const {
  std::string s = fmt::format("{} training tokens (XXH3-128 {})", train_tokens, train_hash.empty() ? "unknown" : train_hash);
  if (!val_hash.empty()) s += fmt::format(", {} validation tokens (XXH3-128 {})", val_tokens, val_hash);
  return s;
}

void agree_on_data(comm::Communicator& comm, const DataIdentity& mine, const std::string& source) {
  // Fixed-size words per rank: both hashes (32 hex digits each, "" as zeros) and both counts.
  constexpr std::size_t kWords = 10;
  std::array<std::int64_t, kWords> words{};
  MG_CHECK(mine.train_hash.size() <= 32 && mine.val_hash.size() <= 32, "agree_on_data: a hash longer than 32 digits");
  std::memcpy(words.data(), mine.train_hash.data(), mine.train_hash.size());
  std::memcpy(reinterpret_cast<char*>(words.data()) + 32, mine.val_hash.data(), mine.val_hash.size());
  words[8] = mine.train_tokens;
  words[9] = mine.val_tokens;
  const int P = comm.size();
  std::vector<std::int64_t> all(kWords * static_cast<std::size_t>(P));
  comm.all_gather(comm::ConstBuffer{words.data(), kWords, DType::Int64}, comm::MutableBuffer{all.data(), all.size(), DType::Int64});
  const auto identity_of = [&](int r) {
    const std::int64_t* w = all.data() + kWords * static_cast<std::size_t>(r);
    const char* bytes = reinterpret_cast<const char*>(w);
    DataIdentity id;
    id.train_hash.assign(bytes, strnlen(bytes, 32));
    id.val_hash.assign(bytes + 32, strnlen(bytes + 32, 32));
    id.train_tokens = w[8];
    id.val_tokens = w[9];
    return id;
  };
  const DataIdentity first = identity_of(0);
  for (int r = 1; r < P; ++r) {
    const DataIdentity other = identity_of(r);
    if (other == first) continue;
    throw InvalidArgument(fmt::format("the ranks read different data from --data {}: rank 0 has {} but rank {} has {}; "
                                      "every rank must train on the same bytes (on several hosts, each host's copy "
                                      "of the data must be identical)", source, first.str(), r, other.str()));
  }
}

nn::Batch dp_shard(const nn::Batch& batch, int dp_rank, int dp_size) {
  MG_CHECK(batch.inputs.defined() && batch.targets.defined() && batch.inputs.dim() == 2 &&
               batch.inputs.shape() == batch.targets.shape(),
           "dp_shard: need inputs and targets of the same shape [B, T], got {} and {}",
           batch.inputs.defined() ? batch.inputs.str() : "undefined",
           batch.targets.defined() ? batch.targets.str() : "undefined");
  const std::int64_t B = batch.inputs.size(0);
  MG_CHECK(dp_size >= 1 && dp_size <= B, "dp_shard: a batch of {} rows cannot be split over dp={} (each rank "
           "needs at least one row; use --batch >= dp)", B, dp_size);
  const ShardRange rows = shard_range(B, dp_size, dp_rank);
  // Slices compose: a micro-batch of a replica's rows knows its rows' place in the global batch.
  const std::int64_t global_rows = batch.global_rows > 0 ? batch.global_rows : B;
  const std::int64_t base = batch.global_rows > 0 ? batch.row_offset : 0;
  return {batch.inputs.narrow(0, rows.offset, rows.size).clone(), batch.targets.narrow(0, rows.offset, rows.size).clone(),
          base + rows.offset, global_rows};
}

}  // namespace meshgrad::data
