// Streaming UTF-8 for printing tokens as they come: characters split across pushes come out whole,
// ill-formed bytes become U+FFFD as Python's bytes.decode("utf-8", "replace") does, and the stream
// gives the same text however the bytes are split.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "meshgrad/text/utf8.hpp"

namespace meshgrad::text::test_utf8 {
namespace {

const std::string kFffd = "\xEF\xBF\xBD";

TEST(Utf8Stream, HoldsBackASplitCharacterUntilItIsComplete) {
  const std::string text = "h\xC3\xA9llo \xE2\x82\xAC \xF0\x9F\x98\x80!";   // "héllo € 😀!"
  Utf8Stream s;
  std::string out;
  for (char c : text) {
    const std::string piece = s.push(std::string(1, c));
    out += piece;
    // Never a partial character: everything printed so far is a prefix of the text on a boundary.
    EXPECT_EQ(text.compare(0, out.size(), out), 0);
  }
  EXPECT_EQ(s.pending(), 0u);
  EXPECT_EQ(out + s.finish(), text);
  Utf8Stream t;
  EXPECT_EQ(t.push("\xF0\x9F"), "");
  EXPECT_EQ(t.pending(), 2u);
  EXPECT_EQ(t.push("\x98"), "");
  EXPECT_EQ(t.push("\x80x"), "\xF0\x9F\x98\x80x");
}

TEST(Utf8Stream, IllFormedBytesBecomeOneReplacementPerMaximalSubpart) {
  // Expected values: Python 3's bytes.decode("utf-8", "replace").
  EXPECT_EQ(to_valid_utf8("a\x80" "b"), "a" + kFffd + "b");                       // lone continuation
  EXPECT_EQ(to_valid_utf8("\xC3" "a"), kFffd + "a");                              // truncated 2-byte
  EXPECT_EQ(to_valid_utf8("\xF0\x9F\x98" "A"), kFffd + "A");                      // truncated 4-byte: one
  EXPECT_EQ(to_valid_utf8("\xED\xA0\x80"), kFffd + kFffd + kFffd);                // a surrogate
  EXPECT_EQ(to_valid_utf8("\xC0\xAF"), kFffd + kFffd);                            // overlong
  EXPECT_EQ(to_valid_utf8("\xF4\x90\x80\x80"), kFffd + kFffd + kFffd + kFffd);    // above U+10FFFF
  EXPECT_EQ(to_valid_utf8("\xFF"), kFffd);
  EXPECT_EQ(to_valid_utf8("ok\xE2\x82"), "ok" + kFffd);                           // cut at the end
  Utf8Stream s;
  EXPECT_EQ(s.push("ok\xE2\x82"), "ok");
  EXPECT_EQ(s.finish(), kFffd);
  EXPECT_EQ(s.finish(), "");
}

TEST(Utf8Stream, AnySplitOfAnyBytesGivesTheWholeText) {
  std::mt19937 gen(7);
  std::uniform_int_distribution<int> byte(0, 255), cut(0, 5), choose(0, 3);
  const std::string pieces[] = {"\xC3\xA9", "\xE2\x82\xAC", "\xF0\x9F\x98\x80", "abc"};
  for (int round = 0; round < 200; ++round) {
    std::string bytes;
    for (int i = 0; i < 40; ++i) {
      // Mostly valid characters, some random bytes.
      if (byte(gen) < 200) bytes += pieces[choose(gen)];
      else bytes += static_cast<char>(byte(gen));
    }
    Utf8Stream s;
    std::string out;
    for (std::size_t i = 0; i < bytes.size();) {
      const std::size_t n = std::min<std::size_t>(static_cast<std::size_t>(cut(gen)), bytes.size() - i);
      out += s.push(std::string_view(bytes).substr(i, n));
      i += n;
    }
    out += s.finish();
    ASSERT_EQ(out, to_valid_utf8(bytes)) << "round " << round;
  }
}

TEST(InvalidUtf8Offset, FindsTheFirstIllFormedByte) {
  EXPECT_EQ(invalid_utf8_offset(""), std::nullopt);
  EXPECT_EQ(invalid_utf8_offset("ck/\xC3\xA9t\xC3\xA9 \xF0\x9F\x98\x80"), std::nullopt);
  EXPECT_EQ(invalid_utf8_offset("d\xFF.txt"), 1u);
  EXPECT_EQ(invalid_utf8_offset("\xFF\xFE"), 0u);
  EXPECT_EQ(invalid_utf8_offset("ab\xC3\xA9\xC0\xAF"), 4u);   // an overlong '/'
  EXPECT_EQ(invalid_utf8_offset("x\xED\xA0\x80"), 1u);         // a surrogate
  EXPECT_EQ(invalid_utf8_offset("abc\xE2\x82"), 3u);            // cut off by the end
}

TEST(EscapeInvalidUtf8, ShowsEachBadByteAndKeepsTheText) {
  EXPECT_EQ(escape_invalid_utf8("d\xFF.txt"), "d\\xFF.txt");
  EXPECT_EQ(escape_invalid_utf8("\xC3\xA9\xE2\x82"), "\xC3\xA9\\xE2\\x82");
  EXPECT_EQ(escape_invalid_utf8("plain"), "plain");
  const std::string escaped = escape_invalid_utf8("a\xFE\xF0\x9F\x98\x80\x80");
  EXPECT_EQ(escaped, "a\\xFE\xF0\x9F\x98\x80\\x80");
  EXPECT_EQ(invalid_utf8_offset(escaped), std::nullopt);
}

}  // namespace
}  // namespace meshgrad::text::test_utf8
