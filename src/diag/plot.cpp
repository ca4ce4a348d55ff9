#include "meshgrad/diag/plot.hpp"

#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "meshgrad/io/file_io.hpp"
#include "meshgrad/tensor/error.hpp"

namespace meshgrad::diag {

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
  MetricsSeries s;
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      throw InvalidArgument(fmt::format("plot: '{}' line {} is not JSON (at byte {} of the line)", path, number, e.byte));
    }
    MG_CHECK(j.is_object(), "plot: '{}' line {} is not a JSON object", path, number);
    // Step lines carry no "type" (or "step"); any other type (the header, "sample" lines) is not a step.
    const bool typed = j.contains("type");
    const bool header = typed && j["type"] == "header";
    if (typed && !header && j["type"] != "step") continue;
    if (header) {
      // A resumed run appends from its checkpoint's step on: the steps the killed run had taken
      // after that checkpoint are superseded by the resumed run's.
      if (j.contains("first_step") && j["first_step"].is_number()) {
        const double first = j["first_step"].get<double>();
        while (!s.step.empty() && s.step.back() >= first) {
          s.step.pop_back();
          s.loss.pop_back();
          s.lr.pop_back();
        }
        while (!s.val_step.empty() && s.val_step.back() >= first) {
          s.val_step.pop_back();
          s.val_loss.pop_back();
        }
      }
      continue;
    }
    auto number_at = [&](const char* key) {
      MG_CHECK(j.contains(key) && j[key].is_number(), "plot: '{}' line {} has no number \"{}\" (is it a metrics file "
               "written by meshgrad train?)", path, number, key);
      return j[key].get<double>();
    };
    s.step.push_back(number_at("step"));
    s.loss.push_back(number_at("loss"));
    s.lr.push_back(number_at("lr"));
    if (j.contains("val_loss")) {
      s.val_step.push_back(s.step.back());
      s.val_loss.push_back(number_at("val_loss"));
    }
  }
  MG_CHECK(!s.step.empty(), "plot: '{}' has no step lines to plot", path);
  return s;
}

}  // namespace meshgrad::diag
