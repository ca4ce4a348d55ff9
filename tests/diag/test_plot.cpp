// meshgrad plot: metrics files into SVG (and PNG) curves: reading, ticks, legend, smoothing, log
// axis, overlays, PNG rendering.
#include <cairo.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include "meshgrad/diag/plot.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad::diag::test_plot {
namespace {

std::string write_file(const std::string& name, const std::string& text) {
  const auto p = std::filesystem::temp_directory_path() / ("meshgrad_plot_" + name);
  std::ofstream(p) << text;
  return p.string();
}

int count(const std::string& text, const std::string& needle) {
  int n = 0;
  for (std::size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

// The text between `from` (searched from the start) and the next `to`; empty when `from` is absent.
std::string between(const std::string& text, const std::string& from, const std::string& to) {
  const std::size_t a = text.find(from);
  if (a == std::string::npos) return "";
  const std::size_t b = text.find(to, a + from.size());
  return text.substr(a + from.size(), b == std::string::npos ? std::string::npos : b - a - from.size());
}

struct Point {
  double x, y;
};

// The points of the polyline with this id; none when there is no such polyline.
std::vector<Point> polyline(const std::string& svg, const std::string& id) {
  const std::string tag = between(svg, "<polyline id=\"" + id + "\"", "/>");
  std::vector<Point> out;
  std::istringstream in(between(tag, "points=\"", "\""));
  Point p;
  char comma;
  while (in >> p.x >> comma >> p.y) out.push_back(p);
  return out;
}

// The labels of a tick group (x_ticks, y_ticks, lr_ticks): where each sits (x for the step axis, y
// for the vertical ones) and its text.
struct Tick {
  double at;
  std::string label;
};
std::vector<Tick> ticks(const std::string& svg, const std::string& group) {
  const std::string body = between(svg, "<g id=\"" + group + "\"", "</g>");
  const std::regex text_re("<text x=\"([-0-9.]+)\" y=\"([-0-9.]+)\"[^>]*>([^<]*)</text>");
  std::vector<Tick> out;
  for (std::sregex_iterator it(body.begin(), body.end(), text_re), end; it != end; ++it) {
    out.push_back({std::stod((*it)[group == "x_ticks" ? 1 : 2].str()), (*it)[3].str()});
  }
  return out;
}

std::vector<std::string> legend(const std::string& svg) {
  std::vector<std::string> out;
  for (const Tick& t : ticks(svg, "legend")) out.push_back(t.label);
  return out;
}

// A run of `steps` steps, loss 5 - step/steps (evaluations every eval_every steps when > 0).
std::string metrics_text(int steps, int eval_every = 0) {
  std::string text = "{\"type\":\"header\",\"mesh\":\"tp=1\"}\n";
  for (int s = 1; s <= steps; ++s) {
    text += fmt::format("{{\"step\":{},\"loss\":{},\"lr\":{}", s, 5.0 - static_cast<double>(s) / steps, 1e-4 * s / steps);
    if (eval_every > 0 && s % eval_every == 0) text += fmt::format(",\"val_loss\":{}", 5.1 - static_cast<double>(s) / steps);
    text += "}\n";
  }
  return text;
}

PlotRun run_of(const std::string& name, const std::string& text) {
  const std::string path = write_file(name, text);
  PlotRun run{name, path, read_metrics(path)};
  std::filesystem::remove(path);
  return run;
}

std::string svg_of(const std::vector<PlotRun>& runs, PlotOptions o = {}) {
  if (o.title.empty()) o.title = "t";
  return plot_svg(runs, o);
}

TEST(Plot, DrawsTrainValidationAndLearningRate) {
  const std::string path = write_file("ok.jsonl",
                                      "{\"type\":\"header\",\"mesh\":\"tp=2\"}\n"
                                      "{\"step\":1,\"loss\":5.5,\"lr\":0.001,\"grad_norm\":1}\n"
                                      "{\"step\":2,\"loss\":4.0,\"lr\":0.002,\"val_loss\":4.2}\n"
                                      "{\"step\":3,\"loss\":3.1,\"lr\":0.002}\n"
                                      "{\"step\":4,\"loss\":2.5,\"lr\":0.001,\"val_loss\":2.9}\n");
  const MetricsSeries s = read_metrics(path);
  ASSERT_EQ(s.step.size(), 4u);
  EXPECT_EQ(s.val_step, (std::vector<double>{2, 4}));
  EXPECT_EQ(s.val_loss, (std::vector<double>{4.2, 2.9}));
  const std::string svg = svg_of({{"ok", path, s}}, {"run <1>"});
  EXPECT_EQ(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u);
  EXPECT_EQ(polyline(svg, "train_loss").size(), 4u);
  EXPECT_EQ(polyline(svg, "val_loss").size(), 2u);
  EXPECT_EQ(polyline(svg, "lr").size(), 4u);
  EXPECT_EQ(count(between(svg, "<g id=\"val_loss_points\">", "</g>"), "<circle"), 2);
  EXPECT_NE(svg.find("run &lt;1&gt;"), std::string::npos) << "the title is escaped";
  EXPECT_EQ(legend(svg), (std::vector<std::string>{"train loss", "val loss", "learning rate"}));
  EXPECT_EQ(count(svg, "<svg"), 1);
  EXPECT_EQ(count(svg, "</svg>"), 1);
  // Lower loss is drawn higher up the page: the last train point's y is larger than the first's.
  const auto train = polyline(svg, "train_loss");
  EXPECT_LT(train.front().y, train.back().y);
  std::filesystem::remove(path);
}

TEST(Plot, NoValidationLegendWithoutEvaluations) {
  const std::string svg = svg_of({run_of("noeval.jsonl", metrics_text(5))});
  EXPECT_EQ(legend(svg), (std::vector<std::string>{"train loss", "learning rate"}));
  EXPECT_TRUE(polyline(svg, "val_loss").empty());
  EXPECT_EQ(svg.find("val loss"), std::string::npos);
}

TEST(Plot, AResumedRunSupersedesTheStepsAfterItsCheckpoint) {
  // Killed after step 4 with a checkpoint at step 2: the resumed run appends steps 3.. again.
  const std::string path = write_file("resumed.jsonl",
                                      "{\"type\":\"header\"}\n"
                                      "{\"step\":1,\"loss\":5,\"lr\":1}\n"
                                      "{\"step\":2,\"loss\":4,\"lr\":1,\"val_loss\":4.5}\n"
                                      "{\"step\":3,\"loss\":9,\"lr\":1}\n"
                                      "{\"step\":4,\"loss\":9,\"lr\":1,\"val_loss\":9}\n"
                                      "{\"type\":\"header\",\"resumed_from\":\"ck/step_00000002\",\"first_step\":3}\n"
                                      "{\"step\":3,\"loss\":3,\"lr\":1}\n"
                                      "{\"step\":4,\"loss\":2,\"lr\":1,\"val_loss\":2.5}\n");
  const MetricsSeries s = read_metrics(path);
  EXPECT_EQ(s.step, (std::vector<double>{1, 2, 3, 4}));
  EXPECT_EQ(s.loss, (std::vector<double>{5, 4, 3, 2}));
  EXPECT_EQ(s.val_step, (std::vector<double>{2, 4}));
  EXPECT_EQ(s.val_loss, (std::vector<double>{4.5, 2.5}));
  std::filesystem::remove(path);
}

// Sample lines (and any other typed line) are not steps; step lines may carry more keys or "type":"step".
TEST(Plot, SkipsLinesThatAreNotSteps) {
  const std::string path = write_file("samples.jsonl",
                                      "{\"type\":\"header\"}\n"
                                      "{\"step\":1,\"loss\":5,\"lr\":1,\"ms_per_step\":80.5,\"mfu\":0.31}\n"
                                      "{\"type\":\"sample\",\"step\":1,\"text\":\"Once upon\"}\n"
                                      "{\"type\":\"step\",\"step\":2,\"loss\":4,\"lr\":1,\"val_loss\":4.4}\n"
                                      "{\"type\":7,\"step\":2}\n"
                                      "{\"type\":\"eval_detail\",\"step\":2,\"loss\":\"n/a\"}\n");
  const MetricsSeries s = read_metrics(path);
  EXPECT_EQ(s.step, (std::vector<double>{1, 2}));
  EXPECT_EQ(s.loss, (std::vector<double>{5, 4}));
  EXPECT_EQ(s.val_loss, (std::vector<double>{4.4}));
  std::filesystem::remove(path);
}

TEST(Plot, BadFilesNameTheFileAndLine) {
  const std::string bad = write_file("bad.jsonl", "{\"step\":1,\"loss\":5.5,\"lr\":0.001}\nnot json\n");
  try {
    read_metrics(bad);
    ADD_FAILURE() << "accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("line 2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
  }
  const std::string missing_key = write_file("nokey.jsonl", "{\"step\":1,\"lr\":0.001}\n");
  EXPECT_THROW(read_metrics(missing_key), InvalidArgument);
  const std::string typed_step = write_file("typed.jsonl", "{\"type\":\"step\",\"step\":1,\"lr\":0.001}\n");
  EXPECT_THROW(read_metrics(typed_step), InvalidArgument) << "a step line with \"type\" is still checked";
  const std::string only_header = write_file("header.jsonl", "{\"type\":\"header\"}\n");
  EXPECT_THROW(read_metrics(only_header), InvalidArgument);
  EXPECT_THROW(read_metrics("/nonexistent/m.jsonl"), InvalidArgument);
  for (const auto& p : {bad, missing_key, typed_step, only_header}) std::filesystem::remove(p);
}

// The message of read_metrics on a file of `text`; "" when it is accepted.
std::string refusal_of(const std::string& name, const std::string& text) {
  const std::string path = write_file(name, text);
  std::string message;
  try {
    read_metrics(path);
  } catch (const InvalidArgument& e) {
    message = e.what();
  }
  std::filesystem::remove(path);
  return message;
}

// reliability-3 N106: a number beyond a double's range was a bare nlohmann message with no file or line.
TEST(Plot, ANumberOutOfRangeNamesTheFileAndLine) {
  const std::string m = refusal_of("overflow.jsonl", "{\"step\":1,\"loss\":5,\"lr\":0.001}\n"
                                                      "{\"step\":2,\"loss\":1e999,\"lr\":0.001}\n");
  EXPECT_NE(m.find("meshgrad_plot_overflow.jsonl' line 2 is not JSON"), std::string::npos) << m;
  EXPECT_NE(m.find("number overflow parsing '1e999'"), std::string::npos) << m;
  EXPECT_EQ(m.find("[json.exception"), std::string::npos) << m;
}

// reliability-3 N114: steps that no run writes (going back without a resumed run's header, not a
// positive integer), a negative learning rate and a header's first_step that is no step were drawn
// without a word (first_step -1 dropped every step before it). Each is refused naming the line.
TEST(Plot, StepsAndLearningRatesNoRunWritesAreRefusedNamingTheLine) {
  const std::string ok = "{\"step\":5,\"loss\":5,\"lr\":0.1}\n";
  const std::pair<std::string, std::string> cases[] = {
      {ok + "{\"step\":3,\"loss\":4,\"lr\":0.1}\n", "line 2 has step 3 after step 5 (line 1)"},
      {ok + "{\"step\":5,\"loss\":4,\"lr\":0.1}\n", "line 2 has step 5 after step 5 (line 1)"},
      {"{\"step\":-5,\"loss\":4,\"lr\":0.1}\n", "line 1: step -5 is not a step number"},
      {"{\"step\":1.5,\"loss\":4,\"lr\":0.1}\n", "line 1: step 1.5 is not a step number"},
      {"{\"step\":1e300,\"loss\":4,\"lr\":0.1}\n", "line 1: step 1e+300 is not a step number"},
      {ok + "{\"step\":6,\"loss\":4,\"lr\":-1}\n", "line 2: lr -1 is not a learning rate"},
      {ok + "{\"type\":\"header\",\"first_step\":-1}\n", "line 2: the header's \"first_step\" is number -1, not a step"},
      {ok + "{\"type\":\"header\",\"first_step\":\"3\"}\n", "line 2: the header's \"first_step\" is string \"3\""},
  };
  for (const auto& [text, expected] : cases) {
    const std::string m = refusal_of("order.jsonl", text);
    EXPECT_NE(m.find(expected), std::string::npos) << "expected: " << expected << "\ngot: " << m;
  }
}

// A resumed run's header that replaces steps says so in a note; one that replaces none adds no note.
TEST(Plot, AResumedRunsReplacedStepsAreNoted) {
  const std::string path = write_file("noted.jsonl",
                                      "{\"step\":1,\"loss\":5,\"lr\":1}\n{\"step\":2,\"loss\":4,\"lr\":1}\n"
                                      "{\"step\":3,\"loss\":9,\"lr\":1}\n"
                                      "{\"type\":\"header\",\"first_step\":2}\n{\"step\":2,\"loss\":3,\"lr\":1}\n"
                                      "{\"type\":\"header\",\"first_step\":3}\n{\"step\":3,\"loss\":2,\"lr\":1}\n");
  const MetricsSeries s = read_metrics(path);
  EXPECT_EQ(s.step, (std::vector<double>{1, 2, 3}));
  EXPECT_EQ(s.loss, (std::vector<double>{5, 3, 2}));
  ASSERT_EQ(s.notes.size(), 1u);
  EXPECT_EQ(s.notes[0], "line 4: a resumed run (first_step 2) replaces the 2 step(s) from step 2 on written before it");
  std::filesystem::remove(path);
}

// Not a regular file: refused at once naming what it is (reliability-2 L3: a directory read as "no
// step lines", /dev/zero read until the memory ran out, a FIFO would block).
TEST(Plot, RefusesWhatIsNotARegularFile) {
  const auto dir = std::filesystem::temp_directory_path() / "meshgrad_plot_dir";
  std::filesystem::create_directories(dir);
  const auto fifo = std::filesystem::temp_directory_path() / "meshgrad_plot_fifo";
  std::filesystem::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::pair<std::string, std::string> cases[] = {
      {dir.string(), "a directory"}, {"/dev/zero", "a character device"}, {fifo.string(), "a FIFO"}};
  for (const auto& [path, kind] : cases) {
    try {
      read_metrics(path);
      ADD_FAILURE() << "accepted " << path;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("'" + path + "' is not a regular file (" + kind + ")"), std::string::npos)
          << e.what();
    }
  }
  std::filesystem::remove(fifo);
  std::filesystem::remove(dir);
}

// Ticks of [lo, hi]: sorted, inside, evenly spaced by 1, 2 or 5 times a power of ten, labels distinct
// and each reading back as its value.
void expect_nice(double lo, double hi, int most, bool integers) {
  SCOPED_TRACE(fmt::format("[{}, {}] at most {}", lo, hi, most));
  const auto t = linear_ticks(lo, hi, most, integers);
  ASSERT_FALSE(t.empty());
  EXPECT_LE(t.size(), static_cast<std::size_t>(most));
  const auto labels = tick_labels(t, false);
  ASSERT_EQ(labels.size(), t.size());
  for (std::size_t i = 0; i < t.size(); ++i) {
    EXPECT_GE(t[i], lo - 1e-9 * std::abs(lo));
    EXPECT_LE(t[i], hi + 1e-9 * std::abs(hi));
    if (integers) { EXPECT_EQ(t[i], std::round(t[i])); }
    const double step = i > 0 ? t[i] - t[i - 1] : 0;
    if (i > 0) {
      const double mantissa = step / std::pow(10, std::floor(std::log10(step) + 1e-9));
      EXPECT_TRUE(std::abs(mantissa - 1) < 1e-6 || std::abs(mantissa - 2) < 1e-6 || std::abs(mantissa - 5) < 1e-6)
          << "step " << step;
      EXPECT_NEAR(step, t[1] - t[0], 1e-9 * std::abs(step));
      EXPECT_NE(labels[i], labels[i - 1]);
      EXPECT_LT(std::stod(labels[i - 1]), std::stod(labels[i]));
      EXPECT_NEAR(std::stod(labels[i]), t[i], 1e-3 * step) << labels[i];
    }
  }
}

TEST(Plot, LinearTicksAreNiceDistinctAndInside) {
  EXPECT_EQ(linear_ticks(1, 3, 10, true), (std::vector<double>{1, 2, 3}));
  EXPECT_EQ(linear_ticks(0.5, 1.5, 10, true), (std::vector<double>{1}));
  EXPECT_EQ(linear_ticks(1, 10, 6, true), (std::vector<double>{2, 4, 6, 8, 10}));
  EXPECT_EQ(linear_ticks(0, 1000, 6, true), (std::vector<double>{0, 200, 400, 600, 800, 1000}));
  EXPECT_EQ(tick_labels(linear_ticks(1, 3, 10, true), false), (std::vector<std::string>{"1", "2", "3"}));
  expect_nice(1, 3, 10, true);
  expect_nice(1, 10, 20, true);
  expect_nice(0, 1000, 11, true);
  expect_nice(7, 123457, 9, true);
  expect_nice(2.0001, 2.0004, 8, false);
  expect_nice(3.2, 3.9, 12, false);
  expect_nice(-0.37, 0.42, 7, false);
  expect_nice(1e-5, 3.1e-4, 8, false);
  EXPECT_EQ(tick_labels({0, 0.5, 1}, false), (std::vector<std::string>{"0.0", "0.5", "1.0"}));
  EXPECT_EQ(tick_labels({1e-4, 2e-4, 3e-4}, false), (std::vector<std::string>{"1e-04", "2e-04", "3e-04"}));
  EXPECT_EQ(tick_labels({1e-4, 1.5e-4, 2e-4}, false), (std::vector<std::string>{"1.0e-04", "1.5e-04", "2.0e-04"}));
  EXPECT_EQ(tick_labels({2e6, 4e6}, false), (std::vector<std::string>{"2e+06", "4e+06"}));
  EXPECT_EQ(tick_labels({0.5, 1, 2, 5, 10, 20, 1e-5}, true),
            (std::vector<std::string>{"0.5", "1", "2", "5", "10", "20", "1e-05"}));
}

// The step axis of short and long runs: integer labels, each exactly where that step's point is drawn.
TEST(Plot, StepTicksSitAtTheirSteps) {
  for (int steps : {1, 3, 10, 1001}) {
    SCOPED_TRACE(fmt::format("{} steps", steps));
    const std::string svg = svg_of({run_of("steps.jsonl", metrics_text(steps))});
    const auto points = polyline(svg, "train_loss");
    ASSERT_EQ(points.size(), static_cast<std::size_t>(steps));
    const auto x = ticks(svg, "x_ticks");
    ASSERT_FALSE(x.empty());
    for (std::size_t i = 0; i < x.size(); ++i) {
      const int step = std::stoi(x[i].label);
      EXPECT_EQ(std::to_string(step), x[i].label) << "integers only";
      if (i > 0) { EXPECT_GT(step, std::stoi(x[i - 1].label)) << "sorted, never repeated"; }
      ASSERT_GE(step, 1);
      ASSERT_LE(step, steps);
      EXPECT_NEAR(x[i].at, points[step - 1].x, 0.01) << "step " << step;
    }
    if (steps == 1) {
      EXPECT_EQ(x.size(), 1u);
      EXPECT_EQ(count(between(svg, "<g id=\"train_loss_points\">", "</g>"), "<circle"), 1) << "one step is a dot";
    }
    if (steps == 3) { EXPECT_EQ(x.size(), 3u); }
    if (steps == 10) { EXPECT_EQ(x.back().label, "10"); }
  }
}

// Loss labels at their values: on the line through two drawn points of known loss.
TEST(Plot, LossTicksSitAtTheirValues) {
  const std::string svg = svg_of({run_of("loss.jsonl", metrics_text(10))});
  const auto points = polyline(svg, "train_loss");   // loss 4.9 at step 1, 4.0 at step 10
  const auto y = ticks(svg, "y_ticks");
  ASSERT_GE(y.size(), 3u);
  for (const Tick& t : y) {
    const double expected = points[0].y + (std::stod(t.label) - 4.9) / (4.0 - 4.9) * (points[9].y - points[0].y);
    EXPECT_NEAR(t.at, expected, 0.02) << t.label;
  }
  EXPECT_FALSE(ticks(svg, "lr_ticks").empty());
}

TEST(Plot, SmoothingIsTensorBoardsDebiasedAverage) {
  // By hand, w = 0.5: s = 0.5, 1.25, 2.125, 3.0625 divided by 1 - 0.5^t = 0.5, 0.75, 0.875, 0.9375.
  const auto s = smooth_ema({1, 2, 3, 4}, 0.5);
  ASSERT_EQ(s.size(), 4u);
  EXPECT_DOUBLE_EQ(s[0], 1.0);
  EXPECT_DOUBLE_EQ(s[1], 1.25 / 0.75);
  EXPECT_DOUBLE_EQ(s[2], 2.125 / 0.875);
  EXPECT_DOUBLE_EQ(s[3], 3.0625 / 0.9375);
  const auto gap = smooth_ema({1, NAN, 3}, 0.5);   // a NaN stays and does not enter the average
  EXPECT_DOUBLE_EQ(gap[0], 1.0);
  EXPECT_TRUE(std::isnan(gap[1]));
  EXPECT_DOUBLE_EQ(gap[2], (0.25 + 1.5) / 0.75);
  EXPECT_EQ(smooth_ema({3, 1, 2}, 0), (std::vector<double>{3, 1, 2}));
  EXPECT_THROW(smooth_ema({1}, 1.0), InvalidArgument);
  EXPECT_THROW(smooth_ema({1}, -0.1), InvalidArgument);

  PlotOptions o;
  o.smooth = 0.5;
  const std::string svg = svg_of({run_of("smooth.jsonl", "{\"step\":1,\"loss\":1,\"lr\":1}\n{\"step\":2,\"loss\":2,\"lr\":1}\n"
                                                         "{\"step\":3,\"loss\":3,\"lr\":1}\n")}, o);
  const auto raw = polyline(svg, "train_loss_raw"), smoothed = polyline(svg, "train_loss");
  ASSERT_EQ(raw.size(), 3u);
  ASSERT_EQ(smoothed.size(), 3u);
  // Raw losses 1, 2, 3 are evenly spaced in y; the smoothed second value 1.667 sits 2/3 of the way.
  EXPECT_NEAR((smoothed[1].y - raw[0].y) / (raw[1].y - raw[0].y), 1.25 / 0.75 - 1, 0.01);
  EXPECT_NE(between(svg, "<polyline id=\"train_loss_raw\"", "/>").find("stroke-opacity"), std::string::npos) << "faint";
  EXPECT_EQ(legend(svg), (std::vector<std::string>{"train loss (raw)", "train loss (smoothed 0.5)", "learning rate"}));
  o.smooth = 1;
  EXPECT_THROW(svg_of({run_of("smooth.jsonl", metrics_text(3))}, o), InvalidArgument);
}

TEST(Plot, LogTicks) {
  EXPECT_EQ(log_ticks(0.5, 20, 10), (std::vector<double>{0.5, 1, 2, 5, 10, 20}));
  EXPECT_EQ(log_ticks(1, 1000, 5), (std::vector<double>{1, 10, 100, 1000}));
  EXPECT_EQ(log_ticks(1e-3, 1e9, 5), (std::vector<double>{1e-3, 1, 1e3, 1e6, 1e9}));
  EXPECT_EQ(log_ticks(2.5, 8.5, 10), (std::vector<double>{3, 4, 5, 6, 7, 8}));
  const auto narrow = log_ticks(3.2, 3.9, 10);   // no two integers: linear ticks
  EXPECT_GE(narrow.size(), 2u);
  for (double t : narrow) EXPECT_TRUE(t >= 3.2 && t <= 3.9) << t;
}

TEST(Plot, LogAxisPlacesDecadesEvenly) {
  PlotOptions o;
  o.log_y = true;
  const std::string svg = svg_of({run_of("log.jsonl", "{\"step\":1,\"loss\":100,\"lr\":1}\n{\"step\":2,\"loss\":10,\"lr\":1}\n"
                                                      "{\"step\":3,\"loss\":1,\"lr\":1}\n")}, o);
  std::map<std::string, double> at;
  for (const Tick& t : ticks(svg, "y_ticks")) at[t.label] = t.at;
  ASSERT_TRUE(at.count("1") && at.count("10") && at.count("100")) << svg;
  EXPECT_NEAR(at["1"] - at["10"], at["10"] - at["100"], 0.02) << "a decade is a decade";
  const auto points = polyline(svg, "train_loss");
  EXPECT_NEAR(points[1].y, at["10"], 0.02);
  EXPECT_NEAR(points[2].y, at["1"], 0.02);
  EXPECT_NE(svg.find("loss (log scale)"), std::string::npos);
}

TEST(Plot, LogAxisRefusesLossesThatAreNotPositive) {
  PlotOptions o;
  o.log_y = true;
  const PlotRun zero = run_of("zero.jsonl", "{\"step\":1,\"loss\":1,\"lr\":1}\n{\"step\":2,\"loss\":0,\"lr\":1}\n");
  try {
    svg_of({zero}, o);
    ADD_FAILURE() << "accepted a zero loss";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(zero.source), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("at step 2"), std::string::npos) << e.what();
  }
  const PlotRun val = run_of("val.jsonl", "{\"step\":5,\"loss\":1,\"lr\":1,\"val_loss\":-1}\n");
  try {
    svg_of({val}, o);
    ADD_FAILURE() << "accepted a negative val_loss";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("val_loss -1 at step 5"), std::string::npos) << e.what();
  }
  o.log_y = false;
  EXPECT_NO_THROW(svg_of({zero}, o));
}

TEST(Plot, OverlaysRunsEachInItsColour) {
  const std::string svg = svg_of({run_of("a.jsonl", metrics_text(20, 10)), run_of("b.jsonl", metrics_text(30))},
                                 {"cmp", 0.9});
  const std::regex colour_re("stroke=\"(#[0-9a-f]{6})\"");
  std::smatch a, b;
  const std::string tag_a = between(svg, "<polyline id=\"train_loss_0\"", "/>");
  const std::string tag_b = between(svg, "<polyline id=\"train_loss_1\"", "/>");
  ASSERT_TRUE(std::regex_search(tag_a, a, colour_re)) << svg;
  ASSERT_TRUE(std::regex_search(tag_b, b, colour_re)) << svg;
  EXPECT_NE(a[1].str(), b[1].str());
  EXPECT_EQ(polyline(svg, "train_loss_1").size(), 30u);
  EXPECT_EQ(polyline(svg, "val_loss_0").size(), 2u);
  EXPECT_TRUE(polyline(svg, "val_loss_1").empty());
  EXPECT_EQ(legend(svg), (std::vector<std::string>{"a.jsonl", "a.jsonl val", "b.jsonl"}));
  EXPECT_TRUE(polyline(svg, "lr").empty());
  EXPECT_NE(svg.find("learning rate not drawn for several runs"), std::string::npos);
  EXPECT_EQ(ticks(svg, "x_ticks").back().label, "30") << "the step axis covers the longer run";
}

TEST(Plot, LegendSitsAboveThePlot) {
  std::vector<PlotRun> runs;
  for (int i = 0; i < 8; ++i) runs.push_back(run_of(fmt::format("a_long_run_name_{}.jsonl", i), metrics_text(5, 5)));
  const std::string svg = svg_of(runs);
  double lowest = 0;
  for (const Tick& t : ticks(svg, "legend")) lowest = std::max(lowest, t.at);
  const auto y = ticks(svg, "y_ticks");
  ASSERT_FALSE(y.empty());
  double plot_top = 1e9;
  std::smatch m;
  const std::string frame = between(svg, "<path d=\"M", "\"");
  ASSERT_TRUE(std::regex_search(frame, m, std::regex("^[0-9.]+,([0-9.]+)")));
  plot_top = std::stod(m[1].str());
  EXPECT_LT(lowest + 6, plot_top) << "16 entries wrap into rows above the plot";
}

TEST(Plot, OutputFormatComesFromTheExtension) {
  EXPECT_EQ(plot_format_for("a/loss.svg", "-o"), PlotFormat::svg);
  EXPECT_EQ(plot_format_for("LOSS.PNG", "-o"), PlotFormat::png);
  for (const auto& [path, ext] : {std::pair{"loss.pdf", "'.pdf'"}, {"loss", "'(none)'"}}) {
    try {
      plot_format_for(path, "-o");
      ADD_FAILURE() << "accepted " << path;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(ext), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("-o"), std::string::npos) << e.what();
    }
  }
}

cairo_status_t read_bytes(void* closure, unsigned char* data, unsigned int length) {
  auto* in = static_cast<std::pair<const std::string*, std::size_t>*>(closure);
  if (in->second + length > in->first->size()) return CAIRO_STATUS_READ_ERROR;
  std::memcpy(data, in->first->data() + in->second, length);
  in->second += length;
  return CAIRO_STATUS_SUCCESS;
}

std::uint32_t big_endian(const std::string& bytes, std::size_t at) {
  std::uint32_t v = 0;
  for (std::size_t i = 0; i < 4; ++i) v = (v << 8) | static_cast<unsigned char>(bytes[at + i]);
  return v;
}

TEST(Plot, PngIsTheSvgRenderedAtTheRequestedSize) {
  PlotOptions o;
  o.width = 640;
  o.height = 360;
  const std::string png = svg_to_png(svg_of({run_of("png.jsonl", metrics_text(20, 5))}, o), 640, 360);
  ASSERT_GT(png.size(), 33u);
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_EQ(png.substr(12, 4), "IHDR");
  EXPECT_EQ(big_endian(png, 16), 640u);
  EXPECT_EQ(big_endian(png, 20), 360u);
  // Decoded again: a white page with the curves on it (the blue train loss is somewhere).
  std::pair<const std::string*, std::size_t> in{&png, 0};
  cairo_surface_t* image = cairo_image_surface_create_from_png_stream(read_bytes, &in);
  ASSERT_EQ(cairo_surface_status(image), CAIRO_STATUS_SUCCESS);
  const unsigned char* pixels = cairo_image_surface_get_data(image);
  const int stride = cairo_image_surface_get_stride(image);
  auto pixel = [&](int x, int y) { return *reinterpret_cast<const std::uint32_t*>(pixels + y * stride + 4 * x); };
  EXPECT_EQ(pixel(2, 2) & 0xFFFFFFu, 0xFFFFFFu) << "white background";
  int blue = 0;
  for (int y = 0; y < 360; ++y) {
    for (int x = 0; x < 640; ++x) blue += (pixel(x, y) & 0xFFFFFFu) == 0x1f77b4u;
  }
  EXPECT_GT(blue, 100) << "the train loss is drawn";
  cairo_surface_destroy(image);
  EXPECT_THROW(svg_to_png("<svg not closed", 10, 10), InvalidArgument);
}

// reliability-3 N108: every point went to librsvg, so a 200,000-step run never rendered to PNG. A
// curve keeps at most 4 vertices per pixel column (first, lowest, highest, last of the points in
// it), so what is drawn is bounded by the width; the extremes and the ends are still drawn.
TEST(Plot, LongRunsAreDrawnWithAtMostFourVerticesPerPixelColumn) {
  constexpr int kSteps = 200000;
  MetricsSeries s;
  for (int i = 1; i <= kSteps; ++i) {
    s.step.push_back(i);
    s.loss.push_back(i == 123457 ? 9.0 : i == 7 ? 0.5 : 3.0 + 0.5 * std::sin(i * 0.37) + 1.0 / i);
    s.lr.push_back(1e-3 * (1 + (i % 3)));
    if (i % 5 == 0) {
      s.val_step.push_back(i);
      s.val_loss.push_back(3.5 + 0.1 * std::cos(i * 0.01));
    }
  }
  PlotOptions o;
  o.width = 600;
  const std::string svg = svg_of({{"long", "long.jsonl", s}}, o);
  for (const char* id : {"train_loss", "val_loss", "lr"}) {
    const auto points = polyline(svg, id);
    EXPECT_GT(points.size(), 100u) << id;
    EXPECT_LE(points.size(), 4u * 600) << id;
    std::map<int, int> per_column;
    for (const Point& p : points) ++per_column[static_cast<int>(std::floor(p.x))];
    for (const auto& [column, n] : per_column) EXPECT_LE(n, 4) << id << " column " << column;
  }
  EXPECT_LE(count(between(svg, "<g id=\"val_loss_points\">", "</g>"), "<circle"), 600 * 10);
  const auto train = polyline(svg, "train_loss");
  // The spike at step 123457 is the highest point drawn (smallest y), the dip at step 7 the lowest.
  const auto top = std::min_element(train.begin(), train.end(), [](Point a, Point b) { return a.y < b.y; });
  const auto bottom = std::max_element(train.begin(), train.end(), [](Point a, Point b) { return a.y < b.y; });
  const double px_per_step = (train.back().x - train.front().x) / (kSteps - 1);
  EXPECT_NEAR(top->x, train.front().x + (123457 - 1) * px_per_step, 1e-2);
  EXPECT_NEAR(bottom->x, train.front().x + (7 - 1) * px_per_step, 1e-2);
  // Rendered to PNG (the whole path of `plot -o x.png`); before, librsvg took minutes on this.
  EXPECT_GT(svg_to_png(svg, 600, 500).size(), 1000u);
}

}  // namespace
}  // namespace meshgrad::diag::test_plot
