#include "meshgrad/train/data.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "meshgrad/tensor/random.hpp"
#include "meshgrad/tensor/shard.hpp"

namespace meshgrad::train {

namespace {

// Written for meshgrad and placed in the public domain. Plain ASCII prose with a small vocabulary
// and repeated phrasing, so a small byte-level model learns spelling and common words within a
// couple of hundred steps and its loss visibly falls from ln(256) ~ 5.55.
constexpr std::string_view kCorpus = R"(The river begins in the hills above the town, where the snow lies late into the spring. In the morning the water is cold and clear, and the light comes down through the trees in long bright lines. The old miller used to say that the river has three voices: a small voice in the hills, a strong voice at the mill, and a slow voice by the sea. He said that a patient man could learn all three, and that a wise man would listen more than he spoke.

The town is small. There is a bridge of grey stone, a market square, a school, a bakery, and a church with a clock that is always five minutes late. On market days the farmers come in from the valley with carts of apples, bread, cheese and wool. The children run between the stalls, and the dogs follow the children, and the baker stands at his door and laughs at all of them. In the evening the square is quiet again, and the only sound is the river under the bridge.

In the autumn the rain comes from the west. It rains for a day, and then for a week, and the river rises until it runs brown and fast under the bridge. The people of the town watch the water from the windows. They have seen floods before, and they know what to do. They carry the sacks of grain up to the high rooms, they tie the boats to the trees, and they wait. When the rain stops, the river falls, and the town goes back to work as if nothing had happened.

The teacher at the school was a tall woman with a quiet voice. She taught the children to read and to write, to add and to take away, and to draw the map of the valley from memory. She told them that a map is not the land, but a story about the land, and that every good story leaves something out. She asked them what the map of the river left out, and the children said: the cold, the sound, the fish, the light in the morning, and the smell of the rain.

One winter the bridge was damaged by ice. Great plates of ice came down the river and struck the stone, and one of the arches cracked. The town met in the church to decide what to do. Some wanted to build a new bridge of iron, and some wanted to mend the old one. They talked for a long time. At last the old miller stood up and said that the stone bridge had stood for three hundred years, and that it had earned the right to be mended. So they mended it, stone by stone, and it stands there still.

The work of mending took all of the spring. The masons came from the city with their tools, and the children of the town carried water and sand for them. Every evening the masons sat in the square and told stories of other bridges they had built, in other valleys, over other rivers. They said that every river is different, but that every bridge must do the same thing: it must carry the weight of the road and let the water pass beneath it. A bridge that fights the river will fall, they said, and a bridge that lets the river pass will stand.

In the summer the river is low and warm. The children swim in the deep pool below the mill, and the old men fish from the bank and say very little. The farmers cut the hay in the fields along the water, and the air is full of the smell of it. At night the stars are bright over the valley, and from the bridge you can hear the river talking to itself in its slow summer voice.

The baker rises before the sun. He lights the oven, he mixes the flour and the water and the salt, and he waits for the dough to rise. He says that bread cannot be hurried, and that the best bread is made by a man who knows how to wait. By the time the church clock strikes six, five minutes late, the first loaves are on the shelf, and the smell of them fills the square. The first customer is always the teacher, and the second is always the miller, and they always talk about the weather.

Years passed. The children grew up and some of them left the valley to work in the city. Some came back, and some did not. The teacher grew old and another teacher took her place. The miller died, and his son kept the mill. But the river did not change. It came down from the hills in the spring, it rose in the autumn rain, it froze at the edges in the winter, and it ran low and warm in the summer, as it had always done, and as it always will.

When the miller's son was asked what his father had taught him, he said that his father had taught him to listen to the river. He said that the river tells you when the rain is coming, when the ice is thin, and when the water is too high to cross. He said that if you listen long enough, the river will tell you everything you need to know, and that most people never learn to listen at all.
)";

}  // namespace

std::string_view builtin_corpus() { return kCorpus; }

ByteDataset::ByteDataset(const std::string& path, int batch, int seq, std::uint64_t seed)
    : batch_(batch), seq_(seq), seed_(seed) {
  MG_CHECK(batch >= 1 && seq >= 1, "ByteDataset: batch and seq must be >= 1, got batch={} seq={}", batch, seq);
  std::string text;
  if (path.empty()) {
    source_ = "the built-in corpus";
    text = std::string(kCorpus);
  } else {
    source_ = "'" + path + "'";
    // A directory opens as an ifstream and fails only on the first read, with a message that names
    // neither the file nor the option.
    std::error_code ec;
    MG_CHECK(!std::filesystem::is_directory(path, ec), "data file '{}' is a directory, not a file", path);
    std::ifstream in(path, std::ios::binary);
    MG_CHECK(in.good(), "data file '{}' cannot be opened for reading", path);
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    MG_CHECK(!in.bad(), "data file '{}' could not be read to the end", path);
  }
  MG_CHECK(static_cast<std::int64_t>(text.size()) >= static_cast<std::int64_t>(seq) + 1,
           "data {} has {} bytes but a training window needs seq + 1 = {} bytes (T inputs and T shifted targets)",
           source_, text.size(), seq + 1);
  tokens_.reserve(text.size());
  for (unsigned char c : text) tokens_.push_back(static_cast<std::int64_t>(c));
}

nn::Batch ByteDataset::next_batch(std::int64_t step) const {
  MG_CHECK(step >= 0, "ByteDataset::next_batch: step must be >= 0, got {}", step);
  const std::int64_t B = batch_, T = seq_;
  // Window starts 0 .. size - T - 1 inclusive: the targets reach index start + T.
  const std::int64_t starts = size() - T;
  std::vector<std::int64_t> inputs(static_cast<std::size_t>(B * T)), targets(static_cast<std::size_t>(B * T));
  for (std::int64_t b = 0; b < B; ++b) {
    const double u = random::uniform(seed_, static_cast<std::uint64_t>(step * B + b));
    const std::int64_t start = std::min(starts - 1, static_cast<std::int64_t>(u * static_cast<double>(starts)));
    for (std::int64_t t = 0; t < T; ++t) {
      inputs[static_cast<std::size_t>(b * T + t)] = tokens_[static_cast<std::size_t>(start + t)];
      targets[static_cast<std::size_t>(b * T + t)] = tokens_[static_cast<std::size_t>(start + t + 1)];
    }
  }
  return {Tensor::from_int64(inputs, {B, T}), Tensor::from_int64(targets, {B, T})};
}

nn::Batch dp_shard(const nn::Batch& batch, int dp_rank, int dp_size) {
  MG_CHECK(batch.inputs.defined() && batch.targets.defined() && batch.inputs.dim() == 2 &&
               batch.inputs.shape() == batch.targets.shape(),
           "dp_shard: need inputs and targets of the same shape [B, T], got {} and {}",
           batch.inputs.defined() ? batch.inputs.str() : "undefined",
           batch.targets.defined() ? batch.targets.str() : "undefined");
  const std::int64_t B = batch.inputs.size(0);
  MG_CHECK(dp_size >= 1 && dp_size <= B, "dp_shard: a batch of {} rows cannot be split over dp={} (each rank "
           "needs at least one row; use --batch >= dp)", B, dp_size);
  const ShardRange rows = shard_range(B, dp_size, dp_rank);
  return {batch.inputs.narrow(0, rows.offset, rows.size).clone(),
          batch.targets.narrow(0, rows.offset, rows.size).clone()};
}

}  // namespace meshgrad::train
