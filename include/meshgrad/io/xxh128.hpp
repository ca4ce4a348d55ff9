// XXH3-128 (libxxhash) of byte streams, as 32 lowercase hex digits: the cheap content hash that runs
// at memory speed, for what must be hashed on every read (checkpoint pieces, the training data at
// every start). The digits are XXH128's canonical (big-endian) form, what `xxhsum -H2` prints.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace meshgrad::io {

// An incremental digest: update() any number of times, hex() whenever (it does not end the stream),
// reset() to start again.
class Xxh128 {
 public:
  Xxh128();   // throws std::bad_alloc when the state cannot be allocated
  ~Xxh128();
  Xxh128(Xxh128&&) noexcept;
  Xxh128& operator=(Xxh128&&) noexcept;
  void reset();
  void update(const void* data, std::size_t n);
  std::string hex() const;   // the digest of what was given since the last reset

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// The digest of n bytes.
std::string xxh128_hex(const void* data, std::size_t n);

}  // namespace meshgrad::io
