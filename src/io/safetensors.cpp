// safetensors reader and writer (format contract in include/meshgrad/io/safetensors.hpp).
//
// Reading validates the whole header before allocating any tensor: every size it trusts is first
// bounded by the file's real size, so a corrupt or hostile file gives an error naming the file,
// the tensor and the byte offset, never a crash, a hang or a huge allocation.
#include "meshgrad/io/safetensors.hpp"

#include "meshgrad/io/file_io.hpp"
#include "meshgrad/io/json_input.hpp"
#include "meshgrad/io/output_path.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>
#include <string_view>

namespace meshgrad::io {

// The data section is copied to and from tensor memory as is: the format is little-endian, so is
// every machine meshgrad builds on today. A big-endian port would byte-swap here.
static_assert(std::endian::native == std::endian::little,
              "meshgrad's safetensors code assumes a little-endian machine (the format is little-endian)");

SafetensorsError::SafetensorsError(std::string path, const std::string& what)
    : InvalidArgument(fmt::format("safetensors file '{}': {}", path, what)), path_(std::move(path)) {}

namespace {

using json = nlohmann::json;

[[noreturn]] void fail(const std::string& path, const std::string& what) { throw SafetensorsError(path, what); }

// The format's dtypes: the name, bytes per element, and what meshgrad reads them as (readable).
// `rank` is the position in the reference implementation's Dtype enum, which its writer sorts by,
// largest first. (The sub-byte types newer versions of the format name, F4 and F6_*, are not
// here: a file holding them is refused at open.)
struct StoredType {
  const char* name;
  std::uint64_t size;
  int rank;
  bool readable;
  DType reads_as;
};
constexpr StoredType kStoredTypes[] = {
    {"BOOL", 1, 0, false, DType::Float32},   {"U8", 1, 1, false, DType::Float32},
    {"I8", 1, 2, false, DType::Float32},     {"F8_E5M2", 1, 3, false, DType::Float32},
    {"F8_E4M3", 1, 4, false, DType::Float32}, {"I16", 2, 5, false, DType::Float32},
    {"U16", 2, 6, false, DType::Float32},    {"F16", 2, 7, true, DType::Float32},
    {"BF16", 2, 8, true, DType::Float32},    {"I32", 4, 9, false, DType::Float32},
    {"U32", 4, 10, false, DType::Float32},   {"F32", 4, 11, true, DType::Float32},
    {"F64", 8, 12, true, DType::Float64},    {"I64", 8, 13, true, DType::Int64},
    {"U64", 8, 14, false, DType::Float32},
};

const StoredType* find_stored_type(const std::string& name) {
  for (const auto& t : kStoredTypes)
    if (name == t.name) return &t;
  return nullptr;
}

const StoredType& stored_type(const char* name) {
  const StoredType* t = find_stored_type(name);
  if (t == nullptr) throw InvalidArgument(fmt::format("safetensors: no dtype named {}", name));
  return *t;
}

// The file's dtype of a meshgrad tensor written natively.
const StoredType& native_type(DType dtype) {
  switch (dtype) {
    case DType::Float32: return stored_type("F32");
    case DType::Float64: return stored_type("F64");
    case DType::Int64: return stored_type("I64");
    case DType::BFloat16: return stored_type("BF16");   // its bits as they are (read back as float32)
  }
  throw InvalidArgument(fmt::format("safetensors: dtype {} has no safetensors name", dtype_name(dtype)));
}

// ---- half precision: IEEE binary16 (5 exponent bits, 10 mantissa bits, bias 15) and bfloat16
// (8 exponent bits, 7 mantissa bits, bias 127), one sign bit each.
struct HalfFormat {
  int mantissa_bits;
  int bias;
};
constexpr HalfFormat kF16{10, 15};
constexpr HalfFormat kBF16{7, 127};
// Elements converted per read or write call (bounds the temporary buffer).
constexpr std::int64_t kHalfChunk = std::int64_t{1} << 20;

double decode_half(std::uint16_t bits, HalfFormat f) {
  const int m = f.mantissa_bits;
  const bool negative = (bits & 0x8000u) != 0;
  const unsigned exponent_field = (bits & 0x7fffu) >> m;
  const unsigned mantissa = bits & ((1u << m) - 1);
  const unsigned all_ones = (1u << (15 - m)) - 1;
  double value;
  if (exponent_field == all_ones) {
    value = mantissa != 0 ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (exponent_field == 0) {   // zero or subnormal: mantissa * 2^(1 - bias - m)
    value = std::ldexp(static_cast<double>(mantissa), 1 - f.bias - m);
  } else {                           // (2^m + mantissa) * 2^(e - bias - m)
    value = std::ldexp(static_cast<double>((1u << m) + mantissa), static_cast<int>(exponent_field) - f.bias - m);
  }
  return negative ? -value : value;
}

// Round to nearest, ties to even, at the format's quantum for |x|'s binade (the subnormal quantum
// below the smallest normal); the scaling by a power of two is exact, so there is one rounding.
std::uint16_t encode_half(double x, HalfFormat f) {
  const int m = f.mantissa_bits;
  const std::uint16_t sign = std::signbit(x) ? 0x8000u : 0u;
  const std::uint16_t exponent_all_ones = static_cast<std::uint16_t>(((1u << (15 - m)) - 1) << m);
  if (std::isnan(x)) return static_cast<std::uint16_t>(sign | exponent_all_ones | (1u << (m - 1)));
  const double a = std::fabs(x);
  if (std::isinf(a)) return static_cast<std::uint16_t>(sign | exponent_all_ones);
  if (a == 0) return sign;
  const int min_exponent = 1 - f.bias;   // of the smallest normal
  int e = std::max(std::ilogb(a), min_exponent);
  const double scaled = std::ldexp(a, m - e);   // < 2^(m+1); < 2^m for a subnormal result
  double rounded = std::floor(scaled);
  const double fraction = scaled - rounded;
  if (fraction > 0.5 || (fraction == 0.5 && std::fmod(rounded, 2.0) != 0)) rounded += 1;
  auto n = static_cast<std::uint32_t>(rounded);
  if (n == (2u << m)) {   // rounded up into the next binade
    n >>= 1;
    e += 1;
  }
  if (n < (1u << m)) return static_cast<std::uint16_t>(sign | n);   // subnormal (exponent field 0) or zero
  // n in [2^m, 2^(m+1)): a normal number (a subnormal that rounded up to 2^m lands here too).
  if (e > f.bias) return static_cast<std::uint16_t>(sign | exponent_all_ones);   // beyond the largest finite
  return static_cast<std::uint16_t>(sign | (static_cast<unsigned>(e + f.bias) << m) | (n - (1u << m)));
}

UniqueFd open_for_reading(const std::string& path, std::uint64_t* size) {
  try {
    return open_regular_file(path, size);   // a FIFO is refused without blocking
  } catch (const FileIoError& e) {
    const bool not_regular = std::string_view(e.what()).find("is not a regular file") != std::string_view::npos;
    fail(path, not_regular ? fmt::format("not a regular file ({})", e.reason())
                           : fmt::format("cannot open for reading: {}", e.reason()));
  }
}

// Reads exactly n bytes at file offset `offset`; `what` says what for the error message.
void read_exact(int fd, const std::string& path, std::uint64_t offset, void* out, std::uint64_t n,
                const std::string& what) {
  auto* dst = static_cast<std::byte*>(out);
  std::uint64_t done = 0;
  while (done < n) {
    const std::size_t chunk = static_cast<std::size_t>(std::min<std::uint64_t>(n - done, std::uint64_t{1} << 30));
    const ssize_t got = ::pread(fd, dst + done, chunk, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      fail(path, fmt::format("read error at byte {} while reading {}: {}", offset + done, what, errno_text(errno)));
    }
    if (got == 0)
      fail(path, fmt::format("file ends at byte {} while reading {} (bytes {}..{} expected; was the file changed "
                             "while reading?)",
                             offset + done, what, offset, offset + n));
    done += static_cast<std::uint64_t>(got);
  }
}

std::string json_type(const json& j) { return j.type_name(); }

// Reads a non-negative integer that fits in u64 (JSON numbers that are integers: "3", not "3.0").
bool as_u64(const json& j, std::uint64_t* out) {
  if (j.is_number_unsigned()) {
    *out = j.get<std::uint64_t>();
    return true;
  }
  if (j.is_number_integer() && j.get<std::int64_t>() >= 0) {
    *out = static_cast<std::uint64_t>(j.get<std::int64_t>());
    return true;
  }
  return false;
}

// The deepest a valid header nests: the top-level object (1) > an entry object (2) > its shape or
// data_offsets array (3). Anything deeper is refused while parsing, before it is built.
constexpr int kMaxHeaderDepth = 3;

json parse_header(const std::string& path, const std::string& text) {
  try {
    return parse_untrusted_json(text, kMaxHeaderDepth);
  } catch (const JsonInputError& e) {
    switch (e.kind()) {
      case JsonInputError::Kind::DuplicateKey:
        if (e.path().empty()) fail(path, fmt::format("header: tensor name '{}' appears more than once", e.key()));
        fail(path, fmt::format("header: key '{}' appears more than once in the entry of {}", e.key(),
                               json_path_text(e.path())));
      case JsonInputError::Kind::TooDeep:
        fail(path, fmt::format("header: JSON {}; a header is an object of entries whose shape and data_offsets are "
                               "arrays of integers",
                               e.what()));
      case JsonInputError::Kind::Syntax:
        // The header starts at file byte 8.
        fail(path, fmt::format("header is not valid JSON (at byte {}): {}", 8 + e.byte().value_or(0), e.what()));
    }
    fail(path, fmt::format("header: {}", e.what()));
  }
}

// Checks one header entry and returns it; data_size bounds the offsets.
SafetensorsEntry parse_entry(const std::string& path, const std::string& name, const json& value,
                             std::uint64_t data_start, std::uint64_t data_size) {
  const auto bad = [&](const std::string& what) { fail(path, fmt::format("tensor '{}': {}", json_quote(name), what)); };
  if (!value.is_object())
    bad(fmt::format("entry is a JSON {}, expected an object with dtype, shape and data_offsets", json_type(value)));
  for (const auto& [key, _] : value.items())
    if (key != "dtype" && key != "shape" && key != "data_offsets")
      bad(fmt::format("unexpected key '{}' (an entry has dtype, shape and data_offsets)", json_quote(key)));
  for (const char* key : {"dtype", "shape", "data_offsets"})
    if (!value.contains(key)) bad(fmt::format("entry has no '{}'", key));

  SafetensorsEntry entry;
  entry.name = name;

  const json& dtype = value["dtype"];
  if (!dtype.is_string()) bad(fmt::format("dtype is a JSON {}, expected a string", json_type(dtype)));
  const std::string dtype_text = dtype.get<std::string>();
  const StoredType* found = find_stored_type(dtype_text);
  if (found == nullptr)
    bad(fmt::format("dtype \"{}\" is not a safetensors dtype meshgrad knows (it reads F32, F64, I64, F16 and BF16, "
                    "and accepts BOOL, U8, I8, F8_E5M2, F8_E4M3, I16, U16, I32, U32 and U64 in a file without reading "
                    "them)",
                    json_quote(dtype_text)));
  entry.dtype = found->reads_as;
  entry.stored = found->name;
  entry.readable = found->readable;

  // Messages quote the untrusted JSON through json_excerpt only (bounded length).
  const json& shape = value["shape"];
  if (!shape.is_array()) bad(fmt::format("shape is a JSON {}, expected an array of integers", json_type(shape)));
  for (std::size_t i = 0; i < shape.size(); ++i) {
    const json& dim = shape[i];
    if (dim.is_number_integer() && !dim.is_number_unsigned() && dim.get<std::int64_t>() < 0)
      bad(fmt::format("shape {} has a negative dim {} (at index {})", json_excerpt(shape), dim.get<std::int64_t>(), i));
    std::uint64_t d = 0;
    if (!as_u64(dim, &d))
      bad(fmt::format("shape {}: dim {} is a JSON {}, expected an integer", json_excerpt(shape), i, json_type(dim)));
    if (d > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      bad(fmt::format("shape {}: dim {} is too large", json_excerpt(shape), i));
    entry.shape.push_back(static_cast<std::int64_t>(d));
  }

  const json& offsets = value["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2)
    bad(fmt::format("data_offsets is {}, expected an array [begin, end] of two integers", json_excerpt(offsets)));
  if (!as_u64(offsets[0], &entry.begin) || !as_u64(offsets[1], &entry.end))
    bad(fmt::format("data_offsets {} must be two non-negative integers", json_excerpt(offsets)));
  if (entry.begin > entry.end) bad(fmt::format("data_offsets [{}, {}]: begin is after end", entry.begin, entry.end));
  if (entry.end > data_size) {
    // data_start + end can pass 2^64 (end is any u64): say so instead of printing a wrapped byte.
    std::uint64_t end_byte = 0;
    const std::string where = __builtin_add_overflow(data_start, entry.end, &end_byte)
                                  ? std::string("beyond byte 2^64")
                                  : fmt::format("at byte {}", end_byte);
    bad(fmt::format("data_offsets [{}, {}] end {}, past the end of the data section (bytes {}..{} of the file)",
                    entry.begin, entry.end, where, data_start, data_start + data_size));
  }

  // prod(shape) * dtype size must equal the byte range. Overflow-checked: a dim can be up to 2^63.
  std::uint64_t nbytes = found->size;
  bool overflow = false;
  const bool empty = std::find(entry.shape.begin(), entry.shape.end(), 0) != entry.shape.end();
  if (empty) {
    nbytes = 0;
  } else {
    for (std::int64_t d : entry.shape) overflow = overflow || __builtin_mul_overflow(nbytes, static_cast<std::uint64_t>(d), &nbytes);
  }
  if (overflow || nbytes != entry.end - entry.begin)
    bad(fmt::format("shape {} of {} needs {} bytes but data_offsets [{}, {}] hold {} bytes (at byte {})",
                    shape_str(entry.shape), found->name, overflow ? std::string("more than 2^64") : std::to_string(nbytes),
                    entry.begin, entry.end, entry.end - entry.begin, data_start + entry.begin));
  // The tensor code computes strides as products of the dims with 0 counted as 1: that product must
  // fit in int64 even for a tensor with no elements (shape [0, 2^62, 4] holds 0 bytes).
  std::int64_t stride_product = 1;
  for (std::int64_t d : entry.shape)
    if (__builtin_mul_overflow(stride_product, std::max<std::int64_t>(d, 1), &stride_product))
      bad(fmt::format("shape {}: the product of its non-zero dims is more than 2^63", shape_str(entry.shape)));
  return entry;
}

}  // namespace

std::string safetensors_dtype_name(DType dtype) { return native_type(dtype).name; }

float f16_to_float(std::uint16_t bits) { return static_cast<float>(decode_half(bits, kF16)); }
float bf16_to_float(std::uint16_t bits) { return static_cast<float>(decode_half(bits, kBF16)); }
std::uint16_t float_to_f16(double value) { return encode_half(value, kF16); }
std::uint16_t float_to_bf16(double value) { return encode_half(value, kBF16); }

FloatStorage parse_float_storage(const std::string& name) {
  if (name == "float32") return FloatStorage::Native;
  if (name == "float16") return FloatStorage::F16;
  if (name == "bfloat16") return FloatStorage::BF16;
  throw InvalidArgument(fmt::format("unknown storage dtype '{}' (expected float32, float16 or bfloat16)", name));
}

SafetensorsFile::SafetensorsFile(std::string path) : path_(std::move(path)) {
  UniqueFd fd = open_for_reading(path_, &file_size_);
  if (file_size_ < 8)
    fail(path_, fmt::format("file has {} bytes, too short for the 8-byte header length", file_size_));
  unsigned char length_bytes[8];
  read_exact(fd.get(), path_, 0, length_bytes, 8, "the header length");
  std::uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | length_bytes[i];
  if (header_size > kMaxSafetensorsHeaderBytes)
    fail(path_, fmt::format("header length {} (bytes 0..8) is larger than the {} bytes meshgrad accepts: not a "
                            "safetensors file or corrupt",
                            header_size, kMaxSafetensorsHeaderBytes));
  if (header_size > file_size_ - 8)
    fail(path_, fmt::format("header length {} (bytes 0..8) runs past the end of the file ({} bytes): truncated or "
                            "corrupt",
                            header_size, file_size_));
  data_start_ = 8 + header_size;
  const std::uint64_t data_size = file_size_ - data_start_;

  std::string text(static_cast<std::size_t>(header_size), '\0');
  read_exact(fd.get(), path_, 8, text.data(), header_size, "the header");
  fd.reset();

  const json header = parse_header(path_, text);
  if (!header.is_object()) fail(path_, fmt::format("header is a JSON {}, expected an object (at byte 8)", json_type(header)));

  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object())
        fail(path_, fmt::format("__metadata__ is a JSON {}, expected an object of strings", json_type(value)));
      for (const auto& [key, text_value] : value.items()) {
        if (!text_value.is_string())
          fail(path_, fmt::format("__metadata__ value of '{}' is a JSON {}, expected a string", json_quote(key),
                                  json_type(text_value)));
        metadata_[key] = text_value.get<std::string>();
      }
      continue;
    }
    entries_.push_back(parse_entry(path_, name, value, data_start_, data_size));
  }

  // The tensors must tile the data section: sorted by offset, each begins where the previous ended
  // and the last ends at the end of the file. (Zero-byte tensors sort before a tensor at the same
  // begin and tile trivially.)
  std::sort(entries_.begin(), entries_.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  std::uint64_t covered = 0;
  const SafetensorsEntry* previous = nullptr;
  for (const auto& e : entries_) {
    if (e.begin < covered)
      fail(path_, fmt::format("tensors '{}' and '{}' overlap: '{}' starts at data offset {} (byte {}) but '{}' ends "
                              "at data offset {}",
                              json_quote(previous->name), json_quote(e.name), json_quote(e.name), e.begin,
                              data_start_ + e.begin, json_quote(previous->name), covered));
    if (e.begin > covered)
      fail(path_, fmt::format("gap in the data section: bytes {}..{} (data offsets {}..{}) belong to no tensor "
                              "(next tensor: '{}')",
                              data_start_ + covered, data_start_ + e.begin, covered, e.begin, json_quote(e.name)));
    covered = e.end;
    previous = &e;
  }
  if (covered != data_size)
    fail(path_, fmt::format("{} trailing bytes after the last tensor: bytes {}..{} belong to no tensor", data_size - covered,
                            data_start_ + covered, file_size_));
  for (std::size_t i = 0; i < entries_.size(); ++i) index_[entries_[i].name] = i;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& e : entries_) out.push_back(e.name);
  return out;
}

bool SafetensorsFile::contains(const std::string& name) const { return index_.count(name) != 0; }

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) fail(path_, fmt::format("no tensor named '{}' (the file has {} tensors)", name, entries_.size()));
  return entries_[it->second];
}

Tensor SafetensorsFile::get(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  std::uint64_t size_now = 0;
  UniqueFd fd = open_for_reading(path_, &size_now);
  if (size_now != file_size_)
    fail(path_, fmt::format("file changed size from {} to {} bytes since its header was read", file_size_, size_now));
  if (!e.readable)
    fail(path_, fmt::format("tensor '{}' has dtype {}, which meshgrad does not read (it reads F32, F64, I64, F16 and "
                            "BF16)",
                            json_quote(name), e.stored));
  // Sizes were checked against the file's size, so these allocations are bounded by it.
  Tensor t = Tensor::empty(e.shape, e.dtype);
  const std::string what = fmt::format("tensor '{}'", name);
  if (e.stored != "F16" && e.stored != "BF16") {
    read_exact(fd.get(), path_, data_start_ + e.begin, t.raw_data(), e.end - e.begin, what);
    return t;
  }
  // Half precision: read in chunks and widen to float32 (exact).
  const HalfFormat format = e.stored == "F16" ? kF16 : kBF16;
  float* out = t.data<float>();
  const std::int64_t n = t.numel();
  std::vector<std::uint16_t> bits(static_cast<std::size_t>(std::min<std::int64_t>(n, kHalfChunk)));
  for (std::int64_t at = 0; at < n; at += kHalfChunk) {
    const std::int64_t count = std::min<std::int64_t>(kHalfChunk, n - at);
    read_exact(fd.get(), path_, data_start_ + e.begin + 2 * static_cast<std::uint64_t>(at), bits.data(),
               2 * static_cast<std::uint64_t>(count), what);
    for (std::int64_t i = 0; i < count; ++i)
      out[at + i] = static_cast<float>(decode_half(bits[static_cast<std::size_t>(i)], format));
  }
  return t;
}

std::map<std::string, Tensor> read_safetensors(const std::string& path) {
  const SafetensorsFile file(path);
  std::map<std::string, Tensor> out;
  for (const auto& name : file.names()) out.emplace(name, file.get(name));
  return out;
}

// ---- writing -------------------------------------------------------------------------------------

namespace {

// One tensor to write: contiguous, with the dtype it is stored as.
struct Planned {
  std::string name;
  Tensor tensor;
  const StoredType* type;
  std::uint64_t nbytes() const { return static_cast<std::uint64_t>(tensor.numel()) * type->size; }
};

// Which string of a header that JSON refuses is not valid UTF-8: 'metadata "data"', 'tensor name
// "w\uFFFD"' (bad bytes replaced), for the error.
std::string invalid_string(const std::vector<Planned>& ordered, const std::map<std::string, std::string>& metadata) {
  using J = nlohmann::ordered_json;
  const auto invalid = [](const std::string& text) {
    try {
      (void)J(text).dump(-1, ' ', false, J::error_handler_t::strict);
      return false;
    } catch (const J::exception&) {
      return true;
    }
  };
  const auto quoted = [](const std::string& text) { return J(text).dump(-1, ' ', false, J::error_handler_t::replace); };
  for (const auto& [key, value] : metadata) {
    if (invalid(key) || invalid(value)) return fmt::format("metadata {}", quoted(key));
  }
  for (const Planned& p : ordered) {
    if (invalid(p.name)) return fmt::format("tensor name {}", quoted(p.name));
  }
  return "a tensor name or metadata string";
}

// The header JSON for tensors already in data order: compact, "__metadata__" first, padded with
// spaces to a multiple of 8 bytes so that the data section starts 8-byte aligned.
std::string make_header(const std::string& path, const std::vector<Planned>& ordered,
                        const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;   // std::map: sorted keys
    header["__metadata__"] = std::move(meta);
  }
  std::uint64_t offset = 0;
  for (const Planned& p : ordered) {
    nlohmann::ordered_json entry = nlohmann::ordered_json::object();
    entry["dtype"] = p.type->name;
    entry["shape"] = p.tensor.shape();
    entry["data_offsets"] = {offset, offset + p.nbytes()};
    header[p.name] = std::move(entry);
    offset += p.nbytes();
  }
  std::string text;
  try {
    text = header.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::strict);
  } catch (const nlohmann::ordered_json::exception& e) {
    // JSON text is UTF-8 (train refuses such text before it trains).
    fail(path, fmt::format("{} is not valid UTF-8: {}", invalid_string(ordered, metadata), e.what()));
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

HalfFormat half_format(const StoredType& type) { return std::string_view(type.name) == "F16" ? kF16 : kBF16; }

// Calls f(i, x) for every element of a contiguous floating tensor, x as a double.
template <class F>
void for_each_value(const Tensor& t, F&& f) {
  dispatch_floating(t.dtype(), "write_safetensors", [&]<class T>() {
    const T* data = t.data<T>();
    for (std::int64_t i = 0; i < t.numel(); ++i) f(i, static_cast<double>(data[i]));
  });
}

// Refuses a finite value that would be stored as infinity: |x| at or beyond the midpoint between
// the largest finite value and the next power of two (which rounds up, to even).
void check_half_range(const std::string& path, const Planned& p) {
  const HalfFormat format = half_format(*p.type);
  const std::uint16_t largest_bits = static_cast<std::uint16_t>(((((1u << (15 - format.mantissa_bits)) - 1) << format.mantissa_bits) - 1));
  const double largest = decode_half(largest_bits, format);
  const double limit = largest + std::ldexp(1.0, format.bias - format.mantissa_bits - 1);
  for_each_value(p.tensor, [&](std::int64_t i, double x) {
    if (std::isfinite(x) && std::fabs(x) >= limit)
      fail(path, fmt::format("cannot write tensor '{}' as {}: element {} is {}, beyond {}'s largest finite value {}",
                             p.name, p.type->name, i, x, p.type->name, largest));
  });
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata, FloatStorage floats) {
  // 1. Validate everything before touching the file system.
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    if (name.empty()) fail(path, "cannot write a tensor with an empty name");
    if (name == "__metadata__") fail(path, "cannot write a tensor named '__metadata__' (reserved for metadata)");
    if (!seen.insert(name).second) fail(path, fmt::format("cannot write: tensor name '{}' is given twice", name));
    if (!t.defined()) fail(path, fmt::format("cannot write tensor '{}': it is undefined", name));
  }
  std::vector<Planned> ordered;
  ordered.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    const StoredType* type = &native_type(t.dtype());
    if (t.dtype() != DType::Int64 && floats == FloatStorage::F16) type = &stored_type("F16");
    if (t.dtype() != DType::Int64 && floats == FloatStorage::BF16) type = &stored_type("BF16");
    ordered.push_back({name, t.contiguous(), type});
    if (type->size == 2) check_half_range(path, ordered.back());
  }
  // 2. Order as the reference writer does: the reference's dtype order, largest first, then by name.
  std::sort(ordered.begin(), ordered.end(), [](const Planned& a, const Planned& b) {
    return a.type->rank != b.type->rank ? a.type->rank > b.type->rank : a.name < b.name;
  });
  const std::string header = make_header(path, ordered, metadata);

  // 3. Through a temporary in the target's directory, flushed and renamed over the target (see
  //    AtomicFileWriter): until the rename the old file is untouched, after it the new one is
  //    complete; on any failure (an exception included) the temporary is removed. Only a missing
  //    target or a regular file is ever replaced.
  try {
    AtomicFileWriter out(path);
    unsigned char length_bytes[8];
    const std::uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) length_bytes[i] = static_cast<unsigned char>(n >> (8 * i));
    out.write(length_bytes, 8, "the header length");
    out.write(header.data(), header.size(), "the header");
    for (const Planned& p : ordered) {
      const std::string what = fmt::format("tensor '{}'", p.name);
      if (p.type->size != 2) {
        out.write(p.tensor.raw_data(), p.nbytes(), what);
        continue;
      }
      // Half precision: rounded in chunks (the range was checked above).
      const HalfFormat format = half_format(*p.type);
      std::vector<std::uint16_t> bits;
      bits.reserve(static_cast<std::size_t>(std::min<std::int64_t>(p.tensor.numel(), kHalfChunk)));
      for_each_value(p.tensor, [&](std::int64_t, double x) {
        bits.push_back(encode_half(x, format));
        if (static_cast<std::int64_t>(bits.size()) == kHalfChunk) {
          out.write(bits.data(), 2 * bits.size(), what);
          bits.clear();
        }
      });
      if (!bits.empty()) out.write(bits.data(), 2 * bits.size(), what);
    }
    out.commit();
  } catch (const OutputFileError& e) {
    fail(path, e.detail());
  }
}

}  // namespace meshgrad::io
