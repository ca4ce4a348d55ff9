#include "meshgrad/data/text_chunks.hpp"

#include <algorithm>
#include <vector>

#include "meshgrad/tensor/error.hpp"
#include "meshgrad/text/tokenizer.hpp"

namespace meshgrad::data {

namespace {

bool printable_non_space(char c) {
  const auto u = static_cast<unsigned char>(c);
  return u > 0x20 && u < 0x7F;
}

}  // namespace

std::optional<std::size_t> safe_text_cut(std::string_view text, std::size_t from) {
  from = std::max<std::size_t>(from, 1);
  if (from >= text.size()) return std::nullopt;
  // split_points(text, from) gives the newline cuts at or after `from` (its first one is the one).
  const std::vector<std::size_t> newline_cuts = text::split_points(text, from);
  if (!newline_cuts.empty()) return newline_cuts.front();
  for (std::size_t i = text.find(' ', from); i != std::string_view::npos && i + 1 < text.size(); i = text.find(' ', i + 1)) {
    if (printable_non_space(text[i - 1]) && printable_non_space(text[i + 1])) return i;
  }
  return std::nullopt;
}

TextChunkReader::TextChunkReader(const std::string& path, std::size_t chunk_bytes, const std::string& what)
    : path_(path), chunk_bytes_(std::max<std::size_t>(chunk_bytes, 1)) {
  std::uint64_t size = 0;
  try {
    fd_ = io::open_regular_file(path, &size);
  } catch (const io::FileIoError& e) {
    throw InvalidArgument(fmt::format("{}: {}", what, e.what()));
  }
  size_ = static_cast<std::int64_t>(size);
}

void TextChunkReader::fill(std::size_t want) {
  while (pending_.size() < want && read_ < size_) {
    const auto n = static_cast<std::size_t>(std::min<std::int64_t>(static_cast<std::int64_t>(want - pending_.size()), size_ - read_));
    const std::size_t at = pending_.size();
    pending_.resize(at + n);
    io::read_exact(fd_.get(), pending_.data() + at, n, static_cast<std::uint64_t>(read_), path_);
    read_ += static_cast<std::int64_t>(n);
  }
}

bool TextChunkReader::next(std::string& chunk) {
  chunk.clear();
  std::size_t want = 2 * chunk_bytes_;
  std::size_t search_from = chunk_bytes_;
  for (;;) {
    fill(want);
    const bool at_end = read_ == size_;
    std::optional<std::size_t> cut;
    if (!(at_end && pending_.size() <= chunk_bytes_)) cut = safe_text_cut(pending_, search_from);
    if (cut || at_end) {
      const std::size_t n = cut.value_or(pending_.size());
      chunk.assign(pending_, 0, n);
      pending_.erase(0, n);
      return !chunk.empty();
    }
    // No cut in the window: read another chunk's worth and search only the new part (less the
    // last byte, whose right neighbour was missing).
    search_from = std::max(search_from, pending_.size() - 1);
    want = pending_.size() + chunk_bytes_;
  }
}

}  // namespace meshgrad::data
