#include "meshgrad/diag/plot.hpp"

#include <fmt/format.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "meshgrad/io/file_io.hpp"
#include "meshgrad/io/json_input.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad::diag {

namespace {

// What the reader keeps between lines: where the last step came from (for messages) and the notes.
struct Reading {
  const std::string& path;
  MetricsSeries s;
  int last_step_line = 0;
};

// train writes steps 1, 2, ...: a step number is an integer from 1 to 2^53 (a double holds every one).
bool is_step_number(double v) { return v >= 1 && v <= 9007199254740992.0 && v == std::floor(v); }

// A resumed run's header: its "first_step" (the checkpoint's step + 1) drops the steps read so far
// from that step on, which the killed run had taken after its checkpoint; said in a note.
void read_header(Reading& r, const nlohmann::json& j, int number) {
  if (!j.contains("first_step")) return;
  const nlohmann::json& f = j["first_step"];
  MG_CHECK(f.is_number() && is_step_number(f.get<double>()), "plot: '{}' line {}: the header's \"first_step\" is {}, "
           "not a step number (a resumed run writes its checkpoint's step + 1, at least 1)", r.path, number,
           io::json_excerpt(f));
  const double first = f.get<double>();
  MetricsSeries& s = r.s;
  std::size_t dropped = 0;
  while (!s.step.empty() && s.step.back() >= first) {
    s.step.pop_back();
    s.loss.pop_back();
    s.lr.pop_back();
    ++dropped;
  }
  while (!s.val_step.empty() && s.val_step.back() >= first) {
    s.val_step.pop_back();
    s.val_loss.pop_back();
  }
  if (dropped > 0) {
    s.notes.push_back(fmt::format("line {}: a resumed run (first_step {:g}) replaces the {} step(s) from step {:g} on "
                                  "written before it", number, first, dropped, first));
  }
  r.last_step_line = 0;
}

// A step line: numeric step (a step number, above the previous one), loss, lr (finite, not negative)
// and, on evaluation steps, val_loss.
void read_step(Reading& r, const nlohmann::json& j, int number) {
  auto number_at = [&](const char* key) {
    MG_CHECK(j.contains(key) && j[key].is_number(), "plot: '{}' line {} has no number \"{}\" (is it a metrics file "
             "written by meshgrad train?)", r.path, number, key);
    return j[key].get<double>();
  };
  MetricsSeries& s = r.s;
  const double step = number_at("step"), loss = number_at("loss"), lr = number_at("lr");
  MG_CHECK(is_step_number(step), "plot: '{}' line {}: step {} is not a step number (train writes 1, 2, ...)", r.path,
           number, step);
  // Steps only increase within a run; a resumed run's header (first_step) is what starts them again.
  MG_CHECK(s.step.empty() || step > s.step.back(), "plot: '{}' line {} has step {:g} after step {:g}{}: a run's steps "
           "increase (only a resumed run's header, with \"first_step\", goes back); are two metrics files joined?",
           r.path, number, step, s.step.back(),
           r.last_step_line > 0 ? fmt::format(" (line {})", r.last_step_line) : std::string());
  MG_CHECK(std::isfinite(lr) && lr >= 0, "plot: '{}' line {}: lr {} is not a learning rate (finite, not negative)",
           r.path, number, lr);
  s.step.push_back(step);
  s.loss.push_back(loss);
  s.lr.push_back(lr);
  if (j.contains("val_loss")) {
    s.val_step.push_back(step);
    s.val_loss.push_back(number_at("val_loss"));
  }
  r.last_step_line = number;
}

}  // namespace

MetricsSeries read_metrics(const std::string& path) {
  // A regular file only: a directory read as no lines, /dev/zero read until memory ran out and a FIFO
  // blocked (reliability-2 L3). The check opens without blocking; the lines are then read as a stream.
  try {
    io::open_regular_file(path, nullptr);
  } catch (const io::FileIoError& e) {
    throw InvalidArgument(fmt::format("plot: metrics file {}", e.what()));
  }
  std::ifstream in(path);
  MG_CHECK(in.good(), "plot: metrics file '{}' cannot be opened for reading", path);
  Reading r{path, {}};
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    // The untrusted-JSON reader: its message says what is wrong ("number overflow parsing '1e999'",
    // N106, as well as syntax) and nesting is bounded; the error names the file and the line.
    nlohmann::json j;
    try {
      j = io::parse_untrusted_json(line, 64);
    } catch (const io::JsonInputError& e) {
      throw InvalidArgument(fmt::format("plot: '{}' line {} is not JSON ({}{})", path, number, e.what(),
                                        e.byte() ? fmt::format(", at byte {} of the line", *e.byte()) : std::string()));
    }
    MG_CHECK(j.is_object(), "plot: '{}' line {} is not a JSON object", path, number);
    // Step lines carry no "type" (or "step"); any other type (the header, "sample" lines) is not a step.
    const bool typed = j.contains("type");
    if (typed && j["type"] == "header") {
      read_header(r, j, number);
    } else if (!typed || j["type"] == "step") {
      read_step(r, j, number);
    }
  }
  MG_CHECK(!r.s.step.empty(), "plot: '{}' has no step lines to plot", path);
  return std::move(r.s);
}

}  // namespace meshgrad::diag
