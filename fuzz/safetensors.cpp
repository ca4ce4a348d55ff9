// libFuzzer target: the safetensors reader (header, layout checks, every tensor read).
#include "file_reader_fuzz.hpp"
#include "meshgrad/io/safetensors.hpp"

MESHGRAD_FUZZ_FILE_READER([](const std::string& path) { (void)meshgrad::io::read_safetensors(path); })
