// Run configuration <-> JSON and the resume rules (contract in include/meshgrad/train/run_config.hpp).
#include "meshgrad/train/run_config.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <optional>
#include <string_view>
#include <utility>

#include "meshgrad/checkpoint/manifest.hpp"
#include "meshgrad/interop/checkpoint_model.hpp"
#include "meshgrad/text/utf8.hpp"
#include "meshgrad/train/option_table.hpp"

namespace meshgrad::train {

namespace {

// "" (none / the built-in corpus) is left out of the record (null), as an option not given: a recorded
// configuration fed back as --config must not give a path option an empty value, which is an error.
nlohmann::json absolute_path(const std::string& path) {
  if (path.empty()) return nullptr;
  return std::filesystem::absolute(path).lexically_normal().string();
}

// One recorded option (an entry of train_option_table() whose `recorded` is not No): its
// command-line name, how it goes to JSON and back, and whether a checkpoint fixes it (the model's shape).
struct OptionField {
  std::string name;
  std::function<nlohmann::json(const TrainOptions&, int resolved_vocab)> get;
  std::function<void(TrainOptions&, const nlohmann::json&)> set;
  bool fixed_by_checkpoint = false;
  bool text = false;   // a text option (a path, a prompt, a name): check_recorded_text checks its spelling
  bool path = false;   // recorded absolute (a relative one gains the working directory)
  // Other command-line names that set the same option (--micro-batches is --grad-accum, --no-metrics
  // sets --metrics to none): given under any of them, the option is given.
  std::vector<std::string> aliases = {};
  // The value a record without the option stands for (a model field newer than the record:
  // interop::absent_field_value); null: a fixed option the record must hold.
  nlohmann::json absent = nullptr;
};

// The model's sizes go through interop::model_config_fields (the list export and sample read back
// from a checkpoint), under the table's names; the vocabulary recorded is the one the run used.
OptionField model_field(const TrainOption& t) {
  const auto& model = interop::model_config_fields();
  const auto m = std::find_if(model.begin(), model.end(), [&](const interop::ModelConfigField& f) { return f.name == t.name; });
  if (m == model.end()) return {};
  MG_CHECK(m->fixed_by_checkpoint == (t.recorded == Recorded::Fixed), "train: the option table and "
           "interop::model_config_fields disagree on whether a checkpoint fixes --{}", t.name);
  return {t.name,
          [get = m->get](const TrainOptions& o, int resolved_vocab) {
            nn::ModelConfig c = o.model;
            c.vocab = resolved_vocab;   // 0 means "the data's": record the one the run used
            return get(c);
          },
          [set = m->set](TrainOptions& o, const nlohmann::json& v) { set(o.model, v); }, m->fixed_by_checkpoint,
          false, false, {}, interop::absent_field_value(*m)};
}

OptionField record_field(const TrainOption& t) {
  OptionField f = model_field(t);
  if (f.name.empty()) {
    f.name = t.name;
    f.set = [&t](TrainOptions& o, const nlohmann::json& v) { set_option_value(t, o, v); };
    f.fixed_by_checkpoint = t.recorded == Recorded::Fixed;
    f.text = t.kind == OptionKind::Text || t.kind == OptionKind::Path;
    f.path = t.kind == OptionKind::Path;
    if (f.path) {
      // A path is recorded absolute, so a resume from another working directory finds the same files.
      f.get = [&t](const TrainOptions& o, int) -> nlohmann::json {
        const std::string value = option_value(t, o).get<std::string>();
        return value.empty() && t.record_empty ? nlohmann::json("") : absolute_path(value);
      };
    } else {
      f.get = [&t](const TrainOptions& o, int) { return option_value(t, o); };
    }
  }
  for (const TrainOption& other : train_option_table()) {
    if (other.alias_of == t.name) f.aliases.push_back(other.name);
  }
  return f;
}

// The recorded options, in the table's order.
const std::vector<OptionField>& option_fields() {
  static const std::vector<OptionField> fields = [] {
    std::vector<OptionField> f;
    for (const TrainOption& t : train_option_table()) {
      if (t.recorded != Recorded::No) f.push_back(record_field(t));
    }
    return f;
  }();
  return fields;
}

// "byte 0xFF at offset 1" of the first ill-formed byte of text (which has one).
std::string bad_byte(std::string_view text, std::size_t at) {
  return fmt::format("byte 0x{:02X} at offset {}", static_cast<unsigned char>(text[at]), at);
}

// The first string (an object's key or a value) of j that is not valid UTF-8: its place as a JSON
// pointer ("/data/source"), its text and the offset of its first bad byte. False when there is none.
bool find_invalid_text(const nlohmann::json& j, const std::string& where, std::string* at, std::string* text,
                       std::size_t* offset) {
  const auto check = [&](const std::string& s, const std::string& place) {
    const std::optional<std::size_t> bad = text::invalid_utf8_offset(s);
    if (!bad) return false;
    *at = place.empty() ? "/" : place;
    *text = s;
    *offset = *bad;
    return true;
  };
  if (j.is_string()) return check(j.get_ref<const std::string&>(), where);
  if (j.is_object()) {
    for (const auto& [key, value] : j.items()) {
      if (check(key, where + "/" + key) || find_invalid_text(value, where + "/" + key, at, text, offset)) return true;
    }
  }
  if (j.is_array()) {
    for (std::size_t i = 0; i < j.size(); ++i) {
      if (find_invalid_text(j[i], fmt::format("{}/{}", where, i), at, text, offset)) return true;
    }
  }
  return false;
}

}  // namespace

void check_recorded_text(const TrainOptions& options) {
  for (const OptionField& f : option_fields()) {
    if (!f.text) continue;
    const std::string given = option_value(train_option(f.name), options).get<std::string>();
    if (const std::optional<std::size_t> bad = text::invalid_utf8_offset(given)) {
      throw InvalidArgument(fmt::format(
          "train: --{} '{}' is not valid UTF-8 ({}); a run records its options as JSON text, which is UTF-8 (every "
          "checkpoint's manifest, --save's metadata, the metrics header), so it would fail at its first save: {}",
          f.name, text::escape_invalid_utf8(given), bad_byte(given, *bad),
          f.path ? "give the file or directory a UTF-8 name (or a link to it under one)" : "give the text in UTF-8"));
    }
    if (!f.path) continue;
    const nlohmann::json recorded = f.get(options, 0);
    if (!recorded.is_string()) continue;
    const std::string& absolute = recorded.get_ref<const std::string&>();
    if (const std::optional<std::size_t> bad = text::invalid_utf8_offset(absolute)) {
      throw InvalidArgument(fmt::format(
          "train: --{} '{}' is recorded as the absolute path '{}', which is not valid UTF-8 ({}: the working "
          "directory's path); a run records its options as JSON text, which is UTF-8: run from a directory whose path "
          "is UTF-8, or give --{} as an absolute path", f.name, given, text::escape_invalid_utf8(absolute),
          bad_byte(absolute, *bad), f.name));
    }
  }
}

void check_record_text(const nlohmann::json& record, const std::string& what) {
  std::string at, bad_text;
  std::size_t offset = 0;
  if (!find_invalid_text(record, "", &at, &bad_text, &offset)) return;
  throw InvalidArgument(fmt::format("train: {} would record '{}' at {}, which is not valid UTF-8 ({}), and it is written "
                                    "as JSON text, which is UTF-8: give what it names (a data file, a directory) a "
                                    "UTF-8 name",
                                    what, text::escape_invalid_utf8(bad_text), text::escape_invalid_utf8(at),
                                    bad_byte(bad_text, offset)));
}

nlohmann::json run_config_json(const TrainOptions& options, int resolved_vocab) {
  nlohmann::json j = nlohmann::json::object();
  for (const OptionField& f : option_fields()) {
    nlohmann::json value = f.get(options, resolved_vocab);
    if (!value.is_null()) j[f.name] = std::move(value);
  }
  return j;
}

namespace {

bool is_given(const TrainOptions& options, const OptionField& f) {
  if (options.given_options.count(f.name) > 0) return true;
  return std::any_of(f.aliases.begin(), f.aliases.end(),
                     [&](const std::string& a) { return options.given_options.count(a) > 0; });
}

// A saved value as a command line spells it: 4, pp=2, true, 2,2 (not JSON's "pp=2" or [2,2]).
std::string command_line_value(const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_array()) {
    std::string s;
    for (const nlohmann::json& e : v) s += (s.empty() ? "" : ",") + command_line_value(e);
    return s;
  }
  return v.dump();
}

bool same_directory(const std::string& a, const std::string& b) {
  std::error_code ec;
  const bool same = std::filesystem::equivalent(a, b, ec);
  return !ec && same;
}

// Where a resumed run writes unless the caller names it (docs/training.md, "Resume"): see
// resume_options in run_config.hpp. *left_out gets the recorded output files not taken.
void place_resumed_outputs(TrainOptions& out, const TrainOptions& options, const nlohmann::json& saved,
                           const std::string& checkpoint, std::string* left_out) {
  if (left_out) left_out->clear();
  const std::string folder = resumed_from_folder(checkpoint);
  const auto recorded = saved.find("checkpoint-dir");
  const bool in_place = recorded != saved.end() && recorded->is_string() &&
                        same_directory(folder, recorded->get<std::string>());
  if (options.given_options.count("checkpoint-dir") == 0) {
    out.checkpoint_dir = in_place ? recorded->get<std::string>() : folder;   // in place: as before, as recorded
    out.from_checkpoint["checkpoint-dir"] = out.checkpoint_dir;
  }
  if (in_place) return;
  // Another folder than the recorded one (a copy, a moved folder): the recorded files are another
  // run's; the caller's own value (the CLI's default metrics file, say) could be that same file.
  std::string dropped;
  for (const auto& [name, path] : {std::pair<const char*, std::string*>{"metrics", &out.metrics_path}, {"save", &out.save_path}}) {
    const auto field = std::find_if(option_fields().begin(), option_fields().end(),
                                    [name = name](const OptionField& f) { return f.name == name; });
    if (is_given(options, *field)) continue;
    const auto it = saved.find(name);
    if (it != saved.end() && it->is_string() && !it->get<std::string>().empty())
      dropped += fmt::format("{}--{} {}", dropped.empty() ? "" : " and ", name, it->get<std::string>());
    path->clear();
    out.from_checkpoint.erase(name);
  }
  if (left_out) *left_out = dropped;
}

}  // namespace

std::vector<std::string> option_names(const std::string& name) {
  std::vector<std::string> names{name};
  for (const OptionField& f : option_fields()) {
    if (f.name == name) names.insert(names.end(), f.aliases.begin(), f.aliases.end());
  }
  return names;
}

std::string resumed_from_folder(const std::string& checkpoint) {
  std::filesystem::path p = std::filesystem::path(checkpoint).lexically_normal();
  if (!p.has_filename() && p.has_parent_path()) p = p.parent_path();   // "ck/step_00000006/"
  const std::filesystem::path parent = p.parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

TrainOptions resume_options(const TrainOptions& options, const nlohmann::json& saved, const std::string& checkpoint,
                            std::string* changed, std::string* left_out) {
  using checkpoint::CheckpointError;
  if (!saved.is_object()) throw checkpoint::CheckpointError(fmt::format("checkpoint '{}': the saved configuration is not an object", checkpoint));
  TrainOptions out = options;
  std::string refused, notes;
  for (const OptionField& f : option_fields()) {
    const auto found = saved.find(f.name);
    // A model field newer than the checkpoint (the Llama family's): the model it holds is GPT-2's,
    // whose value the field stands for, which a resume takes and a given option must agree with.
    const nlohmann::json* it = found != saved.end() ? &*found : f.absent.is_null() ? nullptr : &f.absent;
    if (it == nullptr) {
      // An option newer than the checkpoint: its default (or the caller's value) holds, as it did
      // for the run that wrote it. The model's shape is always recorded.
      if (f.fixed_by_checkpoint)
        throw checkpoint::CheckpointError(fmt::format("checkpoint '{}': the saved configuration has no \"{}\"", checkpoint, f.name));
      continue;
    }
    const bool given = is_given(options, f);
    // The stages' split belongs to the mesh it was written on: a resume on another mesh (given)
    // splits evenly unless --pp-layers is given too.
    if (!given && f.name == "pp-layers" && options.given_options.count("mesh") > 0) continue;
    if (!given) {
      try {
        f.set(out, *it);
      } catch (const std::exception& e) {
        throw checkpoint::CheckpointError(fmt::format("checkpoint '{}': the saved \"{}\" is {}: {}", checkpoint, f.name, it->dump(), e.what()));
      }
      // (The model's shape is the checkpoint's whatever is given: no other value to name.)
      if (!f.fixed_by_checkpoint && f.get(options, options.model.vocab) != *it)
        out.from_checkpoint[f.name] = command_line_value(*it);
      continue;
    }
    // The model's vocabulary 0 means "the data's": compare the resolved one the checkpoint holds.
    const nlohmann::json mine = f.get(options, options.model.vocab);
    if (mine == *it) continue;
    // A GPT-2 without its own "positions" has one position row per --seq (wpe is [seq, hidden]):
    // then --seq is part of its shape too. (The Llama family has no position table: RoPE.)
    const auto kind = saved.find("model");
    const bool gpt = kind == saved.end() || *kind == nlohmann::json("gpt");
    const bool shapes_positions =
        gpt && f.name == "seq" && saved.value("positions", nlohmann::json(0)) == nlohmann::json(0);
    if (f.fixed_by_checkpoint || shapes_positions) {
      refused += fmt::format("{}--{} {} (the checkpoint has {})", refused.empty() ? "" : ", ", f.name, mine.dump(), it->dump());
    } else {
      notes += fmt::format("{}--{} {} -> {}", notes.empty() ? "" : ", ", f.name, it->dump(), mine.dump());
    }
  }
  if (!refused.empty())
    throw checkpoint::CheckpointError(fmt::format("checkpoint '{}' holds a model of another shape than the options ask for: {}; a "
                                      "checkpoint only resumes into the model it was written from (leave these options out)",
                                      checkpoint, refused));
  place_resumed_outputs(out, options, saved, checkpoint, left_out);
  if (changed) *changed = notes;
  return out;
}

}  // namespace meshgrad::train
