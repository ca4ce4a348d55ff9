// SHA-256 (OpenSSL's EVP) of byte streams and files, as lowercase hex: the content hashes that
// prepared datasets (meta.json) and checkpoints (manifest.json) record and verify.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace meshgrad::io {

// An incremental digest: update() any number of times, then hex() once.
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(Sha256&&) noexcept;
  Sha256& operator=(Sha256&&) noexcept;
  void update(const void* data, std::size_t n);
  // The digest of everything given so far (64 lowercase hex digits); the object is spent after it.
  std::string hex();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The digest of n bytes.
std::string sha256_hex(const void* data, std::size_t n);

// Lowercase hex SHA-256 of a file's bytes. Throws InvalidArgument naming an unreadable file.
std::string sha256_file(const std::string& path);

}  // namespace meshgrad::io
