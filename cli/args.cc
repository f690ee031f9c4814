#include "cli/args.h"

#include <algorithm>
#include <charconv>
#include <string_view>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

namespace mg::cli {
namespace {

bool is_number(std::string_view s) {
  double v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  return !s.empty() && ec == std::errc{} && p == s.data() + s.size();
}

// "-1", "-0.5": argparse takes these as values, not as flags.
bool is_negative_number(std::string_view s) { return s.size() > 1 && s[0] == '-' && is_number(s.substr(1)); }

// "-p 2222" (a value with a space, e.g. for --ssh-opts): argparse takes it as a value too.
bool looks_like_flag(std::string_view s) {
  return s.size() > 1 && s[0] == '-' && !is_negative_number(s) && s.find(' ') == std::string_view::npos;
}

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string empty_value_error(const std::string& written) {
  return fmt::format("empty value in '{}=' (an unset shell variable?): give a value or leave the flag out", written);
}

}  // namespace

std::string one_line(std::string_view text, std::size_t max) {
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.remove_suffix(1);
  std::string out;
  out.reserve(std::min(text.size(), max) + 8);
  for (const char ch : text) {
    if (out.size() >= max) {
      out += "...";
      break;
    }
    const auto c = static_cast<unsigned char>(ch);
    if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7f) out += fmt::format("\\x{:02x}", c);
    else out += ch;
  }
  return out;
}

std::string FlagSpec::display() const {
  return long_names.empty() ? "-" + short_names.at(0) : "--" + long_names.front();
}

std::vector<std::string> long_names(const std::vector<FlagSpec>& specs) {
  std::vector<std::string> out;
  for (const auto& s : specs) out.insert(out.end(), s.long_names.begin(), s.long_names.end());
  return out;
}

std::optional<std::string> nearest_name(const std::string& word, const std::vector<std::string>& candidates) {
  auto fold = [](std::string s) {
    std::replace(s.begin(), s.end(), '-', '_');
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
    return s;
  };
  const std::string w = fold(word);
  std::optional<std::string> best;
  std::size_t best_d = std::max<std::size_t>(1, w.size() / 3) + 1;
  for (const auto& c : candidates) {
    const std::size_t d = edit_distance(w, fold(c));
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  return best;
}

Normalized normalize_args(const std::vector<std::string>& args, const std::vector<FlagSpec>& specs,
                          bool stop_at_positional) {
  Normalized out;
  // The flag just before a positional argument, when it was a switch that takes an
  // optional value and was given without one (`--monitor 2`).
  std::optional<std::size_t> bare_optional;
  auto rest_from = [&](std::size_t i) {
    // argparse's rule makes `--monitor 2` the program "2"; almost always a typo for `--monitor=2`.
    if (bare_optional && args[i] != "--" && is_number(args[i])) {
      const std::string name = specs[*bare_optional].display();
      throw ArgsError(fmt::format("'{} {}' makes '{}' the program: write {}={} (the value of an optional-value flag "
                                  "needs '='), or '{} -- {}' if '{}' really is the program",
                                  name, args[i], args[i], name, args[i], name, args[i], args[i]));
    }
    out.rest = out.args.size();
    out.args.insert(out.args.end(), args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
    return out;
  };
  // The specs a long name (or a prefix of one) names: the exact one, else every spec with a
  // name that starts with it (two spellings of one flag count once).
  auto match_long = [&](std::string_view name) {
    std::vector<std::size_t> found;
    for (std::size_t k = 0; k < specs.size(); ++k)
      for (const auto& l : specs[k].long_names)
        if (l == name) return std::vector<std::size_t>{k};
    if (name.empty()) return found;
    for (std::size_t k = 0; k < specs.size(); ++k)
      for (const auto& l : specs[k].long_names)
        if (l.starts_with(name)) {
          found.push_back(k);
          break;
        }
    return found;
  };
  // Emits spec `k` with `value` (nullopt: a switch), taking the next argument when needed.
  auto emit = [&](std::size_t k, const std::string& written, std::optional<std::string> value, std::size_t& i) {
    const FlagSpec& s = specs[k];
    const bool is_long = !s.long_names.empty();
    const std::string name = s.display();
    if (s.takes_value && !value) {
      if (i + 1 >= args.size())
        throw ArgsError(fmt::format("{} needs a value: {}=VALUE", written, written));
      if (looks_like_flag(args[i + 1]))
        throw ArgsError(fmt::format("{} needs a value but is followed by the flag '{}': write {}=VALUE ({}= for an "
                                    "empty value)",
                                    written, args[i + 1], written, written));
      value = args[++i];
    }
    if (value && value->empty() && !s.takes_value)
      throw ArgsError(fmt::format("empty value in '{}=' (an unset shell variable?): write {} alone or leave it out",
                                  written, written));
    if (value && value->empty() && !s.empty_ok) throw ArgsError(empty_value_error(written));
    if (!value) {
      out.args.push_back(name);
    } else if (value->empty()) {
      out.args.push_back(name);
      out.args.emplace_back();
    } else {
      out.args.push_back(is_long ? name + "=" + *value : name + *value);
    }
    if (!value && s.optional_value) bare_optional = k;
    out.given.push_back(k);
    out.values.push_back(std::move(value));
  };
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (looks_like_flag(a)) bare_optional.reset();  // emit() sets it again for this flag
    if (a == "--") {
      if (stop_at_positional) return rest_from(i);
      out.args.insert(out.args.end(), args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
      out.rest = out.args.size();
      return out;
    }
    if (a.starts_with("--")) {
      const std::string_view body = std::string_view(a).substr(2);
      const auto eq = body.find('=');
      const std::string name(body.substr(0, eq));
      std::optional<std::string> value;
      if (eq != std::string_view::npos) value = std::string(body.substr(eq + 1));
      const auto found = match_long(name);
      if (found.empty()) {
        auto near = nearest_name(name, long_names(specs));
        throw ArgsError(fmt::format("unknown flag '--{}'{}", name, near ? fmt::format(": did you mean '--{}'?", *near) : ""));
      }
      if (found.size() > 1) {
        std::string list;
        for (auto k : found) list += (list.empty() ? "" : ", ") + specs[k].display();
        throw ArgsError(fmt::format("ambiguous flag '--{}' could match {}: write more of its name", name, list));
      }
      emit(found.front(), "--" + name, std::move(value), i);
      continue;
    }
    if (looks_like_flag(a)) {
      const std::string c = a.substr(1, 1);
      std::optional<std::size_t> k;
      for (std::size_t j = 0; j < specs.size() && !k; ++j)
        if (std::find(specs[j].short_names.begin(), specs[j].short_names.end(), c) != specs[j].short_names.end()) k = j;
      if (!k) throw ArgsError(fmt::format("unknown flag '{}'", a));
      std::optional<std::string> value;
      if (a.size() > 2) {
        if (!specs[*k].takes_value) {  // combined switches (-mh): CLI11 splits them
          out.args.push_back(a);
          out.given.push_back(*k);
          out.values.emplace_back();
          continue;
        }
        value = a.substr(a[2] == '=' ? 3 : 2);
      }
      emit(*k, "-" + c, std::move(value), i);
      continue;
    }
    if (stop_at_positional) return rest_from(i);
    bare_optional.reset();
    out.args.push_back(a);
  }
  out.rest = out.args.size();
  return out;
}

std::vector<FlagSpec> specs_of(const CLI::App& app) {
  std::vector<FlagSpec> out;
  for (const CLI::Option* o : app.get_options()) {
    FlagSpec s;
    s.long_names = o->get_lnames();
    s.short_names = o->get_snames();
    if (s.long_names.empty() && s.short_names.empty()) continue;  // a positional
    s.takes_value = o->get_expected_max() > 0;  // 0: a flag (switch)
    s.empty_ok = o->get_type_name().starts_with("TEXT");
    s.optional_value = !s.takes_value && o->get_option_text().starts_with("[=");
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace mg::cli
