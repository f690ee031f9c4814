// Strict long flags in front of CLI11, the rules argparse (torchrun) follows:
//  - `--name=` is an explicit empty value; it never takes the next argument as the value;
//  - a unique prefix of a long flag names that flag (`--nproc=2`); an ambiguous one is an
//    error that lists the candidates;
//  - `--name VALUE` refuses a VALUE that is itself a flag (`--rdzv_id --nproc_per_node=2`).
// normalize_args() is pure: argv in, canonical argv (every flag by its first long name,
// `--name=VALUE`) out, or an ArgsError. specs_of() reads a CLI11 App's option table.
#pragma once

#include <cstddef>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace CLI {
class App;
}

namespace mg::cli {

// One line saying what is wrong with the command line and how to fix it.
struct ArgsError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

struct FlagSpec {
  std::vector<std::string> long_names;   // without the leading "--"
  std::vector<std::string> short_names;  // single characters, without "-"
  bool takes_value = true;               // false: a switch (`--standalone`); `--switch=VALUE` still passes on
  bool empty_ok = true;                  // an explicit empty value means something (a text option)
  bool optional_value = false;           // a switch that also takes `=VALUE` (`--monitor[=S]`): never `--flag VALUE`
  std::string display() const;           // "--nproc_per_node" (or "-m" for a short-only flag)
};

// A flag whose explicit empty value is an error (`--port=`), as the small parsers want.
inline FlagSpec strict_flag(std::vector<std::string> longs, bool takes_value, std::vector<std::string> shorts = {}) {
  FlagSpec f;
  f.long_names = std::move(longs);
  f.short_names = std::move(shorts);
  f.takes_value = takes_value;
  f.empty_ok = false;
  return f;
}

struct Normalized {
  // Flags as `--name=VALUE`, `--name` `""` (an explicit empty text value) or `--name` (a
  // switch), then the first positional argument and everything after it, untouched.
  std::vector<std::string> args;
  std::vector<std::size_t> given;  // indices into the specs, in command-line order
  // The value of each `given` flag (same order); nullopt for a switch. For parsers that
  // do not hand the canonical args to CLI11 (mglaunch doctor, the --hostfile fan-out).
  std::vector<std::optional<std::string>> values;
  std::size_t rest = 0;            // index into `args` where the positional arguments start
};

// `args` without argv[0]. With `stop_at_positional`, the first argument that is not a flag
// or a flag's value (or `--`) ends the flags (mglaunch PROGRAM ARGS...); otherwise
// positional arguments pass through where they are. Unknown flags pass through unchanged
// for the caller to report (with nearest_name()).
Normalized normalize_args(const std::vector<std::string>& args, const std::vector<FlagSpec>& specs,
                          bool stop_at_positional);

// The candidate closest to `word` by edit distance, if it is close enough to be a likely
// typo (at most a third of the word's length, at least 1 edit); nullopt otherwise.
std::optional<std::string> nearest_name(const std::string& word, const std::vector<std::string>& candidates);

// `text` made fit for a one-line error: newlines, tabs and other control characters as
// escapes (`\n`, `\t`, `\x1b`), cut to `max` bytes with "..." (a user's value may hold
// anything: `--rdzv_id=$'a\nb'`). Every binary's `PROGRAM: error:` line goes through it.
std::string one_line(std::string_view text, std::size_t max = 2000);

// Every long name of every spec, for nearest_name().
std::vector<std::string> long_names(const std::vector<FlagSpec>& specs);

// The option table of a CLI11 App (help and version flags included). Text options take an
// empty value; numbers and other types do not.
std::vector<FlagSpec> specs_of(const CLI::App& app);

}  // namespace mg::cli
