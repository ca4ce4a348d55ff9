// parse_untrusted_json and the bounded message helpers.
#include <gtest/gtest.h>

#include <string>

#include "meshgrad/io/json_input.hpp"

namespace meshgrad::io::test_json_input {
namespace {

JsonInputError error_of(const std::string& text, int max_depth) {
  try {
    (void)parse_untrusted_json(text, max_depth);
  } catch (const JsonInputError& e) {
    return e;
  }
  ADD_FAILURE() << "accepted: " << text.substr(0, 100);
  return JsonInputError(JsonInputError::Kind::Syntax, "", std::nullopt, {}, "");
}

TEST(JsonInput, ParsesWhatNlohmannParsesWithinTheDepth) {
  const std::string text = R"({"a": [1, -2, 3.5, "x", null, true, {"b": {}}], "c": {"d": []}})";
  EXPECT_EQ(parse_untrusted_json(text, 4), nlohmann::json::parse(text));
  EXPECT_THROW((void)parse_untrusted_json(text, 3), JsonInputError);
  EXPECT_EQ(parse_untrusted_json("7", 1), nlohmann::json(7));
  EXPECT_EQ(parse_untrusted_json("[]", 1), nlohmann::json::array());
}

TEST(JsonInput, DepthBeyondTheLimitIsRefusedWithItsPath) {
  const JsonInputError e = error_of(R"({"a": [1, {"b": [[0]]}]})", 4);
  EXPECT_EQ(e.kind(), JsonInputError::Kind::TooDeep);
  EXPECT_EQ(e.path(), (std::vector<std::string>{"a", "[1]", "b", "[0]"}));
  EXPECT_NE(std::string(e.what()).find("nested deeper than 4 levels (at 'a' > [1] > 'b' > [0])"), std::string::npos)
      << e.what();
  // A million levels: refused at once, no recursion anywhere.
  const std::string deep = std::string(1'000'000, '[') + std::string(1'000'000, ']');
  EXPECT_EQ(error_of(deep, 64).kind(), JsonInputError::Kind::TooDeep);
}

TEST(JsonInput, DuplicateKeysAreRefusedAtAnyLevel) {
  JsonInputError e = error_of(R"({"a": 1, "a": 2})", 4);
  EXPECT_EQ(e.kind(), JsonInputError::Kind::DuplicateKey);
  EXPECT_EQ(e.key(), "a");
  EXPECT_TRUE(e.path().empty());
  e = error_of(R"({"a": {"x": 1}, "b": [{"y": 1, "y": 2}]})", 4);
  EXPECT_EQ(e.key(), "y");
  EXPECT_EQ(e.path(), (std::vector<std::string>{"b", "[0]"}));
  // The same key in different objects is fine.
  EXPECT_NO_THROW((void)parse_untrusted_json(R"({"a": {"x": 1}, "b": {"x": 1}})", 4));
}

TEST(JsonInput, SyntaxErrorsGiveTheByteAndABoundedMessage) {
  JsonInputError e = error_of(R"({"a"1})", 4);
  EXPECT_EQ(e.kind(), JsonInputError::Kind::Syntax);
  ASSERT_TRUE(e.byte().has_value());
  EXPECT_EQ(*e.byte(), 4u);
  EXPECT_EQ(error_of("{} x", 4).kind(), JsonInputError::Kind::Syntax);
  // An unterminated 1 MB string: the parser's "last read" token is the whole string; cut.
  e = error_of("[\"" + std::string(1'000'000, 'z'), 4);
  EXPECT_LT(std::string(e.what()).size(), 300u);
}

TEST(JsonInput, ExcerptsAreBounded) {
  nlohmann::json deep = 1;
  for (int i = 0; i < 100'000; ++i) deep = nlohmann::json::array({std::move(deep)});
  const std::string excerpt = json_excerpt(deep, 20);
  EXPECT_EQ(excerpt, "array " + std::string(20, '[') + "...");
  EXPECT_EQ(json_excerpt(nlohmann::json::array({2, 8})), "array [2, 8]");
  EXPECT_EQ(json_excerpt(nlohmann::json(3.5)), "number 3.5");
  EXPECT_EQ(json_excerpt(nlohmann::json{{"k", "v"}}), R"(object {"k": "v"})");
  EXPECT_LT(json_excerpt(nlohmann::json(std::string(100'000, 's'))).size(), 100u);
  EXPECT_EQ(json_quote("abc", 5), "abc");
  EXPECT_EQ(json_quote("abcdefgh", 3), "abc... (8 bytes)");
  // A cut never splits a UTF-8 character: "é" is 2 bytes.
  EXPECT_EQ(json_quote("a\xc3\xa9z", 2), "a... (4 bytes)");
}

}  // namespace
}  // namespace meshgrad::io::test_json_input
