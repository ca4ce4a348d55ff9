// libFuzzer target: the GPT-2 config.json reader.
#include "file_reader_fuzz.hpp"
#include "meshgrad/train/gpt2_config.hpp"

MESHGRAD_FUZZ_FILE_READER([](const std::string& path) { (void)meshgrad::train::read_gpt2_config(path); })
