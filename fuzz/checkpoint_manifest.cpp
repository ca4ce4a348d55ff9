// libFuzzer target: the checkpoint manifest reader (train/checkpoint_manifest.hpp).
#include "file_reader_fuzz.hpp"
#include "meshgrad/checkpoint/manifest.hpp"

MESHGRAD_FUZZ_FILE_READER([](const std::string& path) { (void)meshgrad::checkpoint::read_manifest_file(path); })
