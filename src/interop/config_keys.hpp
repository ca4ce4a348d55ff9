// The readers of config.json keys the model families share (gpt2_config.cpp, hf_config.cpp): each
// names the file and the key in its message.
#pragma once

#include <cstdint>
#include <limits>
#include <string>

#include <nlohmann/json.hpp>

namespace meshgrad::interop::detail {

using json = nlohmann::json;

// The whole file, refusing what is not a regular file of at most kMaxConfigBytes.
std::string read_config_file(const std::string& path);
// text parsed as untrusted JSON (size and depth bounded) that must be an object.
json parse_config_object(const std::string& text, const std::string& path);
// A key as a positive int no larger than `max`.
int int_key(const json& j, const std::string& path, const char* key, std::int64_t max = std::numeric_limits<int>::max());
double number_key(const json& j, const std::string& path, const char* key);
// A key that changes what the model computes: absent or `expected`, else refused naming why.
void require_bool_key(const json& j, const std::string& path, const char* key, bool expected, const char* why);

}  // namespace meshgrad::interop::detail
