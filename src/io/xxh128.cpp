#include "meshgrad/io/xxh128.hpp"

#include <xxhash.h>

#include <new>

namespace meshgrad::io {

struct Xxh128::State {
  XXH3_state_t* s = XXH3_createState();
  State() {
    if (s == nullptr) throw std::bad_alloc();
  }
  ~State() { XXH3_freeState(s); }
  State(const State&) = delete;
  State& operator=(const State&) = delete;
};

Xxh128::Xxh128() : state_(std::make_unique<State>()) { reset(); }
Xxh128::~Xxh128() = default;
Xxh128::Xxh128(Xxh128&&) noexcept = default;
Xxh128& Xxh128::operator=(Xxh128&&) noexcept = default;

void Xxh128::reset() { XXH3_128bits_reset(state_->s); }

void Xxh128::update(const void* data, std::size_t n) {
  if (n > 0) XXH3_128bits_update(state_->s, data, n);
}

std::string Xxh128::hex() const {
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, XXH3_128bits_digest(state_->s));
  static constexpr char digits[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(2 * sizeof c.digest);
  for (const unsigned char byte : c.digest) {
    hex += digits[byte >> 4];
    hex += digits[byte & 15];
  }
  return hex;
}

std::string xxh128_hex(const void* data, std::size_t n) {
  Xxh128 h;
  h.update(data, n);
  return h.hex();
}

}  // namespace meshgrad::io
