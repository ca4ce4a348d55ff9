// The options of a training run, declared once: every surface that takes them is generated from
// this table, so none can lose one or give it another default.
//   - `meshgrad train`'s command-line options, with their help text, checks and shown defaults
//     (tools/train_options.hpp), and so the keys of its --config files (tools/json_config.hpp reads
//     a file by the command's options);
//   - Python's train() keywords and its docstring (python/meshgrad.cpp);
//   - the run record a checkpoint keeps (run_config.cpp: run_config_json, resume_options).
// Defaults are never written here: a surface shows and starts from the values of its TrainOptions
// (the library's default-constructed one; the CLI and Python start from larger or smaller models and
// more or fewer steps, set in one place each, and their help and docstring print those values).
//
// Most options are a member of TrainOptions. The adapters, which are not, and why:
//   mesh, backend          not part of TrainOptions (they choose the ranks that run it); each surface
//                          holds its own string, initialised from `surface_default` here.
//   dtype                  nn::ModelConfig::dtype is a DType; the option is its name ("float32").
//   tp-invariant,          two flags of the one nn::ParallelConfig::invariance: each asks for its
//   mesh-invariant         mode (the stronger wins), false drops only its own mode.
//   no-metrics             sets --metrics to none (an alias of metrics, command line only).
// The model's sizes are recorded through interop::model_config_fields (the list export and sample
// read back), under the names declared here (the tests check that the two lists agree).
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "meshgrad/train/options.hpp"

namespace meshgrad::train {

// What an option's value is. Text is a string; Path a string naming a file or directory (Python's
// None and the record's null mean none; the record keeps it absolute).
enum class OptionKind { Int, Seed, Double, Flag, Text, Path, IntList };

// Whether the run record (a checkpoint's configuration, the metrics header, a --config file) keeps
// the option: not at all, as a value a resume takes unless given again, or as the model's shape,
// which a resume cannot change.
enum class Recorded { No, Kept, Fixed };

// Where an option is taken.
enum Surface : unsigned { kCommandLine = 1, kPython = 2, kEverySurface = kCommandLine | kPython };

// A member of TrainOptions (the accessor only names it: `+[](TrainOptions& o) -> auto& { return o.lr; }`).
template <class T>
using OptionMember = T& (*)(TrainOptions&);
// A flag that is not a bool member: set(o, true) when given; get says whether it is on.
struct FlagAdapter {
  bool (*get)(const TrainOptions&);
  void (*set)(TrainOptions&, bool);
};
// A text option that is not a string member (dtype).
struct TextAdapter {
  std::string (*get)(const TrainOptions&);
  void (*set)(TrainOptions&, const std::string&);
};
// An option the surface holds itself (mesh, backend), starting at surface_default.
struct SurfaceHeld {};

using OptionTarget = std::variant<SurfaceHeld, OptionMember<int>, OptionMember<std::uint64_t>, OptionMember<double>,
                                 OptionMember<bool>, OptionMember<std::string>, OptionMember<std::vector<int>>,
                                 FlagAdapter, TextAdapter>;

struct TrainOption {
  std::string name;   // command-line name without the dashes: "grad-accum"
  OptionKind kind;
  std::string help;   // one line: the command line's help, the docstring's note
  OptionTarget field;
  Recorded recorded = Recorded::No;
  unsigned surfaces = kEverySurface;
  // Another name of the option `alias_of` ("micro-batches" of "grad-accum", "no-metrics" of
  // "metrics"): it sets the same value, the two exclude each other, and given under either name the
  // option is given (TrainOptions::given_options; the record's resume rules).
  std::string alias_of = {};
  std::string group = {};   // the command line's help group ("": the command's own options)
  // The command line's checks: integers (and each item of a list) at least `min` (none below
  // kNoMinimum) and at most `max` (0: the type's largest); -1 also allowed when minus_one says what
  // it means; a text one of `choices`; `example` shows a list in messages ("3,3").
  long long min = kNoMinimum;
  unsigned long long max = 0;
  std::string minus_one = {};
  std::vector<std::string> choices = {};
  std::string example = {};
  // A path recorded as "" when none, not left out: for --metrics, whose command-line default is a file,
  // so that a resume of a --no-metrics run does not take that default.
  bool record_empty = false;
  // For SurfaceHeld options only: the value a surface starts from.
  std::string surface_default = {};

  static constexpr long long kNoMinimum = -(1LL << 62);
  std::string python_keyword() const;   // the name with '_' for '-': "grad_accum"
  bool on(Surface s) const { return (surfaces & s) != 0; }
  bool is_alias() const { return !alias_of.empty(); }
};

// Every option of a training run, in the order the command line's help, the docstring and the
// record list them.
const std::vector<TrainOption>& train_option_table();
// The entry named `name` (its command-line name); throws InvalidArgument naming it when there is none.
const TrainOption& train_option(const std::string& name);

// The option's value in `o` as JSON (a number, a bool, a string, an array of ints); null for
// SurfaceHeld options, which TrainOptions does not hold. As a command line or a record spells it,
// except that paths are as given (not absolute).
nlohmann::json option_value(const TrainOption& option, const TrainOptions& o);
// Sets the option from JSON of its kind (as option_value gives it; FlagAdapter false drops the mode
// or setting the adapter stands for). Throws on a value of another type. SurfaceHeld: nothing.
void set_option_value(const TrainOption& option, TrainOptions& o, const nlohmann::json& value);

}  // namespace meshgrad::train
