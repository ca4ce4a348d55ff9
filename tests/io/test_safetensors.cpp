// safetensors reader/writer: bit-exact round trips, the byte layout against hand-written bytes,
// one hand-crafted malformed file per rule of the format, and atomic writes.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "io/scratch_directory.hpp"
#include "meshgrad/io/safetensors.hpp"

namespace meshgrad::io::test_safetensors {
namespace {

namespace fs = std::filesystem;

std::string u64_le(std::uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<std::size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// A file from a header text (padded with spaces to a multiple of 8, as writers do) and data bytes.
std::string file_bytes(std::string header, const std::string& data) {
  header.append((8 - header.size() % 8) % 8, ' ');
  return u64_le(header.size()) + header + data;
}

// Data-section start of file_bytes(header, ...).
std::uint64_t data_start_of(const std::string& header) { return 8 + (header.size() + 7) / 8 * 8; }

class SafetensorsTest : public ScratchDirectoryTest {
 protected:
  // Writes bytes to a file and expects reading it to throw SafetensorsError whose message names the
  // file and contains every needle.
  void expect_malformed(const std::string& bytes, const std::vector<std::string>& needles) {
    const std::string p = path("bad.safetensors");
    write_bytes(p, bytes);
    expect_read_error(p, needles);
  }

  static void expect_read_error(const std::string& p, const std::vector<std::string>& needles) {
    try {
      (void)read_safetensors(p);
      ADD_FAILURE() << "reading " << p << " did not throw; expected: " << ::testing::PrintToString(needles);
    } catch (const SafetensorsError& e) {
      const std::string message = e.what();
      EXPECT_EQ(e.path(), p);
      EXPECT_NE(message.find("'" + p + "'"), std::string::npos) << "message does not name the file: " << message;
      for (const auto& needle : needles)
        EXPECT_NE(message.find(needle), std::string::npos) << "missing \"" << needle << "\" in: " << message;
    }
  }
};

// ---- round trips ---------------------------------------------------------------------------------

Tensor float32_with_special_values() {
  Tensor t = Tensor::empty({2, 3}, DType::Float32);
  float* p = t.data<float>();
  p[0] = 1.5f;
  p[1] = -0.0f;
  p[2] = std::numeric_limits<float>::denorm_min();
  p[3] = std::numeric_limits<float>::quiet_NaN();
  p[4] = -std::numeric_limits<float>::infinity();
  p[5] = 3.14159274f;
  return t;
}

TEST_F(SafetensorsTest, RoundTripIsBitExactForEveryDtypeAndScalars) {
  const Tensor f32 = float32_with_special_values();
  const Tensor f64 = Tensor::from_values({0.1, -2.5e-300, 1e300, 7.0, -0.0, 1.0 / 3.0}, {3, 1, 2}, DType::Float64);
  const std::vector<std::int64_t> ints = {std::numeric_limits<std::int64_t>::min(), -1, 0,
                                          std::numeric_limits<std::int64_t>::max()};
  const Tensor i64 = Tensor::from_int64(ints, {4});
  const Tensor scalar32 = Tensor::scalar(-42.125, DType::Float32);
  const Tensor scalar64 = Tensor::scalar(1e-17, DType::Float64);
  const Tensor scalar_i = Tensor::from_int64(std::vector<std::int64_t>{123456789012345}, {});
  const Tensor empty = Tensor::zeros({0, 3}, DType::Float32);
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "héllo \"quoted\""}};

  const std::string p = path("round.safetensors");
  write_safetensors(p,
                    {{"w.f32", f32}, {"w.f64", f64}, {"ids", i64}, {"loss", scalar32}, {"s64", scalar64},
                     {"step", scalar_i}, {"empty", empty}},
                    metadata);

  const SafetensorsFile file(p);
  EXPECT_EQ(file.metadata(), metadata);
  const auto back = read_safetensors(p);
  ASSERT_EQ(back.size(), 7u);
  const std::vector<std::pair<std::string, Tensor>> expected = {{"w.f32", f32}, {"w.f64", f64},     {"ids", i64},
                                                                {"loss", scalar32}, {"s64", scalar64}, {"step", scalar_i},
                                                                {"empty", empty}};
  for (const auto& [name, t] : expected) {
    ASSERT_TRUE(back.count(name)) << name;
    const Tensor& got = back.at(name);
    EXPECT_EQ(got.dtype(), t.dtype()) << name;
    EXPECT_EQ(got.shape(), t.shape()) << name;
    EXPECT_TRUE(bitwise_equal(got, t)) << name;
  }
  EXPECT_EQ(back.at("loss").shape(), Shape{});
  EXPECT_EQ(back.at("step").to_int64_vector(), std::vector<std::int64_t>{123456789012345});
}

TEST_F(SafetensorsTest, NonContiguousTensorIsWrittenRowMajor) {
  const Tensor t = Tensor::from_values({1, 2, 3, 4, 5, 6}, {2, 3}, DType::Float64).transpose(0, 1);   // [3, 2]
  ASSERT_FALSE(t.is_contiguous());
  const std::string p = path("t.safetensors");
  write_safetensors(p, {{"t", t}});
  const Tensor back = read_safetensors(p).at("t");
  EXPECT_EQ(back.shape(), (Shape{3, 2}));
  EXPECT_EQ(back.to_vector(), (std::vector<double>{1, 4, 2, 5, 3, 6}));
}

TEST_F(SafetensorsTest, EmptyFileHasOnlyTheHeader) {
  const std::string p = path("empty.safetensors");
  write_safetensors(p, {});
  // The reference writer's bytes for no tensors: {} padded to 8.
  EXPECT_EQ(read_bytes(p), u64_le(8) + std::string("{}      "));
  EXPECT_TRUE(read_safetensors(p).empty());
}

// ---- the byte layout, against bytes written by hand ----------------------------------------------

// The safetensors reference implementation's own serialization test vector: one F32 tensor
// "attn.0" of shape [1, 2, 3] holding 0..5. The header is 64 bytes (already a multiple of 8).
TEST_F(SafetensorsTest, LayoutMatchesTheReferenceTestVector) {
  const std::string header = R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})";
  ASSERT_EQ(header.size(), 64u);
  // 0.0f .. 5.0f little-endian: 1.0f = 0x3f800000, 2.0f = 0x40000000, 3.0f = 0x40400000,
  // 4.0f = 0x40800000, 5.0f = 0x40a00000.
  const unsigned char data[24] = {0, 0, 0, 0, 0, 0, 0x80, 0x3f, 0, 0, 0, 0x40,
                                  0, 0, 0x40, 0x40, 0, 0, 0x80, 0x40, 0, 0, 0xa0, 0x40};
  const std::string expected = std::string("\x40\0\0\0\0\0\0\0", 8) + header +
                               std::string(reinterpret_cast<const char*>(data), sizeof data);

  const std::string p = path("attn.safetensors");
  write_safetensors(p, {{"attn.0", Tensor::from_values({0, 1, 2, 3, 4, 5}, {1, 2, 3}, DType::Float32)}});
  EXPECT_EQ(read_bytes(p), expected);

  // And the reader takes the hand-written bytes.
  const std::string q = path("hand.safetensors");
  write_bytes(q, expected);
  const Tensor t = read_safetensors(q).at("attn.0");
  EXPECT_EQ(t.shape(), (Shape{1, 2, 3}));
  EXPECT_EQ(t.to_vector(), (std::vector<double>{0, 1, 2, 3, 4, 5}));
}

// Mixed dtypes and metadata: "__metadata__" first, then data order = largest element type first
// (I64, F64, F32), then name; header padded with spaces to a multiple of 8.
TEST_F(SafetensorsTest, LayoutOfMixedDtypesWithMetadata) {
  const std::string header =
      R"({"__metadata__":{"format":"pt"},)"
      R"("a":{"dtype":"I64","shape":[],"data_offsets":[0,8]},)"
      R"("c":{"dtype":"F64","shape":[1],"data_offsets":[8,16]},)"
      R"("b":{"dtype":"F32","shape":[1],"data_offsets":[16,20]}})";
  ASSERT_EQ(header.size(), 193u);   // + 7 spaces = 200 = 0xc8
  const unsigned char data[20] = {7, 0, 0, 0, 0, 0, 0, 0,             // a: int64 7
                                  0, 0, 0, 0, 0, 0, 0, 0x40,          // c: 2.0 = 0x4000000000000000
                                  0, 0, 0x80, 0x3f};                  // b: 1.0f = 0x3f800000
  const std::string expected = std::string("\xc8\0\0\0\0\0\0\0", 8) + header + std::string(7, ' ') +
                               std::string(reinterpret_cast<const char*>(data), sizeof data);

  const std::string p = path("mixed.safetensors");
  write_safetensors(p,
                    {{"b", Tensor::from_values({1.0}, {1}, DType::Float32)},
                     {"a", Tensor::from_int64(std::vector<std::int64_t>{7}, {})},
                     {"c", Tensor::from_values({2.0}, {1}, DType::Float64)}},
                    {{"format", "pt"}});
  const std::string got = read_bytes(p);
  EXPECT_EQ(got.size(), 228u);
  EXPECT_EQ(got, expected);

  const SafetensorsFile file(p);
  EXPECT_EQ(file.data_start(), 208u);
  EXPECT_EQ(file.names(), (std::vector<std::string>{"a", "c", "b"}));
  EXPECT_EQ(file.entry("b").begin, 16u);
  EXPECT_EQ(file.entry("b").end, 20u);
}

TEST_F(SafetensorsTest, ReaderAcceptsAnyEntryOrderAndUnpaddedHeader) {
  // Entries listed out of data order, no padding: both are allowed by the format.
  const std::string header =
      R"({"y":{"dtype":"F32","shape":[1],"data_offsets":[8,12]},"x":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})";
  const unsigned char data[12] = {5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x80, 0xbf};   // x = 5, y = -1.0f
  const std::string p = path("order.safetensors");
  write_bytes(p, u64_le(header.size()) + header + std::string(reinterpret_cast<const char*>(data), sizeof data));
  const auto t = read_safetensors(p);
  EXPECT_EQ(t.at("x").to_int64_vector(), std::vector<std::int64_t>{5});
  EXPECT_EQ(t.at("y").to_vector(), std::vector<double>{-1.0});
}

// ---- malformed files: each is an error naming the file and the problem -----------------------------

const std::string kEntry8 = R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})";

TEST_F(SafetensorsTest, MissingFile) { expect_read_error(path("nope.safetensors"), {"cannot open"}); }

TEST_F(SafetensorsTest, DirectoryIsNotAFile) { expect_read_error(dir_.string(), {"not a regular file"}); }

TEST_F(SafetensorsTest, FileShorterThanEightBytes) {
  expect_malformed(std::string("\x08\0\0\0\0", 5), {"5 bytes", "too short"});
  expect_malformed("", {"0 bytes", "too short"});
}

TEST_F(SafetensorsTest, HeaderLengthPastTheEndOfTheFile) {
  expect_malformed(u64_le(100) + std::string(20, ' '), {"header length 100", "past the end of the file (28 bytes)"});
}

TEST_F(SafetensorsTest, HeaderLengthAbsurd) {
  // Must not try to allocate: both are rejected from the 8 length bytes alone.
  expect_malformed(u64_le(100'000'001) + "{}", {"header length 100000001", "larger than"});
  expect_malformed(u64_le(std::numeric_limits<std::uint64_t>::max()) + "{}",
                   {"header length 18446744073709551615", "larger than"});
}

TEST_F(SafetensorsTest, HeaderNotJson) {
  // The parser stops at the '1' where ':' belongs: header index 4, file byte 12.
  expect_malformed(file_bytes(R"({"a"1})", ""), {"not valid JSON", "at byte 12", "column 5"});
  expect_malformed(file_bytes("{not json}", ""), {"not valid JSON"});
  expect_malformed(file_bytes("", ""), {"not valid JSON"});
  expect_malformed(file_bytes(R"({"a": )", ""), {"not valid JSON"});
  expect_malformed(file_bytes("{} trailing", ""), {"not valid JSON"});
  // Invalid UTF-8 in a string.
  expect_malformed(file_bytes("{\"\xff\":1}", ""), {"not valid JSON"});
}

TEST_F(SafetensorsTest, HeaderNotAnObject) {
  expect_malformed(file_bytes("[1, 2]", ""), {"header is a JSON array, expected an object"});
  expect_malformed(file_bytes("\"text\"", ""), {"header is a JSON string, expected an object"});
}

TEST_F(SafetensorsTest, EntryNotAnObject) {
  expect_malformed(file_bytes(R"({"w": 3})", ""), {"tensor 'w'", "entry is a JSON number"});
}

TEST_F(SafetensorsTest, EntryMissingAField) {
  expect_malformed(file_bytes(R"({"w":{"shape":[2],"data_offsets":[0,8]}})", std::string(8, '\0')),
                   {"tensor 'w'", "no 'dtype'"});
  expect_malformed(file_bytes(R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", std::string(8, '\0')),
                   {"tensor 'w'", "no 'shape'"});
  expect_malformed(file_bytes(R"({"w":{"dtype":"F32","shape":[2]}})", std::string(8, '\0')),
                   {"tensor 'w'", "no 'data_offsets'"});
}

TEST_F(SafetensorsTest, EntryFieldsOfWrongJsonTypes) {
  const std::string d8(8, '\0');
  expect_malformed(file_bytes(R"({"w":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", d8),
                   {"tensor 'w'", "dtype is a JSON number, expected a string"});
  expect_malformed(file_bytes(R"({"w":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})", d8),
                   {"tensor 'w'", "shape is a JSON string, expected an array"});
  expect_malformed(file_bytes(R"({"w":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", d8),
                   {"tensor 'w'", "dim 0 is a JSON number, expected an integer"});
  expect_malformed(file_bytes(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", d8),
                   {"tensor 'w'", "data_offsets is array [0], expected an array [begin, end]"});
  expect_malformed(file_bytes(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,"8"]}})", d8),
                   {"tensor 'w'", "two non-negative integers"});
  expect_malformed(file_bytes(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", d8),
                   {"tensor 'w'", "begin is after end"});
  expect_malformed(file_bytes(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"extra":1}})", d8),
                   {"tensor 'w'", "unexpected key 'extra'"});
  expect_malformed(file_bytes(R"({"__metadata__":{"k":1}})", ""), {"__metadata__ value of 'k'", "expected a string"});
  expect_malformed(file_bytes(R"({"__metadata__":[]})", ""), {"__metadata__ is a JSON array"});
}

TEST_F(SafetensorsTest, UnknownDtypeIsNamed) {
  expect_malformed(file_bytes(R"({"w":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}})", std::string(1, '\0')),
                   {"tensor 'w'", "dtype \"F4\" is not a safetensors dtype meshgrad knows"});
  expect_malformed(file_bytes(R"({"w":{"dtype":"bf16","shape":[2],"data_offsets":[0,4]}})", std::string(4, '\0')),
                   {"tensor 'w'", "dtype \"bf16\""});
}

// A dtype of the format that meshgrad does not read: the file opens (its layout is checked with
// that dtype's size), other tensors read, and reading that one names it.
TEST_F(SafetensorsTest, UnreadDtypesAreAcceptedInAFileButNotRead) {
  const std::string header =
      R"({"mask":{"dtype":"U8","shape":[2,2],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  std::string data = std::string("\x01\x00\x01\x01", 4);
  const float one = 1.0f;
  data.append(reinterpret_cast<const char*>(&one), 4);
  const std::string p = path("u8.safetensors");
  write_bytes(p, file_bytes(header, data));
  const SafetensorsFile file(p);
  EXPECT_FALSE(file.entry("mask").readable);
  EXPECT_EQ(file.entry("mask").stored, "U8");
  EXPECT_TRUE(file.entry("w").readable);
  EXPECT_EQ(file.get("w").data<float>()[0], 1.0f);
  try {
    (void)file.get("mask");
    ADD_FAILURE() << "read a U8 tensor";
  } catch (const SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'mask' has dtype U8, which meshgrad does not read"), std::string::npos)
        << e.what();
  }
  // The layout check uses U8's size: 4 elements of U8 in 8 bytes is refused.
  expect_malformed(file_bytes(R"({"m":{"dtype":"U8","shape":[4],"data_offsets":[0,8]}})", std::string(8, '\0')),
                   {"tensor 'm'", "shape [4] of U8 needs 4 bytes"});
}

// ---- half precision --------------------------------------------------------------------------------

// (sign, exponent field, mantissa) -> value, written out from the IEEE definitions independently of
// the code under test: normal (1 + m / 2^M) 2^(e - bias), subnormal (m / 2^M) 2^(1 - bias).
double half_value(std::uint16_t bits, int mantissa_bits, int bias) {
  const int exponent = (bits & 0x7fff) >> mantissa_bits;
  const int mantissa = bits & ((1 << mantissa_bits) - 1);
  const double sign = (bits & 0x8000) ? -1.0 : 1.0;
  if (exponent == 0) return sign * std::ldexp(mantissa, 1 - bias - mantissa_bits);
  return sign * std::ldexp(1.0 + std::ldexp(mantissa, -mantissa_bits), exponent - bias);
}

struct HalfCase {
  const char* name;
  int mantissa_bits, bias;
  float (*decode)(std::uint16_t);
  std::uint16_t (*encode)(double);
};
const HalfCase kHalfCases[] = {{"F16", 10, 15, &f16_to_float, &float_to_f16}, {"BF16", 7, 127, &bf16_to_float, &float_to_bf16}};

// Every one of the 65536 bit patterns: decoding gives the IEEE value, encoding it gives the pattern
// back (NaNs: a NaN); every midpoint between neighbours rounds to the even one, and a hair off the
// midpoint to the nearer one.
TEST(HalfPrecision, EveryPatternDecodesExactlyAndEveryMidpointRoundsToEven) {
  for (const HalfCase& c : kHalfCases) {
    SCOPED_TRACE(c.name);
    const std::uint16_t exponent_mask = static_cast<std::uint16_t>(((1 << (15 - c.mantissa_bits)) - 1) << c.mantissa_bits);
    for (std::uint32_t b = 0; b < 0x10000; ++b) {
      const auto bits = static_cast<std::uint16_t>(b);
      const float v = c.decode(bits);
      const bool special = (bits & exponent_mask) == exponent_mask;
      if (special && (bits & ~(exponent_mask | 0x8000)) != 0) {   // NaN
        ASSERT_TRUE(std::isnan(v)) << b;
        const std::uint16_t back = c.encode(v);
        ASSERT_EQ(back & exponent_mask, exponent_mask) << b;
        ASSERT_NE(back & ~(exponent_mask | 0x8000), 0) << b;
        continue;
      }
      if (special) {
        ASSERT_TRUE(std::isinf(v) && std::signbit(v) == ((bits & 0x8000) != 0)) << b;
      } else {
        ASSERT_EQ(static_cast<double>(v), half_value(bits, c.mantissa_bits, c.bias)) << b;
      }
      ASSERT_EQ(c.encode(v), bits) << b;
      ASSERT_EQ(std::signbit(v), (bits & 0x8000) != 0) << b;
      // Midpoints between this positive finite value and the next one up.
      if ((bits & 0x8000) || special || ((bits + 1) & exponent_mask) == exponent_mask) continue;
      const double lo = v, hi = c.decode(static_cast<std::uint16_t>(bits + 1));
      const double mid = (lo + hi) / 2;   // exact in double
      const std::uint16_t even = (bits & 1) ? static_cast<std::uint16_t>(bits + 1) : bits;
      ASSERT_EQ(c.encode(mid), even) << b;
      ASSERT_EQ(c.encode(-mid), even | 0x8000) << b;
      ASSERT_EQ(c.encode(std::nextafter(mid, 0.0)), bits) << b;
      ASSERT_EQ(c.encode(std::nextafter(mid, 1e300)), static_cast<std::uint16_t>(bits + 1)) << b;
    }
  }
}

TEST(HalfPrecision, RangeEnds) {
  EXPECT_EQ(f16_to_float(0x3C00), 1.0f);
  EXPECT_EQ(f16_to_float(0x7BFF), 65504.0f);
  EXPECT_EQ(f16_to_float(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(bf16_to_float(0x3F80), 1.0f);
  EXPECT_EQ(float_to_f16(65519.99), 0x7BFF);   // below the midpoint to 65536
  EXPECT_EQ(float_to_f16(65520.0), 0x7C00);    // the midpoint rounds to even: infinity
  EXPECT_EQ(float_to_f16(std::ldexp(1.0, -25)), 0x0000);                        // half the smallest subnormal: to even
  EXPECT_EQ(float_to_f16(std::nextafter(std::ldexp(1.0, -25), 1.0)), 0x0001);   // just above: up
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7F80);          // rounds past the largest bfloat16
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(float_to_bf16(-0.0), 0x8000);
}

TEST_F(SafetensorsTest, HalfPrecisionFilesRoundTripTheRoundedValues) {
  const Tensor f32 = Tensor::from_values({1.0, 1.0 / 3.0, -2.5e-6, 1000.1, -0.0, 65504.0}, {2, 3}, DType::Float32);
  const Tensor f64 = Tensor::from_values({0.1, -7.77}, {2}, DType::Float64);
  const Tensor ids = Tensor::from_int64(std::vector<std::int64_t>{5, -5}, {2});
  for (const auto& [storage, name, encode] :
       {std::tuple{FloatStorage::F16, "F16", &float_to_f16}, std::tuple{FloatStorage::BF16, "BF16", &float_to_bf16}}) {
    SCOPED_TRACE(name);
    const std::string p = path(std::string(name) + ".safetensors");
    write_safetensors(p, {{"a", f32}, {"b", f64}, {"ids", ids}}, {{"format", "pt"}}, storage);
    const SafetensorsFile file(p);
    EXPECT_EQ(file.entry("a").stored, name);
    EXPECT_EQ(file.entry("b").stored, name);
    EXPECT_EQ(file.entry("ids").stored, "I64");
    EXPECT_EQ(file.entry("a").end - file.entry("a").begin, 12u);
    // I64 first, then the half tensors, as the reference writer orders them.
    EXPECT_EQ(file.names(), (std::vector<std::string>{"ids", "a", "b"}));
    for (const auto& [tensor_name, original] : {std::pair{"a", f32}, std::pair{"b", f64}}) {
      const Tensor back = file.get(tensor_name);
      ASSERT_EQ(back.dtype(), DType::Float32);
      ASSERT_EQ(back.shape(), original.shape());
      const Tensor wide = original.to(DType::Float64);
      for (std::int64_t i = 0; i < back.numel(); ++i) {
        const std::uint16_t bits = encode(wide.data<double>()[i]);
        const float expected = std::string(name) == "F16" ? f16_to_float(bits) : bf16_to_float(bits);
        EXPECT_EQ(back.data<float>()[i], expected) << tensor_name << "[" << i << "]";
        EXPECT_EQ(std::signbit(back.data<float>()[i]), std::signbit(wide.data<double>()[i]));
      }
    }
    EXPECT_EQ(file.get("ids").data<std::int64_t>()[1], -5);
  }
  // A finite value beyond float16's range is refused naming the tensor and the element; nothing is written.
  const Tensor big = Tensor::from_values({1.0, 70000.0}, {2}, DType::Float32);
  const std::string p = path("big.safetensors");
  try {
    write_safetensors(p, {{"big", big}}, {}, FloatStorage::F16);
    ADD_FAILURE() << "wrote 70000 as float16";
  } catch (const SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'big' as F16: element 1 is 70000"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(p));
  write_safetensors(p, {{"big", big}}, {}, FloatStorage::BF16);   // bfloat16 holds it (rounded)
  EXPECT_EQ(read_safetensors(p).at("big").data<float>()[1], 70144.0f);
}

TEST_F(SafetensorsTest, NegativeDim) {
  expect_malformed(file_bytes(R"({"w":{"dtype":"F32","shape":[2,-2],"data_offsets":[0,8]}})", std::string(8, '\0')),
                   {"tensor 'w'", "negative dim -2"});
}

TEST_F(SafetensorsTest, ShapeDoesNotMatchByteRange) {
  const std::string header = R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})";
  expect_malformed(file_bytes(header, std::string(8, '\0')),
                   {"tensor 'w'", "shape [3] of F32 needs 12 bytes", "hold 8 bytes",
                    fmt::format("at byte {}", data_start_of(header))});
  // Element count overflowing 64 bits must not wrap around to a "matching" size.
  expect_malformed(
      file_bytes(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,0]}})", ""),
      {"tensor 'w'", "more than 2^64"});
}

TEST_F(SafetensorsTest, OffsetsOutsideTheDataSection) {
  const std::string header = R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})";
  const std::uint64_t start = data_start_of(header);
  expect_malformed(file_bytes(header, std::string(8, '\0')),
                   {"tensor 'w'", "past the end of the data section",
                    fmt::format("end at byte {}", start + 16), fmt::format("bytes {}..{}", start, start + 8)});
}

TEST_F(SafetensorsTest, OverlappingTensors) {
  const std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
  expect_malformed(file_bytes(header, std::string(12, '\0')),
                   {"'a' and 'b' overlap", fmt::format("byte {}", data_start_of(header) + 4)});
}

TEST_F(SafetensorsTest, GapBetweenTensors) {
  const std::string header = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                             R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})";
  const std::uint64_t start = data_start_of(header);
  expect_malformed(file_bytes(header, std::string(12, '\0')),
                   {"gap in the data section", fmt::format("bytes {}..{}", start + 4, start + 8), "'b'"});
  // A data section that does not start at offset 0 is a gap too.
  expect_malformed(file_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", std::string(8, '\0')),
                   {"gap in the data section", "data offsets 0..4"});
}

TEST_F(SafetensorsTest, DuplicateTensorNames) {
  expect_malformed(file_bytes(R"({"w":)" + kEntry8 + R"(,"w":)" + kEntry8 + "}", std::string(8, '\0')),
                   {"tensor name 'w' appears more than once"});
  expect_malformed(file_bytes(R"({"w":{"dtype":"F32","dtype":"F64","shape":[2],"data_offsets":[0,8]}})",
                              std::string(8, '\0')),
                   {"key 'dtype' appears more than once in the entry of 'w'"});
}

// ---- hostile headers: nesting, size, wrap-around ---------------------------------------------------

std::string nested(std::size_t depth, const std::string& inner = "1") {
  return std::string(depth, '[') + inner + std::string(depth, ']');
}

// Deep nesting anywhere in the header is refused while parsing (it used to overflow the stack
// printing the value into the message, in 0.03 s, from a 200 KB file).
TEST_F(SafetensorsTest, DeeplyNestedJsonAnywhereIsRefusedNotACrash) {
  const std::string deep = nested(100'000);
  expect_malformed(file_bytes(R"({"w":{"dtype":"F32","shape":)" + deep + R"(,"data_offsets":[0,0]}})", ""),
                   {"nested deeper than 3 levels", "'w' > 'shape' > [0]"});
  expect_malformed(file_bytes(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":)" + deep + "}}", ""),
                   {"nested deeper than 3 levels", "'w' > 'data_offsets' > [0]"});
  expect_malformed(file_bytes(R"({"__metadata__":{"k":)" + deep + "}}", ""), {"nested deeper than 3 levels"});
  expect_malformed(file_bytes(deep, ""), {"nested deeper than 3 levels"});
  expect_malformed(file_bytes(R"({"w":{"dtype":)" + nested(2) + "}}", ""), {"nested deeper than 3 levels"});
  // One level too deep is enough: shape [[2]].
  expect_malformed(file_bytes(R"({"w":{"dtype":"F32","shape":[[2]],"data_offsets":[0,8]}})", std::string(8, '\0')),
                   {"nested deeper than 3 levels"});
}

// Messages quote untrusted names and values cut to a bounded length.
TEST_F(SafetensorsTest, HugeNamesAndValuesAreCutInMessages) {
  const std::string name(1'000'000, 'n');
  const std::string p = path("bad.safetensors");
  const std::string long_shape = "[" + std::string(200'000, '1') + "0]";   // 1.0e200000: a float dim
  for (const std::string& header :
       {R"({")" + name + R"(":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})",
        R"({"w":{"dtype":"F32","shape":)" + long_shape + R"(,"data_offsets":[0,8]}})",
        R"({"w":{"dtype":")" + name + R"(","shape":[2],"data_offsets":[0,8]}})"}) {
    write_bytes(p, file_bytes(header, std::string(8, '\0')));
    try {
      (void)read_safetensors(p);
      ADD_FAILURE() << "no error";
    } catch (const SafetensorsError& e) {
      EXPECT_LT(std::string(e.what()).size(), 600u) << std::string(e.what()).substr(0, 300);
    }
  }
}

// Duplicate detection and parsing are linear: 100,000 zero-size tensors parse (this took hours at
// the quadratic rate of the old parser callback; bench_safetensors_header prints the time).
TEST_F(SafetensorsTest, HundredThousandTensorsParse) {
  std::string header = "{";
  for (int i = 0; i < 100'000; ++i)
    header += fmt::format(R"({}"t{}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}})", i ? "," : "", i);
  header += "}";
  write_bytes(path("many.safetensors"), file_bytes(header, ""));
  const SafetensorsFile file(path("many.safetensors"));
  EXPECT_EQ(file.names().size(), 100'000u);
  EXPECT_TRUE(file.contains("t99999"));
  // A duplicate at the very end is still found.
  header.back() = ',';
  header += R"("t5":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}})";
  expect_malformed(file_bytes(header, ""), {"tensor name 't5' appears more than once"});
}

// data_start + end past 2^64 is reported as such, not as a wrapped-around small byte number.
TEST_F(SafetensorsTest, OffsetsNearTwoToTheSixtyFourDoNotWrap) {
  const std::string max = std::to_string(std::numeric_limits<std::uint64_t>::max());
  const std::string header = R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[)" + max + "," + max + "]}}";
  expect_malformed(file_bytes(header, ""), {"tensor 'w'", "beyond byte 2^64", "past the end of the data section"});
  try {
    write_bytes(path("w.safetensors"), file_bytes(header, ""));
    (void)read_safetensors(path("w.safetensors"));
  } catch (const SafetensorsError& e) {
    EXPECT_EQ(std::string(e.what()).find("end at byte"), std::string::npos) << e.what();
  }
}

// A zero-element shape whose other dims multiply past 2^63 would overflow the stride computation.
TEST_F(SafetensorsTest, EmptyShapeWithHugeDimsIsRefused) {
  const std::string big = std::to_string(std::numeric_limits<std::int64_t>::max());
  expect_malformed(file_bytes(R"({"w":{"dtype":"F32","shape":[0,)" + big + "," + big + R"(],"data_offsets":[0,0]}})", ""),
                   {"tensor 'w'", "product of its non-zero dims is more than 2^63"});
  // The largest that fits is fine.
  write_bytes(path("ok.safetensors"),
              file_bytes(R"({"w":{"dtype":"F32","shape":[0,)" + big + R"(],"data_offsets":[0,0]}})", ""));
  EXPECT_EQ(read_safetensors(path("ok.safetensors")).at("w").numel(), 0);
}

TEST_F(SafetensorsTest, TrailingGarbage) {
  const std::string header = R"({"w":)" + kEntry8 + "}";
  const std::uint64_t start = data_start_of(header);
  expect_malformed(file_bytes(header, std::string(8, '\0') + "xyz"),
                   {"3 trailing bytes", fmt::format("bytes {}..{}", start + 8, start + 11)});
  // Data with no tensor at all.
  expect_malformed(file_bytes("{}", "abcd"), {"4 trailing bytes"});
}

TEST_F(SafetensorsTest, EveryTruncationAndByteFlipIsAnErrorOrAValidFile) {
  const std::string p = path("good.safetensors");
  write_safetensors(p, {{"a", Tensor::from_values({1, 2, 3}, {3}, DType::Float32)},
                        {"b", Tensor::from_int64(std::vector<std::int64_t>{4, 5}, {2})}},
                    {{"k", "v"}});
  const std::string good = read_bytes(p);
  const std::string q = path("mutated.safetensors");
  // Every proper prefix is malformed (the data section must be covered exactly).
  for (std::size_t n = 0; n < good.size(); ++n) {
    write_bytes(q, good.substr(0, n));
    EXPECT_THROW((void)read_safetensors(q), SafetensorsError) << "prefix of " << n << " bytes";
  }
  // Flipping any single byte either still parses or is reported; it never crashes.
  for (std::size_t i = 0; i < good.size(); ++i) {
    for (unsigned char mask : {0x01, 0x80, 0xff}) {
      std::string bad = good;
      bad[i] = static_cast<char>(static_cast<unsigned char>(bad[i]) ^ mask);
      write_bytes(q, bad);
      try {
        (void)read_safetensors(q);
      } catch (const SafetensorsError&) {
      }
    }
  }
}

TEST_F(SafetensorsTest, ErrorsAreInvalidArgument) {
  write_bytes(path("x"), "abc");
  EXPECT_THROW((void)read_safetensors(path("x")), InvalidArgument);
}

// ---- writing: validation and atomicity -----------------------------------------------------------

TEST_F(SafetensorsTest, FailedWriteLeavesTheExistingFileByteIdentical) {
  const std::string p = path("keep.safetensors");
  write_safetensors(p, {{"w", Tensor::from_values({1, 2}, {2}, DType::Float32)}});
  const std::string before = read_bytes(p);
  const Tensor ok = Tensor::ones({3}, DType::Float32);

  const auto expect_write_error = [&](const std::vector<std::pair<std::string, Tensor>>& tensors,
                                      const std::string& needle) {
    try {
      write_safetensors(p, tensors);
      ADD_FAILURE() << "write did not throw; expected " << needle;
    } catch (const SafetensorsError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(p), std::string::npos) << message;
      EXPECT_NE(message.find(needle), std::string::npos) << message;
    }
    EXPECT_EQ(read_bytes(p), before) << needle;
    EXPECT_EQ(listing(), std::vector<std::string>{"keep.safetensors"}) << "temporary file left behind";
  };
  expect_write_error({{"a", ok}, {"b", Tensor()}}, "tensor 'b': it is undefined");
  expect_write_error({{"a", ok}, {"a", ok}}, "'a' is given twice");
  expect_write_error({{"", ok}}, "empty name");
  expect_write_error({{"__metadata__", ok}}, "reserved");
  expect_write_error({{"bad\xff", ok}}, "tensor name \"bad\xEF\xBF\xBD\" is not valid UTF-8");
  // A metadata string is named by its key (reliability-3 N80: it was "a tensor name or metadata string").
  try {
    write_safetensors(p, {{"w", ok}}, {{"format", "pt"}, {"data", "d\xff.txt"}});
    ADD_FAILURE() << "write did not throw";
  } catch (const SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("metadata \"data\" is not valid UTF-8"), std::string::npos) << e.what();
  }
  EXPECT_EQ(read_bytes(p), before);
}

// Only a missing path or a regular file is replaced: a directory, a device or a symbolic link is
// refused before anything is written (rename() used to replace /dev/full by a regular file, and a
// link by a file, without a word).
TEST_F(SafetensorsTest, DirectoryDeviceOrSymlinkIsNeverReplaced) {
  fs::create_directories(dir_ / "target" / "inner");
  fs::create_directories(dir_ / "empty");
  std::ofstream(dir_ / "real.bin") << "keep";
  fs::create_symlink(dir_ / "real.bin", dir_ / "link.safetensors");
  const auto expect_refused = [&](const std::string& p, const std::string& needle) {
    try {
      write_safetensors(p, {{"a", Tensor::ones({2})}});
      ADD_FAILURE() << "writing over " << p << " did not throw";
    } catch (const SafetensorsError& e) {
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_refused(path("target"), "is a directory");
  expect_refused(path("empty"), "is a directory");
  expect_refused(path("link.safetensors"), "is a symbolic link");
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0600), 0);
  expect_refused(path("fifo"), "is a FIFO");
  std::vector<std::string> expected{"empty", "fifo", "link.safetensors", "real.bin", "target"};
  if (::geteuid() == 0) {   // a device node like /dev/null (c 1 3), made here rather than risk /dev
    ASSERT_EQ(::mknod(path("null").c_str(), S_IFCHR | 0666, ::makedev(1, 3)), 0);
    expect_refused(path("null"), "is a character device");
    expected.push_back("null");
    EXPECT_TRUE(fs::is_character_file(dir_ / "null"));
  }
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(listing(), expected);
  EXPECT_TRUE(fs::is_symlink(dir_ / "link.safetensors"));
  EXPECT_EQ(read_bytes(dir_ / "real.bin"), "keep");
  EXPECT_TRUE(fs::is_directory(dir_ / "target" / "inner"));
}

TEST_F(SafetensorsTest, WriteIntoMissingDirectoryFails) {
  try {
    write_safetensors(path("no/such/dir/x.safetensors"), {{"a", Tensor::ones({2})}});
    ADD_FAILURE() << "no error";
  } catch (const SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot create temporary file"), std::string::npos) << e.what();
  }
}

// An I/O error in the middle of the data (here: the file size limit, which makes write() fail with
// EFBIG once SIGXFSZ is ignored) leaves the old file and no temporary.
TEST_F(SafetensorsTest, IoErrorMidWriteLeavesTheExistingFile) {
  const std::string p = path("keep.safetensors");
  write_safetensors(p, {{"w", Tensor::from_values({1, 2}, {2}, DType::Float32)}});
  const std::string before = read_bytes(p);

  struct rlimit saved {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  const auto old_handler = ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit limited = saved;
  limited.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limited), 0);
  std::string message;
  try {
    write_safetensors(p, {{"big", Tensor::zeros({100000}, DType::Float64)}});
  } catch (const SafetensorsError& e) {
    message = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &saved);
  ::signal(SIGXFSZ, old_handler);

  EXPECT_NE(message.find("write error while writing tensor 'big'"), std::string::npos) << message;
  EXPECT_EQ(read_bytes(p), before);
  EXPECT_EQ(listing(), std::vector<std::string>{"keep.safetensors"});
}

TEST_F(SafetensorsTest, SuccessfulWriteReplacesTheFileAndLeavesNoTemporary) {
  const std::string p = path("w.safetensors");
  write_safetensors(p, {{"w", Tensor::from_values({1, 2}, {2}, DType::Float32)}});
  write_safetensors(p, {{"v", Tensor::from_values({3}, {1}, DType::Float64)}});
  const auto back = read_safetensors(p);
  ASSERT_EQ(back.size(), 1u);
  EXPECT_EQ(back.at("v").to_vector(), std::vector<double>{3});
  EXPECT_EQ(listing(), std::vector<std::string>{"w.safetensors"});
}

TEST_F(SafetensorsTest, GetOfUnknownNameNamesFileAndTensor) {
  const std::string p = path("w.safetensors");
  write_safetensors(p, {{"w", Tensor::ones({2})}});
  const SafetensorsFile file(p);
  try {
    (void)file.get("missing.weight");
    ADD_FAILURE() << "no error";
  } catch (const SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find(p), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("no tensor named 'missing.weight'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace meshgrad::io::test_safetensors
