// libFuzzer target: the checkpoint manifest reader (checkpoint/manifest.hpp).
#include "file_reader_fuzz.hpp"
#include "meshgrad/checkpoint/manifest.hpp"

MESHGRAD_FUZZ_FILE_READER([](const std::string& path) { (void)meshgrad::checkpoint::read_manifest_file(path); })
