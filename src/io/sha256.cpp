#include "meshgrad/io/sha256.hpp"

#include <fmt/format.h>
#include <openssl/evp.h>

#include <array>
#include <fstream>

#include "meshgrad/tensor/error.hpp"

namespace meshgrad::io {

struct Sha256::Impl {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx{EVP_MD_CTX_new(), EVP_MD_CTX_free};
};

Sha256::Sha256() : impl_(std::make_unique<Impl>()) {
  MG_CHECK(impl_->ctx && EVP_DigestInit_ex(impl_->ctx.get(), EVP_sha256(), nullptr) == 1,
           "sha256: OpenSSL cannot start a digest");
}
Sha256::~Sha256() = default;
Sha256::Sha256(Sha256&&) noexcept = default;
Sha256& Sha256::operator=(Sha256&&) noexcept = default;

void Sha256::update(const void* data, std::size_t n) {
  if (n > 0) MG_CHECK(EVP_DigestUpdate(impl_->ctx.get(), data, n) == 1, "sha256: digest failed");
}

std::string Sha256::hex() {
  std::array<unsigned char, EVP_MAX_MD_SIZE> md{};
  unsigned int len = 0;
  MG_CHECK(EVP_DigestFinal_ex(impl_->ctx.get(), md.data(), &len) == 1, "sha256: digest failed");
  static constexpr char digits[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(2 * len);
  for (unsigned int i = 0; i < len; ++i) {
    hex += digits[md[i] >> 4];
    hex += digits[md[i] & 15];
  }
  return hex;
}

std::string sha256_hex(const void* data, std::size_t n) {
  Sha256 h;
  h.update(data, n);
  return h.hex();
}

std::string sha256_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MG_CHECK(in.good(), "sha256: '{}' cannot be opened for reading", path);
  Sha256 h;
  std::array<char, 1 << 16> buf;
  while (in) {
    in.read(buf.data(), buf.size());
    const std::streamsize n = in.gcount();
    if (n > 0) h.update(buf.data(), static_cast<std::size_t>(n));
  }
  MG_CHECK(!in.bad(), "sha256: '{}' could not be read to the end", path);
  return h.hex();
}

}  // namespace meshgrad::io
