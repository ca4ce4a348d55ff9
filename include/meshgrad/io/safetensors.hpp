// safetensors: the file format meshgrad loads and saves weights and gradient dumps in, written with
// meshgrad's own code on nlohmann-json (the format is simple enough that a dependency would cost more
// than it saves, and the checks below are the point).
//
// The format contract (https://github.com/huggingface/safetensors, "Format"):
//
//   offset 0           8                       8 + N                                end of file
//          +-----------+-----------------------+------------------------------------+
//          | N: u64 LE | header: N bytes JSON  | data section: raw little-endian     |
//          +-----------+-----------------------+------------------------------------+
//
//   header = {"__metadata__": {"key": "value", ...},            (optional, string -> string)
//             "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
//
// - data_offsets are byte offsets relative to the start of the data section, [begin, end).
// - end - begin == prod(shape) * size(dtype); a scalar has shape [] and one element.
// - Elements are stored row-major ("C" order), little-endian.
// - The tensors cover the data section exactly: no gaps, no overlap, no bytes after the last one
//   (this is what makes a file safe to map and impossible to hide data in).
// - The header may end with spaces (0x20) so that the data section starts 8-byte aligned.
//
// Dtypes. meshgrad reads "F32" (float32), "F64" (float64) and "I64" (int64) as themselves, and
// "F16" (IEEE binary16) and "BF16" (bfloat16) as float32, exactly (every value of either is a float32
// value). The format's other dtypes (BOOL, U8, I8, F8_E5M2, F8_E4M3, I16, U16, I32, U32, U64) are
// accepted in a file and their layout is checked like any other, but they are not read: get() of
// such a tensor throws naming it. So a Hugging Face file that carries buffers meshgrad never uses
// (older GPT-2 files hold uint8 or bool attention masks, "h.0.attn.bias") still loads. A dtype name
// that is not the format's is an error naming it.
// meshgrad writes float32 / float64 / int64 tensors as F32 / F64 / I64, or floating tensors rounded
// to F16 or BF16 (FloatStorage).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "meshgrad/tensor/error.hpp"
#include "meshgrad/tensor/tensor.hpp"

namespace meshgrad::io {

// A safetensors file that cannot be read or written: malformed content, a missing tensor, an I/O
// failure. The message names the file, the tensor where there is one, what is wrong and, for
// content errors, the absolute byte offset in the file.
class SafetensorsError : public InvalidArgument {
 public:
  SafetensorsError(std::string path, const std::string& what);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The largest header meshgrad accepts (the reference implementation's limit). A larger length field
// is taken as a corrupt file instead of an allocation request.
inline constexpr std::uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// "F32" <-> DType::Float32 and so on.
std::string safetensors_dtype_name(DType dtype);

// Where one tensor is in a file.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::Float32;   // what get() returns (float32 for F16 and BF16); set when readable
  std::string stored = "F32";     // the dtype as the file names it: "F32", "BF16", "U8", ...
  bool readable = true;           // false: a dtype meshgrad does not read (get() throws naming it)
  Shape shape;
  std::uint64_t begin = 0;   // [begin, end): relative to the data section
  std::uint64_t end = 0;
};

// A validated safetensors file. The constructor reads the header and checks the whole layout
// (every rule above) before anything else is read; get() then reads one tensor's bytes. Throws
// SafetensorsError on any violation.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(std::string path);

  const std::string& path() const { return path_; }
  // Tensor names in data-section order.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  // Throws SafetensorsError naming the file and the tensor when there is none of that name.
  const SafetensorsEntry& entry(const std::string& name) const;
  // Reads the tensor: a new contiguous tensor in the file's dtype, F16 and BF16 converted to
  // float32 (exact). Throws SafetensorsError naming the tensor and its dtype when it is not readable.
  Tensor get(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Byte offset of the data section in the file (8 + header length).
  std::uint64_t data_start() const { return data_start_; }

 private:
  std::string path_;
  std::uint64_t file_size_ = 0;
  std::uint64_t data_start_ = 0;
  std::vector<SafetensorsEntry> entries_;        // sorted by data offset
  std::map<std::string, std::size_t> index_;     // name -> position in entries_
  std::map<std::string, std::string> metadata_;
};

// Every tensor of a file by name (throws, as get() does, when one has a dtype meshgrad does not read).
std::map<std::string, Tensor> read_safetensors(const std::string& path);

// How write_safetensors stores floating tensors: in their own dtype (F32 / F64), or rounded to
// nearest, ties to even, to F16 or BF16 (as PyTorch's .half() / .bfloat16() and numpy's astype
// round). Int64 tensors are I64 whatever this says.
enum class FloatStorage { Native, F16, BF16 };

// "float32" / "float16" / "bfloat16" (as PyTorch and Hugging Face's config.json name them) ->
// Native (for float32 data) / F16 / BF16; throws InvalidArgument naming the text otherwise.
FloatStorage parse_float_storage(const std::string& name);

// Half-precision values, bit patterns as stored (little-endian u16 in a file). The decoders are
// exact. The encoders round to nearest, ties to even, from a double (a float32 converts to double
// exactly, so there is one rounding); a finite value beyond the format's largest finite value
// (65504 for F16, about 3.39e38 for BF16) after rounding gives infinity, NaN a quiet NaN of the
// same sign, subnormals are produced and read.
float f16_to_float(std::uint16_t bits);
float bf16_to_float(std::uint16_t bits);
std::uint16_t float_to_f16(double value);
std::uint16_t float_to_bf16(double value);

// Writes tensors (float32 / float64 / int64, any layout) and optional string metadata to path,
// floating tensors stored as `floats` says. A finite value that rounds to infinity in F16 / BF16 is
// refused (SafetensorsError naming the tensor, the element and the value): the file would not hold
// the model. NaN and infinities are kept.
//
// Layout, as the reference writer lays it out: tensors ordered by the reference's dtype order,
// largest first (I64, F64, F32, BF16, then F16), then by name; the header lists "__metadata__" first (keys sorted) and then
// the tensors in data order, as compact JSON padded with spaces to a multiple of 8 bytes. So the
// output is deterministic and every tensor starts aligned to its element size.
//
// Atomic (io/output_path.hpp, AtomicFileWriter): the file is written to a temporary
// ".NAME.tmp-*" in the same directory, flushed to disk (fsync) and renamed over path; on any error
// (invalid input, I/O, an exception) the temporary is removed and an existing file at path is left
// untouched. Only a missing path or a regular file is replaced: a directory, a device or a
// symbolic link at path is refused. Throws SafetensorsError on an undefined tensor, an empty,
// duplicate or reserved ("__metadata__") name, such a path, or an I/O failure.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {},
                       FloatStorage floats = FloatStorage::Native);

}  // namespace meshgrad::io
