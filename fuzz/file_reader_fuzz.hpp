// The one entry point every meshgrad libFuzzer target shares: readers of files meshgrad did not
// write (safetensors, config.json, and later the checkpoint manifest) take a path, so each input
// becomes a file in memory (memfd, no disk I/O) named /proc/self/fd/N, and the reader runs on it.
//
// What a run checks, beyond ASan/UBSan (any memory error, UB or crash aborts):
//  - the reader either returns or throws meshgrad::InvalidArgument (the documented error type):
//    any other exception escapes and libFuzzer reports it as a crash;
//  - the error message names the file and stays bounded (no untrusted value dumped whole).
//
// A new target is one file, fuzz/<name>.cpp:
//   #include "file_reader_fuzz.hpp"
//   MESHGRAD_FUZZ_FILE_READER([](const std::string& path) { (void)meshgrad::io::read_x(path); })
// plus `meshgrad_fuzz_target(<name>)` in fuzz/CMakeLists.txt and seed files in fuzz/corpus/<name>/
// (.ci/run runs every fuzz/corpus/<name> with build-fuzz/fuzz/fuzz_<name>).
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "meshgrad/tensor/error.hpp"

namespace meshgrad::fuzz {

// The largest error message accepted: enough for a path, a tensor name cut to 60 characters and
// a few numbers, far below what dumping a hostile value would print.
inline constexpr std::size_t kMaxMessageBytes = 2048;

template <class Reader>
int run_file_reader(const std::uint8_t* data, std::size_t size, const Reader& reader) {
  const int fd = ::memfd_create("meshgrad-fuzz", MFD_CLOEXEC);
  if (fd < 0) std::abort();
  std::size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n <= 0) std::abort();
    done += static_cast<std::size_t>(n);
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  try {
    reader(path);
  } catch (const InvalidArgument& e) {
    const std::string message = e.what();
    if (message.find(path) == std::string::npos || message.size() > kMaxMessageBytes) {
      std::fprintf(stderr, "bad error message (%zu bytes, must name %s): %.600s\n", message.size(), path.c_str(),
                   message.c_str());
      std::abort();
    }
  }
  ::close(fd);
  return 0;
}

}  // namespace meshgrad::fuzz

#define MESHGRAD_FUZZ_FILE_READER(...)                                                   \
  extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {   \
    return ::meshgrad::fuzz::run_file_reader(data, size, __VA_ARGS__);                   \
  }
