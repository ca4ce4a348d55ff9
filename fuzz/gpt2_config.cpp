// libFuzzer target: the GPT-2 config.json reader.
#include "file_reader_fuzz.hpp"
#include "meshgrad/interop/gpt2_config.hpp"

MESHGRAD_FUZZ_FILE_READER([](const std::string& path) { (void)meshgrad::interop::read_gpt2_config(path); })
