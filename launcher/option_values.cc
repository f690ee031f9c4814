#include "launcher/option_values.h"

#include <signal.h>
#include <string.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <map>

#include <fmt/format.h>

#include "cli/args.h"
#include "cli/errors.h"
#include "launcher/options.h"

namespace mg {

// `flag` names where the text came from: "--node_rank", "PET_NODE_RANK" or a --config key.
int parse_int(const std::string& flag, std::string_view text, int min_value, std::optional<int> max_value) {
  int v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  const std::string range =
      max_value ? fmt::format("use {}..{}", min_value, *max_value) : fmt::format("must be >= {}", min_value);
  if (text.empty()) throw UsageError(fmt::format("bad {} '': empty (an unset shell variable?); expected an integer", flag));
  if (ec == std::errc::result_out_of_range) throw UsageError(fmt::format("bad {} '{}': {}", flag, text, range));
  if (ec != std::errc{} || p != text.data() + text.size())
    throw UsageError(fmt::format("bad {} '{}': expected an integer", flag, text));
  if (v < min_value || (max_value && v > *max_value)) throw UsageError(fmt::format("bad {} '{}': {}", flag, text, range));
  return v;
}

// Seconds in [min_s, max_s] (a decimal number).
double parse_seconds(const std::string& flag, std::string_view text, double min_s, double max_s) {
  if (text.empty()) throw UsageError(fmt::format("bad {} '': empty (an unset shell variable?); expected seconds", flag));
  double v = -1;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc{} || p != text.data() + text.size() || !(v >= min_s) || v > max_s)
    throw UsageError(fmt::format("bad {} '{}': use {}..{} seconds", flag, text, min_s, max_s));
  return v;
}

std::vector<int> parse_int_list(const std::string& flag, const std::string& text) {
  std::vector<int> out;
  std::string_view rest = text;
  while (true) {
    auto comma = rest.find(',');
    out.push_back(parse_int(flag, rest.substr(0, comma), 0));
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  return out;
}


Streams StreamSpec::for_rank(int local_rank) const {
  if (auto it = per_rank.find(local_rank); it != per_rank.end()) return it->second;
  return all;
}

bool StreamSpec::covers(int local_rank, Streams which) const {
  return (static_cast<unsigned>(for_rank(local_rank)) & static_cast<unsigned>(which)) != 0;
}

StreamSpec parse_stream_spec(const std::string& flag, const std::string& text) {
  auto one = [&](std::string_view v) {
    if (v.size() != 1 || v[0] < '0' || v[0] > '3')
      throw UsageError(fmt::format("bad {} '{}': use 0 (none), 1 (stdout), 2 (stderr), 3 (both) or "
                                   "LOCAL_RANK:N,... e.g. 0:3,1:2",
                                   flag, text));
    return static_cast<Streams>(v[0] - '0');
  };
  StreamSpec spec;
  if (text.find(':') == std::string::npos) {
    spec.all = one(text);
    return spec;
  }
  std::string_view rest = text;
  while (!rest.empty()) {
    auto comma = rest.find(',');
    auto item = rest.substr(0, comma);
    auto colon = item.find(':');
    if (colon == std::string_view::npos) one("x");
    spec.per_rank[parse_int(flag, item.substr(0, colon), 0)] = one(item.substr(colon + 1));
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  return spec;
}

NodeRange parse_nnodes(const std::string& text, const std::string& flag) {
  NodeRange r;
  auto colon = text.find(':');
  if (colon == std::string::npos) {
    r.min = r.max = parse_int(flag, text, 1);
    return r;
  }
  if (text.find(':', colon + 1) != std::string::npos)  // torch's parse_min_max_nnodes refuses it too
    throw UsageError(fmt::format("bad {} '{}': expected N or MIN:MAX", flag, text));
  r.min = parse_int(flag, std::string_view(text).substr(0, colon), 1);
  r.max = parse_int(flag, std::string_view(text).substr(colon + 1), 1);
  if (r.min > r.max) throw UsageError(fmt::format("bad {} '{}': MIN must be <= MAX", flag, text));
  return r;
}

bool uses_rendezvous_server(const AgentOptions& o) { return o.rdzv_backend != "static" && o.nnodes.max > 1; }

namespace {

// One pair of matching outer quotes ('...' or "...") off `text`, as a shell would have
// removed them: PyTorch's own launcher tests pass --rdzv-conf='join_timeout=5,...' with
// the quotes inside the value.
std::string_view strip_outer_quotes(std::string_view text) {
  if (text.size() >= 2 && (text.front() == '\'' || text.front() == '"') && text.back() == text.front())
    return text.substr(1, text.size() - 2);
  return text;
}

std::string_view strip_space(std::string_view text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) text.remove_prefix(1);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.remove_suffix(1);
  return text;
}

// torch's RendezvousParameters.get_as_bool spellings.
std::optional<bool> conf_bool(std::string value) {
  std::transform(value.begin(), value.end(), value.begin(), ::tolower);
  for (const char* t : {"1", "true", "t", "yes", "y"})
    if (value == t) return true;
  for (const char* f : {"0", "false", "f", "no", "n"})
    if (value == f) return false;
  return std::nullopt;
}

}  // namespace

const std::vector<std::string>& known_rdzv_conf_keys() {
  static const std::vector<std::string> keys = {
      // dynamic rendezvous (c10d, mglaunch) and its c10d store
      "join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout", "keep_alive_interval",
      "keep_alive_max_attempt", "read_timeout", "is_host", "store_type", "use_libuv", "use_agent_store",
      // LaunchConfig (every backend) and the static backend
      "timeout", "rank",
      // etcd (and etcd-v2's spellings of its TLS files); user= is mglaunch's
      "protocol", "cacert", "cert", "key", "etcd_prefix", "user", "ca_cert", "ssl_cert", "ssl_cert_key"};
  return keys;
}

void apply_rdzv_conf(AgentOptions& o, const std::string& conf) {
  // torchrun's _parse_rendezvous_config: KEY=VALUE items split at commas, spaces around
  // keys and values dropped. mglaunch also drops one pair of outer quotes of the whole
  // text and of each value.
  std::string_view rest = strip_outer_quotes(strip_space(conf));
  while (!rest.empty()) {
    auto comma = rest.find(',');
    auto item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    auto eq = item.find('=');
    const std::string key(strip_space(item.substr(0, eq)));
    if (eq == std::string_view::npos || key.empty())
      throw UsageError(fmt::format("bad --rdzv_conf '{}': expected KEY=VALUE,...", conf));
    const std::string value(strip_outer_quotes(strip_space(item.substr(eq + 1))));
    const auto& known = known_rdzv_conf_keys();
    if (std::find(known.begin(), known.end(), key) == known.end()) {
      auto near = cli::nearest_name(key, known);
      o.usage_warnings.push_back(fmt::format("--rdzv_conf key '{}' is not one mglaunch or torchrun knows{}; ignored",
                                             key, near ? fmt::format(" (did you mean '{}'?)", *near) : ""));
      continue;
    }
    if (value.empty()) throw UsageError(fmt::format("bad --rdzv_conf {}='': give a value", key));
    if (key == "is_host" || key == "use_libuv" || key == "use_agent_store") {
      auto b = conf_bool(value);
      if (!b) throw UsageError(fmt::format("bad --rdzv_conf {}='{}': use true or false", key, value));
      if (key == "is_host") o.rdzv_is_host = *b;
      continue;
    }
    if (key == "cacert" || key == "cert" || key == "key" || key == "user" || key == "etcd_prefix") {
      (key == "cacert" ? o.etcd_cacert : key == "cert" ? o.etcd_cert : key == "key" ? o.etcd_key
       : key == "user" ? o.etcd_user : o.etcd_prefix) = value;
      continue;
    }
    if (key == "protocol") {
      if (value != "http" && value != "https")
        throw UsageError(fmt::format("bad --rdzv_conf protocol='{}': use http or https", value));
      o.etcd_https = value == "https";
      continue;
    }
    if (key == "store_type") {
      std::string t = value;
      std::transform(t.begin(), t.end(), t.begin(), ::tolower);
      if (t != "tcp" && t != "file")
        throw UsageError(fmt::format("bad --rdzv_conf store_type='{}': use tcp or file", value));
      continue;
    }
    // etcd-v2's file names and the static backend's rank (torchrun sets it from --node_rank)
    if (key == "ca_cert" || key == "ssl_cert" || key == "ssl_cert_key" || key == "rank") continue;
    double v = -1;
    try {
      std::size_t used = 0;
      v = std::stod(value, &used);
      if (used != value.size()) v = -1;
    } catch (const std::exception&) {
    }
    if (!(v >= 0) || v > 1e9)
      throw UsageError(fmt::format("bad --rdzv_conf value {}='{}': expected a number of seconds", key, value));
    // torch's keys that mean nothing here: the store's read timeout, the close and
    // heartbeat timeouts, the launcher's overall timeout
    if (key == "timeout" || key == "read_timeout" || key == "close_timeout" || key == "heartbeat_timeout") continue;
    auto ms = std::chrono::milliseconds(static_cast<long>(v * 1000));
    if (key == "join_timeout") o.join_timeout = ms;
    else if (key == "last_call_timeout") o.last_call_timeout = ms;
    else if (key == "keep_alive_interval") o.keep_alive_interval = std::max(ms, std::chrono::milliseconds(10));
    else o.keep_alive_max_attempt = std::max(1, static_cast<int>(v));
  }
}

std::vector<std::string> parse_filter_list(const std::string& text) {
  std::vector<std::string> out;
  std::string item;
  for (std::size_t i = 0; i <= text.size(); ++i) {
    if (i < text.size() && text[i] == ',' && i + 1 < text.size() && text[i + 1] == ',') {
      item += ',';
      ++i;
    } else if (i == text.size() || text[i] == ',') {
      if (!item.empty()) out.push_back(std::move(item));
      item.clear();
    } else {
      item += text[i];
    }
  }
  return out;
}

std::vector<int> parse_signal_list(const std::string& flag, const std::string& text) {
  std::vector<int> out;
  std::string_view rest = text;
  while (true) {
    const auto comma = rest.find(',');
    std::string name(strip_space(rest.substr(0, comma)));
    std::transform(name.begin(), name.end(), name.begin(), ::toupper);
    const std::string bare = name.starts_with("SIG") ? name.substr(3) : name;
    int sig = 0;
    for (int n = 1; n < 32 && !bare.empty(); ++n)
      if (const char* abbrev = ::sigabbrev_np(n); abbrev && bare == abbrev) sig = n;
    if (bare == "IOT") sig = SIGABRT;
    if (bare == "POLL") sig = SIGIO;
    // Python's real-time names: RTMIN, RTMAX, RTMIN+N, RTMAX-N.
    for (auto [prefix, base, dir] : {std::tuple{"RTMIN", SIGRTMIN, 1}, std::tuple{"RTMAX", SIGRTMAX, -1}}) {
      const std::string_view p = prefix;
      if (!bare.starts_with(p)) continue;
      const std::string_view off = std::string_view(bare).substr(p.size());
      int n = 0;
      if (off.empty()) {
        sig = base;
      } else if (off.size() > 1 && off[0] == (dir > 0 ? '+' : '-')) {
        auto [end, ec] = std::from_chars(off.data() + 1, off.data() + off.size(), n);
        if (ec == std::errc() && end == off.data() + off.size() && n >= 0 && n <= SIGRTMAX - SIGRTMIN)
          sig = base + dir * n;
      }
    }
    if (sig == 0)
      throw UsageError(fmt::format("bad {} '{}': '{}' is no signal name; give names such as SIGTERM,SIGINT,SIGUSR1",
                                   flag, text, std::string(strip_space(rest.substr(0, comma)))));
    if (sig == SIGKILL || sig == SIGSTOP)
      throw UsageError(fmt::format("bad {} '{}': SIG{} cannot be caught, so it cannot be handled; drop it", flag, text,
                                   bare));
    if (std::find(out.begin(), out.end(), sig) == out.end()) out.push_back(sig);
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  return out;
}

std::string substitute_local_rank(const std::string& arg, int local_rank) {
  static constexpr std::string_view kName = "local_rank";
  auto is_ident = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  std::string out;
  out.reserve(arg.size());
  for (std::size_t i = 0; i < arg.size(); ++i) {
    if (arg[i] != '$' || i + 1 >= arg.size()) {
      out += arg[i];
      continue;
    }
    std::string_view rest = std::string_view(arg).substr(i + 1);
    if (rest[0] == '$') {
      out += '$';
      ++i;
    } else if (rest.starts_with("{local_rank}")) {
      out += std::to_string(local_rank);
      i += kName.size() + 2;
    } else if (rest.starts_with(kName) && (rest.size() == kName.size() || !is_ident(rest[kName.size()]))) {
      out += std::to_string(local_rank);
      i += kName.size();
    } else {
      out += '$';  // safe_substitute keeps unknown placeholders as written
    }
  }
  return out;
}

}  // namespace mg
